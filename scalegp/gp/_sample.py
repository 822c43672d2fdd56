"""Posterior function draws by Matheron's rule (pathwise conditioning).

Wilson et al. (2020), "Efficiently sampling functions from Gaussian process posteriors": with
``A = K + Σ`` (``Σ`` the training noise, ``σ²I`` or per point), a prior draw ``f`` and noise
``ε ~ N(0, Σ)``,

    f_post(x*) = m(x*) + f(x*) - K(x*, X) A⁻¹ (f(X) + ε),    m(x*) = m + K(x*, X) A⁻¹ (y - m),

is a draw from the posterior at every ``x*`` jointly: ``f(x*) - K* A⁻¹(f(X) + ε)`` has mean 0
and covariance ``K** - K* A⁻¹ K*ᵀ``. The prior draws are random features
(`scalegp.gp._prior_features`, fresh frequencies per draw, exact covariance on average);
``A⁻¹`` acts on all ``S·o`` right-hand sides together: one batched CG solve with the model's
iterative solver (its preconditioner and ``predict_tol``), or two triangular solves with the
exact solver's Cholesky factor; then one kernel product ``K(x*, X) V`` with all the solutions
as columns. Memory is linear in the test rows and the draws: no ``(m, m)`` matrix is formed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from scalegp.gp._params import Posterior
from scalegp.gp._predict import PREDICT_BLOCK
from scalegp.gp._prior_features import PRIOR_FEATURES, draw_prior
from scalegp.ops import Engine

#: Up to this many query rows, `ScalableGPRegressor.sample_y` (``method="auto"``) draws from
#: the exact predictive covariance (``predict(return_cov=True)`` and an SVD, as scikit-learn):
#: ``O(m³)`` time and a few ``(m, m)`` float64 matrices, under a second here; beyond, the
#: pathwise draw, linear in ``m``.
SAMPLE_EXACT_MAX_ROWS = 1000


def sample_paths(params, x_train, posterior: Posterior, x_test, n_samples: int, rng, *,
                 solver=None, n_features: int = PRIOR_FEATURES, engine: Engine = Engine()):
    """Latent posterior draws ``f_post(x*) - m(x*)`` at ``x_test (m, d)``: ``(m, o, S)``.

    ``posterior``: the exact solver's (with ``cholesky``), or any other with ``solver`` the
    `scalegp.gp.BBMMSolver` that solves ``A V = R`` for the ``(n, S·o)`` right-hand sides (its
    preconditioner, ``predict_tol`` and ``max_cg_iter``; a ConvergenceWarning when a column
    does not converge). ``rng``: a ``numpy.random.RandomState``, which draws the prior's
    features and weights and the training noise ``ε``; the same state gives the same draws.
    Add ``m(x*)`` (``predict``'s mean) and, for draws of y, the test points' noise.
    """
    hp = params.constrained()
    n, d = x_train.shape
    o = hp.mean.shape[0]
    dtype = x_train.dtype
    prior = draw_prior(hp.kernel, d, n_samples, o, rng, n_features, dtype)
    noise_sd = np.sqrt(np.asarray(hp.noise, np.float64))
    noise_sd = noise_sd[:, None, None] if noise_sd.ndim else noise_sd
    eps = jnp.asarray(noise_sd * rng.standard_normal((n, o, n_samples)), dtype)
    rhs = (prior(x_train) + eps).reshape(n, o * n_samples)
    if posterior.cholesky is not None:
        solutions = _cholesky_solve(jnp.asarray(posterior.cholesky, dtype), rhs)
    else:
        if solver is None:
            raise ValueError("sample_paths needs the iterative solver for a posterior without "
                             "a Cholesky factor")
        # the solver subtracts the mean: a zero one, broadcast over every column
        zero_mean = dataclasses.replace(params, mean=jnp.zeros((1,), dtype))
        solutions = solver.posterior(zero_mean, x_train, rhs).alpha
    x_test = jnp.asarray(x_test, dtype)
    update = _cross_product(hp.kernel, x_train, solutions, x_test, engine)
    return prior(x_test) - update.reshape(x_test.shape[0], o, n_samples)


def sample_prior(kernel, x_test, n_outputs: int, n_samples: int, rng, *,
                 n_features: int = PRIOR_FEATURES):
    """Latent prior draws ``f(x*)`` of ``GP(0, kernel)`` at ``x_test (m, d)``: ``(m, o, S)``,
    as in `sample_paths`."""
    x_test = jnp.asarray(x_test)
    prior = draw_prior(kernel, x_test.shape[1], n_samples, n_outputs, rng, n_features,
                       x_test.dtype)
    return prior(x_test)


@jax.jit
def _cholesky_solve(cholesky, rhs):
    return jax.scipy.linalg.cho_solve((cholesky, True), rhs)


def _cross_product(kernel, x_train, v, x_test, engine):
    """``K(x_test, x_train) v`` in blocks of `PREDICT_BLOCK` test rows (padded: one compiled
    program whatever ``m``)."""
    blocks = []
    for start in range(0, x_test.shape[0], PREDICT_BLOCK):
        block = x_test[start: start + PREDICT_BLOCK]
        padded = jnp.pad(block, ((0, PREDICT_BLOCK - block.shape[0]), (0, 0)))
        blocks.append(_cross_block(kernel, x_train, v, padded, engine)[: block.shape[0]])
    if not blocks:
        return jnp.zeros((0, v.shape[1]), v.dtype)
    return jnp.concatenate(blocks, axis=0)


@functools.partial(jax.jit, static_argnames="engine")
def _cross_block(kernel, x_train, v, xb, engine):
    return engine.kernel_mv(xb, x_train, v, kernel)
