"""The products every tiled backend is built from, at the backend's matmul precision
(`products`), the RBF's exponent tile made of one of them, the rows' squared norms, and what the
distance expansion's users share: its accuracy limits and the smooth Matérn profiles of the
squared distance it gives (a leaf: no scalegp imports)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

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


#: The largest mean scaled squared norm of the keys, ``mean_j |b_j|²``, for which the RBF takes
#: the distance expansion (`Products.neg_half_sqdist`); above it the coordinate differences
#: (`scalegp.ops.rbf_kernel_mv`, d <= `scalegp.ops._kernels.DIRECT_MAX_D`).
#:
#: The expansion ``a·b - |a|²/2 - |b|²/2`` rounds with an absolute error of a few ``u (|a|² +
#: |b|²)`` (u = eps/2), and K_ij moves by K_ij times that: largest at (nearly) coincident points
#: far from the keys' centre in lengthscales, i.e. at lengthscales short against the spread. The
#: accuracy target is norm-wise (issue #17: 2e-5 = 336 u in float32, forward), and the rows'
#: errors average: measured (docs/decisions.md #4), ``|ΔKv| / |Kv|`` was 0.35 to
#: 1.04 times ``u · mean_j |b_j|²`` for K(x, x) v over d = 1 to 16, uniform and Gaussian
#: points, lengthscales 1 to 0.01 of their spread, wherever that mean is 50 or more. So 140
#: keeps the estimate within half the target (1.04 · 140 u ≈ 8.7e-6;
#: tests/ops/test_rbf_expansion.py checks the switch). A mean, not the maximum: the worst case
#: over pairs would be entry-wise and, for Gaussian keys at d = 8, 4-5 times the mean, sending
#: ordinary lengthscales to the slower differences (docs/decisions.md #4). A
#: query far beyond the keys rounds worse than the estimate in its own row, by its squared
#: norm over the mean, but its kernel values fall as e^{-|a - b|²/2}. The same in units of any
#: dtype's eps.
RBF_EXPANSION_MEAN_LIMIT = 140.0

#: `RBF_EXPANSION_MEAN_LIMIT` for a Matérn by the expansion (`matern_of_squared`), per ν, on its
#: points (scaled by ``√(2ν) / l``): measured as there, ``|ΔKv| / |Kv|`` was 0.18 to 0.98 (ν =
#: 3/2) and 0.12 to 0.33 (ν = 5/2) times ``u · mean_j |b_j|²``, so these keep the estimate within
#: half the target (2e-5 = 336 u). They replace a worst-case bound over pairs ((3d + 4) u (|a|² +
#: |b|²) in t², from the keys' largest norm), ~100x pessimistic, which sent Gaussian keys at d =
#: 4 and a lengthscale of their spread to the differences.
MATERN_EXPANSION_MEAN_LIMIT = {1.5: 140.0, 2.5: 420.0}


def matern_coordinate_limit(d: int, dtype) -> float:
    """A bound on the coordinates of a Matérn by the expansion that keeps every partial sum of
    the squared distance (at most ``4 d max|coordinate|²``) finite, so that t is finite and
    ``t e^{-t}`` is not ``inf · 0``. Points this far from the keys' centre (in lengthscales)
    have kernel values 0 with every point near it."""
    return float(np.sqrt(np.finfo(dtype).max / (8 * max(d, 1))))


def matern_of_squared(s, nu):
    """``(K, w)`` of the Matérn ν = 3/2 or 5/2 from the squared distances ``s = t²`` >= 0 of
    points scaled by ``√(2ν) / l`` (any shape), with ``w = -2 ∂K/∂(t²)``, the weight of the
    point gradients (``da_i = Σ_j w_ij (g_i · v_j) (b_j - a_i)``)::

        ν = 3/2:  K = (1 + t) e^{-t},            w = e^{-t}
        ν = 5/2:  K = (1 + t + t²/3) e^{-t},     w = (1 + t) e^{-t} / 3

    w is finite at t = 0, so coincident points need no guard; ``(1 + t) e^{-t}`` as a
    multiply-add."""
    t = jnp.sqrt(s)
    e = jnp.exp(-t)
    u = e + t * e
    if nu == 1.5:
        return u, e
    return u + (s * (1.0 / 3.0)) * e, u * (1.0 / 3.0)


class Products(NamedTuple):
    """The tile products at one matmul precision (a backend's policy, `products`)."""

    matmul: Callable  # x @ y
    matmul_nt: Callable  # x @ y.T
    matmul_tn: Callable  # x.T @ y
    neg_half_sqdist: Callable  # (a, b, a_half_norms, b_half_norms) -> -|a_i - b_j|² / 2


def products(precision) -> Products:
    """The products every tiled backend builds on, at ``precision`` with the inputs' dtype
    accumulated. On CPU and GPU a backend takes ``HIGHEST`` (full float32): TF32 or bfloat16
    passes would cost two to four digits in the distance expansion (`Products.neg_half_sqdist`:
    ``a·b - |a|²/2 - |b|²/2`` in one matrix product, clamped at 0 so that K <= 1 where
    rounding makes a distance slightly negative)."""
    def contract(x, y, x_axis, y_axis):
        return lax.dot_general(x, y, (((x_axis,), (y_axis,)), ((), ())), precision=precision,
                               preferred_element_type=x.dtype)

    def matmul(x, y):
        return contract(x, y, 1, 0)

    def matmul_nt(x, y):
        return contract(x, y, 1, 1)

    def matmul_tn(x, y):
        return contract(x, y, 0, 0)

    def neg_half_sqdist(a, b, a_half_norms, b_half_norms):
        cross = matmul_nt(a, b)
        return jnp.minimum(cross - a_half_norms[:, None] - b_half_norms[None, :], 0.0)

    return Products(matmul, matmul_nt, matmul_tn, neg_half_sqdist)
