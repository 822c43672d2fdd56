"""Float32-accurate products of dense operands as Mosaic kernels: ``Aᵀ B`` (a contraction over
the long axis: Gram matrices, projections on a basis) and ``A S`` (a tall operand times a
small one), each operand split into three bfloat16 pieces and the six products of pieces
above ``2^-24`` summed (`_blocks.pieces`): the accuracy of XLA's ``HIGHEST``.

Why: XLA compiles a float32 dot at ``HIGHEST`` for a TPU slowly, seconds for each (768 ×
10⁴)·(10⁴ × 768) product, and the GP's programs hold dozens (its preconditioner, the variance
cache; docs/decisions.md #57); these kernels compile in a fraction of that, and their
compilation does not grow with the operands' shapes.

Tiles: rows in blocks of `ROWS`, the other axes whole up to `COLUMNS` and in blocks of it
beyond. A block past an operand's edge reads undefined values: the contracted axis's are
masked to zero in the kernel; the others land in outputs that are never written back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops.backends.mosaic import _blocks

#: Rows of the long axis per grid step.
ROWS = 256
#: The short axes whole up to this many, in blocks of it beyond (a multiple of `_blocks.LANES`).
COLUMNS = 512
#: The scoped VMEM the kernels ask for: a step holds two float32 operand blocks of up to
#: ``ROWS × COLUMNS`` (double-buffered), their bfloat16 pieces, and an output block.
VMEM_LIMIT_MIB = 48


def _block(size: int) -> int:
    return size if size <= COLUMNS else COLUMNS


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


def _call(kernel, grid, in_specs, out_spec, out_shape, interpret, name):
    compiler_params = None if interpret else _blocks._tpu().CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=VMEM_LIMIT_MIB << 20)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_spec,
                          out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
                          compiler_params=compiler_params, interpret=interpret, name=name)


@functools.partial(jax.jit, static_argnames="interpret")
def matmul_tn(a, b, interpret: bool = False):
    """``Aᵀ B`` (k, t) for float32 ``a`` (n, k) and ``b`` (n, t), to float32 accuracy."""
    n, k = a.shape
    t = b.shape[1]
    rows = n if n <= ROWS else ROWS
    bk, bt = _block(k), _block(t)
    return _call(_accumulating_kernel(0, rows, n),
                 (pl.cdiv(k, bk), pl.cdiv(t, bt), pl.cdiv(n, rows)),
                 [pl.BlockSpec((rows, bk), lambda i, j, r: (r, i)),
                  pl.BlockSpec((rows, bt), lambda i, j, r: (r, j))],
                 pl.BlockSpec((bk, bt), lambda i, j, r: (i, j)), (k, t), interpret,
                 "scalegp_dense_tn")(a, b)


@functools.partial(jax.jit, static_argnames="interpret")
def matmul(a, s, interpret: bool = False):
    """``A S`` (n, t) for float32 ``a`` (n, k) and a small ``s`` (k, t), to float32 accuracy."""
    n, k = a.shape
    t = s.shape[1]
    rows = n if n <= ROWS else ROWS
    bk, bt = _block(k), _block(t)
    return _call(_accumulating_kernel(1, bk, k),
                 (pl.cdiv(n, rows), pl.cdiv(t, bt), pl.cdiv(k, bk)),
                 [pl.BlockSpec((rows, bk), lambda r, j, c: (r, c)),
                  pl.BlockSpec((bk, bt), lambda r, j, c: (c, j))],
                 pl.BlockSpec((rows, bt), lambda r, j, c: (r, j)), (n, t), interpret,
                 "scalegp_dense_nn")(a, s)
