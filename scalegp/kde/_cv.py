"""Bandwidth by cross-validation: the leave-one-out likelihood maximised over log h after a
coarse scan, by L-BFGS-B (per-feature bandwidths) or a bracketed secant search (a scalar one),
or for a scalar bandwidth on the host-planned path by a safeguarded Newton search (see the
package docstring)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from scalegp._lbfgsb import lbfgsb
from scalegp._validation import check_int, check_points, check_weights
from scalegp.kde._density import compute_dtype
from scalegp.kde._loo import GroupedObjective, PlannedObjective, collapse_duplicates, loo_is_dense
from scalegp.kde._sample import rng_from
from scalegp.kde._spread import (
    constant_features,
    effective_sample_size,
    raise_constant,
    robust_std,
    scott_factor,
    weighted_std,
)
from scalegp.kde._trust import (
    FAR_FACTOR,
    far_candidates,
    far_message,
    flat_directions,
    flat_message,
    heavy_stacks,
    lost_terms,
    stacks_message,
    warn,
)
from scalegp.ops import Engine

DEFAULT_CV_SUBSAMPLE = 8192
CV_BANDWIDTHS = ("cv", "cv-diag")
CV_MAX_ITER = 100  # the search's iteration limit by default
# Coarse scan of log(h / h_scott) before the search, and the search's bounds around log h_scott.
_SCAN_OFFSETS = np.linspace(-4.5, 0.0, 5)
_LOG_BOUND_BELOW, _LOG_BOUND_ABOVE = 10.0, 5.0
# The searches' gradient tolerance (per log h). The objective is an average of float32 log-densities
# and varies by ~1e-7 between neighbouring bandwidths from rounding alone, so a smaller gradient
# cannot be resolved by the line search (it then spins at one point); at a curvature of ~0.3 per
# log h squared, 1e-5 is ~3e-5 in log h from the optimum, ~1e-10 in the objective.
_GTOL = 1e-5
# `_NewtonSearch`: the largest step in log h, and the step (~ the distance to the optimum) below
# which it stops: the objective is then within ~f'' * 1e-8 of its maximum.
_NEWTON_MAX_STEP, _NEWTON_XTOL = 1.5, 1e-3
# `_BracketSearch`: the bracket's width in log h below which it stops (the gradient tolerance
# above is ~3e-5 in log h; a narrower bracket costs one or two more evaluations at most).
_BRACKET_XTOL = 1e-6
# Rounds of leaving far rows out (`_leave_out_far_rows`): a round's rows hide the next ones'
# pull only where they lie orders of magnitude apart.
_FAR_ROUNDS = 3


@dataclasses.dataclass(frozen=True, eq=False)
class CVResult:
    """Outcome of `cross_validate_bandwidth`.

    Attributes:
      bandwidth: the selected bandwidth: a float (scalar) or a (d,) array (diagonal), in the units
        of the data that was passed.
      log_likelihood: mean held-out LOO log-likelihood at ``bandwidth`` (in those units).
      initial_bandwidth: Scott's factor times a robust spread per feature (the smaller of
        the standard deviation and the interquartile range over 1.349), (d,), the centre of
        the scan and bounds.
      converged: whether the search (L-BFGS-B for per-feature bandwidths; for a scalar one
        `_BracketSearch`, or `_NewtonSearch` on the planned path) met its tolerance (or
        stopped at the float noise floor).
      at_bound: (d,) or (1,) bool, the components that ended on a search bound.
      n_iter: the search's iterations; n_evaluations: objective evaluations, scan included.
      n_unique: distinct points after collapsing duplicates (rows of zero weight dropped).
      n_held_out: held-out points in the objective (``min(cv_subsample, n_unique)``, less
        the far rows).
      message: the search's message.
      far_rows: (k,) int64 indices of the rows fitted (those of ``data``, or of the estimator's
        X) whose leave-one-out terms alone moved the bandwidth by over 10x (or underflowed):
        left out of the objective (not of the density), with a warning.
      flat_directions: principal directions in which the held-out points spread less than
        half the bandwidth (the kernel is wider than the data there), with a warning.
      stacked_share: the share of the weight on heavy stacks of exact duplicates (16 copies
        or more) among values that no other row shares, which cross-validation treats as
        single points, where it is 5% or more (with a warning); else 0.0.
      findings: the warnings these three gave, as text.
    """

    bandwidth: float | np.ndarray
    log_likelihood: float
    initial_bandwidth: np.ndarray
    converged: bool
    at_bound: np.ndarray
    n_iter: int
    n_evaluations: int
    n_unique: int
    n_held_out: int
    message: str
    far_rows: np.ndarray
    flat_directions: int = 0
    stacked_share: float = 0.0
    findings: tuple = ()


def cross_validate_bandwidth(
    data,
    weights=None,
    *,
    diagonal: bool = False,
    cv_subsample: int | None = DEFAULT_CV_SUBSAMPLE,
    random_state=None,
    max_iter: int = CV_MAX_ITER,
    impl="auto",
    mesh=None,
    scheme="allgather",
    prune="auto",
    prune_tol=None,
) -> CVResult:
    """Bandwidth maximising the leave-one-out log-likelihood (see the package docstring).

    The user-level entry: it checks its arguments, builds one `scalegp.ops.Engine` from
    ``impl``, ``mesh``, ``scheme``, ``prune`` and ``prune_tol`` and collapses the duplicates
    once, then runs `cross_validate` (which `fit_kde` calls on the rows it collapsed).

    Args:
      data: (n, d) points, already in the coordinates the bandwidth is for.
      weights: optional (n,) non-negative weights (relative; duplicates are summed).
      diagonal: one bandwidth per feature (True) or one scalar (False).
      cv_subsample: number of distinct points held out in the objective, each scored against all
        the data; None holds out every point (n^2 work per step). Chosen at random (without
        replacement) with ``random_state`` when smaller than the number of distinct points.
      random_state: None, an int, or a numpy Generator/RandomState for the held-out subset.
      max_iter: the search's iteration limit.
      impl: engine implementation for the grouped path.
      mesh, scheme: None for one device, or the devices each group's held-out points are sharded
        over and how the data reach them (see the package docstring).
      prune, prune_tol: for the grouped path, as in `log_density`; the distinct points are put
        in `scalegp.ops.spatial_order` when pruning may pay, so that each group of held-out
        points (consecutive in that order) is compact.
    Returns:
      a `CVResult`; warns (ConvergenceWarning) when the search did not converge or a bound was
      hit, and (UserWarning) for far rows, a layout flatter than the kernel and heavy stacks of
      duplicates (`CVResult.findings`).
    """
    X = check_points(data, "data")
    w = check_weights(weights, X.shape[0], "weights")
    cv_subsample = check_int("cv_subsample", cv_subsample, 2, allow_none=True)
    max_iter = check_int("max_iter", max_iter, 1)
    engine = Engine.create(impl, mesh, scheme, prune=prune, prune_tol=prune_tol)
    unique, unique_w, inverse = collapse_duplicates(X, w, drop_zero=True)
    return cross_validate(unique, unique_w, origin=inverse, raw=unique, diagonal=diagonal,
                          cv_subsample=cv_subsample, random_state=random_state,
                          max_iter=max_iter, engine=engine)[0]


def cross_validate(points, weights, *, origin, raw, diagonal, cv_subsample, random_state,
                   max_iter, engine: Engine):
    """`cross_validate_bandwidth` on points its caller checked and collapsed: (result, planned),
    ``planned`` the data's k-d order and tile tree the objective ran on where it took the
    host-planned path (`scalegp.ops.Engine.planned_loo`, for the scoring to reuse: `fit_kde`),
    else None.

    Args:
      points: (u, d) distinct rows, in lexicographic order (`collapse_duplicates`: the held-out
        subset is drawn by position), in the coordinates of the bandwidth; weights: (u,)
        float64, their summed weights, all positive.
      origin: (N,) int, each row the caller fitted -> its point (-1: none, a row of zero
        weight), so that far rows are named, and stacks counted, in the caller's rows.
      raw: (u, d) each point in the caller's coordinates, where ties are judged
        (`heavy_stacks`).
      cv_subsample, max_iter: checked; engine: the caller's `scalegp.ops.Engine`."""
    u, d = points.shape
    dtype = compute_dtype(points)
    initial = _scott_start(points, weights, origin.shape[0])
    theta0 = np.log(initial) if diagonal else np.array([np.mean(np.log(initial))])
    if cv_subsample is None or cv_subsample >= u:
        held = np.arange(u)
    else:
        held = np.sort(rng_from(random_state).choice(u, size=cv_subsample, replace=False))
    if (not loo_is_dense(u, held.shape[0], engine)
            and engine.cross_validates_planned(u, d, dtype)):
        objective = _planned_objective(points, weights, held, initial, diagonal, dtype, engine)
    else:
        objective = _grouped_objective(points, weights, held, initial, diagonal, dtype, engine)
    # rows lost at the scan's smallest bandwidth (every kernel value underflows) are lost at
    # all: left out before searching (the planned path evaluates there first anyway)
    lost = lost_terms(objective.values(theta0 + _SCAN_OFFSETS[0]))
    lost_rows = objective.held[lost] if np.sum(~lost) >= 2 else objective.held[:0]
    if lost_rows.size:
        objective = objective.restricted(objective.held[~lost])
    search, result = _searched(objective, theta0, diagonal, dtype, max_iter)
    objective, search, result, far, first, spent = _leave_out_far_rows(
        objective, search, result, weights, diagonal, max_iter)
    if lost_rows.size:
        far, first = np.union1d(far, lost_rows), None
    theta = search.best_theta
    converged = search.nonfinite == 0 and (
        bool(result.success)
        # the line search stopped at float rounding (float32: ~1e-7 relative in the objective)
        # with a small gradient: converged for our purpose
        or ("ABNORMAL" in str(result.message) and np.max(np.abs(result.jac)) < 1e-3)
    )
    at_bound = (theta - search.lower < 1e-6) | (search.upper - theta < 1e-6)
    _warn_outcome(converged, at_bound, diagonal, str(result.message), search.nonfinite)
    bandwidth = _bandwidth(theta, diagonal)
    findings = _findings(points, weights, origin, raw, objective.held, far, first, bandwidth)
    return CVResult(
        bandwidth=bandwidth,
        log_likelihood=-search.best_value,
        initial_bandwidth=initial,
        converged=converged,
        at_bound=at_bound,
        n_iter=int(result.nit),
        n_evaluations=int(search.evaluations + spent),
        n_unique=int(u),
        n_held_out=int(objective.held.shape[0]),
        message=str(result.message),
        far_rows=np.flatnonzero(np.isin(origin, far)),
        **findings,
    ), getattr(objective, "planned", None)


