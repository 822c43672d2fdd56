"""A fitted KDE (`FittedKDE`) and `fit_kde`, which makes one from data and a bandwidth choice."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from scalegp._validation import (
    as_compute_dtype,
    check_bandwidth,
    check_int,
    check_option,
    check_points,
    check_weights,
)
from scalegp.kde._cv import (
    CV_BANDWIDTHS,
    CV_MAX_ITER,
    DEFAULT_CV_SUBSAMPLE,
    CVResult,
    cross_validate,
)
from scalegp.kde._density import (
    DEFAULT_BATCH_SIZE,
    compute_dtype,
    engine_log_density,
    pad_weights,
)
from scalegp.kde._loo import collapse_duplicates
from scalegp.kde._sample import sample
from scalegp.kde._spread import (
    BANDWIDTH_RULES,
    SCALES,
    Scaling,
    effective_sample_size,
    fit_scaling,
    rule_bandwidth,
    scott_factor,
    silverman_factor,
)
from scalegp.ops import Engine, spatial_order


@dataclasses.dataclass(frozen=True, eq=False)
class FittedKDE:
    """A fitted Gaussian KDE: the scaled data, weights, bandwidth and scaling (see `fit_kde`).

    Attributes:
      data: (n, d) the training data in scaled coordinates z, in the compute dtype.
      weights: (n,) float64 weights as `scalegp._validation.check_weights` returns them (the
        largest in [0.5, 1)), or None for equal weights.
      bandwidth: float or (d,) float64 array, in scaled coordinates.
      scaling: the `Scaling` from raw features x to z.
      cv_result: the `CVResult` for a cross-validated bandwidth, else None.
      data_order: the rows of the keys (``distinct``, else ``data``) in spatial order at
        ``bandwidth`` (``planned``'s k-d order, else `scalegp.ops.spatial_order`), computed
        once at fit where pruned scoring may pay (so scoring does not sort the data on every
        call), else None.
      planned: the keys in k-d order with their tile tree (`scalegp.ops.Engine.planned_kde`),
        made once at fit where the scoring engine takes the host-planned pruned path (one
        device, xla, ``prune`` True or an "auto" that pays), else None; ``data_order`` is then
        its k-d order of the keys. Every `log_density` on that path reuses it: nothing sorts
        the data again. After a cross-validation on that path it is the cross-validation's
        (`scalegp.ops.Engine.planned_loo` of the distinct rows: the same points, ordered and
        in a tree once), where those are the keys (none of zero weight); with no duplicates
        it holds the data's rows in the cross-validation's row order, its ``order[k]``
        standing for the data's row ``data_order[k]``.
      distinct: where ``data`` has exact duplicate rows (in z, as computed), the keys that
        `log_density` sums
        over: (u, d) its distinct rows, each once, in the compute dtype, with
        ``distinct_weights`` (u,) float64, the summed weights of their copies, and
        ``distinct_index`` (n,) each row's key. A stack of copies then costs one kernel value
        per query, not one per copy (the same sum up to rounding), and the data themselves
        are scored as their u keys. None: the keys are ``data`` and ``weights``.
    """

    data: np.ndarray
    weights: np.ndarray | None
    bandwidth: float | np.ndarray
    scaling: Scaling
    cv_result: CVResult | None = None
    data_order: np.ndarray | None = None
    planned: object | None = None
    distinct: np.ndarray | None = None
    distinct_weights: np.ndarray | None = None
    distinct_index: np.ndarray | None = None

    @property
    def n_features(self) -> int:
        return self.data.shape[1]

    def log_density(
        self, X, *, batch_size: int = DEFAULT_BATCH_SIZE, impl="auto", mesh=None,
        scheme="allgather", prune="auto", prune_tol=None,
    ) -> np.ndarray:
        """(n_queries, d) raw points -> (n_queries,) log p(x), Jacobian of the scaling included.
        The user-level entry: X and the settings are checked, and one `scalegp.ops.Engine`
        built from ``impl`` ... ``prune_tol`` (see `log_density`) for `log_density_with`."""
        X = check_points(X, "X", min_samples=0)
        if X.shape[1] != self.n_features:
            raise ValueError(
                f"X has {X.shape[1]} features, but the KDE was fitted on {self.n_features}"
            )
        batch_size = check_int("batch_size", batch_size, 1)
        engine = Engine.create(impl, mesh, scheme, prune=prune, prune_tol=prune_tol)
        return self.log_density_with(engine, X, batch_size=batch_size)

    def log_density_with(self, engine: Engine, X, *, batch_size: int) -> np.ndarray:
        """`log_density` for a caller that checked X ((n_queries, d) finite floats: the
        estimator's ``score_samples``, with scikit-learn's helpers) and ``batch_size`` and
        built the ``engine``."""
        Z = as_compute_dtype(self.scaling.transform(X), self.data.dtype)
        keys, weights = ((self.data, self.weights) if self.distinct is None
                         else (self.distinct, self.distinct_weights))

        def score(queries, planned_rows=None):
            return engine_log_density(engine, queries, keys, self.bandwidth, weights,
                                      batch_size=batch_size, data_order=self.data_order,
                                      planned=self.planned, planned_rows=planned_rows)

        themselves = Z.shape == self.data.shape and np.array_equal(Z, self.data)
        if self.distinct is not None and themselves:
            # the data themselves: each row takes its key's value, which it would get as a
            # query (rows are scored independently of their batch)
            values = score(self.distinct)[self.distinct_index]
        elif themselves and self.planned is not None and self.data_order is not None:
            # the tree may hold the rows in another order (the cross-validation's): its rows
            # in k-d order are the data's in ``data_order``
            rows = np.empty(Z.shape[0], np.int64)
            rows[self.planned.order] = self.data_order
            values = score(Z, rows)
        else:
            values = score(Z)
        return values + values.dtype.type(self.scaling.log_abs_det)

    def density(self, X, **kwargs) -> np.ndarray:
        return np.exp(self.log_density(X, **kwargs))

    def sample(self, n_samples: int = 1, random_state=None) -> np.ndarray:
        """(n_samples, d) float64 draws in raw coordinates."""
        Z = sample(self.data, self.bandwidth, n_samples, self.weights, random_state)
        return self.scaling.inverse_transform(Z)

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """The KDE's exact mean (d,) and covariance (d, d) in raw coordinates: the weighted mean
        and (biased, weights normalised) covariance of the data plus the kernel's covariance
        ``A^-T diag(h^2) A^-1``."""
        Z = self.data.astype(np.float64)
        n, d = Z.shape
        p = np.full(n, 1.0 / n) if self.weights is None else self.weights / self.weights.sum()
        mean_z = p @ Z
        centred = Z - mean_z
        cov_z = (centred * p[:, None]).T @ centred + np.diag(
            np.broadcast_to(np.asarray(self.bandwidth, np.float64) ** 2, (d,))
        )
        inverse = self.scaling.inverse
        return mean_z @ inverse + self.scaling.location, inverse.T @ cov_z @ inverse


def fit_kde(
    X,
    weights=None,
    *,
    bandwidth="scott",
    scale: str | None = None,
    cv_subsample: int | None = DEFAULT_CV_SUBSAMPLE,
    random_state=None,
    max_iter: int = CV_MAX_ITER,
    impl="auto",
    mesh=None,
    scheme="allgather",
    prune="auto",
    prune_tol=None,
) -> FittedKDE:
    """Fits a Gaussian KDE to the rows of X.

    Args:
      X: (n, d) data; weights: optional (n,) non-negative weights.
      bandwidth: in scaled coordinates: a positive float, a (d,) array, "scott" or "silverman"
        (the rule's factor times each feature's standard deviation: a (d,) array for
        ``scale=None``, the bare factor for the other scalings, whose features have unit spread),
        "cv" (scalar) or "cv-diag" (per feature), see `cross_validate_bandwidth`.
      scale: None, "standardize" or "covariance"; see `fit_scaling`.
      cv_subsample, random_state, max_iter: for the cross-validated bandwidths.
      impl: engine implementation used by cross-validation.
      mesh, scheme: devices for cross-validation (see the module docstring).
      prune, prune_tol: tile pruning in cross-validation (see `cross_validate_bandwidth`);
        where it may pay, the keys' order (and, on the host-planned path, their tile tree,
        `FittedKDE.planned`) is also stored for scoring: the cross-validation's tree where
        it made one of the same points on that path, else one made here (in the
        cross-validation's order where it made one).
      The arguments are checked and one `scalegp.ops.Engine` is built from ``impl``, ``mesh``,
      ``scheme``, ``prune`` and ``prune_tol`` here; the fit itself is `fit_checked`.
    Returns:
      a `FittedKDE`.
    """
    X = check_points(X)
    n, d = X.shape
    w = check_weights(weights, n, "weights")
    bandwidth = check_bandwidth(bandwidth, BANDWIDTH_RULES + CV_BANDWIDTHS, n_features=d)
    check_option("scale", scale, SCALES)
    if isinstance(bandwidth, str) and bandwidth in CV_BANDWIDTHS:
        cv_subsample = check_int("cv_subsample", cv_subsample, 2, allow_none=True)
        max_iter = check_int("max_iter", max_iter, 1)
    engine = Engine.create(impl, mesh, scheme, prune=prune, prune_tol=prune_tol)
    return fit_checked(X, w, bandwidth=bandwidth, scale=scale, cv_subsample=cv_subsample,
                       random_state=random_state, max_iter=max_iter, engine=engine)


def fit_checked(X, weights, *, bandwidth, scale, cv_subsample, random_state, engine: Engine,
                max_iter: int = CV_MAX_ITER) -> FittedKDE:
    """`fit_kde` for a caller that checked its arguments and built the engine
    (`scalegp.ScalableKernelDensity.fit`, with scikit-learn's helpers): X (n, d) a finite float
    array (`check_points`), ``weights`` as `check_weights` returns them, ``bandwidth`` as
    `check_bandwidth` returns it, ``scale`` one of `SCALES`, ``cv_subsample`` and ``max_iter``
    checked integers, ``engine`` a `scalegp.ops.Engine`. Nothing is checked again: the data
    are scaled, their duplicates collapsed once (in z, as computed: the keys of the scoring and
    the points of the cross-validation), the bandwidth chosen and the scoring's tile tree
    built (or the cross-validation's reused) once."""
    n, d = X.shape
    scaling = fit_scaling(X, weights, scale)
    Z = as_compute_dtype(scaling.transform(X), compute_dtype(X))
    # Duplicates collapsed in z as computed, where the kernel sees the rows: distinct rows
    # that round to one z would be twins at distance 0 there (what cross-validation must
    # leave out together). Equal rows map to equal z (the scaling works row by row).
    collapsed = collapse_duplicates(Z, weights)
    cv_result = cv_planned = None
    if isinstance(bandwidth, str) and bandwidth in BANDWIDTH_RULES:
        if scale is None:
            bandwidth = rule_bandwidth(X, bandwidth, weights)
        else:
            factor = scott_factor if bandwidth == "scott" else silverman_factor
            bandwidth = factor(effective_sample_size(weights, n), d)
    elif isinstance(bandwidth, str):
        with concurrent.futures.ThreadPoolExecutor(1) as background:
            # Every scalar bandwidth orders the keys alike: where the scoring's tiles are built
            # after the cross-validation (which made none to reuse), their order (host numpy,
            # O(m log m)) is made meanwhile.
            keys = _keys(Z, weights, collapsed)[0]
            order_ahead = None
            if bandwidth == "cv" and not engine.cross_validates_planned(*keys.shape, keys.dtype):
                order_ahead = background.submit(engine.planned_order, keys, 1.0)
            cv_result, cv_planned = _cross_validate(
                X, collapsed, diagonal=bandwidth == "cv-diag", cv_subsample=cv_subsample,
                random_state=random_state, max_iter=max_iter, engine=engine)
            return _fitted(Z, weights, cv_result.bandwidth, scaling, cv_result, collapsed,
                           cv_planned, engine, order_ahead)
    return _fitted(Z, weights, bandwidth, scaling, cv_result, collapsed, cv_planned, engine)


def _cross_validate(X, collapsed, **settings):
    """`cross_validate` on the distinct rows of positive weight of ``collapsed`` (the data's
    distinct rows in z, their summed weights, each data row's), each with the first of its
    rows in X, raw, where ties are judged."""
    distinct, distinct_w, index = collapsed
    positive = distinct_w > 0
    to_point = np.where(positive, np.cumsum(positive) - 1, -1)
    first = np.empty(distinct.shape[0], np.int64)
    first[index[::-1]] = np.arange(index.shape[0] - 1, -1, -1)  # each distinct row's first row
    return cross_validate(distinct[positive], distinct_w[positive], origin=to_point[index],
                          raw=X[first[positive]], **settings)


def _keys(Z, w, collapsed):
    """``(keys, their weights, (distinct rows, their weights, index) or Nones)``: the scoring's
    keys, the distinct rows of ``collapsed`` where there are fewer than the data's."""
    distinct, distinct_w, _ = collapsed
    if distinct.shape[0] == Z.shape[0]:  # no duplicates: the data are the keys
        return Z, w, (None, None, None)
    return distinct, distinct_w, collapsed


def _fitted(Z, w, bandwidth, scaling, cv_result, collapsed, cv_planned, engine,
            order_ahead=None) -> FittedKDE:
    """The `FittedKDE`: its keys (`_keys`) in k-d order, with their tile tree where the engine
    scores on the planned path: the cross-validation's (``cv_planned``) where it holds the
    keys, else one built here (in the cross-validation's order where it made one, else in
    ``order_ahead``'s, a future of `scalegp.ops.Engine.planned_order`, where given)."""
    distinct, distinct_w, index = collapsed
    positive = distinct_w > 0
    keys, key_w, kept = _keys(Z, w, collapsed)
    if cv_planned is not None and positive.all():
        # the cross-validation's points are the distinct rows, in the same order: its tree
        # holds the keys (those of the data in the order of ``index``)
        planned = engine.planned_kde(distinct, bandwidth, built=cv_planned)
        order = None if planned is None else (
            planned.order if keys is distinct else np.argsort(index)[planned.order])
    else:
        hint = None  # the cross-validation's order, the rows of zero weight last
        if cv_planned is not None and keys is distinct:
            hint = np.concatenate([np.flatnonzero(positive)[cv_planned.order],
                                   np.flatnonzero(~positive)])
        elif order_ahead is not None:
            hint = order_ahead.result()
        planned = engine.planned_kde(
            keys, bandwidth, None if key_w is None else pad_weights(key_w, keys.shape[0], Z.dtype),
            order=hint)
        order = None if planned is None else planned.order
    if planned is None and engine.orders_keys(*keys.shape, keys.dtype):
        order = spatial_order(keys, bandwidth)
    return FittedKDE(data=Z, weights=w, bandwidth=bandwidth, scaling=scaling,
                     cv_result=cv_result, data_order=order, planned=planned, distinct=kept[0],
                     distinct_weights=kept[1], distinct_index=kept[2])

