"""Float32-accurate products of dense operands for the layers above the engine: the GP's
preconditioner (its Gram matrices, its solves) and variance cache.

`dense_products` returns them for the platform in use: the fused backend's kernels where one
compiles there and declares "dense_products" (Mosaic on a TPU, `scalegp.ops._plan.dense_backend`),
else XLA's dot at ``HIGHEST``. Why not XLA's dot everywhere: for a TPU it compiles float32
``HIGHEST`` products slowly, and they were most of the GP's compilation (docs/decisions.md
#57). Operands that are not 2-D float32 arrays, and products over a mesh
(where XLA partitions a dot over the devices, and would gather a kernel's operands instead),
take XLA's dot. Both forms are differentiable: each one's gradients are products of the two
forms again.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from scalegp.ops import _plan
from scalegp.ops._interface import DenseProducts
from scalegp.ops._tile_math import tile_product


def _xla_matmul(a, s):
    return jnp.matmul(a, s, precision=lax.Precision.HIGHEST)


def _xla_matmul_tn(a, b):
    return jnp.matmul(jnp.swapaxes(a, -1, -2), b, precision=lax.Precision.HIGHEST)


#: XLA's products at ``HIGHEST`` (any batch dimensions, any float dtype).
XLA_PRODUCTS = DenseProducts(matmul=_xla_matmul, matmul_tn=_xla_matmul_tn)


def dense_products(mesh=None) -> DenseProducts:
    """``(matmul, matmul_tn)``: ``a @ s`` for ``a (..., n, k)``, ``s (..., k, t)``, and ``aᵀ @
    b`` for ``a (..., n, k)``, ``b (..., n, t)``, to float32 accuracy (float64 in float64), for
    the platform the engine's products are planned for (the default device's). With a ``mesh``
    (the operands row-sharded in the global view), XLA's."""
    backend = None if mesh is not None else _plan.dense_backend()
    if backend is None:
        return XLA_PRODUCTS
    return _with_fallback(backend.dense)


@functools.cache
def _with_fallback(kernels: DenseProducts) -> DenseProducts:
    """``kernels`` (2-D float32 only) made differentiable, with XLA's products for other
    operands."""

    def kernel_ok(*arrays):
        return all(a.ndim == 2 and a.dtype == jnp.float32 for a in arrays)

    # C = A S:  dA = dC Sᵀ,  dS = Aᵀ dC.   C = Aᵀ B:  dA = B dCᵀ,  dB = A dC.
    matmul = tile_product(lambda a, s: (kernels.matmul(a, s), ()),
                          lambda inputs, _, g: (matmul(g, inputs[1].T),
                                                matmul_tn(inputs[0], g)), inputs=2)
    matmul_tn = tile_product(lambda a, b: (kernels.matmul_tn(a, b), ()),
                             lambda inputs, _, g: (matmul(inputs[1], g.T),
                                                   matmul(inputs[0], g)), inputs=2)

    def either_matmul(a, s):
        return matmul(a, s) if kernel_ok(a, s) else _xla_matmul(a, s)

    def either_matmul_tn(a, b):
        return matmul_tn(a, b) if kernel_ok(a, b) else _xla_matmul_tn(a, b)

    return DenseProducts(matmul=either_matmul, matmul_tn=either_matmul_tn)
