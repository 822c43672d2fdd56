"""scalegp.estimators._gpr_strategy: how the GP regressor's fit starts (the compact subset)."""

import numpy as np
import pytest

from scalegp import ScalableGPRegressor
from scalegp.estimators import _gpr_strategy


def short_lengthscale_draw(n, lengthscale, seed=0, features=2000):
    """n points uniform in the unit square and a draw of a unit-variance RBF GP of
    ``lengthscale`` (random Fourier features) plus noise of sd 0.1."""
    rng = np.random.default_rng(seed)
    omega = rng.standard_normal((features, 2)) / lengthscale
    phase = rng.uniform(0, 2 * np.pi, features)
    amplitude = rng.standard_normal(features) * np.sqrt(2.0 / features)
    x = rng.uniform(size=(n, 2))
    return x, np.cos(x @ omega.T + phase) @ amplitude + 0.1 * rng.standard_normal(n)


def test_a_compact_subset_is_patches_of_the_data_at_their_density():
    """Its points are as close to each other as the data's (a random subset of the same size
    is spaced sqrt(20) times wider), and its four patches lie apart."""
    from scipy.spatial import cKDTree

    rng = np.random.default_rng(0)
    x = rng.uniform(size=(20000, 2)) * [1.0, 100.0]  # the features in units of their spread
    rows = _gpr_strategy.compact_subset(x, 1024, runs=4)
    assert rows.shape == (1024,) and np.all(np.diff(rows) > 0)
    unit = x / [1.0, 100.0]

    def spacing(points):
        return np.median(cKDTree(points).query(points, k=2)[0][:, 1])

    assert spacing(unit[rows]) < 1.5 * spacing(unit)
    random = spacing(unit[rng.choice(20000, 1024, replace=False)])
    assert spacing(unit[rows]) < random / 3
    assert np.all(np.ptp(unit[rows], axis=0) > 0.3)  # patches apart, not one corner


@pytest.mark.slow
def test_a_compact_start_sees_a_lengthscale_a_random_subset_misses(monkeypatch):
    """16,384 points of lengthscale 0.01: a random 512-point subset is spaced about 0.044
    apart, sees uncorrelated values and explains the signal as noise; the compact start's
    four patches keep the data's density, and its lengthscale is within 30% of the truth."""
    x, y = short_lengthscale_draw(16384, 0.01)
    settings = dict(normalize_y=True, random_state=0, subset_size=512, max_iter_full=0,
                    solver="bbmm")
    compact = ScalableGPRegressor(**settings).fit(x, y)
    np.testing.assert_allclose(compact.lengthscale_, 0.01, rtol=0.3)
    monkeypatch.setattr(_gpr_strategy, "COMPACT_MIN_RATIO", np.inf)
    random = ScalableGPRegressor(**settings).fit(x, y)
    assert np.all(np.abs(np.asarray(random.lengthscale_) / 0.01 - 1) > 0.3), random.lengthscale_


@pytest.mark.slow
def test_a_random_start_that_explains_the_patches_is_kept(monkeypatch):
    """Smooth data (lengthscale about 0.3 of the extent): the random subset's fit passes the
    score test on the compact patches, so no compact fit is made and the fit is the one
    without the compact start."""
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(4096, 2))
    y = np.sin(3 * x[:, 0]) + np.cos(2 * x[:, 1]) + 0.1 * rng.standard_normal(4096)
    phases = []
    minimize = _gpr_strategy._minimize
    monkeypatch.setattr(_gpr_strategy, "_minimize",
                        lambda *a, **k: phases.append(a[4]) or minimize(*a, **k))
    settings = dict(normalize_y=True, random_state=0, subset_size=512, max_iter_full=0,
                    solver="bbmm")
    with_rule = ScalableGPRegressor(**settings).fit(x, y)
    assert not any("compact" in phase for phase in phases), phases
    monkeypatch.setattr(_gpr_strategy, "COMPACT_MIN_RATIO", np.inf)
    without = ScalableGPRegressor(**settings).fit(x, y)
    np.testing.assert_array_equal(with_rule.theta_, without.theta_)
