"""Full-precision products that every tile implementation is built from (a leaf: no scalegp
imports), and the RBF's exponent tile made of one of them.

Products run at ``lax.Precision.HIGHEST`` with the inputs' dtype accumulated: TF32 or bfloat16
passes would cost two to four digits in the distance expansion below.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


#: Up to this many features `half_sq_norms` writes its sum out; beyond, a ``fori_loop``, so
#: that the program does not grow with d (wide data compiled for minutes when unrolled).
UNROLLED_NORM_FEATURES = 16


def half_sq_norms(x):
    """(n, d) -> (n,): ``|x_i|² / 2`` as a sum over the features written out, one elementwise
    operation per feature: each row's value the same whatever the array's height. Reduced with
    ``jnp.sum``, XLA's CPU backend vectorised the reduction by rows: a row's norm (and so its
    kernel values, by an ulp) depended on how many rows the call had (at d = 4 and 8, and the
    expressions' tiles beyond `scalegp.ops._kernels.DIRECT_MAX_D` features)."""
    if x.shape[-1] == 0:
        return jnp.zeros(x.shape[:-1], x.dtype)

    def add(k, total):
        column = lax.dynamic_index_in_dim(x, k, axis=-1, keepdims=False)
        return total + column * column

    total = x[..., 0] * x[..., 0]
    if x.shape[-1] > UNROLLED_NORM_FEATURES:
        return 0.5 * lax.fori_loop(1, x.shape[-1], add, total)
    for k in range(1, x.shape[-1]):
        total = add(k, total)
    return 0.5 * total


def _contract(x, y, x_axis, y_axis):
    return lax.dot_general(
        x, y, (((x_axis,), (y_axis,)), ((), ())), precision=HIGHEST, preferred_element_type=x.dtype
    )


def matmul(x, y):
    """x @ y at full precision (shared by the blocked implementations, Pallas kernels included)."""
    return _contract(x, y, 1, 0)


def matmul_nt(x, y):
    """x @ y.T"""
    return _contract(x, y, 1, 1)


def matmul_tn(x, y):
    """x.T @ y"""
    return _contract(x, y, 0, 0)


def neg_half_sqdist(a, b, a_half_norms, b_half_norms):
    """Exponent tile ``-|a_i - b_j|^2 / 2`` for a (p, d), b (q, d) -> (p, q).

    Uses ``a.b - |a|^2/2 - |b|^2/2`` so the work is one matrix product, at full float32 precision
    (TF32 would cost two to four digits here). Rounding can make the distance slightly negative for
    nearly equal points; clamping the exponent at 0 keeps K <= 1.
    """
    cross = matmul_nt(a, b)
    return jnp.minimum(cross - a_half_norms[:, None] - b_half_norms[None, :], 0.0)
