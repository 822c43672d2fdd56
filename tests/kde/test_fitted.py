"""scalegp.kde._fitted: `fit_kde`'s rule bandwidths and scalings against scipy.stats.gaussian_kde,
and its densities under stretched features (the scaling's Jacobian)."""

import numpy as np
import pytest
import scipy.stats

from scalegp import kde
from scalegp.kde._spread import rule_bandwidth
from tests.kde.references import TOL, mixture

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", ["scott", "silverman"])
@pytest.mark.parametrize("weighted", [False, True])
def test_covariance_scaling_matches_scipy(dtype, rule, weighted):
    X = mixture(300, d=3, seed=4)
    Q = mixture(50, d=3, seed=5)
    w = np.random.default_rng(6).uniform(0.1, 3.0, 300) if weighted else None
    reference = scipy.stats.gaussian_kde(X.T, bw_method=rule, weights=w)
    model = kde.fit_kde(X.astype(dtype), w, bandwidth=rule, scale="covariance")
    assert model.bandwidth == pytest.approx(reference.factor, rel=1e-12)
    np.testing.assert_allclose(model.log_density(Q), reference.logpdf(Q.T), rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("scale", [None, "standardize", "covariance"])
@pytest.mark.parametrize("rule", ["scott", "silverman"])
def test_rules_and_scalings_follow_the_data_scale(scale, rule):
    """Stretching features by c stretches rule bandwidths by c (unlike scikit-learn's rules), and
    the density transforms with the Jacobian: p_{cX}(c x) = p_X(x) / prod(c)."""
    X = mixture(300, seed=14)
    Q = mixture(30, seed=15)
    c = np.array([10.0, 0.05])
    base = kde.fit_kde(X, bandwidth=rule, scale=scale)
    stretched = kde.fit_kde(X * c, bandwidth=rule, scale=scale)
    if scale is None:
        np.testing.assert_allclose(stretched.bandwidth, base.bandwidth * c, rtol=1e-12)
    else:
        assert stretched.bandwidth == pytest.approx(base.bandwidth, rel=1e-12)
    np.testing.assert_allclose(
        stretched.log_density(Q * c), base.log_density(Q) - np.log(c).sum(), rtol=0, atol=1e-9
    )


def test_scott_rule_per_feature_and_standardize_agree():
    """'scott' on raw features is Scott's factor times each feature's spread, which is the same
    KDE as Scott's factor on standardised features."""
    X = mixture(250, seed=16)
    Q = mixture(25, seed=17)
    h = rule_bandwidth(X, "scott")
    np.testing.assert_allclose(h, 250 ** (-1 / 6) * X.std(axis=0, ddof=1), rtol=1e-12)
    raw = kde.fit_kde(X, bandwidth="scott").log_density(Q)
    standardized = kde.fit_kde(X, bandwidth="scott", scale="standardize").log_density(Q)
    np.testing.assert_allclose(raw, standardized, rtol=0, atol=1e-10)