def _bandwidth(theta, diagonal: bool):
    return np.exp(theta) if diagonal else float(np.exp(theta[0]))


def _searched(objective, theta0, diagonal, dtype, max_iter):
    """(search, its result): L-BFGS-B for per-feature bandwidths; for a scalar one Newton's
    where the objective gives its second derivative (the planned one), else the bracket's."""
    if diagonal:
        search = _Search(objective, theta0, dtype)
    elif objective.curvature:
        search = _NewtonSearch(objective, theta0, dtype)
    else:
        search = _BracketSearch(objective, theta0, dtype)
    return search, search.run(max_iter)


def _leave_out_far_rows(objective, search, result, unique_w, diagonal, max_iter):
    """Held-out rows whose own terms set the bandwidth, left out of the objective: the
    candidates of `far_candidates` at the search's optimum, searched again without them, and
    left out where that moved the bandwidth by over `FAR_FACTOR` (or their terms, or every
    value the first search saw, were not finite); up to `_FAR_ROUNDS` times. Returns
    (objective, search, result, far: the rows left out (collapsed indices), the bandwidth the
    first search reached with them: None where it saw no finite value, or no rows left out,
    the evaluations of the searches not returned)."""
    far, first, spent = [], None, 0
    for _ in range(_FAR_ROUNDS):
        candidates, lost = far_candidates(*objective.rows(search.best_theta),
                                          unique_w[objective.held])
        if lost.any():  # the search saw a lost term, and its optimum says nothing of the rest
            candidates = lost
        if not candidates.any() or np.sum(~candidates) < 2:
            break
        reduced = objective.restricted(objective.held[~candidates])
        again, again_result = _searched(reduced, search.theta0, diagonal, search.dtype, max_iter)
        finite = np.isfinite(search.best_value) and not lost.any()
        moved = abs(np.mean(again.best_theta) - np.mean(search.best_theta))
        if finite and moved <= math.log(FAR_FACTOR):
            spent += again.evaluations
            break
        spent += search.evaluations
        if not far and finite:
            first = _bandwidth(search.best_theta, diagonal)
        far.append(objective.held[candidates])
        objective, search, result = reduced, again, again_result
    far = np.concatenate(far or [np.zeros(0, np.int64)])
    return objective, search, result, far, first, spent


