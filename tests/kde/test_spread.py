"""scalegp.kde._spread: per-feature spreads, rules and the standardising scaling, in memory
linear in the features."""

import numpy as np
import pytest

from scalegp import kde
from scalegp.kde._spread import fit_scaling, rule_bandwidth

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


@pytest.mark.parametrize("weighted", [False, True])
def test_per_feature_spreads_take_memory_linear_in_the_features(weighted):
    """'standardize' and the rules read each feature's spread without the (d, d) covariance
    (800 MB at 10,000 features: a wide KDE's fit ran out of memory before its compilation
    did), and agree with that covariance's diagonal; the scaling maps rows one by one."""
    X = np.random.default_rng(40).normal(3.0, [0.5, 2.0, 7.0], size=(200, 3))
    w = np.random.default_rng(41).uniform(0.0, 2.0, 200) if weighted else None
    std = np.sqrt(np.diag(np.cov(X, rowvar=False, aweights=w)))
    np.testing.assert_allclose(fit_scaling(X, w, "standardize").scale, std, rtol=1e-13)
    np.testing.assert_allclose(rule_bandwidth(X, "scott", w),
                               kde.scott_factor(200 if w is None else w.sum() ** 2 / (w**2).sum(), 3) * std,
                               rtol=1e-13)
    wide = np.random.default_rng(42).normal(size=(10, 20_000))
    scaling = fit_scaling(wide, None, "standardize")
    assert scaling.scale.shape == (20_000,) and scaling.whitening is None
    z = scaling.transform(wide)
    np.testing.assert_array_equal(scaling.transform(wide[3:4]), z[3:4])
    np.testing.assert_allclose(scaling.inverse_transform(z), wide, rtol=0, atol=1e-12)

