"""scalegp.kde's weights are relative, at any scale (the package docstring's "Weights"): every
function that takes weights gives the same for c w as for w, and weights beyond the compute
dtype's range warn."""

import numpy as np
import pytest

from scalegp import kde
from scalegp.kde._density import density
from scalegp.kde._loo import loo_log_density
from scalegp.kde._sample import sample
from tests.kde.references import mixture

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


def weights_at(scale, n):
    """(weights at ``scale``, the weights that must give the same results): uniform(0.5, 1.5)
    times the scale; weights of 5e-324, the smallest subnormal, are all equal."""
    if scale == 5e-324:
        return np.full(n, scale), np.ones(n)
    relative = np.random.default_rng(44).uniform(0.5, 1.5, n)
    return scale * relative, relative


@pytest.mark.parametrize("scale", [5e-324, 1e-300, 1e-40, 1e300, 1e308])
def test_functions_take_weights_at_any_scale(scale):
    """Every function that takes weights gives for c w what it gives for w, in float32 and in
    the float64 numpy parts (spread, scaling, sampling, moments)."""
    X, Q = mixture(300, seed=43), mixture(40, seed=43, draw=45)
    X32, Q32 = X.astype(np.float32), Q.astype(np.float32)
    w, reference = weights_at(scale, 300)

    def same(f, rtol=1e-12, atol=0.0):
        np.testing.assert_allclose(f(w), f(reference), rtol=rtol, atol=atol)

    same(lambda w: kde.log_density(Q32, X32, 0.4, w), rtol=0, atol=1e-5)
    same(lambda w: density(Q32, X32, 0.4, w), rtol=1e-5)
    same(lambda w: loo_log_density(X32, 0.4, w), rtol=0, atol=1e-5)
    same(lambda w: sample(X, 0.4, 50, w, random_state=5))
    same(lambda w: kde.fit_kde(X, w, bandwidth="silverman").bandwidth)
    for scaling in ("standardize", "covariance"):
        same(lambda w: kde.fit_kde(X, w, bandwidth=1.0, scale=scaling).scaling.matrix)
        same(lambda w: kde.fit_kde(X, w, bandwidth=1.0, scale=scaling).scaling.location)
    same(lambda w: kde.fit_kde(X, w, bandwidth="scott", scale="covariance").moments()[1])
    same(lambda w: kde.cross_validate_bandwidth(X32, w).bandwidth, rtol=1e-5)
    same(lambda w: kde.cross_validate_bandwidth(X32, w, diagonal=True).bandwidth, rtol=1e-5)


@pytest.mark.skipif(np.finfo(np.longdouble).minexp >= np.finfo(np.float64).minexp,
                    reason="long double is float64 on this platform")
def test_long_double_weights_beyond_float64_keep_their_ratios():
    X, Q = mixture(50, seed=46), mixture(5, seed=46, draw=47)
    relative = np.random.default_rng(48).uniform(0.5, 1.5, 50)
    tiny = relative.astype(np.longdouble) * np.longdouble("1e-4000")
    np.testing.assert_allclose(kde.log_density(Q, X, 0.4, tiny),
                               kde.log_density(Q, X, 0.4, relative), rtol=1e-12)


def test_weights_beyond_the_compute_dtypes_ratios_warn():
    """A weight below float32's smallest normal (1.2e-38) times the largest would be flushed to
    zero by the engine: a warning says so, and float64 keeps it; below float64's range too."""
    X = np.array([[0.0, 0.0], [100.0, 0.0]])
    Q = X[1:]
    w = np.array([1.0, 1e-40])
    exact = np.log(1e-40) - np.log(2 * np.pi)  # the other point is 100 bandwidths away
    with pytest.warns(RuntimeWarning, match=r"1 weight\(s\) are below 1.18e-38 times the largest"):
        got = kde.log_density(Q.astype(np.float32), X.astype(np.float32), 1.0, w)
    assert got[0] < -4000  # the light point left out
    np.testing.assert_allclose(kde.log_density(Q, X, 1.0, w), [exact], rtol=1e-12)
    with pytest.warns(RuntimeWarning, match="1 positive weight.* below about 1e-323 times"):
        kde.log_density(Q, X, 1.0, np.array([1e300, 1e-300]))

