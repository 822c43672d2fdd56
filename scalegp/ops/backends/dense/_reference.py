"""Dense reference implementations: they build the full kernel matrix.

They are the oracle the blocked implementations are tested against, and the fastest path for
small problems. Inputs are *prepared*: already divided by the lengthscale and centred (see
`scalegp.ops._prepare`), so the kernel is simply ``K_ij = exp(-|a_i - b_j|^2 / 2)``.
Gradients come from ordinary autodiff, which is fine here because K exists anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp.ops._kernels import TileArithmetic, broadcast_squares, kernel_tile
from scalegp.ops._matmul import half_sq_norms, products

#: The float32 matmul precision of this backend's products (its policy, `Backend.precision`):
#: full float32 on CPU and GPU, where TF32 or bfloat16 passes would cost digits.
PRECISION = lax.Precision.HIGHEST
matmul, matmul_nt, matmul_tn, neg_half_sqdist = products(PRECISION)
ARITHMETIC = TileArithmetic(broadcast_squares, half_sq_norms, PRECISION)


def kernel_matrix(a, b):
    """(n, d), (m, d) -> (n, m): ``K_ij = exp(-|a_i - b_j|^2 / 2)``."""
    return jnp.exp(neg_half_sqdist(a, b, half_sq_norms(a), half_sq_norms(b)))


def kernel_mv(a, b, v, block_sizes=None):
    """``K(a, b) @ v`` for a (n, d), b (m, d), v (m, o) -> (n, o)."""
    del block_sizes
    return matmul(kernel_matrix(a, b), v)


def kernel_logsumexp(a, b, w, block_sizes=None):
    """``log sum_j w_j exp(-|a_i - b_j|^2 / 2)`` for a (n, d), b (m, d), w (m,) >= 0 -> (n,)."""
    del block_sizes
    e = neg_half_sqdist(a, b, half_sq_norms(a), half_sq_norms(b))
    return weighted_logsumexp(e, w)


def weighted_logsumexp(e, w):
    """``log sum_j w_j exp(e_ij)`` over the last axis, with exact gradients also where w_j = 0.

    (jax.scipy's ``logsumexp(e, b=w)`` treats zero weights as absent and returns a zero gradient
    for them; the true derivative ``exp(e_ij - f_i)`` is not zero.) The shift by the row maximum is
    held constant under autodiff: the result does not depend on it.
    """
    shift = jax.lax.stop_gradient(jnp.max(jnp.where(w > 0, e, -jnp.inf), axis=-1, keepdims=True))
    # A zero-weight point may lie far closer than every weighted one (e - shift >> 0): capping the
    # exponent keeps its term 0 * finite = 0 instead of 0 * inf = nan, in value and gradient.
    cap = float(np.log(np.finfo(e.dtype).max)) - 1.0  # exp(cap) stays finite after rounding
    return jnp.log(jnp.sum(w * jnp.exp(jnp.minimum(e - shift, cap)), axis=-1)) + shift[..., 0]


def expression_mv(kernel, x, y, v, block_sizes=None):
    """``K(x, y) @ v`` for a kernel expression on centred x (n, d), y (m, d), v (m, o)."""
    del block_sizes
    return matmul(kernel_tile(kernel, x, y.T, ARITHMETIC), v)
