"""Random-feature prior draws (`scalegp.gp._prior_features`): each kernel family's spectral
measure reproduces its covariance, a single draw errs by at most ``k(0)/√F``, and the same
random state gives the same draws."""

import math

import numpy as np
import pytest

from scalegp import ops
from scalegp.gp import _prior_features
from scalegp.ops import kernel_matrix

POINTS_2D = np.array([[0.0, 0.0], [0.3, -0.2], [-0.5, 0.4], [1.1, 0.7], [0.05, 0.02],
                      [2.0, -1.5]])
POINTS_1D = np.array([[0.0], [0.2], [0.45], [0.9], [1.3], [3.7]])

KERNELS = {
    "rbf_ard": (ops.RBF(np.array([0.7, 1.6])), POINTS_2D),
    "matern12": (ops.Matern(np.array([0.8, 1.2]), nu=0.5), POINTS_2D),
    "matern32": (ops.Matern(np.array([0.8, 1.2]), nu=1.5), POINTS_2D),
    "matern52": (ops.Matern(0.9, nu=2.5), POINTS_2D),
    "rq": (ops.RationalQuadratic(0.8, 0.7), POINTS_2D),
    "periodic": (ops.ExpSineSquared(0.9, 1.3), POINTS_1D),
    "periodic_short": (ops.ExpSineSquared(0.3, 0.8), POINTS_1D),
    "co2_like": (2.0 * ops.RBF(3.0) * ops.ExpSineSquared(1.0, 1.0)
                 + 0.5 * ops.RationalQuadratic(1.2, 0.8) + 0.3 * ops.RBF(0.2), POINTS_1D),
    "product_with_sum": (ops.Matern(1.0, nu=1.5) * (ops.RBF(0.5) + 3.0 * ops.RBF(2.0)),
                         POINTS_2D),
    "constant_plus": (0.7 + ops.RBF(np.array([0.5, 0.9])), POINTS_2D),
}


def _draws(kernel, d, n_draws, n_features, seed=0, n_outputs=1):
    return _prior_features.draw_prior(kernel, d, n_draws, n_outputs,
                                      np.random.RandomState(seed), n_features=n_features,
                                      dtype=np.float32)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_draws_covariance_averages_to_the_kernel(name):
    # E over the frequencies of each draw's own covariance is k (Bochner): 4,000 draws of 16
    # frequencies per term, so the average errs by ~k(0)/√64,000 = 0.004 k(0) per entry
    kernel, x = KERNELS[name]
    draws = _draws(kernel, x.shape[1], 4000, 16)
    want = np.asarray(kernel_matrix(kernel, x, x), np.float64)
    got = np.asarray(draws.covariance(x, x), np.float64).mean(axis=0)
    k0 = float(kernel.at_zero())
    np.testing.assert_allclose(got, want, atol=0.02 * k0)


@pytest.mark.parametrize("name", ["rbf_ard", "matern12", "periodic", "co2_like"])
def test_empirical_covariance_of_prior_draws_matches_the_kernel(name):
    # the functions themselves (weights included): 20,000 draws, few features each
    kernel, x = KERNELS[name]
    draws = _draws(kernel, x.shape[1], 20_000, 8, seed=1)
    values = np.asarray(draws(x), np.float64)[:, 0, :]  # (m, S)
    assert values.shape == (x.shape[0], 20_000)
    want = np.asarray(kernel_matrix(kernel, x, x), np.float64)
    k0 = float(kernel.at_zero())
    # sd of a sample covariance entry: about k(0)·√(2/S) = 0.01 k(0)
    np.testing.assert_allclose(np.cov(values), want, atol=0.05 * k0)
    np.testing.assert_allclose(values.mean(axis=1), 0.0, atol=5 * math.sqrt(k0 / 20_000))


