"""Full-precision products that every tile implementation is built from (a leaf: no scalegp
imports), and the RBF's exponent tile made of one of them.

Products run at ``lax.Precision.HIGHEST`` with the inputs' dtype accumulated: TF32 or bfloat16
passes would cost two to four digits in the distance expansion below.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def half_sq_norms(x):
    """(n, d) -> (n,): |x_i|^2 / 2, accumulated in at least float32."""
    return 0.5 * jnp.sum(x * x, axis=-1)


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
