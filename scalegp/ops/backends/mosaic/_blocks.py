"""What the Mosaic kernels share around a ``pallas_call``: their tiles and parameters
(`MosaicParams`), the compiler parameters, the grid specification with VMEM scratch, the
float32-accurate products made of bfloat16 matrix-unit passes, and the tile exponents.

Float32 accuracy from bfloat16 passes. Mosaic (JAX 0.10-0.11) offers a float32 dot at
``DEFAULT`` (one bfloat16 pass: three digits) or ``HIGHEST`` (six passes), nothing between.
The kernels split operands into bfloat16 pieces themselves, by integer masks on the bits
(`hi_lo`, `pieces`): a split written as float conversions, ``x - f32(bf16(x))``, may be
simplified away by a compiler that allows excess precision. Two kinds of products:

- **a tile times a thin operand** (``K @ V``, ``W @ [y, 1]``): the tile is computed in the
  kernel and split once, ``K = K_hi + K_lo`` with ``K_hi`` rounded to 8 bits and ``|K_lo| <=
  2^-8 |K|`` (then rounded to bfloat16: an error of at most ``2^-17 |K|``); the thin operand
  arrives split as ``[V_hi | V_lo]`` (2o columns: the matrix unit pads every axis to 128, so
  up to 64 columns ride free), and ``K @ V ≈ K_hi [V_hi|V_lo] + K_lo [V_hi|V_lo]``: two passes,
  an element error of at most ``2^-16`` relative. Norm-wise errors of ``K v`` were 3e-6 to
  5e-6 over many keys per row (compiled on a TPU v5e and interpreted), up to 1.5e-5 where one
  term dominates a row.
- **thin times thin** (``a · b`` of the distance expansion, ``g · v`` of a backward pass): both
  operands arrive as three pieces each (``x = x1 + x2 + x3`` exactly: 24 bits), and the six
  products of significance above ``2^-24`` are laid side by side along the contraction
  (`piece_operands`): ``[x1 x1 x2 x1 x2 x3] · [y1 y2 y1 y3 y2 y1]``, one pass while six
  times the width fits in 128, with the matrix unit's float32 accumulation: float32
  accuracy.

Layout: query tiles are (block_q, ·) row-major, key tiles feature-major (·, block_k) so that
keys lie along the 128 lanes; the key axis is the grid's last ("arbitrary") axis, streamed
through VMEM, with the running sums in VMEM scratch.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._kernels import DIRECT_MAX_D
from scalegp.ops._matmul import RBF_EXPANSION_MEAN_LIMIT, half_sq_norms
from scalegp.ops._tiling import BlockSizes, pad_axis, round_up

#: The lane width of TPU vector registers and of the matrix unit: key tiles are multiples.
LANES = 128
#: Up to this many features the exponents always come from the coordinate differences on the
#: vector unit; beyond, from the expansion on the matrix unit where the keys allow it
#: (`distances`).
DIFFERENCES_MAX_D = 4


@dataclasses.dataclass(frozen=True)
class MosaicParams:
    """The Mosaic kernels' parameters besides the tile sizes (`BlockSizes.launch`).

    Attributes:
      vmem_limit_mib: the scoped VMEM limit (Mosaic's default is 16 MiB; larger tiles need
        more).
      differences_max_d: up to this many features the exponents come from the coordinate
        differences (vector unit), beyond from the expansion (matrix unit).
    """

    vmem_limit_mib: int = 64
    differences_max_d: int = DIFFERENCES_MAX_D


#: The parameters of tiles that carry none (a benchmark's tile sweep may set it, then clear
#: JAX's caches).
DEFAULT_PARAMS = MosaicParams()


def params_of(bs: BlockSizes) -> MosaicParams:
    return bs.launch if isinstance(bs.launch, MosaicParams) else DEFAULT_PARAMS


def check_blocks(bs: BlockSizes):
    """Raises ValueError unless block_q and block_k are multiples of `LANES` (the backward
    passes swap the roles of queries and keys, so both lie along lanes somewhere)."""
    if bs.block_q % LANES or bs.block_k % LANES:
        raise ValueError(
            f"the Mosaic kernels need block_q and block_k multiples of {LANES}, got "
            f"block_q={bs.block_q}, block_k={bs.block_k}; leave them None for the defaults")


def _tpu():
    """Pallas's TPU module, imported at the first kernel call: importing it costs a tenth of a
    second, which every ``import scalegp`` (and so every command) would pay."""
    from jax.experimental.pallas import tpu

    return tpu


def smem_spec():
    """A whole small array in SMEM (scalars a kernel reads one at a time)."""
    return pl.BlockSpec(memory_space=_tpu().SMEM)


def compiler_params(bs: BlockSizes, interpret: bool, semantics=("parallel", "arbitrary")):
    if interpret:
        return None
    return _tpu().CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=params_of(bs).vmem_limit_mib << 20)


def call(kernel, grid, in_specs, out_specs, out_shape, scratch, bs, interpret, name,
         prefetch=(), aliases=None):
    """``pallas_call(...)(*inputs)`` of a kernel over (row tiles, key tiles) with float32 VMEM
    scratch; ``prefetch``: arrays (visit lists) prefetched into SMEM ahead of the inputs, which
    the index maps and the kernel take first; ``aliases``: input positions (after the
    prefetched ones) -> the outputs they are."""
    tpu = _tpu()
    fn = pl.pallas_call(
        kernel,
        grid_spec=tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[tpu.VMEM(shape, jnp.float32) for shape in scratch]),
        out_shape=out_shape,
        compiler_params=compiler_params(bs, interpret),
        interpret=interpret,
        name=name,
        input_output_aliases={len(prefetch) + a: o for a, o in (aliases or {}).items()},
    )
    return lambda *inputs: fn(*prefetch, *inputs)


def rows_spec(block, width):
    """The i-th (block, width) tile of a row-major array (grid (i, j))."""
    return pl.BlockSpec((block, width), lambda i, j: (i, 0))


def cols_spec(height, block):
    """The j-th (height, block) tile of a feature-major array (grid (i, j))."""
    return pl.BlockSpec((height, block), lambda i, j: (0, j))


def key_rows_spec(block, width):
    """The j-th (block, width) tile of a row-major array of keys (grid (i, j))."""
    return pl.BlockSpec((block, width), lambda i, j: (j, 0))


# ----------------------------------------------------------------------------------------------
# bfloat16 pieces


def _rounded_hi(x):
    """``x`` rounded to its top 8 significant bits (bfloat16's), by integer operations."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type((bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000),
                                    jnp.float32)


