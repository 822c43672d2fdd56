"""scalegp.estimators._gpr_fit: how ScalableGPRegressor.fit fits its hyperparameters. The
optimisers, on synthetic objectives whose optimum and curvature are known; the strategy: how a
fit starts (the compact subset) and when it stops short of all data (`expected_gain`,
``full_data_tol``); and the one engine a fit builds."""

import dataclasses
import types
import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from scalegp import ScalableGPRegressor
from scalegp._lbfgsb import Stalled, StallGuard, lbfgsb
from scalegp.estimators import _gpr_fit
from scalegp.estimators._gpr_fit import (
    Objective,
    minimize,
    objective_tolerance,
    scoring_steps,
)
from scalegp.estimators._progress import FitProgress
from scalegp.ops import Engine


@dataclasses.dataclass
class _Result:
    value: float
    grad: np.ndarray
    cg_iterations: int = 0
    solution: object = None


class _Quadratic:
    """A "solver" whose objective is ½(θ - c)ᵀH(θ - c) + noise·sin(1e4·θ₀) (rounding-like
    noise at the optimum when noise > 0)."""

    def __init__(self, hessian, centre, noise=0.0):
        self.hessian, self.centre, self.noise = hessian, centre, noise

    def value_and_grad(self, theta, x, y):
        r = theta - self.centre
        wiggle = self.noise * np.sin(1e4 * theta[0])
        return _Result(0.5 * r @ self.hessian @ r + wiggle, self.hessian @ r)


def _objective(solver, dtype=np.float64):
    x = np.zeros((3, 1), dtype)
    return Objective(solver, x, np.zeros((3, 1)), None, lambda t, o, d, m, dt: np.asarray(t))


HESSIAN = np.array([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]])
CENTRE = np.array([1.0, -2.0, 0.5])


def test_scoring_with_the_true_curvature_takes_one_step():
    objective = _objective(_Quadratic(HESSIAN, CENTRE))
    theta, value, steps, _ = scoring_steps(objective, np.zeros(3), HESSIAN, 10, "fit",
                                           progress=FitProgress(0), min_decrease=1e-12,
                                           max_step=np.inf)
    np.testing.assert_allclose(theta, CENTRE, atol=1e-12)
    assert steps == 1 and objective.evaluations == 2  # the start and the step; then nothing left
    assert value == pytest.approx(0.0, abs=1e-20)


def test_scoring_learns_a_wrong_curvature_and_respects_bounds():
    objective = _objective(_Quadratic(HESSIAN, CENTRE))
    bounds = [(None, None), (-1.0, None), (None, None)]
    theta, _, steps, _ = scoring_steps(objective, np.zeros(3), 3 * HESSIAN, 20, "fit",
                                       progress=FitProgress(0), bounds=bounds,
                                       min_decrease=1e-10)
    assert theta[1] == -1.0  # the bound, not the unconstrained optimum at -2
    free = np.array([0, 2])
    # optimum of the two free coordinates with θ₁ fixed at its bound
    expected = CENTRE[free] - np.linalg.solve(HESSIAN[np.ix_(free, free)],
                                              HESSIAN[free, 1] * (-1.0 - CENTRE[1]))
    np.testing.assert_allclose(theta[free], expected, atol=1e-4)
    assert 1 < steps < 20


def test_scoring_stops_when_the_predicted_gain_is_small():
    objective = _objective(_Quadratic(HESSIAN, CENTRE))
    start = CENTRE + 0.01  # predicted gain ½ gᵀH⁻¹g ≈ 5e-4, below min_decrease = 0.5
    theta, _, steps, _ = scoring_steps(objective, start, HESSIAN, 10, "fit",
                                       progress=FitProgress(0))
    np.testing.assert_array_equal(theta, start)
    assert steps == 0 and objective.evaluations == 1


