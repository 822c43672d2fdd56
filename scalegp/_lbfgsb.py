"""L-BFGS-B for scalegp's objectives computed in float32 or float64: the GP's hyperparameters
(`scalegp.estimators`) and the KDE's cross-validated bandwidth (`scalegp.kde`).

One run of scipy's L-BFGS-B within bounds (`lbfgsb`), optionally under a `StallGuard`: a
float32 objective is uncertain by many roundings, and L-BFGS-B's own ``ftol`` cannot express
"several evaluations in a row without progress" (docs/decisions.md #12). The callers choose
the tolerances of their objective's precision.
"""

from __future__ import annotations

import numpy as np

#: scipy's default ``ftol`` of L-BFGS-B.
SCIPY_FTOL = 2.220446049250313e-09


class Stalled(Exception):
    """Raised by a `StallGuard` to end an L-BFGS-B run."""


class StallGuard:
    """An ``objective`` (``theta -> (value, gradient)``) for L-BFGS-B, ended (`Stalled`) after
    ``patience`` evaluations in a row that lower the best value by less than ``ftol`` of it;
    the best point seen is the answer.

    It enforces a tolerance looser than scipy's default (float32's rounding floor, a subset's
    early stop) in place of L-BFGS-B's own ``ftol``, which one small-gain iteration satisfies,
    and it ends what that test would not: at a float32 objective's rounding floor L-BFGS-B's
    line searches fail, each after up to 20 evaluations, and it restarts before it gives up,
    so most of such a fit's evaluations came after its best point. An evaluation clearly worse
    than the best (by more than ``ftol``) is no miss: a line search backtracking from a long
    step makes those, the rounding floor does not; ``worse_patience`` evaluations in a row
    without progress of either kind end it all the same. An objective that remembers points
    says so by an ``evaluations`` count: a remembered point is neither progress nor a miss.
    """

    def __init__(self, objective, ftol: float, patience: int = 3, worse_patience: int = 10):
        self.objective, self.ftol = objective, ftol
        self.patience, self.worse_patience = patience, worse_patience
        self.best_theta, self.best_value, self.misses, self.since_best = None, np.inf, 0, 0

    def __call__(self, theta):
        evaluations = getattr(self.objective, "evaluations", None)
        value, grad = self.objective(theta)
        # A remembered point is neither progress nor a miss, but it can be the best: a
        # restart's start was the previous run's best, and the answer must not be worse.
        new = evaluations is None or self.objective.evaluations > evaluations
        if new:
            tol = self.ftol * max(abs(self.best_value), 1.0)
            if value < self.best_value - tol:
                self.misses = self.since_best = 0
            else:
                self.since_best += 1
                if value <= self.best_value + tol:  # within the floor, not a backtracking step
                    self.misses += 1
        if value < self.best_value or self.best_theta is None:
            self.best_theta, self.best_value = np.array(theta, np.float64), value
        if new and (self.misses >= self.patience or self.since_best >= self.worse_patience):
            raise Stalled
        return value, grad


class FirstStep:
    """``objective`` scaled so that L-BFGS-B's first trial moves no entry of theta by more than
    ``step``: ``c · objective`` with ``c = step / max|∇objective(theta0)|``.

    L-BFGS-B starts with the identity for its Hessian; within bounds scipy then takes the first
    trial at ``theta0 - ∇`` projected on the box (length multiplier 1), so an objective whose
    gradient is in the hundreds (a log likelihood summed over tens of thousands of points)
    jumps to the box's corners, where one evaluation can cost many nearby ones (a Laplace mode
    at a huge outputscale). Later steps do not depend on ``c``: each update rescales the
    Hessian by ``sᵀy / yᵀy``, and ``ftol`` is relative (while ``|c · value| >= 1``). The value
    and gradient at ``theta0``, needed for ``c``, serve L-BFGS-B's first evaluation.
    """

    def __init__(self, objective, theta0, step: float):
        self.objective = objective
        self.theta0 = np.array(theta0, np.float64)
        value, grad = objective(self.theta0)
        self.first = (value, grad)
        size = float(np.max(np.abs(grad), initial=0.0))
        self.scale = step / size if np.isfinite(size) and size > step else 1.0

    def __call__(self, theta):
        if self.first is not None and np.array_equal(theta, self.theta0):
            (value, grad), self.first = self.first, None
        else:
            value, grad = self.objective(theta)
        return self.scale * value, self.scale * np.asarray(grad)


def lbfgsb(objective, theta0, maxiter, *, bounds=None, ftol=SCIPY_FTOL, gtol=None,
           stall_ftol=None, callback=None, first_step=None):
    """One L-BFGS-B run of ``objective`` (``theta -> (value, gradient)``, float64 numpy) from
    ``theta0``: ``(theta, value, result)``.

    ``bounds``: None, or a ``(low, high)`` pair per entry (None for no limit); ``ftol``,
    ``gtol`` (None: scipy's default; it applies to the scaled gradient) and ``maxiter``:
    scipy's options; ``callback``: scipy's, called with each iterate. With ``stall_ftol``, the
    run is under a `StallGuard` of that tolerance, and the result is None where the guard ended
    it (the best point it saw is the answer). With ``first_step``, the objective is scaled as
    `FirstStep` says (``value`` and ``result.fun`` are unscaled).
    """
    guard = objective if stall_ftol is None else StallGuard(objective, stall_ftol)
    if first_step is not None and bounds is not None:  # where scipy starts: theta0 in bounds
        low, high = np.array([(-np.inf if lo is None else lo, np.inf if hi is None else hi)
                              for lo, hi in bounds], np.float64).T
        theta0 = np.clip(theta0, low, high)
    scaled = guard if first_step is None else FirstStep(guard, theta0, first_step)
    options = {"maxiter": maxiter, "ftol": ftol}
    if gtol is not None:
        options["gtol"] = gtol
    try:
        res = _minimize(scaled, theta0, jac=True, method="L-BFGS-B", bounds=bounds,
                        callback=callback, options=options)
    except Stalled:  # only raised by a StallGuard
        return guard.best_theta, guard.best_value, None
    if first_step is not None:
        res.fun = float(res.fun) / scaled.scale
    return res.x, float(res.fun), res


def _minimize(*args, **kwargs):
    # imported at the first run, not with the module: a process that never optimises does
    # not pay for scipy.optimize (and scipy.linalg with it) at start-up
    import scipy.optimize

    return scipy.optimize.minimize(*args, **kwargs)

