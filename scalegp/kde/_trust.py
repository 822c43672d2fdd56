"""How far a cross-validated bandwidth can be trusted: rows whose own leave-one-out term sets it
(far rows), directions in which the data spread less than the kernel (a layout of lower
dimension than the data), and heavy stacks of exact duplicates among values that are not tied
otherwise. Each finding is a warning that names its cause and what to do, and a field of
`scalegp.kde.CVResult` (see the package docstring and docs/kde.md)."""

from __future__ import annotations

import math
import warnings

import numpy as np

from scalegp.ops import MASK_VALUE

#: Rows whose leave-one-out terms move the cross-validated bandwidth by more than this factor
#: (leaving them out of the objective against keeping them in) are far rows: an order of
#: magnitude. Heavy-tailed data have single rows that move it up to 8x (Pareto(2), n = 1,000).
FAR_FACTOR = 10.0
# Candidates: rows for which one Newton step predicts a move of 4x. The step underestimates
# the move for an isolated row (its pull grows as h shrinks) and overestimates it in heavy
# tails; a search without the candidates decides (`FAR_FACTOR`).
_CANDIDATE_SHIFT = math.log(4.0)
# The curvature (per row, in log h) below which the rest's is taken as this, for the step:
# the mean LOO log-likelihood's is ~0.1-4 at its maximum (normal to clustered data).
_CURVATURE_FLOOR = 1e-2
# The most rows one round takes as candidates together ("a few").
_FAR_GROUP = 16
# A principal direction is flat when the data's spread along it is below this many
# bandwidths; checked up to `_FLAT_MAX_FEATURES` features (a (d, d) covariance), with at least
# `_FLAT_MIN_POINTS` held-out points per feature (a handful of points always lies near some
# lower-dimensional layout).
_FLAT_SPREAD = 0.5
_FLAT_MAX_FEATURES = 512
_FLAT_MIN_POINTS = 10
# A stack is heavy with at least this many copies (a bootstrap resample's largest is ~10 at a
# million rows); reported when heavy stacks hold `_HEAVY_SHARE` of the weight.
_HEAVY_COPIES = 16
_HEAVY_SHARE = 0.05


def far_candidates(values, slopes, curvatures, weights) -> tuple[np.ndarray, np.ndarray]:
    """(candidates, lost), (s,) bool each: held-out rows whose leave-one-out terms may set the
    bandwidth on their own, and those whose term is lost.

    From each row's ``l_i = log p_{-i}(x_i)``, its slope ``g_i`` and its curvature ``c_i =
    -l_i''`` in the common log-scale t of the bandwidth, at the search's optimum (where the
    weighted slopes sum to 0), dropping a set S of rows moves t by ``-sum_S pi_i g_i / (F -
    sum_S pi_i c_i)`` to first order (``pi`` the normalised weights, F their mean curvature).
    The candidates are the fewest of the (up to `_FAR_GROUP`) rows of largest pull whose
    predicted move exceeds `_CANDIDATE_SHIFT`: one far row's own curvature is most of F, so
    two far rows each hide the other's pull. A term is lost where every kernel value of the
    row underflows (a row ~1e19 bandwidths from the rest in float32): it is then not finite,
    or the engine's stand-in for log 0 (`scalegp.ops.MASK_VALUE`), a constant that would swamp
    the objective; lost terms, and those without finite derivatives, are candidates too."""
    lost = lost_terms(values)
    usable = ~lost & np.isfinite(slopes) & np.isfinite(curvatures)
    pi = np.asarray(weights, np.float64) / np.sum(weights)
    pull = np.where(usable, pi * np.where(usable, slopes, 0.0), 0.0)
    own = np.where(usable, pi * np.where(usable, curvatures, 0.0), 0.0)
    strongest = np.argsort(-pull, kind="stable")[:_FAR_GROUP]
    strongest = strongest[pull[strongest] > 0]
    moves = np.cumsum(pull[strongest]) / np.maximum(
        np.sum(own) - np.cumsum(own[strongest]), _CURVATURE_FLOOR)
    candidates = ~usable
    past = np.flatnonzero(moves > _CANDIDATE_SHIFT)
    if past.size:
        candidates[strongest[: past[0] + 1]] = True
    return candidates, lost


def lost_terms(values) -> np.ndarray:
    """(s,) bool: leave-one-out terms that are lost (see `far_candidates`)."""
    values = np.asarray(values, np.float64)
    return ~(values > 0.5 * MASK_VALUE)  # NaN and -inf included