def hi_lo(x):
    """(x_hi, x_lo) in bfloat16 with ``x_hi`` exact to 8 bits and ``x_lo`` the rest rounded:
    ``|x - x_hi - x_lo| <= 2^-17 |x|``."""
    hi = _rounded_hi(x)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def pieces(x):
    """Three bfloat16 pieces whose sum is x exactly (24 significant bits)."""
    p1 = _rounded_hi(x)
    r = x - p1
    p2 = _rounded_hi(r)
    p3 = r - p2
    return tuple(p.astype(jnp.bfloat16) for p in (p1, p2, p3))


def split_columns(x):
    """``[x_hi | x_lo | 0]`` bfloat16 of x (n, c), its 2c columns padded to a multiple of
    `LANES` (lane-dense products and outputs): the thin operand of `split_dot`."""
    both = jnp.concatenate(hi_lo(x.astype(jnp.float32)), axis=1)
    return pad_axis(both, round_up(both.shape[1], LANES), axis=1)


def split_dot(tile, thin):
    """``tile @ x`` to ``2^-16`` relative per element for a float32 tile (p, q) and
    ``thin = split_columns(x)`` (q, 2c): (p, 2c), whose two column halves sum to the product
    (`fold`)."""
    hi, lo = hi_lo(tile)
    return (jnp.dot(hi, thin, preferred_element_type=jnp.float32)
            + jnp.dot(lo, thin, preferred_element_type=jnp.float32))


def fold(out, c):
    """The product (n, c) from `split_dot`'s halves."""
    return out[:, :c] + out[:, c:2 * c]


