"""scalegp.kde._sample: draws match the KDE's analytic moments, are reproducible and respect zero
weights."""

import numpy as np
import pytest

from scalegp import kde
from scalegp.kde._sample import sample
from tests.kde.references import mixture

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


@pytest.mark.parametrize(
    "scale,bandwidth,weighted",
    [(None, 0.5, False), (None, np.array([0.2, 0.7]), True), ("standardize", "scott", True),
     ("covariance", 0.4, False)],
)
def test_sample_moments_match_the_kde(scale, bandwidth, weighted):
    """Mean and covariance of 200,000 draws match the KDE's analytic moments within 6 standard
    errors (estimated from the draws' own fourth moments)."""
    X = mixture(500, seed=28)
    w = np.random.default_rng(29).uniform(0.0, 2.0, 500) if weighted else None
    model = kde.fit_kde(X, w, bandwidth=bandwidth, scale=scale)
    # analytic moments, written out independently of FittedKDE.moments
    p = np.full(500, 1 / 500) if w is None else w / w.sum()
    mean = p @ X
    h = np.broadcast_to(np.asarray(model.bandwidth, np.float64), (2,))
    kernel_cov = model.scaling.inverse.T @ np.diag(h**2) @ model.scaling.inverse
    cov = (X - mean).T @ ((X - mean) * p[:, None]) + kernel_cov
    got_mean, got_cov = model.moments()
    np.testing.assert_allclose(got_mean, mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got_cov, cov, rtol=1e-10, atol=1e-12)

    draws = model.sample(200_000, random_state=0)
    assert draws.shape == (200_000, 2)
    n = draws.shape[0]
    centred = draws - mean
    se_mean = np.sqrt(np.diag(cov) / n)
    assert np.all(np.abs(draws.mean(axis=0) - mean) < 6 * se_mean)
    products = centred[:, :, None] * centred[:, None, :]
    se_cov = products.std(axis=0) / np.sqrt(n)
    assert np.all(np.abs(products.mean(axis=0) - cov) < 6 * se_cov)


def test_sample_is_reproducible_and_respects_zero_weights():
    X = mixture(50, seed=30)
    w = np.zeros(50)
    w[7] = 1.0
    a = sample(X, 0.1, 1000, w, random_state=3)
    b = sample(X, 0.1, 1000, w, random_state=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, sample(X, 0.1, 1000, w, random_state=4))
    # only row 7 can be picked
    assert np.abs(a.mean(axis=0) - X[7]).max() < 0.02

