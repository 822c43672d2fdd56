"""Prediction from a posterior: means and variances in fixed blocks of test rows, covariances."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from scalegp._validation import check_memory
from scalegp.gp._params import Posterior, constrained
from scalegp.ops import Engine, kernel_matrix

#: Test rows per prediction block. Every block is padded to exactly this many rows, so each test
#: point's mean and variance come out of the same compiled arithmetic whatever else is predicted
#: with it (row independence: `scalegp.ops`); the xla query tile (and a multiple of the pallas
#: one), so that no block is padded twice.
PREDICT_BLOCK = 1024
#: ... and a mean-only prediction of at most `SHORT_PREDICT_ROWS` rows on one device (a
#: Bayesian-optimisation step, a service's lone query) runs in blocks of `SHORT_PREDICT_BLOCK`
#: rows, whose kernel products take the engine's short query tiles
#: (the xla backend's short tiles, a row's arithmetic the same): one query does not pay
#: for 1,024. Variances keep the full block: their products (the LOVE factor's many columns,
#: the Cholesky path's triangular solve) round a row by the block's height.
SHORT_PREDICT_BLOCK = 8
SHORT_PREDICT_ROWS = 64
#: ... and a prediction of many rows, where the engine's products give a row the same bits in a
#: batch of any height (`scalegp.ops.Engine.rows_independent`), runs in blocks of this many rows
#: while that many remain, then in `PREDICT_BLOCK`s: what a block costs whatever its height
#: (the training points and the variance cache's columns laid out for the kernel product, on a
#: TPU gigabytes at 10⁶ training points; a dispatch) is then paid 16 times less often. Not for
#: the Cholesky path's variances (its triangular solve rounds a row by the block's height).
TALL_PREDICT_BLOCK = 16384

#: Matrices of m x m entries in the compute dtype that `predict` holds at once for a covariance
#: (the test kernel matrix, the reduction, their difference).
COVARIANCE_MATRICES = 3


def check_covariance_memory(m: int, needed: int):
    """A MemoryError, before anything is allocated, where a covariance of ``m`` query rows
    needs more than `scalegp._validation.memory_limit` (``needed`` bytes): an allocation that
    large aborted the process or failed inside XLA."""
    check_memory(
        needed, f"return_cov for {m:,} query rows: ({m:,}, {m:,}) matrices",
        "ask for return_std=True (the variances, linear in the rows) or for the covariance of "
        "fewer rows at a time")


def predict(
    params,
    x_train,
    posterior: Posterior,
    x_test,
    *,
    return_std: bool = False,
    return_cov: bool = False,
    include_noise: bool = True,
    engine: Engine = Engine(),
):
    """Predictive mean, and optionally std or covariance, at ``x_test (m, d)``.

    ``mean = m + K(X*, X) α``; ``var = k(0) - diag(K* A⁻¹ K*ᵀ) (+ σ² if include_noise)``
    (from the Cholesky factor or the LOVE factor of ``posterior``, whichever it holds; ``k(0)``
    is the kernel's constant diagonal); ``cov = K(X*, X*) - K* A⁻¹ K*ᵀ (+ σ² I)`` needs the
    Cholesky factor or forms an ``(m, m)`` matrix from the LOVE factor, so keep ``m`` small: a
    request beyond the memory this process can hold is a MemoryError before any work.

    Means and variances are computed in blocks of :data:`PREDICT_BLOCK` test rows (a few means
    alone: :data:`SHORT_PREDICT_BLOCK`; many, where the products allow it, first in blocks of
    :data:`TALL_PREDICT_BLOCK`), so a row's result does not depend on the other rows, and
    memory stays linear in ``m``.

    ``engine``: where the kernel products run (`scalegp.ops.Engine`: with a mesh, the test rows
    of each product are sharded over it).

    Returns:
      ``mean (m, o)``, plus ``std (m,)`` or ``cov (m, m)`` (shared by all outputs). Variances
      below 0 (rounding, or an under-ranked LOVE cache) are clipped to 0 with a RuntimeWarning
      when the clipping exceeds ``1e-6 · k(0)``.
    """
    if (return_std or return_cov) and posterior.cholesky is None and posterior.love_factor is None:
        raise ValueError("posterior has no variance cache: call BBMMSolver.love first")
    hp = constrained(params)
    if include_noise and (return_std or return_cov) and jnp.ndim(hp.noise) > 0:
        raise ValueError(
            "the noise is per training point (shape (n,)): it says nothing about new points; "
            "predict with include_noise=False and add the noise of the test points")
    m = x_test.shape[0]
    if return_cov:
        # and the Cholesky path's two (m, n) matrices (cross-covariances, triangular solve)
        entries = m * (COVARIANCE_MATRICES * m + 2 * x_train.shape[0])
        check_covariance_memory(m, entries * jnp.dtype(x_train.dtype).itemsize)
    # host rows are cut and padded on the host: for one short block, eager device slicing
    # and padding cost more than its kernel rows
    xp = np if isinstance(x_test, np.ndarray) else jnp
    x_test = xp.asarray(x_test, x_train.dtype)
    means, variances = [], []
    rows = (SHORT_PREDICT_BLOCK if m <= SHORT_PREDICT_ROWS and not return_std
            and engine.mesh is None else PREDICT_BLOCK)
    tall = (rows == PREDICT_BLOCK and m >= TALL_PREDICT_BLOCK
            and not (return_std and posterior.cholesky is not None)
            and engine.rows_independent(*x_train.shape, x_train.dtype))
    for start, height in _blocks(m, rows, TALL_PREDICT_BLOCK if tall else rows):
        block = x_test[start: start + height]
        padded = xp.pad(block, ((0, height - block.shape[0]), (0, 0)))
        mean, var = _predict_block(hp, x_train, posterior, padded, return_std, engine)
        means.append(mean)
        if return_std:
            variances.append(var)
    mean = (_joined(tuple(means), m) if means
            else jnp.zeros((0,) + hp.mean.shape, x_train.dtype))
    if not (return_std or return_cov):
        return mean
    if return_std:
        if not variances:
            return mean, jnp.zeros((0,), x_train.dtype)
        std, worst, prior_variance = _standard_deviation(_joined(tuple(variances), m), hp,
                                                         include_noise)
        _warn_clip(float(worst), prior_variance)
        return mean, std
    prior_variance = hp.kernel.at_zero()
    if return_cov:
        if posterior.cholesky is not None:
            test_train = kernel_matrix(hp.kernel, x_test, x_train)
            v = jax.scipy.linalg.solve_triangular(posterior.cholesky, test_train.T, lower=True)
            reduction = v.T @ v
        else:
            rk = engine.kernel_mv(x_test, x_train, posterior.love_factor, hp.kernel)
            reduction = rk @ rk.T
        cov = kernel_matrix(hp.kernel, x_test, x_test) - reduction
        if include_noise:
            cov = cov + hp.noise * jnp.eye(m, dtype=cov.dtype)
        diag = jnp.diagonal(cov)
        if m:
            _warn_clip(float(jnp.min(diag)), prior_variance)
        cov = cov.at[jnp.diag_indices(m)].set(jnp.maximum(diag, 0.0))
        return mean, cov


def _blocks(m: int, rows: int, tall: int):
    """``(start, height)`` of the blocks that cover ``m`` rows: of ``tall`` rows while that
    many remain, then of ``rows`` (the last one padded)."""
    bulk = m // tall * tall
    return ([(start, tall) for start in range(0, bulk, tall)]
            + [(start, rows) for start in range(bulk, m, rows)])


@functools.partial(jax.jit, static_argnames=("return_std", "engine"))
def _predict_block(hp, x_train, posterior, xb, return_std, engine):
    """(mean (b, o), latent variance (b,) or None) for one padded block of test rows."""
    mean = hp.mean + engine.kernel_mv(xb, x_train, posterior.alpha, hp.kernel)
    if not return_std:
        return mean, None
    if posterior.cholesky is not None:
        cross = kernel_matrix(hp.kernel, xb, x_train).T
        v = jax.scipy.linalg.solve_triangular(posterior.cholesky, cross, lower=True)
        return mean, hp.kernel.at_zero() - jnp.sum(v * v, axis=0)
    rk = engine.kernel_mv(xb, x_train, posterior.love_factor, hp.kernel)
    return mean, hp.kernel.at_zero() - jnp.sum(rk * rk, axis=-1)


# The steps around the blocks as compiled programs: eager, each step of them compiled a program
# of its own (on a TPU, each a compilation of its own for the chip).
@functools.partial(jax.jit, static_argnums=1)
def _joined(blocks, m):
    """The first ``m`` rows of the padded blocks' results (a tuple), in order."""
    return (blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=0))[:m]