def _findings(points, weights, origin, raw, held, far, first, bandwidth) -> dict:
    """`CVResult`'s far-row, flat-layout and stack fields, and their warnings (issued here)."""
    u, d = points.shape
    messages = []
    if far.size:
        named = np.flatnonzero(np.isin(origin, far))
        messages.append(far_message(named, origin.shape[0], first, bandwidth))
    flat = flat_directions(points[held], weights[held], bandwidth)
    if flat:
        messages.append(flat_message(flat, d))
    counts = np.bincount(origin[origin >= 0], minlength=u)
    share, stacks, copies = heavy_stacks(raw, counts, weights)
    if stacks:
        messages.append(stacks_message(share, stacks, copies))
    warn(messages)
    return {"flat_directions": flat, "stacked_share": share, "findings": tuple(messages)}


_grouped_objective = GroupedObjective
_planned_objective = PlannedObjective


def _scott_start(unique, unique_w, n_samples: int) -> np.ndarray:
    """Scott's factor times `robust_std` per feature of the collapsed data: the centre of the
    scan and bounds."""
    u, d = unique.shape
    if u < 2:
        raise ValueError(
            "bandwidth cross-validation needs at least 2 distinct points with positive weight "
            f"(exact duplicates count once), got {u} (n_samples={n_samples}); use a float "
            "bandwidth"
        )
    std = weighted_std(unique, unique_w, what="bandwidth cross-validation")
    constant = constant_features(std, np.average(unique, axis=0, weights=unique_w))
    if constant.size:
        raise_constant(constant, "a cross-validated bandwidth")
    # a robust spread: far rows would otherwise move the scan and the bounds with them
    return scott_factor(effective_sample_size(unique_w), d) * robust_std(unique, unique_w, std)


