"""Tile sizes and padding shared by the tiled backends."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Finite stand-in for log(0): padded or zero-weight keys get this log-weight. It is finite so that
# the running maximum never becomes -inf (which would turn exp(m_old - m_new) into nan), and far
# enough below any real exponent that exp() of it is exactly zero. Same trick as jax's attention op.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one blocked kernel product.

    Attributes:
      block_q: rows of the query (x1) tile.
      block_k: rows of the key (x2) tile.
      block_o: columns of the value tile in a fused forward kernel (xla ignores it).
      launch: the backend's own launch parameters (hashable; Triton's warps and stages,
        `backends.triton.TritonLaunch`), or None.
    """

    block_q: int
    block_k: int
    block_o: int = 64
    launch: Any = None

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_o"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def compensated_add(total, term):
    """Adds ``term`` to a running ``total = (sum, compensation)`` by Neumaier's compensated
    summation: the rounding error of each addition is kept in the compensation, so the sum over
    many key tiles errs by O(eps) of the result plus O(eps²) of the terms, not O(tiles · eps)
    of the partial sums. It matters for GPs at large n: with smooth v the tiles' partial sums of
    K v are large and alike, and plain float32 accumulation over ~100 tiles erred by several
    ulps of the result, as much as the noise variance at n = 10^5
    (docs/decisions.md #8). Costs a few elementwise operations per output element
    and tile, against a tile's ``block_k · (d + o)``."""
    s, c = total
    t = s + term
    lost = jnp.where(jnp.abs(s) >= jnp.abs(term), (s - t) + term, (term - t) + s)
    return t, c + lost


def compensated_zeros(shape, dtype):
    """A `compensated_add` total of zeros."""
    zeros = jnp.zeros(shape, dtype)
    return zeros, zeros


def compensated_sum(total):
    """The value of a `compensated_add` total."""
    s, c = total
    return s + c


def log_weights(w):
    """log(w) with ``MASK_VALUE`` where w == 0 (and no nan gradient from the masked branch)."""
    positive = w > 0
    return jnp.where(positive, jnp.log(jnp.where(positive, w, 1.0)), MASK_VALUE)


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def even_block(size: int, max_block: int, multiple: int = 8) -> int:
    """Largest useful block <= max_block that splits `size` into nearly equal tiles.

    Padding 1025 rows to a block of 1024 would double the work; two blocks of 520 do not.
    """
    num_blocks = -(-size // max_block)
    return min(max_block, round_up(-(-size // num_blocks), multiple))


def pad_axis(x, size: int, axis: int = 0, value=0.0):
    """Pads `x` along `axis` up to `size` with a constant."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


#: The xla path's full query tile (`backends.xla._blocks.BLOCK_Q`). An elementwise finish
#: of per-row results runs on a whole number of them (`rowwise_padded`), short tiles too.
FULL_TILE_ROWS = 1024


def rowwise_padded(fn, rows, size: int):
    """``fn(rows)`` for an elementwise ``fn`` (exp, log, ...) over a pytree of arrays whose
    leading axis is cut to its first n rows afterwards, computed as if on ``size`` rows.

    XLA's CPU backend evaluates transcendental functions in vector lanes and a scalar remainder
    loop that round differently, so ``log`` of row i would depend on how many rows follow it.
    Computed on a fixed, whole number of tiles (``size``, padded here if need be), with
    optimisation barriers that stop XLA from cutting the array before ``fn``, every row takes the
    same path: part of the engine's row-independence contract (`scalegp.ops._plan`).
    """
    n = jax.tree_util.tree_leaves(rows)[0].shape[0]
    padded = jax.tree_util.tree_map(lambda t: pad_axis(t, size), rows)
    out = lax.optimization_barrier(fn(lax.optimization_barrier(padded)))
    return jax.tree_util.tree_map(lambda t: t[:n], out)

