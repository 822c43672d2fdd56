"""Tile sizes and padding shared by the blocked implementations (xla and pallas)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

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
      block_o: columns of the value tile in the Pallas forward kernel (xla ignores it).
      num_warps, num_stages: Triton launch parameters (Pallas on GPU only).
    """

    block_q: int
    block_k: int
    block_o: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_o", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