class _Search:
    """The coarse scan of the common log-scale, then L-BFGS-B (`scalegp._lbfgsb.lbfgsb`) within
    bounds around Scott's rule, remembering the best finite point seen (returned even if
    L-BFGS-B ends elsewhere)."""

    def __init__(self, objective, theta0, dtype):
        self.objective, self.theta0, self.dtype = objective, theta0, dtype
        self.eps = float(np.finfo(dtype).eps)
        self.lower, self.upper = theta0 - _LOG_BOUND_BELOW, theta0 + _LOG_BOUND_ABOVE
        self.best_value, self.best_theta = np.inf, theta0
        self.evaluations = self.nonfinite = 0
        self._seen = {}  # theta's bytes -> (value, gradient) given to L-BFGS-B

    def _record(self, value, theta):
        self.evaluations += 1
        self.nonfinite += not np.isfinite(value)
        if np.isfinite(value) and value < self.best_value:
            self.best_value, self.best_theta = value, np.array(theta, dtype=np.float64)

    def _value_and_grad(self, theta):
        # Near the optimum the line search may ask for the same point again and again (the
        # objective's rounding noise exceeds its change there): both objectives see log h in
        # the compute dtype, so points that round alike are answered from memory.
        key = np.asarray(theta, self.dtype).tobytes()
        if key not in self._seen:
            value, grad = self.objective(theta, with_grad=True)
            finite = np.isfinite(value) and np.all(np.isfinite(grad))
            self._record(value if finite else np.nan, theta)
            # a huge value makes the line search step back
            self._seen[key] = (value, grad) if finite else (1e30, np.zeros_like(theta))
        value, grad = self._seen[key]
        return value, grad.copy()

    def run(self, max_iter: int):
        for offset in _SCAN_OFFSETS:  # forward passes only
            theta = self.theta0 + offset
            self._record(self.objective(theta, with_grad=False)[0], theta)
        _, _, result = lbfgsb(self._value_and_grad, self.best_theta.copy(), max_iter,
                              bounds=list(zip(self.lower, self.upper)),
                              ftol=max(4 * self.eps, 1e-12), gtol=_GTOL)
        return result


