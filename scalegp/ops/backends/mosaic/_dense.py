"""Float32-accurate products of dense operands as Mosaic kernels: ``Aᵀ B`` (a contraction over
the long axis: Gram matrices, projections on a basis) and ``A S`` (a tall operand times a
small one), each operand split into three bfloat16 pieces and the six products of pieces
above ``2^-24`` summed (`_blocks.pieces`): the accuracy of XLA's ``HIGHEST``.

Why: XLA compiles a float32 dot at ``HIGHEST`` for a TPU slowly, and the GP's programs hold
dozens (its preconditioner, the variance cache); these kernels compile in a fraction of that
time (docs/decisions.md #57).

Tiles: the tall operand's rows in blocks of `ROWS`, the short axes whole up to `COLUMNS` and
in blocks of it beyond; the grid's last axis walks the contracted one. A block past an
operand's edge reads undefined values: the contracted axis's are masked to zero in the kernel;
the others land in outputs that are never written back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._tiling import BlockSizes
from scalegp.ops.backends.mosaic import _blocks

#: Rows of the tall operand per block.
ROWS = 256
#: The short axes whole up to this many, in blocks of it beyond (a multiple of `_blocks.LANES`).
COLUMNS = 512
#: The tiles as `_blocks.call` takes them: only their (default) launch parameters are read, the
#: scoped VMEM limit; a step holds two double-buffered operand blocks of up to ``ROWS ×
#: COLUMNS`` floats, their bfloat16 pieces and an output block.
_TILES = BlockSizes(block_q=ROWS, block_k=COLUMNS)


def _six_products(a, b, dims):
    """``a · b`` over ``dims`` (a ``dot_general`` contraction) from the three bfloat16 pieces
    of each: the six products of pieces above ``2^-24``, the smallest summed first."""
    a1, a2, a3 = _blocks.pieces(a)
    b1, b2, b3 = _blocks.pieces(b)
    out = None
    for p, q in ((a3, b1), (a2, b2), (a1, b3), (a2, b1), (a1, b2), (a1, b1)):
        term = lax.dot_general(p, q, (dims, ((), ())), preferred_element_type=jnp.float32)
        out = term if out is None else out + term
    return out


def _accumulating_kernel(a_axis: int, block: int, size: int):
    """The kernel of both products: ``o += a · b`` contracted over ``a``'s axis ``a_axis`` and
    ``b``'s rows, one block of ``block`` of the ``size`` contracted indices per step of the
    grid's last axis; indices past ``size`` (a ragged last block's, undefined) masked to 0."""
    ragged = size % block != 0

    def kernel(a_ref, b_ref, o_ref):
        step = pl.program_id(2)

        @pl.when(step == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        x, y = a_ref[...], b_ref[...]
        if ragged:
            def inside(shape, axis):
                return step * block + lax.broadcasted_iota(jnp.int32, shape, axis) < size

            x = jnp.where(inside(x.shape, a_axis), x, 0.0)
            y = jnp.where(inside(y.shape, 0), y, 0.0)
        o_ref[...] += _six_products(x, y, ((a_axis,), (0,)))

    return kernel


def _product(a, b, a_axis: int, interpret: bool, name: str):
    """``a · b`` (p, t) contracted over ``a``'s axis ``a_axis`` (0: ``Aᵀ B``; 1: ``A S``) and
    ``b``'s rows, ``p`` ``a``'s other axis; a grid of (output row blocks, output column blocks,
    contracted blocks)."""
    free = 1 - a_axis
    blocks = (min(a.shape[0], ROWS), min(a.shape[1], COLUMNS))
    size, p, t = a.shape[a_axis], a.shape[free], b.shape[1]
    contracted, rows, columns = blocks[a_axis], blocks[free], min(t, COLUMNS)
    if a_axis == 0:
        a_spec = pl.BlockSpec(blocks, lambda i, j, c: (c, i))
    else:
        a_spec = pl.BlockSpec(blocks, lambda i, j, c: (i, c))
    return _blocks.call(
        _accumulating_kernel(a_axis, contracted, size),
        (pl.cdiv(p, rows), pl.cdiv(t, columns), pl.cdiv(size, contracted)),
        [a_spec, pl.BlockSpec((contracted, columns), lambda i, j, c: (c, j))],
        pl.BlockSpec((rows, columns), lambda i, j, c: (i, j)),
        jax.ShapeDtypeStruct((p, t), jnp.float32), (), _TILES, interpret, name,
        semantics=("parallel", "parallel", "arbitrary"))(a, b)


@functools.partial(jax.jit, static_argnames="interpret")
def matmul_tn(a, b, interpret: bool = False):
    """``Aᵀ B`` (k, t) for float32 ``a`` (n, k) and ``b`` (n, t), to float32 accuracy."""
    return _product(a, b, 0, interpret, "scalegp_dense_tn")


@functools.partial(jax.jit, static_argnames="interpret")
def matmul(a, s, interpret: bool = False):
    """``A S`` (n, t) for float32 ``a`` (n, k) and a small ``s`` (k, t), to float32 accuracy."""
    return _product(a, s, 1, interpret, "scalegp_dense_nn")
