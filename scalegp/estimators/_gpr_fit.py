"""How `ScalableGPRegressor` fits its hyperparameters: the strategy, as functions of an explicit
`FitProblem`, and the optimisers it runs.

The strategy (docs/decisions.md #11): L-BFGS-B (or Adam) with the exact objective from the start
and each restart, on a random subset when there are many points; then, for an exact fit on more
than ``subset_size`` points, scoring steps on all of them (`refine_exact`); for BBMM, scoring
steps on nested random subsets growing fourfold and last on all data (`scoring_stages`, the
recipe of Wang et al. (2019), refined), or Adam steps on all data; last the prediction cache
(`final_solve`). Every BBMM objective and solve runs on the fit's one `scalegp.ops.Engine`
(``FitProblem.bbmm``).

The optimisers: the objective as scipy sees it (`Objective`), L-BFGS-B (`scalegp._lbfgsb`,
restarted after a stall), Adam, and the scoring steps of the BBMM stages, with progress
reports; and the objective of a fitted model (`fitted_log_marginal_likelihood`).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.exceptions import ConvergenceWarning

from scalegp import gp
from scalegp._lbfgsb import SCIPY_FTOL, lbfgsb
from scalegp.estimators._gpr_inputs import bbmm_solver, default_kernel, gp_engine
from scalegp.estimators._gpr_kernels import KernelSpec
from scalegp.estimators._gpr_predict import fitted_state
from scalegp.estimators._precision import host_scope
from scalegp.estimators._progress import FitProgress
from scalegp.ops import Engine, compiles_ahead, spatial_order

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
            return dataclasses.replace(self, fixed_noise=np.asarray(self.fixed_noise)[idx])
        return self

    # Equal by value (the per-row noise by its bytes): the Fisher information's compiled program
    # is static in it (`Unpacking`), and each fit makes its parametrisation anew.
    def _key(self):
        noise = None if self.fixed_noise is None else np.asarray(self.fixed_noise)
        return (self.spec, self.noise_floor,
                None if noise is None else (noise.dtype.str, noise.shape, noise.tobytes()))

    def __eq__(self, other):
        return isinstance(other, Parametrisation) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


@dataclasses.dataclass(frozen=True)
class Unpacking:
    """``theta -> parameters`` of ``params`` for ``o`` targets, ``d`` features and a
    ``fixed_mean`` (a tuple, or None), in ``dtype``: hashable by value, a static argument of
    `gp.fisher_information`'s program, which every call of a fit and every later fit of the
    same model and sizes then share."""

    params: Parametrisation
    o: int
    d: int
    fixed_mean: tuple | None
    dtype: object

    def __call__(self, theta):
        return self.params(theta, self.o, self.d, self.fixed_mean, self.dtype)


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
      bbmm: the BBMM solver on the fit's engine, its probes fixed by the fit's seed.
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
    def of_estimator(cls, model, x, yj, engine: Engine) -> "FitProblem":
        """The problem of the `ScalableGPRegressor` ``model`` being fitted (its settings, and
        the state `fit` has set so far) on the centred inputs ``x`` and the targets ``yj`` in
        the fitted units, its kernel products on ``engine`` (the fit's one, from
        `scalegp.estimators._gpr_inputs.check_settings`)."""
        kernel = model._model_kernel()
        return cls(
            x=x, y=yj, params=model._parametrisation(), fixed_mean=model._fixed_mean,
            kernel_bounds=None if model._spec is None else np.asarray(
                kernel.bounds, np.float64).reshape(-1, 2),
            solver=model.solver_, bbmm=bbmm_solver(model, model._probe_seed, engine),
            optimizer=model.optimizer, learning_rate=model.learning_rate,
            n_restarts=model.n_restarts_optimizer, max_iter=model.max_iter,
            subset_size=model.subset_size, max_iter_full=model.max_iter_full,
            full_data_tol=model.full_data_tol,
            stationary=model._spec is None or bool(kernel.is_stationary()))

    def objective(self, solver, rows=None) -> Objective:
        """The objective of ``solver`` on the training ``rows`` (None: all of them)."""
        if rows is None:
            return Objective(solver, self.x, self.y, self.fixed_mean, self.params)
        # taken on the host: indexing the device's arrays compiles a gather for every subset's
        # size (on a TPU, a program of its own each)
        return Objective(solver, np.asarray(self.x)[rows], np.asarray(self.y)[rows],
                         self.fixed_mean, self.params.rows(rows))

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
    if compiles_ahead():
        _compile_ahead(problem, objective, theta0, idx)
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


def _compile_ahead(problem: FitProblem, objective, theta0, subset):
    """What the fit will run, compiled in background threads in the order it needs it
    (`scalegp._ahead`): the exact ``objective``'s programs on its rows (on the host, where they
    run: `gp.CholeskySolver.compile_ahead`); for a BBMM fit the Fisher information of
    ``subset`` (`gp.fisher_information_ahead`), the objective on each stage's points
    (`stage_sizes`) and on all data, with the final solve and variance cache there
    (`gp.BBMMSolver.compile_ahead`)."""
    (n, o), d = problem.y.shape, problem.x.shape[1]
    with host_scope():
        params = objective.unpack(theta0, o, d, problem.fixed_mean, objective.x.dtype)
        objective.solver.compile_ahead(params, objective.x, objective.y)
        if problem.solver != "bbmm":
            return
        unpack, points = _information_args(problem, subset)
        gp.fisher_information_ahead(unpack, theta0, points, o)
    params = problem.params(theta0, o, d, problem.fixed_mean, problem.x.dtype)
    for size in stage_sizes(len(subset), n):
        problem.bbmm.compile_ahead(params, jax.ShapeDtypeStruct((size, d), problem.x.dtype),
                                   jax.ShapeDtypeStruct((size, o), problem.y.dtype),
                                   posterior=False)
    problem.bbmm.compile_ahead(params, problem.x, problem.y)


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
    unpack, points = _information_args(problem, subset, size)
    with host_scope():  # exact: on a TPU, on the host (as `Objective`'s exact evaluations)
        return gp.fisher_information(unpack, theta, points, problem.y.shape[1])


def _information_args(problem: FitProblem, subset, size=None):
    """`information`'s ``(unpack, points)`` for `gp.fisher_information`: the points taken on
    the host, as `FitProblem.objective` takes them."""
    o, d = problem.y.shape[1], problem.x.shape[1]
    subset = subset if size is None else subset[:size]
    fixed_mean = None if problem.fixed_mean is None else tuple(
        np.asarray(problem.fixed_mean, np.float64).tolist())
    unpack = Unpacking(problem.params.rows(subset), o, d, fixed_mean, np.dtype(problem.x.dtype))
    return unpack, np.asarray(problem.x)[subset]


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
    last = problem.objective(gp.CholeskySolver(), subset)  # the last stage's objective
    for size in stage_sizes(m, n):
        # The subset and the first size - |subset| of the rest: each stage holds the last.
        stage = np.sort(np.concatenate([subset, rest[:size - len(subset)]]))
        last = problem.objective(problem.bbmm, stage)
        theta, _, nit, curvature = scoring_steps(
            last, theta, curvature * (size / m), problem.max_iter_full,
            f"BBMM fit on {size:,} of the points", progress=progress, bounds=bounds,
            min_decrease=min_decrease)
        steps, m = steps + nit, size
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


def stage_sizes(m: int, n: int) -> list[int]:
    """The points of `scoring_stages`' nested subsets after one of ``m`` points, of ``n`` in
    all: growing fourfold while they hold at most a third of the data."""
    sizes, size = [], 4 * m
    while size <= n // 3:
        sizes.append(size)
        size *= 4
    return sizes


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


# ------------------------------------------------------------------------------------------
# The optimisers


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
        self.evaluations += 1
        # An exact objective (the whole fit's, or a BBMM fit's subset start) runs on the host
        # CPU where dense work belongs there (a TPU: docs/decisions.md #50, #52); the data
        # follow it there, uncommitted.
        exact = isinstance(self.solver, gp.CholeskySolver)
        with warnings.catch_warnings(), host_scope(exact):
            warnings.simplefilter("ignore", RuntimeWarning)
            params = self.unpack(theta, o, d, self.fixed_mean, self.x.dtype)
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
              else bbmm_solver(model, model._probe_seed, gp_engine(model)))
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
