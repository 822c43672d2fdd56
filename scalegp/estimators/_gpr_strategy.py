"""How `ScalableGPRegressor` fits its hyperparameters, as functions of an explicit `FitProblem`.

The strategy (docs/decisions.md #11): L-BFGS-B (or Adam) with the exact objective from the start
and each restart, on a random subset when there are many points; then, for an exact fit on more
than ``subset_size`` points, scoring steps on all of them (`refine_exact`); for BBMM, scoring
steps on nested random subsets growing fourfold and last on all data (`scoring_stages`, the
recipe of Wang et al. (2019), refined), or Adam steps on all data.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from scalegp import gp
from scalegp.estimators._gpr_checks import bbmm_solver
from scalegp.estimators._gpr_kernels import KernelSpec
from scalegp.estimators._gpr_optimise import (
    Objective,
    minimize,
    objective_tolerance,
    predicted_decrease,
    restart_points,
    scoring_steps,
)
from scalegp.estimators._progress import FitProgress
from scalegp.ops import spatial_order

#: L-BFGS-B's ftol for the exact fit on a subset that starts the fit on more data.
SUBSET_FTOL = 1e-4

#: Points of the Fisher information that starts the exact scoring steps on all data.
CURVATURE_POINTS = 1024

#: A BBMM fit of a stationary kernel on at least this many times the subset's points also
#: fits a compact subset of ``COMPACT_RUNS`` patches (`compact_start`), where the subset
#: holds at least ``COMPACT_MIN_POINTS`` (patches of fewer than 64 points pin no lengthscale).
COMPACT_MIN_RATIO = 4
COMPACT_RUNS = 4
COMPACT_MIN_POINTS = 256
#: ... unless the random subset's fit passes the score test on the compact one
#: (`score_statistic`) with a statistic under this many times the number of parameters (its
#: mean is 1 per parameter where the fit describes the compact points).
SCORE_LIMIT = 10


@dataclasses.dataclass(frozen=True, eq=False)
class Parametrisation:
    """The optimised vector ``theta`` as the solvers' parameters: for the default model
    (``spec`` None) `gp.GPParams` with the noise above ``noise_floor`` (in the fitted units);
    for a scikit-learn kernel `gp.KernelParams` of ``spec`` with ``fixed_noise``, the alpha of
    the training rows in use (a scalar, or one per row)."""

    spec: KernelSpec | None
    fixed_noise: object
    noise_floor: float | None

    def __call__(self, theta, o, d, fixed_mean, dtype):
        """The parameters of ``theta`` (numpy, or a traced jax array: the Fisher information
        differentiates this) for ``o`` targets and ``d`` features; a ``fixed_mean`` (o,) is
        put before it, a learnt mean is its first ``o`` entries."""
        if isinstance(theta, jax.Array):
            xp = jnp
            theta = theta.astype(dtype)
        else:
            xp, theta = np, np.asarray(theta, np.float64)
        if fixed_mean is not None:
            theta = xp.concatenate([xp.asarray(fixed_mean, theta.dtype), theta])
        if self.spec is not None:
            return gp.KernelParams(mean=jnp.asarray(theta[:o], dtype),
                                   theta=jnp.asarray(theta[o:], dtype), spec=self.spec,
                                   fixed_noise=jnp.asarray(self.fixed_noise, dtype))
        return gp.GPParams.unflatten(theta, o, d, dtype=dtype, noise_lower_bound=self.noise_floor)

    def rows(self, idx):
        """The parametrisation for the training rows ``idx`` (their own per-row noise, if any)."""
        if np.ndim(self.fixed_noise):
            return dataclasses.replace(self, fixed_noise=self.fixed_noise[idx])
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class FitProblem:
    """Everything a fit's optimisation reads, fixed for that fit.

    Attributes:
      x: (n, d) training inputs, centred, in the compute dtype.
      y: (n, o) targets in the units the model is fitted in, in the compute dtype.
      params: the `Parametrisation` of the optimised vector.
      fixed_mean: (o,) the fixed mean in the fitted units, or None (learnt: the vector's
        first ``o`` entries).
      kernel_bounds: (p, 2) the scikit-learn kernel's log bounds, or None for the default
        model (unbounded parameters).
      solver: "exact" or "bbmm" (``solver_``).
      bbmm: the BBMM solver, its probes fixed by the fit's seed.
      optimizer, learning_rate, n_restarts, max_iter, subset_size, max_iter_full,
        full_data_tol: the estimator's settings of those names (``n_restarts``:
        ``n_restarts_optimizer``).
      stationary: whether the kernel is stationary (the default model's is).
    """

    x: object
    y: object
    params: Parametrisation
    fixed_mean: np.ndarray | None
    kernel_bounds: np.ndarray | None
    solver: str
    bbmm: gp.BBMMSolver
    optimizer: str
    learning_rate: float
    n_restarts: int
    max_iter: int
    subset_size: int
    max_iter_full: int
    stationary: bool = False
    full_data_tol: float = 0.0

    @classmethod
    def of_estimator(cls, model, x, yj) -> "FitProblem":
        """The problem of the `ScalableGPRegressor` ``model`` being fitted (its settings, and
        the state `fit` has set so far) on the centred inputs ``x`` and the targets ``yj`` in
        the fitted units."""
        kernel = model._model_kernel()
        return cls(
            x=x, y=yj, params=model._parametrisation(), fixed_mean=model._fixed_mean,
            kernel_bounds=None if model._spec is None else np.asarray(
                kernel.bounds, np.float64).reshape(-1, 2),
            solver=model.solver_, bbmm=bbmm_solver(model, model._probe_seed),
            optimizer=model.optimizer, learning_rate=model.learning_rate,
            n_restarts=model.n_restarts_optimizer, max_iter=model.max_iter,
            subset_size=model.subset_size, max_iter_full=model.max_iter_full,
            full_data_tol=model.full_data_tol,
            stationary=model._spec is None or bool(kernel.is_stationary()))

    def objective(self, solver, rows=None) -> Objective:
        """The objective of ``solver`` on the training ``rows`` (None: all of them)."""
        if rows is None:
            return Objective(solver, self.x, self.y, self.fixed_mean, self.params)
        return Objective(solver, self.x[rows], self.y[rows], self.fixed_mean,
                         self.params.rows(rows))

    def bounds(self, size):
        """L-BFGS-B bounds of an optimised vector of ``size``: None for the default model
        (unconstrained parameters); the kernel's own (log) bounds after the free means."""
        if self.kernel_bounds is None:
            return None
        free_means = size - self.kernel_bounds.shape[0]
        return [(None, None)] * free_means + [tuple(b) for b in self.kernel_bounds]


def optimise(problem: FitProblem, theta0, rng, progress: FitProgress):
    """``(theta, NLML at theta or None, iterations, α at theta or None)``: exact fits from
    ``theta0`` and the restarts (on a random subset for BBMM), then a few BBMM steps on all
    data."""
    if problem.optimizer is None or theta0.size == 0:  # nothing to optimise
        return theta0, None, 0, None
    n, o = problem.y.shape
    # An exact fit on more than subset_size points starts on a random half (at most
    # subset_size) of them, where an evaluation costs a quarter to an eighth (n² to n³),
    # and finishes by scoring steps on all of them (`refine_exact`).
    refine = (problem.solver == "exact" and problem.optimizer != "adam"
              and n > problem.subset_size)
    idx = None
    if problem.solver == "bbmm" or refine:
        size = min(problem.subset_size, n if problem.solver == "bbmm" else n // 2)
        idx = np.sort(rng.choice(n, size=size, replace=False))
    objective = problem.objective(gp.CholeskySolver(), idx)
    n_free_start = 0 if problem.fixed_mean is not None else o
    best = None
    # A subset fit only starts the stages on more data, which move on to the full-data
    # optimum: it stops once an iteration gains under 1e-4 of the NLML.
    ftol = SUBSET_FTOL if idx is not None else None
    for i, start in enumerate(starts(problem, theta0, n_free_start, rng)):
        theta, value, nit = _minimize(problem, objective, start, problem.max_iter,
                                      f"exact fit (start {i})", progress, ftol=ftol)
        if best is None or value < best[1]:
            best = (theta, value, nit)
    theta, value, n_iter = best
    if refine:
        theta, value, nit = refine_exact(problem, theta, idx, rng, progress)
        return theta, value, n_iter + nit, None
    if problem.solver == "exact":
        return theta, value, n_iter, None
    if problem.stationary and len(idx) >= COMPACT_MIN_POINTS and \
            n >= COMPACT_MIN_RATIO * len(idx):
        theta, idx, nit = compact_start(problem, theta, idx, theta0, progress)
        n_iter += nit
    if problem.max_iter_full == 0:
        return theta, None, n_iter, None  # the subset's objective is not the full data's
    objective = problem.objective(problem.bbmm)
    # A planned, small number of steps (Wang et al., 2019): reaching it is expected.
    phase = "BBMM fit on all data"
    if problem.optimizer == "adam":
        theta, value, nit = _minimize(problem, objective, theta, problem.max_iter_full, phase,
                                      progress, warn_maxiter=False)
    else:
        theta, value, nit = scoring_stages(problem, theta, idx, objective, rng, progress)
        if value is None:  # no step on all data: the NLML there is left to whoever reads it
            return theta, None, n_iter + nit, None
    value, _ = objective(theta)  # remembered: sets the solution at theta
    return theta, value, n_iter + nit, objective.solution


def compact_subset(x, size: int, runs: int = COMPACT_RUNS):
    """(size,) sorted row indices: ``runs`` runs of consecutive rows of x (n, d) in k-d order
    (`scalegp.ops.spatial_order`, features in units of their spread), one at
    the middle of each of ``runs`` equal parts of the order, so that each run is a compact
    patch of the data at their own density, and the patches lie apart."""
    x = np.asarray(x, np.float32)
    n = x.shape[0]
    spread = x.std(axis=0)
    order = spatial_order(x, np.where(spread > 0, spread, 1.0))
    length = size // runs
    first = np.clip((np.arange(runs) * 2 + 1) * n // (2 * runs) - length // 2, 0, n - length)
    return np.sort(np.concatenate([order[a:a + length] for a in first]))


def compact_start(problem: FitProblem, theta, subset, theta0, progress):
    """``(theta, subset, iterations)``: the random subset's fit ``theta`` or an exact fit from
    ``theta0`` on a compact subset of the same size (`compact_subset`), whichever has the
    lower exact NLML on the two subsets together.

    Why: a random subset of m points is spaced about n/m times (to the power 1/d) wider than
    the data. Where the data's lengthscale is shorter than that spacing, its fit sees
    uncorrelated values and explains the signal as noise (docs/decisions.md #40), and the
    BBMM stages' steps from there were rejected. A compact subset keeps the data's density and sees
    short lengthscales; it sees long ones poorly, which the random one sees. The union of both
    holds dense patches and wide spacing, so the better of the two fits explains it better."""
    compact = compact_subset(problem.x, len(subset))
    objective = problem.objective(gp.CholeskySolver(), compact)
    statistic, limit = score_statistic(problem, objective, theta, compact), SCORE_LIMIT * len(theta)
    if statistic <= limit:
        progress.report(f"random start kept: its score statistic on a compact subset "
                        f"{statistic:.3g} (under {limit:.3g})")
        return theta, subset, 0
    theta_c, _, nit = _minimize(problem, objective, theta0, problem.max_iter,
                                "exact fit (compact start)", progress, ftol=SUBSET_FTOL)
    both = problem.objective(gp.CholeskySolver(), np.union1d(subset, compact))
    value_c, value_r = both(theta_c)[0], both(theta)[0]
    compact_wins = value_c < value_r
    progress.report(f"{'compact' if compact_wins else 'random'} start taken: exact NLML on "
                    f"both subsets {value_c:.6g} (compact) against {value_r:.6g} (random; its "
                    f"score statistic on the compact subset {statistic:.3g})")
    return (theta_c, compact, nit) if compact_wins else (theta, subset, nit)


def score_statistic(problem: FitProblem, objective, theta, rows) -> float:
    """The score test's ``gᵀ F⁻¹ g`` of ``theta`` on ``rows`` (their exact ``objective``): the
    NLML's gradient g there against its covariance under the model, the Fisher information F.
    About χ²_p (p parameters, mean p) where ``theta`` describes these points; inf where the
    objective is not finite. One evaluation and one information of the subset, a fraction of
    a fit on it."""
    value, grad = objective(theta)
    if not np.isfinite(value):
        return np.inf
    info = information(problem, theta, rows)
    return float(grad @ np.linalg.lstsq(info, grad, rcond=1e-10)[0])


def _minimize(problem, objective, theta0, maxiter, phase, progress, warn_maxiter=True,
              ftol=None):
    # one frame between `optimise` and `minimize`: its warning's stacklevel counts it
    return minimize(objective, theta0, maxiter, phase, optimizer=problem.optimizer,
                    learning_rate=problem.learning_rate, progress=progress, ftol=ftol,
                    warn_maxiter=warn_maxiter, bounds=problem.bounds(len(theta0)))


def starts(problem: FitProblem, theta0, n_free_start, rng):
    """``theta0`` and ``n_restarts`` random starts: for the default model around ``theta0``
    (`restart_points`); for a scikit-learn kernel drawn uniformly within its (log) bounds as
    scikit-learn draws them."""
    if problem.kernel_bounds is None:
        return restart_points(theta0, problem.n_restarts, n_free_start, rng)
    bounds = problem.kernel_bounds
    points = [theta0]
    for _ in range(problem.n_restarts):
        start = theta0.copy()
        start[n_free_start:] = rng.uniform(bounds[:, 0], bounds[:, 1])
        points.append(start)
    return points


def information(problem: FitProblem, theta, subset, size=None):
    """The exact Fisher information of ``theta`` on ``x[subset]``, or on its first ``size``
    points when given."""
    o, d = problem.y.shape[1], problem.x.shape[1]
    subset = subset if size is None else subset[:size]
    unpack = functools.partial(problem.params.rows(subset), o=o, d=d,
                               fixed_mean=problem.fixed_mean, dtype=problem.x.dtype)
    return gp.fisher_information(unpack, theta, problem.x[subset], o)


def refine_exact(problem: FitProblem, theta, subset, rng, progress):
    """Scoring steps (`scoring_steps`) of the exact objective on all data from ``theta``,
    the optimum on ``subset``, to L-BFGS-B's tolerance; ``(theta, value, steps)``.

    The curvature is the Fisher information of 1,024 of the subset's points scaled to
    ``n`` (its cost grows as the cube of the points, an evaluation's as the cube of ``n``);
    from the subset's optimum, a few quasi-Newton steps reach the full-data one where
    L-BFGS-B, started anew, spends its first evaluations learning each parameter's scale.
    A failed step is halved once only: near the optimum of a float32 objective, further
    halvings evaluate its rounding noise.
    """
    n = problem.y.shape[0]
    size = min(len(subset), CURVATURE_POINTS)
    curvature = information(problem, theta, rng.permutation(subset), size) * (n / size)
    objective = problem.objective(gp.CholeskySolver())
    theta, value, steps, _ = scoring_steps(
        objective, theta, curvature, problem.max_iter, "exact fit on all data",
        progress=progress, bounds=problem.bounds(len(theta)), min_decrease=0.0, halvings=1,
        ftol=objective_tolerance(problem.x.dtype))
    return theta, value, steps


def scoring_stages(problem: FitProblem, theta, subset, objective, rng, progress):
    """Scoring steps (`scoring_steps`) on nested random subsets growing fourfold from
    ``subset`` (the exact fit's) while they hold at most a third of the data, then on all
    data (``objective``) unless they are not worth it (`expected_gain`); ``(theta, value,
    steps)``, ``value`` None where no step on all data was tried.

    The first curvature is the exact subset's Fisher information; each stage hands its
    BFGS-updated curvature to the next, scaled by the ratio of sizes. A subset's optimum is
    off the full-data one by its sampling error, which shrinks as the subset grows, so each
    stage starts closer and the full-data stage, where an evaluation costs the most, needs
    the fewest steps."""
    n = problem.y.shape[0]
    m = len(subset)
    curvature = information(problem, theta, subset)
    bounds = problem.bounds(len(theta))
    rest = rng.permutation(np.setdiff1d(np.arange(n), subset))
    # A BBMM step must promise more than p/2 nats (p free parameters): a point from which the
    # optimum is nearer lies inside the estimate's joint confidence region (2ΔNLML below the
    # mean of χ²_p), and the stochastic objective's own noise is of that size (its probes,
    # preconditioner and quadrature all move with θ; docs/decisions.md #37).
    min_decrease = max(0.5, 0.5 * len(theta))
    steps = 0
    size = 4 * m
    last = problem.objective(gp.CholeskySolver(), subset)  # the last stage's objective
    while size <= n // 3:
        # The subset and the first size - |subset| of the rest: each stage holds the last.
        stage = np.sort(np.concatenate([subset, rest[:size - len(subset)]]))
        last = problem.objective(problem.bbmm, stage)
        theta, _, nit, curvature = scoring_steps(
            last, theta, curvature * (size / m), problem.max_iter_full,
            f"BBMM fit on {size:,} of the points", progress=progress, bounds=bounds,
            min_decrease=min_decrease)
        steps, m, size = steps + nit, size, 4 * size
    if problem.full_data_tol > 0:
        gain = expected_gain(predicted_decrease(last, theta, curvature, bounds), len(theta), m, n)
        if gain <= problem.full_data_tol * n:
            progress.report(
                f"BBMM fit on all data skipped: its expected gain over the fit on {m:,} points, "
                f"{gain:.3g} nats ({gain / n:.2g} per point), is under full_data_tol "
                f"({problem.full_data_tol:g} per point)")
            return theta, None, steps
    # On all data, where an evaluation costs the most, a step that fails to lower the NLML is
    # not halved.
    theta, value, nit, _ = scoring_steps(
        objective, theta, curvature * (n / m), problem.max_iter_full, "BBMM fit on all data",
        progress=progress, bounds=bounds, halvings=0, min_decrease=min_decrease)
    return theta, value, steps + nit


def expected_gain(promise: float, p: int, m: int, n: int) -> float:
    """The expected decrease (nats) of the NLML on all ``n`` points from ``theta``, the fit on
    ``m`` of them whose next step promises ``promise`` nats there, to the full-data optimum:
    ``½ p (n/m - 1) + (n/m) promise`` for ``p`` parameters.

    The first term is ``½ tr(F_n (F_m⁻¹ - F_n⁻¹))``, the sampling error of the subset's optimum
    against the full data's (nested samples, information growing in proportion to the points,
    the model right); the second is the stage's own remaining step scaled to ``n`` points.
    Over ``n`` it is what the subset's hyperparameters are expected to lose in held-out
    log-likelihood per point against the full data's (a second-order loss, like the gain).
    Where the information grows slower than the points (fixed-domain asymptotics, where some
    combinations of the hyperparameters are not consistently estimable), it overestimates.
    """
    ratio = n / m
    return 0.5 * p * (ratio - 1.0) + ratio * max(promise, 0.0)


def final_solve(problem: FitProblem, theta, value, alpha0, progress: FitProgress):
    """``(params, NLML, posterior)`` at the optimum ``theta``: the solve of the prediction
    cache (``alpha0``: a warm start for it, or None), with BBMM's variance cache; the NLML is
    ``value`` unless that is None or not finite. Then the exact solver evaluates it here;
    BBMM leaves a None as it is, since its NLML on all data costs as much as a training
    step there (the estimator evaluates it when it is first read)."""
    o, d = problem.y.shape[1], problem.x.shape[1]
    x, yj = problem.x, problem.y
    params = problem.params(theta, o, d, problem.fixed_mean, x.dtype)
    exact = problem.solver == "exact"
    solver = gp.CholeskySolver() if exact else problem.bbmm
    with progress.phase("final solve" + ("" if exact else " and variance cache")):
        deferred = value is None and not exact
        if not deferred and (value is None or not np.isfinite(value)):
            result = solver.value_and_grad(params, x, yj)
            value, alpha0 = float(result.value), result.solution
        if exact:
            posterior = solver.posterior(params, x, yj)
        else:  # the variance cache comes with the solve's own preconditioner
            posterior = solver.posterior(params, x, yj, initial=alpha0, variance=True)
        jax.block_until_ready(posterior)
    return params, value, posterior
