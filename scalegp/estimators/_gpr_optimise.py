"""The optimisers of `ScalableGPRegressor`'s fit: the objective as scipy sees it, L-BFGS-B
(`scalegp._lbfgsb`, restarted after a stall), Adam, and the scoring steps of the BBMM stages,
with progress reports, and the objective of a fitted model (`fitted_log_marginal_likelihood`).
What they are run on is `_gpr_strategy`'s."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
from sklearn.exceptions import ConvergenceWarning

from scalegp import gp
from scalegp._lbfgsb import SCIPY_FTOL, lbfgsb
from scalegp.estimators._gpr_checks import bbmm_solver
from scalegp.estimators._gpr_predict import fitted_state
from scalegp.estimators._gpr_units import default_kernel
from scalegp.estimators._progress import FitProgress


class Objective:
    """``theta -> (NLML, gradient)`` in float64 numpy, for scipy, on fixed data.

    Remembers its recent evaluations by ``theta`` (scipy's L-BFGS-B and the progress callback
    ask again for points they have seen), and the last one (``theta``, ``value``,
    ``cg_iterations``, ``solution``: the solver's ``α``, a warm start for the final solve) so
    that progress reports need no second evaluation. A trial point where the objective is not
    finite, or where ``K + σ²I`` is numerically singular (float32, tiny noise), is infinite, so
    the optimiser backs off; at the final hyperparameters the error is raised with its advice.
    """

    _REMEMBERED = 8

    def __init__(self, solver, x, y, fixed_mean, unpack):
        self.solver, self.x, self.y, self.fixed_mean, self.unpack = solver, x, y, fixed_mean, unpack
        self.theta, self.value, self.cg_iterations, self.solution = None, np.inf, 0, None
        self.evaluations = 0
        self._seen = {}

    def __call__(self, theta):
        self.theta = np.array(theta, np.float64)
        key = self.theta.tobytes()
        if key not in self._seen:
            if len(self._seen) >= self._REMEMBERED:
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = self._evaluate(self.theta)
        value, grad, self.cg_iterations, self.solution = self._seen[key]
        self.value = value
        return value, grad.copy()

    def _evaluate(self, theta):
        o, d = self.y.shape[1], self.x.shape[1]
        params = self.unpack(theta, o, d, self.fixed_mean, self.x.dtype)
        self.evaluations += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                result = self.solver.value_and_grad(params, self.x, self.y)
            except gp.NotPositiveDefiniteError:
                return np.inf, np.zeros(len(theta)), 0, None
        value = float(result.value)
        grad = result.grad.flatten()
        if self.fixed_mean is not None:
            grad = grad[o:]
        cg_iterations = int(result.cg_iterations)
        if not np.isfinite(value) or not np.all(np.isfinite(grad)):
            return np.inf, np.zeros_like(grad), cg_iterations, None
        return value, grad, cg_iterations, result.solution


def fitted_log_marginal_likelihood(model, theta, eval_gradient=False, clone_kernel=True):
    """`ScalableGPRegressor.log_marginal_likelihood` of the fitted ``model`` at ``theta``
    (its layout there), in y's units, float64 as scikit-learn's; with its gradient when
    ``eval_gradient``; ``clone_kernel=False`` sets ``kernel_`` to ``theta``'s."""
    theta = np.asarray(theta, np.float64)
    fixed_mean = model._fixed_mean
    expected = model.theta_.shape
    o = model._y_train_mean.shape[0]
    if model._spec is not None:
        fixed_mean = model.theta_[:o] if fixed_mean is None else fixed_mean
        expected = (model._model_kernel().n_dims,)
    if theta.shape != expected:
        raise ValueError(f"theta must have shape {expected}, got {theta.shape}")
    params, x, _, dtype, _ = fitted_state(model)
    y2 = np.asarray(model.y_train_, np.float64).reshape(x.shape[0], o)
    yj = jnp.asarray((y2 - model._y_train_mean) / model._y_train_std, dtype)
    solver = (gp.CholeskySolver() if model.solver_ == "exact"
              else bbmm_solver(model, model._probe_seed))
    unpack = model._parametrisation()
    value, grad = Objective(solver, x, yj, fixed_mean, unpack)(theta)
    if not clone_kernel:
        if model._spec is not None:
            model.kernel_.theta = theta
        else:
            model.kernel_ = default_kernel(
                unpack(theta, o, x.shape[1], fixed_mean, dtype).constrained(), model._unit())
    value = np.float64(-value + model._lml_offset(yj.size))
    return (value, -np.asarray(grad, np.float64)) if eval_gradient else value


def objective_tolerance(dtype) -> float:
    """L-BFGS-B's ``ftol`` (stop when an iteration lowers the NLML by less than this fraction)
    for an objective computed in ``dtype``: scipy's default in float64; in float32, where the
    Cholesky or CG behind the NLML leaves it uncertain by many roundings, 100 ``eps``: smaller
    "decreases" are rounding noise, and chasing them took most of a float32 fit's evaluations
    (docs/decisions.md #11)."""
    return max(SCIPY_FTOL, 100 * float(np.finfo(dtype).eps))


def minimize(objective: Objective, theta0, maxiter, phase, *, optimizer, learning_rate,
             progress: FitProgress, warn_maxiter=True, bounds=None, ftol=None):
    """Minimise ``objective`` from ``theta0`` within ``bounds`` (None, or a ``(low, high)``
    pair per entry, None for no limit); returns ``(theta, value, iterations)``. ``phase``
    names it in the reports of ``progress``; ``ftol``: L-BFGS-B's, by default
    `objective_tolerance`."""
    if bounds is not None:
        theta0 = np.clip(theta0, *_limits(bounds))
    with progress.phase(phase, total=maxiter) as progress:
        if optimizer == "adam":
            return _adam(objective, theta0, maxiter, float(learning_rate), progress, bounds)

        ftol = objective_tolerance(objective.x.dtype) if ftol is None else ftol

        def callback(xk):
            value = objective.value if np.array_equal(xk, objective.theta) else objective(xk)[0]
            progress.update(value, objective.cg_iterations)

        # A run that stalls or whose line search fails has stopped where its curvature pairs,
        # not the objective, gave out: pairs gathered across a noisy stretch (a float32
        # objective where large lengthscales leave K nearly low-rank) point its steps nowhere.
        # A fresh run from the best point found forgets them; it continues while a run gains
        # more than the tolerance. From a plateau start on 20 features, the restarts took the
        # LML from 79.9 to 134.4 (scikit-learn 135.5).
        theta, start_value = np.asarray(theta0, np.float64), np.inf
        while True:
            theta, value, res = _lbfgsb(objective, theta, maxiter - progress.iteration, bounds,
                                        ftol, callback)
            exhausted = progress.iteration >= maxiter
            # Stalled, or its line search failed; or, under the guard's looser tolerance,
            # "converged" by scipy's own: a float32 step that rounds to no change meets it.
            restart = res is None or res.status == 2 or (res.status == 0 and ftol > SCIPY_FTOL)
            gained, start_value = start_value - value, value
            if (not restart or exhausted or not np.isfinite(value)
                    or gained <= ftol * max(abs(value), 1.0)):
                break
    if warn_maxiter and exhausted:
        warnings.warn(
            f"L-BFGS-B ({phase}) reached max_iter={maxiter} iterations before it converged: "
            "raise max_iter or rescale the data (e.g. StandardScaler and normalize_y=True)",
            ConvergenceWarning,
            stacklevel=6,  # minimize <- _minimize <- optimise <- fit <- in_precision <- caller
        )
    return theta, value, progress.iteration


def _lbfgsb(objective: Objective, theta0, maxiter, bounds, ftol, callback):
    """One L-BFGS-B run from ``theta0`` (`scalegp._lbfgsb.lbfgsb`): ``(theta, value,
    result)``, the result None where a `StallGuard` ended it (the best point it saw is the
    answer).

    L-BFGS-B's own ``ftol`` ends a run at the first iteration that gains under it. Its first
    iterations after a start on a plateau gain that little while its curvature pairs form:
    from scikit-learn's RBF(1.0) on 20 standard normal features (kernel values ~e^-20) it
    stopped after 3 iterations, 419 nats short of the optimum. A looser ftol than scipy's
    (float32, a subset) is therefore the guard's: several evaluations in a row without
    progress. float64 at scipy's default keeps L-BFGS-B's own tests alone.
    """
    return lbfgsb(objective, theta0, maxiter, bounds=bounds, ftol=min(ftol, SCIPY_FTOL),
                  stall_ftol=None if ftol <= SCIPY_FTOL else ftol, callback=callback)


def scoring_steps(objective: Objective, theta0, curvature, maxiter, phase, *,
                  progress: FitProgress, bounds=None, min_decrease=0.5, halvings=3, ftol=0.0,
                  max_step=1.0):
    """Minimise ``objective`` from ``theta0`` by quasi-Newton steps that start from a known
    curvature; returns ``(theta, value, steps, curvature)`` (the last: updated by the steps).

    ``curvature (p, p)``: an estimate of the Hessian at ``theta0``; for the full-data phase the
    subset's Fisher information scaled by ``n / m``. A step is ``-H⁻¹g`` on the parameters that
    no bound holds (projected Newton), shortened to change no parameter by more than
    ``max_step`` (a trust region; in log units for scales, so at most a factor e per step),
    clipped to the bounds, halved (at most ``halvings`` times, and only while the halved step's
    predicted decrease stays above the stopping threshold below) until the objective falls
    (Armijo); ``H`` then takes a BFGS update from the two gradients. Unlike L-BFGS-B started
    cold, whose first steps probe the scale of each parameter with several evaluations, a step
    here costs one evaluation when the curvature is right. Stops after ``maxiter`` steps, when
    the predicted decrease ``½ gᵀH⁻¹g`` is below ``min_decrease`` (nats; with ``H`` the
    information, a step that gains under ½ nat is shorter than one standard error of the
    estimate) or below ``ftol`` times the NLML (L-BFGS-B's relative tolerance, for an exact
    optimum), or when no decrease is found.

    The trust region matters where the curvature is a subset's information scaled to more
    points: on data whose lengthscale is shorter than a random subset's spacing, the subset
    barely separates signal from noise, its information on the noise can be ten times too small
    for more data, and the Newton step then moves the noise several-fold (docs/decisions.md
    #13). Such a trial is rejected all the same, but a stochastic (BBMM)
    evaluation there costs the most: conditioning, hence CG iterations, grows as the noise
    falls.
    """
    low, high = _limits(bounds) if bounds is not None else (-np.inf, np.inf)
    theta = np.clip(np.asarray(theta0, np.float64), low, high)
    hessian = _positive_definite(np.asarray(curvature, np.float64))
    steps = 0
    with progress.phase(phase, total=maxiter) as progress:
        value, grad = objective(theta)
        if not np.isfinite(value):
            return theta, value, steps, hessian
        while steps < maxiter:
            direction = newton_direction(theta, grad, hessian, low, high)
            threshold = max(min_decrease, ftol * max(abs(value), 1.0))
            if -0.5 * grad @ direction < threshold:
                break
            direction *= min(1.0, max_step / np.max(np.abs(direction)))
            accepted = False
            for halving in range(halvings + 1):
                trial = np.clip(theta + 0.5**halving * direction, low, high)
                slope = grad @ (trial - theta)
                # A shorter trial whose predicted decrease is below the threshold is not
                # evaluated: the step would have stopped the iteration, and a stochastic
                # objective cannot tell such a decrease from its own noise.
                if halving and -(slope + 0.5 * (trial - theta) @ hessian @ (trial - theta)) < (
                        threshold):
                    break
                trial_value, trial_grad = objective(trial)
                if trial_value <= value + 1e-4 * min(slope, 0.0) and trial_value < value:
                    accepted = True
                    break
            if not accepted:
                break
            s, y = trial - theta, trial_grad - grad
            if s @ y > 1e-10 * np.linalg.norm(s) * np.linalg.norm(y):
                hs = hessian @ s
                hessian = hessian + np.outer(y, y) / (y @ s) - np.outer(hs, hs) / (s @ hs)
            theta, value, grad = trial, trial_value, trial_grad
            steps += 1
            progress.update(value, objective.cg_iterations)
    return theta, value, steps, hessian


def newton_direction(theta, grad, hessian, low, high):
    """The projected Newton step ``-H⁻¹g`` of the scoring steps, on the parameters that no bound
    (``low``, ``high``) holds: one held at a bound by the gradient stays there (clipping a
    full step instead stalls beside a bound). Its predicted decrease is ``-½ gᵀ step``."""
    free = ~(((theta <= low) & (grad > 0)) | ((theta >= high) & (grad < 0)))
    direction = np.zeros_like(theta)
    if free.any():
        direction[free] = -np.linalg.solve(hessian[np.ix_(free, free)], grad[free])
    return direction


def predicted_decrease(objective: Objective, theta, curvature, bounds=None) -> float:
    """``½ gᵀH⁻¹g`` (nats) at ``theta``: what the next scoring step of ``objective`` with the
    curvature ``H (p, p)`` promises (0 where the objective is not finite there)."""
    low, high = _limits(bounds) if bounds is not None else (-np.inf, np.inf)
    theta = np.clip(np.asarray(theta, np.float64), low, high)
    value, grad = objective(theta)
    if not np.isfinite(value):
        return 0.0
    hessian = _positive_definite(np.asarray(curvature, np.float64))
    return float(-0.5 * grad @ newton_direction(theta, grad, hessian, low, high))


def _positive_definite(matrix):
    """``matrix`` symmetrised, its eigenvalues floored at 1e-8 of the largest: an information
    matrix can be singular (a parameter the data do not inform), and a step needs ``H⁻¹``."""
    matrix = 0.5 * (matrix + matrix.T)
    eigenvalues, vectors = np.linalg.eigh(matrix)
    floor = 1e-8 * max(float(np.max(np.abs(eigenvalues))), np.finfo(np.float64).tiny)
    return (vectors * np.maximum(eigenvalues, floor)) @ vectors.T


def _limits(bounds):
    """``(low (k,), high (k,))`` arrays from L-BFGS-B style bounds (None: unbounded)."""
    low = np.array([-np.inf if b[0] is None else b[0] for b in bounds], np.float64)
    high = np.array([np.inf if b[1] is None else b[1] for b in bounds], np.float64)
    return low, high


def _adam(objective: Objective, theta0, steps, lr, progress, bounds=None):
    """Adam (Kingma & Ba, 2015) with the default moments (0.9, 0.999), projected onto the
    bounds after each step; the best iterate wins, so a step that overshoots late in the run
    costs nothing."""
    low, high = _limits(bounds) if bounds is not None else (-np.inf, np.inf)
    b1, b2, eps = 0.9, 0.999, 1e-8
    theta = np.array(theta0, np.float64)
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    best = (theta.copy(), np.inf)
    for k in range(1, steps + 1):
        value, grad = objective(theta)
        if value < best[1]:
            best = (theta.copy(), value)
        progress.update(value, objective.cg_iterations)
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad**2
        theta = theta - lr * (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)
        theta = np.clip(theta, low, high)
    value, _ = objective(theta)
    if value < best[1]:
        best = (theta, value)
    return best[0], float(best[1]), int(steps)


def restart_points(theta0, n_restarts: int, n_free_start: int, rng) -> list:
    """``theta0`` and ``n_restarts`` points around it: each hyperparameter from
    ``theta0[n_free_start:]`` multiplied by ``e^U``, U ~ uniform(-2, 2), in constrained units."""
    starts = [theta0]
    for _ in range(n_restarts):
        t = theta0.copy()
        constrained = np.log1p(np.exp(np.clip(t[n_free_start:], -50, 50)))
        constrained = constrained * np.exp(rng.uniform(-2, 2, size=constrained.shape))
        t[n_free_start:] = np.asarray(gp.softplus_inverse(constrained))
        starts.append(t)
    return starts
