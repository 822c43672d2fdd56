"""What the Triton backend's three families of Pallas kernels (`_rbf`, `_expression`,
`_pruned`) share around a ``pallas_call``: the checked tile sizes, the launch parameters
(`TritonLaunch`), the accumulator dtype, the matmul precision policy, the Triton compiler
parameters and the two BlockSpecs they use.

On GPU the kernels go through the Triton lowering with `jax.experimental.pallas.triton`'s
``CompilerParams`` passed explicitly (newer JAX defaults to Mosaic GPU otherwise); with
``interpret=True`` (CPU, tests) no compiler parameters are passed.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._matmul import products
from scalegp.ops._tiling import BlockSizes

#: Matmul precision of every product in these kernels: full float32 (``HIGHEST``), so that
#: Triton emits no TF32 dots (`benchmarks/gpu/pallas_lowering.py` checks the lowering).
PRECISION = lax.Precision.HIGHEST
matmul, matmul_nt, matmul_tn, neg_half_sqdist = products(PRECISION)

#: The smallest tile side the kernels take (tiles are powers of two: Triton's tensors are).
MIN_BLOCK = 16


def accumulator_dtype(dtype):
    """The accumulators' dtype: float32, or the input's if it is wider."""
    return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class TritonLaunch:
    """Triton's launch parameters of a kernel (`BlockSizes.launch`)."""

    num_warps: int = 4
    num_stages: int = 2


def launch_of(bs: BlockSizes) -> TritonLaunch:
    """``bs``'s launch parameters, the defaults where a caller's tiles carry none."""
    return bs.launch if isinstance(bs.launch, TritonLaunch) else TritonLaunch()


def compiler_params(bs: BlockSizes, interpret: bool):
    """Triton's launch parameters of ``bs``, or None in interpret mode."""
    if interpret:
        return None
    from jax.experimental.pallas import (
        triton as plgpu,  # GPU only: not imported elsewhere
    )

    launch = launch_of(bs)
    return plgpu.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages)


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