class _BracketSearch(_Search):
    """A scalar bandwidth on the grouped objective (value and gradient, no second derivative):
    the scan of `_Search`, then a safeguarded secant search for ``f'(t) = 0`` inside the
    scan's bracket, instead of L-BFGS-B (whose import, scipy.optimize, outweighs a small
    problem's cached run; docs/decisions.md #33).

    The scan's best point ``t_i`` is no worse than its neighbours ``t_{i±1}`` (a search bound
    beyond the scan's ends), so a minimum of f lies between them. Each evaluated gradient
    shrinks that bracket to the side where f falls; the next point is the secant root of the
    last two gradients where the slope between them is positive and the root lies inside the
    bracket (for the first step the scan's second difference stands in for that slope; twice
    that step where the bracket did not halve over the last two, to land beyond the root),
    else the bracket's midpoint. It ends when ``|g| <``
    `_GTOL` or the bracket is narrower than `_BRACKET_XTOL`; the best point seen is the answer,
    the one L-BFGS-B reaches from the scan's best (a one-dimensional problem has no other
    local search to do). A non-finite point (an underflow at a tiny h) counts as lying below
    the minimum."""

    def run(self, max_iter: int):
        scan = [self.theta0[0] + offset for offset in _SCAN_OFFSETS]
        values = []
        for t in scan:  # forward passes only
            values.append(self.objective(np.array([t]), with_grad=False)[0])
            self._record(values[-1], np.array([t]))
        finite = np.where(np.isfinite(values), values, np.inf)
        i = int(np.argmin(finite))
        lo = scan[i - 1] if i > 0 else float(self.lower[0])
        hi = scan[i + 1] if i + 1 < len(scan) else float(self.upper[0])
        t, previous = float(scan[i]), None
        # the first step's curvature: the scan's second difference around its best point
        if 0 < i < len(scan) - 1 and np.all(np.isfinite(finite[i - 1: i + 2])):
            spacing = scan[i + 1] - scan[i]
            curvature = (finite[i + 1] - 2 * finite[i] + finite[i - 1]) / spacing**2
        else:
            curvature = np.nan
        success, message, grad = False, "iteration limit reached", np.zeros(1)
        widths = []
        for iteration in range(1, max_iter + 1):
            value, grad = self._value_and_grad(np.array([t]))
            g = float(grad[0])
            if value >= 1e30:  # not finite: the minimum lies at larger h
                lo, g = t, np.nan
            elif abs(g) < _GTOL:
                success, message = True, "gradient below tolerance"
                break
            elif g > 0:
                hi = t
            else:
                lo = t
            if hi - lo < _BRACKET_XTOL:
                success = True
                message = ("stopped at a search bound" if min(t - self.lower[0],
                                                              self.upper[0] - t) < _BRACKET_XTOL
                           else "bracket below tolerance")
                break
            slope = curvature
            if previous is not None and np.isfinite(previous[1]):
                slope = (g - previous[1]) / (t - previous[0])
            widths.append(hi - lo)
            target = 0.5 * (lo + hi)
            if np.isfinite(g) and slope > 0:
                # the secant root; twice that step where the bracket failed to halve over the
                # last two (secant steps close in from one side: this one lands beyond the root)
                stalled = len(widths) > 2 and widths[-1] > 0.5 * widths[-3]
                step = -(2 if stalled else 1) * g / slope
                if lo < t + step < hi:
                    target = t + step
            previous, t = (t, g), target
        return _NewtonResult(success, message, iteration, np.asarray(grad, np.float64))


@dataclasses.dataclass
class _NewtonResult:
    """What `_NewtonSearch.run` reports, in L-BFGS-B's terms."""

    success: bool
    message: str
    nit: int
    jac: np.ndarray