@functools.partial(jax.jit, static_argnums=2)
def _standard_deviation(var, hp, include_noise: bool):
    """``(std (m,), the smallest variance before clipping, k(0))`` from the latent variances
    ``var (m,)``, the noise added where ``include_noise``."""
    noise = hp.noise if include_noise else 0.0
    clipped = jnp.maximum(var, 0.0) + noise
    return jnp.sqrt(jnp.maximum(clipped, 0.0)), jnp.min(var + noise), hp.kernel.at_zero()


def _warn_clip(worst: float, prior_variance):
    if worst < -1e-6 * float(prior_variance):
        warnings.warn(
            f"predictive variances down to {worst:.3g} were clipped to 0 (prior variance "
            f"{float(prior_variance):.3g}); with the iterative solver raise love_rank, otherwise "
            "raise noise_lower_bound or use float64",
            RuntimeWarning,
            stacklevel=3,
        )


def predict_moments(params, x_train, posterior: Posterior, x_test, *, return_std: bool = False,
                    engine: Engine = Engine()):
    """``(mean (m, o), latent variance (m,) or None)`` at ``x_test (m, d)``: the arithmetic of
    `predict`'s blocks on the given rows as they are, without its host steps (no blocks, no
    clipping, no noise, no checks), so that it can be traced: jit, grad with respect to
    ``x_test`` (the engine's products have their own gradients), vmap. ``return_std`` needs
    the variance factor in ``posterior``, as `predict`."""
    return _predict_block(params.constrained(), x_train, posterior, x_test, return_std, engine)