def piece_operands(x, y):
    """``(X, Yt)`` in bfloat16, (n, k) and (k, m) with k = 6c padded to `LANES`, such that
    ``X @ Yt = x @ yᵀ`` to float32 accuracy for x (n, c), y (m, c): the six products of
    pieces above ``2^-24``, side by side."""
    x1, x2, x3 = pieces(x.astype(jnp.float32))
    y1, y2, y3 = pieces(y.astype(jnp.float32))
    width = round_up(6 * x.shape[1], LANES)  # the contraction, padded with zeros
    return (pad_axis(jnp.concatenate([x1, x1, x2, x1, x2, x3], axis=1), width, axis=1),
            pad_axis(jnp.concatenate([y1, y2, y1, y3, y2, y1], axis=1), width, axis=1).T)


# ----------------------------------------------------------------------------------------------
# exponents -|a_i - b_j|² / 2 of a tile


def distances(bs: BlockSizes, b):
    """How a product on prepared keys b (m, d) forms its exponents: True (the coordinate
    differences) up to ``differences_max_d`` features; False (the expansion) beyond
    `DIRECT_MAX_D`; between, a traced boolean: the differences where the keys' mean squared
    norm is past `RBF_EXPANSION_MEAN_LIMIT`, as on the other backends."""
    d = b.shape[1]
    if d <= params_of(bs).differences_max_d:
        return True
    if d > DIRECT_MAX_D:
        return False
    return lax.stop_gradient(jnp.sum(b * b) / b.shape[0]) > RBF_EXPANSION_MEAN_LIMIT


def either(differences, fn, *args):
    """``fn(*args, differences)`` for a static choice, else by ``lax.cond`` on it."""
    if isinstance(differences, bool):
        return fn(*args, differences)
    return lax.cond(differences, lambda: fn(*args, True), lambda: fn(*args, False))


def geometry(a, b, differences: bool, rows: int, cols: int):
    """The operands from which a kernel forms the exponents of prepared points a (n, d),
    b (m, d), padded to ``rows`` and ``cols``: by the ``differences``, ``(a, bᵀ)`` in float32;
    by the expansion, `piece_operands` of ``[a, -|a|²/2, 1]`` and ``[b, 1, -|b|²/2]``, whose
    product is ``a·b - |a|²/2 - |b|²/2``."""
    if differences:
        return pad_axis(a, rows).astype(jnp.float32), pad_axis(b, cols).astype(jnp.float32).T
    one_a, one_b = jnp.ones_like(a[:, :1]), jnp.ones_like(b[:, :1])
    a_aug = jnp.concatenate([a, -half_sq_norms(a)[:, None], one_a], axis=1)
    b_aug = jnp.concatenate([b, one_b, -half_sq_norms(b)[:, None]], axis=1)
    return piece_operands(pad_axis(a_aug, rows), pad_axis(b_aug, cols))


def exponents(rows, cols_t):
    """A tile's exponents (p, q) from `geometry`'s tiles: rows (p, ·), cols_t (·, q)."""
    if rows.dtype == jnp.float32:  # the differences, one feature at a time
        total = None
        for f in range(rows.shape[1]):
            delta = rows[:, f:f + 1] - cols_t[f:f + 1, :]
            total = delta * delta if total is None else total + delta * delta
        return -0.5 * total
    return jnp.minimum(jnp.dot(rows, cols_t, preferred_element_type=jnp.float32), 0.0)


def swapped(bs: BlockSizes) -> BlockSizes:
    """The tiles of a backward pass whose rows are the keys (padded to block_k) and whose
    columns are the queries (padded to block_q)."""
    return BlockSizes(block_q=bs.block_k, block_k=bs.block_q, block_o=bs.block_o,
                      launch=bs.launch)


def padded_sizes(n: int, m: int, bs: BlockSizes) -> tuple[int, int]:
    return round_up(n, bs.block_q), round_up(m, bs.block_k)


def on_first_key_tile(body):
    pl.when(pl.program_id(1) == 0)(body)


def on_last_key_tile(body):
    pl.when(pl.program_id(1) == pl.num_programs(1) - 1)(body)