def flat_directions(z, weights, bandwidth) -> int:
    """How many principal directions of the points ``z`` (s, d), in units of ``bandwidth``
    (a float or (d,)), have a spread below `_FLAT_SPREAD`: there the kernel is wider than the
    data, whose layout has a lower dimension than its features. 0 where it cannot be told
    (one feature, under `_FLAT_MIN_POINTS` points per feature, over `_FLAT_MAX_FEATURES`
    features)."""
    s, d = z.shape
    if d < 2 or s < _FLAT_MIN_POINTS * d or d > _FLAT_MAX_FEATURES:
        return 0
    scaled = np.asarray(z, np.float64) / np.asarray(bandwidth, np.float64)
    covariance = np.atleast_2d(np.cov(scaled, rowvar=False, aweights=weights))
    spread = np.sqrt(np.clip(np.linalg.eigvalsh(covariance), 0.0, None))
    return int(np.sum(spread < _FLAT_SPREAD))


def heavy_stacks(raw, counts, weights) -> tuple[float, int, int]:
    """``(share, stacks, copies)``: the share of the weight on heavy stacks of exact duplicates
    (distinct rows ``raw`` (u, d) with ``counts`` (u,) copies and summed ``weights``), their
    number and the most copies, where they stand among data that are not tied otherwise;
    ``(0.0, 0, 0)`` where there are none, they hold under `_HEAVY_SHARE` of the weight, or most
    of the other weight sits on values that other rows share feature by feature (integer or
    rounded data, whose ties are their resolution)."""
    counts, weights = np.asarray(counts), np.asarray(weights, np.float64)
    heavy = counts >= _HEAVY_COPIES
    share = float(np.sum(weights[heavy]) / np.sum(weights))
    light = ~heavy
    if share < _HEAVY_SHARE or not light.any():
        return 0.0, 0, 0
    shared = np.ones(counts.shape[0], bool)
    for column in np.asarray(raw).T:  # a value tied with another row's, feature by feature
        _, inverse = np.unique(column, return_inverse=True)
        shared &= (np.bincount(inverse.reshape(-1), counts) >= 2)[inverse.reshape(-1)]
    if np.sum(weights[light & shared]) >= 0.5 * np.sum(weights[light]):
        return 0.0, 0, 0
    return share, int(np.sum(heavy)), int(np.max(counts))


def _listed(rows) -> str:
    shown = ", ".join(str(int(r)) for r in rows[:10])
    return shown + (f", ... ({len(rows):,} in all)" if len(rows) > 10 else "")


def far_message(rows, n_rows: int, with_rows, without) -> str:
    """The warning for far rows (indices ``rows`` of the ``n_rows`` fitted), with the bandwidth
    the search reached with them held out (None: no finite likelihood) and without."""
    before = ("the likelihood underflowed at every bandwidth" if with_rows is None
              else f"the bandwidth was {_bandwidth(with_rows)}")
    return (
        f"bandwidth cross-validation: row(s) {_listed(rows)} of the {n_rows:,} lie so far from "
        f"the other data that their leave-one-out terms alone set the bandwidth (with them held "
        f"out {before}; without them it is {_bandwidth(without)}). They were left out of the "
        "cross-validation objective (they stay in the density). Check them for data errors and "
        "remove them, or use a rule ('scott'); cv_result_.far_rows lists them")


def flat_message(flat: int, d: int) -> str:
    return (
        f"bandwidth cross-validation: the data spread over fewer dimensions than their {d} "
        f"features: along {flat} of their principal directions their spread is below half the "
        "bandwidth, so the kernel is wider than the data there (points on a line or plane, or "
        "features that depend on each other, or in very different units) and new points off "
        "that layout score poorly. Use scale='standardize' for features in different units; "
        "drop dependent features (then scale='covariance'), project the data onto their "
        "principal components, or use bandwidth='cv-diag'; cv_result_.flat_directions counts "
        "them")


def stacks_message(share: float, stacks: int, copies: int) -> str:
    return (
        f"bandwidth cross-validation: {share:.0%} of the weight sits on {stacks:,} stack(s) of "
        f"exact duplicate rows (up to {copies:,} copies) among values that are otherwise not "
        "tied. Cross-validation leaves a stack out whole, so it chooses the bandwidth as if each "
        "stack were one point and smooths the stacks away: a Gaussian KDE has no point masses. "
        "If they are point masses (a detection limit, a default value), model them apart from "
        "the other rows; if they are rounding, round every value alike; "
        "cv_result_.stacked_share holds the share")


def _bandwidth(h) -> str:
    values = np.atleast_1d(np.asarray(h, np.float64))
    return f"{values[0]:.4g}" if values.size == 1 else "[" + ", ".join(
        f"{v:.4g}" for v in values[:4]) + (", ...]" if values.size > 4 else "]")


def warn(messages) -> None:
    for message in messages:
        warnings.warn(message, UserWarning, stacklevel=5)
