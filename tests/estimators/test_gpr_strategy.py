"""scalegp.estimators._gpr_strategy: how the GP regressor's fit starts (the compact subset) and
when it stops short of all data (`expected_gain`, ``full_data_tol``)."""

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


def test_the_expected_gain_is_the_sampling_error_plus_the_stage_step():
    assert _gpr_strategy.expected_gain(0.0, 4, 1000, 4000) == pytest.approx(6.0)
    assert _gpr_strategy.expected_gain(2.0, 4, 1000, 4000) == pytest.approx(6.0 + 8.0)
    assert _gpr_strategy.expected_gain(2.0, 4, 1000, 1000) == pytest.approx(2.0)


def test_the_expected_gain_matches_nested_fits_of_a_normal_model():
    """½ p (n/m - 1) against simulation: the mean and variance of a normal sample (p = 2),
    fitted on the first m of n points, lose that much NLL on all n against their own fit."""
    rng = np.random.default_rng(0)
    n, m, reps = 400, 100, 4000
    x = rng.normal(3.0, 2.0, size=(reps, n))

    def nll(mean, var):
        return 0.5 * n * np.log(var) + ((x - mean[:, None]) ** 2).sum(1) / (2 * var)

    loss = nll(x[:, :m].mean(1), x[:, :m].var(1)) - nll(x.mean(1), x.var(1))
    expected = _gpr_strategy.expected_gain(0.0, 2, m, n)
    assert abs(loss.mean() - expected) < 0.1 * expected + 3 * loss.std() / np.sqrt(reps)


BBMM_SMALL = dict(solver="bbmm", subset_size=64, max_iter_full=2, preconditioner_rank=30,
                  num_probes=8, normalize_y=True, random_state=0, verbose=1)


def test_a_fit_skips_steps_on_all_data_that_gain_under_the_tolerance(caplog, capsys):
    """Stages of 256 of 1,200 points; a tolerance above their expected gain per point skips
    the steps on all data and leaves the NLML to its first reading; 0 takes them."""
    import logging

    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, size=(1200, 2))
    y = np.sin(2 * x[:, 0]) * np.cos(x[:, 1]) + 0.1 * rng.normal(size=1200)
    with caplog.at_level(logging.INFO, logger="scalegp.gp"):
        skipped = ScalableGPRegressor(full_data_tol=1.0, **BBMM_SMALL).fit(x, y)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("BBMM fit on all data skipped") for m in messages)
    assert not any(m.startswith("BBMM fit on all data iter") for m in messages)
    assert "log_marginal_likelihood_value_" not in vars(skipped)
    value = skipped.log_marginal_likelihood_value_  # evaluated now, and kept
    assert vars(skipped)["log_marginal_likelihood_value_"] == value
    assert value == pytest.approx(float(skipped.log_marginal_likelihood(skipped.theta_)),
                                  rel=1e-6)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="scalegp.gp"):
        full = ScalableGPRegressor(full_data_tol=0.0, **BBMM_SMALL).fit(x, y)
    assert not any(r.getMessage().startswith("BBMM fit on all data skipped")
                   for r in caplog.records)
    assert "log_marginal_likelihood_value_" in vars(full)
    # both describe the data: the skipped fit's hyperparameters are the 256-point stage's
    x_test = rng.uniform(-2, 2, size=(500, 2))
    f_test = np.sin(2 * x_test[:, 0]) * np.cos(x_test[:, 1])
    rmse = [np.sqrt(np.mean((model.predict(x_test) - f_test) ** 2)) for model in (skipped, full)]
    assert rmse[0] < 1.2 * rmse[1] + 0.01


def test_a_refit_forgets_the_last_fits_nlml():
    rng = np.random.default_rng(2)
    x = rng.uniform(-2, 2, size=(1200, 2))
    y = np.sin(2 * x[:, 0]) + 0.1 * rng.normal(size=1200)
    settings = dict(BBMM_SMALL, verbose=0)
    model = ScalableGPRegressor(full_data_tol=0.0, **settings).fit(x, y)
    assert "log_marginal_likelihood_value_" in vars(model)
    model.set_params(full_data_tol=1.0).fit(x, 2 * y)
    assert "log_marginal_likelihood_value_" not in vars(model)


@pytest.mark.parametrize("tol", [-1e-3, float("nan"), "small", True])
def test_full_data_tol_must_be_a_number_at_least_zero(tol):
    x = np.random.default_rng(0).uniform(size=(50, 2))
    with pytest.raises(ValueError, match="full_data_tol must be a finite number >= 0"):
        ScalableGPRegressor(full_data_tol=tol).fit(x, x[:, 0])