@pytest.mark.parametrize("name", ["rbf_ard", "matern32", "co2_like"])
def test_one_draw_errs_by_at_most_k0_over_root_f(name):
    # the stated error: each entry of a single draw's covariance has sd <= k(0)/√F; the
    # diagonal is exact (cos² + sin² = 1: every draw is exactly N(0, k(0)) at each point)
    kernel, x = KERNELS[name]
    f = 256
    draws = _draws(kernel, x.shape[1], 50, f, seed=2)
    cov = np.asarray(draws.covariance(x, x), np.float64)
    want = np.asarray(kernel_matrix(kernel, x, x), np.float64)
    k0 = float(kernel.at_zero())
    np.testing.assert_allclose(np.diagonal(cov, axis1=1, axis2=2), k0, rtol=1e-5)
    off = ~np.eye(x.shape[0], dtype=bool)
    rms = np.sqrt(np.mean((cov - want)[:, off] ** 2))
    assert 0.1 * k0 / math.sqrt(f) < rms < k0 / math.sqrt(f)


def test_more_features_shrink_a_single_draws_error():
    kernel, x = KERNELS["rbf_ard"]
    want = np.asarray(kernel_matrix(kernel, x, x), np.float64)
    errors = []
    for f in (16, 1024):
        cov = np.asarray(_draws(kernel, 2, 20, f, seed=3).covariance(x, x), np.float64)
        errors.append(np.sqrt(np.mean((cov - want) ** 2)))
    assert errors[1] < errors[0] / 4  # √64 = 8 in expectation


def test_same_state_same_draws_and_shapes():
    kernel, x = KERNELS["co2_like"]
    a = _draws(kernel, 1, 5, 32, seed=7, n_outputs=3)
    b = _draws(kernel, 1, 5, 32, seed=7, n_outputs=3)
    c = _draws(kernel, 1, 5, 32, seed=8, n_outputs=3)
    # three product/sum terms of 32 frequencies each
    assert a.frequencies.shape == (5, 96, 1) and a.weights.shape == (5, 192, 3)
    va, vb, vc = (np.asarray(d(x)) for d in (a, b, c))
    assert va.shape == (x.shape[0], 3, 5)
    np.testing.assert_array_equal(va, vb)
    assert not np.allclose(va, vc)


def test_evaluation_is_blocked_over_rows_and_draws():
    # more rows than a block and more draws than a chunk: the same values as one by one
    kernel = ops.RBF(np.array([0.5, 0.8]))
    x = np.random.RandomState(0).normal(size=(_prior_features.ROW_BLOCK + 37, 2))
    draws = _draws(kernel, 2, 9, 2048, seed=4)  # chunk = 2**22 / (1024·2048) = 2 draws
    values = np.asarray(draws(x))
    phase = np.einsum("md,sfd->msf", x, np.asarray(draws.frequencies, np.float64))
    amp = np.asarray(draws.amplitudes, np.float64)
    w = np.asarray(draws.weights, np.float64)[..., 0]
    want = (np.einsum("msf,sf->ms", amp * np.cos(phase), w[:, :2048])
            + np.einsum("msf,sf->ms", amp * np.sin(phase), w[:, 2048:]))
    np.testing.assert_allclose(values[:, 0, :], want, atol=2e-3)


def test_periodic_on_several_features_and_negative_constants_are_refused():
    with pytest.raises(ValueError, match="not positive definite beyond one feature"):
        _draws(ops.ExpSineSquared(1.0, 1.0) * ops.RBF(1.0), 2, 2, 8)
    with pytest.raises(ValueError, match="negative constant"):
        _draws(-1.0 * ops.RBF(1.0), 1, 2, 8)
    with pytest.raises(ValueError, match="n_features must be a positive integer"):
        _draws(ops.RBF(1.0), 1, 2, 0)


def test_periodic_harmonic_weights_are_the_bessel_series():
    # exp(-2 sin²(πτ/p)/l²) = Σ_k P(k) cos(2πkτ/p)
    k, p = _prior_features._harmonic_weights(0.4)
    tau = np.linspace(0, 2.5, 11)
    series = (p[:, None] * np.cos(2 * np.pi * k[:, None] * tau / 1.7)).sum(axis=0)
    np.testing.assert_allclose(series, np.exp(-2 * np.sin(np.pi * tau / 1.7) ** 2 / 0.16),
                               atol=1e-12)
