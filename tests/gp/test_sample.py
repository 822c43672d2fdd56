"""Pathwise posterior draws (`scalegp.gp.sample_paths`): their mean and covariance are the
posterior's, with the exact solver's Cholesky factor and with the batched CG solve alike."""

import numpy as np
import pytest

from scalegp import gp
from scalegp.ops import kernel_matrix
from tests.gp.problems import NOISE, rbf_params, regression_data


def _posterior_covariance(params, x, x_test):
    """The latent posterior covariance ``K** - K* A⁻¹ K*ᵀ``, float64, dense."""
    hp = params.constrained()
    a = np.asarray(kernel_matrix(hp.kernel, x, x), np.float64) + NOISE * np.eye(len(x))
    cross = np.asarray(kernel_matrix(hp.kernel, x_test, x), np.float64)
    test = np.asarray(kernel_matrix(hp.kernel, x_test, x_test), np.float64)
    return test - cross @ np.linalg.solve(a, cross.T)


@pytest.mark.parametrize("solver", ["exact", "bbmm"])
def test_pathwise_draws_have_the_posterior_covariance(solver):
    x, y, x_test = regression_data(150, d=2, seed=3, num_test=12)
    x, x_test = x.astype(np.float32), x_test.astype(np.float32)
    params = rbf_params(np.float32, lengthscale=np.array([0.8, 1.2]))
    y2 = y[:, None].astype(np.float32)
    if solver == "exact":
        posterior, bbmm = gp.CholeskySolver().posterior(params, x, y2), None
    else:
        bbmm = gp.BBMMSolver(preconditioner_rank=20)  # a weak preconditioner: CG iterates
        posterior = bbmm.posterior(params, x, y2)
    draws = 3000
    latent = gp.sample_paths(params, x, posterior, x_test, draws, np.random.RandomState(0),
                             solver=bbmm, n_features=64)
    assert latent.shape == (12, 1, draws)
    values = np.asarray(latent, np.float64)[:, 0, :]
    want = _posterior_covariance(params, x, x_test)
    se = np.sqrt(np.diag(want) / draws)
    assert np.max(np.abs(values.mean(axis=1)) / se) < 4.5
    assert np.linalg.norm(np.cov(values) - want) / np.linalg.norm(want) < 0.15


def test_several_outputs_are_independent_draws():
    x, y, x_test = regression_data(80, d=2, seed=4, num_test=5)
    params = rbf_params(np.float32, lengthscale=np.array([1.0, 1.0]), mean=np.zeros(2))
    y2 = np.stack([y, -y], axis=1).astype(np.float32)
    posterior = gp.CholeskySolver().posterior(params, x.astype(np.float32), y2)
    latent = np.asarray(gp.sample_paths(params, x.astype(np.float32), posterior,
                                        x_test.astype(np.float32), 2000,
                                        np.random.RandomState(1), n_features=32), np.float64)
    assert latent.shape == (5, 2, 2000)
    # same posterior covariance per output, no correlation between them
    cross = np.mean(latent[:, 0, :] * latent[:, 1, :], axis=1)
    var = np.mean(latent[:, 0, :] ** 2, axis=1)
    assert np.all(np.abs(cross) < 5 * var / np.sqrt(2000))


def test_a_posterior_without_a_cholesky_factor_needs_the_solver():
    x, y, x_test = regression_data(20, d=2, num_test=3)
    params = rbf_params(np.float32, lengthscale=np.array([1.0, 1.0]))
    posterior = gp.Posterior(alpha=np.zeros((20, 1), np.float32))
    with pytest.raises(ValueError, match="needs the iterative solver"):
        gp.sample_paths(params, x.astype(np.float32), posterior, x_test.astype(np.float32), 2,
                        np.random.RandomState(0))