def test_scoring_stops_at_a_relative_tolerance_of_the_value():
    # The objective shifted by 1000: ftol counts against |value|, as L-BFGS-B's does.
    shifted = _Quadratic(HESSIAN, CENTRE)
    shifted.value_and_grad = lambda theta, x, y, f=shifted.value_and_grad: _Result(
        f(theta, x, y).value + 1000.0, f(theta, x, y).grad)
    start = CENTRE + 0.01  # predicted gain ½ gᵀH⁻¹g = 6e-4, against ftol·1000
    for ftol, expected_steps in ((1e-7, 1), (5e-7, 1), (1e-6, 0)):
        objective = _objective(shifted)
        _, _, steps, _ = scoring_steps(objective, start, HESSIAN, 10, "fit",
                                       progress=FitProgress(0), min_decrease=0.0, ftol=ftol)
        assert steps == expected_steps, ftol


def test_scoring_steps_stay_in_the_trust_region():
    # Curvature a hundred times too small: the Newton step would move θ by about 200. The trial
    # moves no parameter by more than max_step, and the steps still reach the optimum.
    quadratic = _Quadratic(HESSIAN, CENTRE)
    seen = []
    evaluate = quadratic.value_and_grad
    quadratic.value_and_grad = lambda theta, x, y: (seen.append(theta.copy()),
                                                    evaluate(theta, x, y))[1]
    scoring_steps(_objective(quadratic), np.zeros(3), HESSIAN / 100, 1, "fit",
                  progress=FitProgress(0), halvings=0, max_step=0.25)
    assert len(seen) == 2 and np.abs(seen[1]).max() == pytest.approx(0.25)
    theta, _, steps, _ = scoring_steps(_objective(_Quadratic(HESSIAN, CENTRE)), np.zeros(3),
                                       HESSIAN / 100, 50, "fit", progress=FitProgress(0),
                                       min_decrease=1e-10, max_step=0.25)
    np.testing.assert_allclose(theta, CENTRE, atol=1e-3)


def test_scoring_without_halvings_stops_at_a_failed_step():
    objective = _objective(_Quadratic(HESSIAN, CENTRE))
    theta, _, steps, _ = scoring_steps(objective, np.zeros(3), HESSIAN / 10, 10, "fit",
                                       progress=FitProgress(0), halvings=0, max_step=np.inf)
    # the tenfold step overshoots: not taken, and nothing else is tried
    np.testing.assert_array_equal(theta, np.zeros(3))
    assert steps == 0 and objective.evaluations == 2


def test_scoring_halves_a_step_only_while_it_promises_the_threshold():
    # A curvature a tenth of the true one: a trial of length t lands at (1 - 10t) of the way
    # back, and falls only for t < 0.2 (t = ⅛ of the halvings). Under that curvature the full
    # step predicts D = ½gᵀH⁻¹g and one of length t predicts D(2t - t²): ½, ¼, ⅛ promise
    # 0.75D, 0.44D, 0.23D. A threshold of 0.2D lets all three be tried (⅛ is taken); one of
    # 0.3D stops after ¼, without evaluating ⅛.
    start = np.zeros(3)
    g = HESSIAN @ (start - CENTRE)
    full = 0.5 * g @ np.linalg.solve(HESSIAN / 10, g)
    for threshold, evaluations, taken in ((0.2 * full, 5, 1), (0.3 * full, 4, 0)):
        objective = _objective(_Quadratic(HESSIAN, CENTRE))
        _, _, steps, _ = scoring_steps(objective, start, HESSIAN / 10, 1, "fit",
                                       progress=FitProgress(0), min_decrease=threshold,
                                       max_step=np.inf)
        assert (objective.evaluations, steps) == (evaluations, taken)


def test_lbfgs_stops_at_the_rounding_floor():
    # Rounding-like noise of 1e-3 at the optimum: L-BFGS-B's line searches fail there; the stall
    # guard ends the run after three evaluations without progress, at the best point seen.
    noisy = _Quadratic(HESSIAN, CENTRE, noise=1e-3)
    seen = []
    evaluate = noisy.value_and_grad
    noisy.value_and_grad = lambda *args: seen.append(evaluate(*args)) or seen[-1]
    objective = _objective(noisy, np.float32)
    theta, value, _ = minimize(objective, np.zeros(3), 200, "fit", optimizer="L-BFGS-B",
                               learning_rate=0.0, progress=FitProgress(0))
    assert np.linalg.norm(theta - CENTRE) < 0.1
    assert value == min(result.value for result in seen)  # every evaluation, not the remembered
    assert objective.evaluations < 40
    assert objective_tolerance(np.float32) == pytest.approx(100 * np.finfo(np.float32).eps)
    assert objective_tolerance(np.float64) == pytest.approx(2.220446049250313e-09)


