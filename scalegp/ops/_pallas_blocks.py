"""What the three families of Pallas kernels (`_pallas`, `_pallas_expression`,
`_pallas_pruning`) share around a ``pallas_call``: the checked tile sizes, the accumulator
dtype, the Triton compiler parameters and the two BlockSpecs they use.

On GPU the kernels go through the Triton lowering with `jax.experimental.pallas.triton`'s
``CompilerParams`` passed explicitly (newer JAX defaults to Mosaic GPU otherwise); with
``interpret=True`` (CPU, tests) no compiler parameters are passed.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from scalegp.ops._tiling import BlockSizes

#: The smallest tile side the kernels take (tiles are powers of two: Triton's tensors are).
MIN_BLOCK = 16


def accumulator_dtype(dtype):
    """The accumulators' dtype: float32, or the input's if it is wider."""
    return jnp.promote_types(dtype, jnp.float32)


def compiler_params(bs: BlockSizes, interpret: bool):
    """Triton's launch parameters of ``bs``, or None in interpret mode."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)


def check_pow2(bs: BlockSizes):
    """Raises ValueError unless block_q, block_k and block_o are powers of two >= `MIN_BLOCK`."""
    for name in ("block_q", "block_k", "block_o"):
        value = getattr(bs, name)
        if value < MIN_BLOCK or value & (value - 1):
            raise ValueError(
                f"pallas needs {name} to be a power of two >= {MIN_BLOCK}, got {value}; "
                "pass e.g. 32, 64 or 128, or leave it None for the default"
            )


def whole_array_spec(shape):
    """BlockSpec of a whole (small-per-row) array, visible to every kernel instance."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def row_block_spec(block, width=None):
    """BlockSpec of the i-th block of rows, (block,) or (block, width), for grid index i (any
    further grid indices are ignored)."""
    if width is None:
        return pl.BlockSpec((block,), lambda i, *_: (i,))
    return pl.BlockSpec((block, width), lambda i, *_: (i, 0))