class _NewtonSearch(_Search):
    """A safeguarded 1-D Newton search on the common log-scale t = log h of a scalar bandwidth,
    for an objective that also gives its second derivative (`_PlannedObjective`).

    It minimises the negated mean f(t), so it solves ``f'(t) = 0``, where f' is the
    gradient g of a mean of ``log Σ_j w_j exp(-|x_i - x_j|² s / 2) - d t`` in ``s = e^{-2t}``:
    in s it is linear where each row's sum is one neighbour's term (small h, where the search
    starts), so the Newton step is taken in s, ``t ← t - log(1 + 2 g / f'') / 2``, which is t's
    Newton step to first order and lands on the root of the one-neighbour model at once.
    Safeguards: a step of at most `_NEWTON_MAX_STEP` (a non-convex f, or a step whose log
    is undefined, moves that far downhill; a non-finite value, that far up in h); a bracket of
    evaluated points where g has either sign, each later step kept strictly inside it (halfway
    to its end otherwise); the search
    bounds of `_Search`, which a step may reach (and stop at when g pushes out). It starts at
    the scan's smallest bandwidth (the cheapest evaluation on the planned path: its cost grows
    with h) and ends when the step is under `_NEWTON_XTOL` or ``|g| <`` `_GTOL`; the best
    point seen is the answer. It finds the maximum of the LOO likelihood nearest from below
    in h, not the best of a scan (the same where it is unimodal in log h)."""

    def run(self, max_iter: int):
        t = float(self.theta0[0] + _SCAN_OFFSETS[0])
        lower, upper = float(self.lower[0]), float(self.upper[0])
        below = above = None  # evaluated points with g < 0 (f falls to the right), g > 0
        success, message, grad = False, "iteration limit reached", np.zeros(1)
        for iteration in range(1, max_iter + 1):
            value, grad, second = self.objective(np.array([t]), True, with_curvature=True)
            finite = np.isfinite(value) and np.all(np.isfinite(grad)) and np.isfinite(second)
            self._record(value if finite else np.nan, np.array([t]))
            if not finite:  # (an underflow at a tiny h): towards larger h, within bounds
                message = "non-finite objective"
                target = min(t + _NEWTON_MAX_STEP, upper) if above is None else 0.5 * (t + above)
                if target == t:
                    break
                t = target
                continue
            g = float(grad[0])
            if abs(g) < _GTOL:
                success, message = True, "gradient below tolerance"
                break
            if g < 0:
                below = t if below is None else max(below, t)
            else:
                above = t if above is None else min(above, t)
            # Newton's in s = e^{-2t}: s ← s (1 + 2 g / f''), defined where f'' > 0 and the
            # new s is positive; else downhill as far as allowed
            ratio = 2 * g / second if second > 0 else -np.inf
            step = -0.5 * np.log1p(ratio) if ratio > -1 else -np.sign(g) * _NEWTON_MAX_STEP
            step = float(np.clip(step, -_NEWTON_MAX_STEP, _NEWTON_MAX_STEP))
            target = min(max(t + step, lower), upper)
            if below is not None and target <= below:
                target = 0.5 * (t + below)
            if above is not None and target >= above:
                target = 0.5 * (t + above)
            if abs(target - t) < _NEWTON_XTOL:
                success = True
                message = ("stopped at a search bound" if target in (lower, upper)
                           else "step below tolerance")
                break
            t = target
        return _NewtonResult(success, message, iteration, np.asarray(grad, np.float64))


def _warn_outcome(converged, at_bound, diagonal, message, nonfinite):
    if not converged:
        _convergence_warning(
            f"bandwidth cross-validation did not converge ({message}; {nonfinite} non-finite "
            "objective evaluations); the best bandwidth seen is returned. Raise max_iter, or use "
            "float64 data with JAX x64 enabled")
    if at_bound.any():
        which = np.flatnonzero(at_bound).tolist() if diagonal else "all"
        _convergence_warning(
            f"the cross-validated bandwidth stopped at a search bound (features: {which}; bounds "
            f"exp(-{_LOG_BOUND_BELOW:g}) to exp({_LOG_BOUND_ABOVE:g}) times Scott's rule). This "
            "usually means a feature takes few distinct values (ties in one coordinate reward an "
            "ever smaller bandwidth); consider a rule ('scott') or jittering discrete features")


def _convergence_warning(message):
    # scikit-learn's class, which users filter; imported only when there is something to say,
    # so that the command line's KDE starts without scikit-learn (decisions #33)
    from sklearn.exceptions import ConvergenceWarning

    warnings.warn(message, ConvergenceWarning, stacklevel=4)