def test_objective_remembers_evaluations():
    objective = _objective(_Quadratic(HESSIAN, CENTRE))
    first = objective(np.ones(3))
    again = objective(np.ones(3))
    assert objective.evaluations == 1 and first[0] == again[0]
    again[1][0] = 99.0  # the caller's copy: the remembered gradient is untouched
    assert objective(np.ones(3))[1][0] != 99.0


@pytest.mark.parametrize("dtype, status, restarted", [
    (np.float32, None, True),  # ended by the stall guard
    (np.float32, 0, True),  # "converged" by scipy's own ftol: a step that rounded to no change
    (np.float64, 2, True),  # its line search failed
    (np.float64, 0, False),  # converged at scipy's default tolerance
    (np.float64, 1, False),  # out of iterations
])
def test_a_run_that_stops_early_restarts_from_its_best_point(monkeypatch, dtype, status,
                                                             restarted):
    """A fresh L-BFGS-B run (no curvature pairs) follows from the best point while runs gain
    more than the tolerance; converged or out-of-iterations runs are final."""
    values = iter([10.0, 4.0, 4.0 - 1e-12, 0.0])  # the third run gains under the tolerance
    starts = []

    def one_run(objective, theta0, maxiter, bounds, ftol, callback):
        starts.append(np.array(theta0))
        theta = theta0 + 1.0
        callback(theta)
        result = None if status is None else types.SimpleNamespace(status=status)
        return theta, next(values), result

    monkeypatch.setattr(_gpr_fit, "_lbfgsb", one_run)
    objective = _objective(_Quadratic(HESSIAN, CENTRE), dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        theta, value, iterations = minimize(objective, np.zeros(3), 50, "fit",
                                            optimizer="L-BFGS-B", learning_rate=0.0,
                                            progress=FitProgress(0))
    runs = 3 if restarted else 1
    assert len(starts) == iterations == runs
    for k, start in enumerate(starts):
        np.testing.assert_array_equal(start, np.full(3, float(k)))
    np.testing.assert_array_equal(theta, np.full(3, float(runs)))
    assert value == [10.0, 4.0, 4.0 - 1e-12][runs - 1]


def test_restarts_stop_at_max_iter(monkeypatch):
    def stalls(objective, theta0, maxiter, bounds, ftol, callback):
        for _ in range(min(maxiter, 4)):
            theta0 = theta0 + 1.0
            callback(theta0)
        return theta0, -float(theta0[0]), None  # every run gains

    monkeypatch.setattr(_gpr_fit, "_lbfgsb", stalls)
    objective = _objective(_Quadratic(HESSIAN, CENTRE), np.float32)
    with pytest.warns(ConvergenceWarning, match="max_iter=10"):
        theta, _, iterations = minimize(objective, np.zeros(3), 10, "fit", optimizer="L-BFGS-B",
                                        learning_rate=0.0, progress=FitProgress(0))
    assert iterations == 10 and theta[0] == 10.0


def test_the_stall_guard_never_answers_worse_than_its_start():
    """A restart starts where the run before it had its best point, which the objective
    remembers: the guard counts that point as its best, so a restart that finds nothing better
    returns it (it used to return the first new point it saw, which may be worse)."""
    objective = _objective(_Quadratic(HESSIAN, CENTRE), np.float32)
    objective(CENTRE)  # the previous run's best, remembered
    guard = StallGuard(objective, ftol=1e-3)
    guard(CENTRE)
    with pytest.raises(Stalled):
        for step in (1e-3, 2e-3, 3e-3, 4e-3):  # worse, within the floor: three misses
            guard(CENTRE + step)
    np.testing.assert_array_equal(guard.best_theta, CENTRE)
    assert guard.best_value == 0.0


def test_a_first_step_bounds_the_first_trial_and_not_the_answer():
    """Within bounds scipy's first L-BFGS-B trial is ``theta0 - gradient``: with a gradient in
    the thousands (a likelihood summed over many points) it lands on the bounds' corner.
    ``first_step`` scales the objective so that no entry moves further on that trial; the run
    still reaches the optimum, evaluates ``theta0`` once, and reports unscaled values."""
    hessian, centre = 1e3 * HESSIAN, CENTRE
    bounds = [(-5.0, 5.0)] * 3

    def run(first_step):
        seen = []

        def objective(theta):
            seen.append(np.array(theta))
            r = theta - centre
            return 0.5 * r @ hessian @ r, hessian @ r

        theta, value, _ = lbfgsb(objective, np.zeros(3), 100, bounds=bounds,
                                 first_step=first_step)
        return theta, value, seen

    _, _, unscaled = run(None)
    assert np.max(np.abs(unscaled[1])) == 5.0  # the corner
    theta, value, seen = run(0.25)
    assert np.max(np.abs(seen[1] - seen[0])) == pytest.approx(0.25)
    assert sum(np.array_equal(t, seen[0]) for t in seen) == 1
    np.testing.assert_allclose(theta, centre, atol=1e-4)
    r = theta - centre
    assert value == pytest.approx(0.5 * r @ hessian @ r, abs=1e-6)


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
    rows = _gpr_fit.compact_subset(x, 1024, runs=4)
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
    monkeypatch.setattr(_gpr_fit, "COMPACT_MIN_RATIO", np.inf)
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
    minimize = _gpr_fit._minimize
    monkeypatch.setattr(_gpr_fit, "_minimize",
                        lambda *a, **k: phases.append(a[4]) or minimize(*a, **k))
    settings = dict(normalize_y=True, random_state=0, subset_size=512, max_iter_full=0,
                    solver="bbmm")
    with_rule = ScalableGPRegressor(**settings).fit(x, y)
    assert not any("compact" in phase for phase in phases), phases
    monkeypatch.setattr(_gpr_fit, "COMPACT_MIN_RATIO", np.inf)
    without = ScalableGPRegressor(**settings).fit(x, y)
    np.testing.assert_array_equal(with_rule.theta_, without.theta_)


def test_the_expected_gain_is_the_sampling_error_plus_the_stage_step():
    assert _gpr_fit.expected_gain(0.0, 4, 1000, 4000) == pytest.approx(6.0)
    assert _gpr_fit.expected_gain(2.0, 4, 1000, 4000) == pytest.approx(6.0 + 8.0)
    assert _gpr_fit.expected_gain(2.0, 4, 1000, 1000) == pytest.approx(2.0)


def test_the_expected_gain_matches_nested_fits_of_a_normal_model():
    """½ p (n/m - 1) against simulation: the mean and variance of a normal sample (p = 2),
    fitted on the first m of n points, lose that much NLL on all n against their own fit."""
    rng = np.random.default_rng(0)
    n, m, reps = 400, 100, 4000
    x = rng.normal(3.0, 2.0, size=(reps, n))

    def nll(mean, var):
        return 0.5 * n * np.log(var) + ((x - mean[:, None]) ** 2).sum(1) / (2 * var)

    loss = nll(x[:, :m].mean(1), x[:, :m].var(1)) - nll(x.mean(1), x.var(1))
    expected = _gpr_fit.expected_gain(0.0, 2, m, n)
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


@pytest.fixture
def engines_built(monkeypatch):
    """The `scalegp.ops.Engine` objects built while the test runs (by `Engine.create`, a
    constructor call or `dataclasses.replace`), as their constructors' arguments."""
    built = []
    init = Engine.__init__

    def counting(self, *args, **kwargs):
        built.append((args, kwargs))
        init(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", counting)
    return built


@pytest.mark.parametrize("solver", ["exact", "bbmm"])
def test_a_fit_builds_one_engine(engines_built, solver):
    """The engine of the settings is built once, by `check_settings`, and handed to the
    training order, the BBMM solver and through it to every product of the fit, the
    preconditioner's included (issue 59: three were built); the BBMM fit takes a step on
    all data and builds its variance cache."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, (64, 2))
    y = np.sin(x[:, 0]) + 0.1 * rng.standard_normal(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # max_iter=3
        model = ScalableGPRegressor(solver=solver, max_iter=3, max_iter_full=1,
                                    full_data_tol=0.0, num_probes=4, preconditioner_rank=16,
                                    love_rank=16, random_state=0).fit(x, y)
    assert model.solver_ == solver
    assert len(engines_built) == 1, engines_built
