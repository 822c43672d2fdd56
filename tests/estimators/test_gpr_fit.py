"""scalegp.estimators._gpr_optimise: the optimisers behind ScalableGPRegressor.fit, on synthetic
objectives whose optimum and curvature are known."""

import dataclasses
import types
import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from scalegp._lbfgsb import Stalled, StallGuard, lbfgsb
from scalegp.estimators import _gpr_optimise
from scalegp.estimators._gpr_optimise import (
    Objective,
    minimize,
    objective_tolerance,
    scoring_steps,
)
from scalegp.estimators._progress import FitProgress


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

    monkeypatch.setattr(_gpr_optimise, "_lbfgsb", one_run)
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

    monkeypatch.setattr(_gpr_optimise, "_lbfgsb", stalls)
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
