"""The problems tests/linalg shares: small dense operators (n up to a few thousand), their
preconditioners and a reference Lanczos run."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from scalegp.linalg import LowRankPreconditioner, pivoted_cholesky


def rbf_kernel(x1: np.ndarray, x2: np.ndarray, lengthscale: float = 1.0) -> np.ndarray:
    """Dense ``exp(-|x1_i - x2_j|² / (2 l²))`` in float64 numpy (the oracle)."""
    a = np.asarray(x1, np.float64) / lengthscale
    b = np.asarray(x2, np.float64) / lengthscale
    sq = np.sum(a**2, 1)[:, None] + np.sum(b**2, 1)[None, :] - 2.0 * a @ b.T
    return np.exp(-0.5 * np.maximum(sq, 0.0))


def rbf_system(n: int, d: int, noise: float, lengthscale: float = 1.0, seed: int = 0):
    """Points ``x ~ N(0, I_d)`` and the float64 matrix ``A = K(x, x) + noise I``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    return x, rbf_kernel(x, x, lengthscale) + noise * np.eye(n)


def random_spd(n: int, condition: float, seed: int = 0) -> np.ndarray:
    """``Q diag(λ) Qᵀ`` with log-spaced eigenvalues from 1 to ``condition``."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    eigenvalues = np.logspace(0.0, np.log10(condition), n)
    return (q * eigenvalues) @ q.T


def dense_matvec(a, dtype=jnp.float64):
    """``V -> A V`` on ``(..., n, t)`` blocks from a dense (batched) matrix."""
    a = jnp.asarray(a, dtype)
    return lambda v: jnp.matmul(a, v, precision="highest")


def rbf_column(x, lengthscale: float = 1.0, dtype=jnp.float64):
    """``i -> K(x, x)[:, i]`` without building ``K`` (for pivoted Cholesky)."""
    x = jnp.asarray(x, dtype) / lengthscale

    def column(i):
        return jnp.exp(-0.5 * jnp.sum((x - x[i]) ** 2, axis=-1))

    return column


def rbf_preconditioner(x, noise, rank: int, dtype=jnp.float64) -> LowRankPreconditioner:
    """``P = L Lᵀ + noise I`` for a rank-``rank`` pivoted-Cholesky factor ``L`` of the RBF kernel
    (lengthscale 1) on ``x``, as the GP builds it."""
    chol = pivoted_cholesky(jnp.ones(x.shape[0], dtype), rbf_column(x, dtype=dtype), max_rank=rank)
    return LowRankPreconditioner.from_factor(chol.factor, noise)


def lanczos_tridiagonal(a: np.ndarray, start: np.ndarray, steps: int):
    """``(diag (steps,), offdiag (steps - 1,))`` of ``Qᵀ A Q`` for the Krylov basis ``Q`` of
    ``span{start, A start, …}``: plain Lanczos in float64 numpy with full reorthogonalisation
    (twice), the reference for the coefficients :func:`scalegp.linalg.cg` records."""
    basis = [start / np.linalg.norm(start)]
    diag, offdiag = [], []
    for j in range(steps):
        w = a @ basis[j]
        diag.append(basis[j] @ w)
        q = np.stack(basis, axis=1)
        for _ in range(2):
            w = w - q @ (q.T @ w)
        if j + 1 < steps:
            offdiag.append(np.linalg.norm(w))
            basis.append(w / offdiag[-1])
    return np.array(diag), np.array(offdiag)
