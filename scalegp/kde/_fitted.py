"""A fitted KDE (`FittedKDE`) and `fit_kde`, which makes one from data and a bandwidth choice."""

from __future__ import annotations

import dataclasses

import numpy as np

from scalegp._validation import as_compute_dtype, check_bandwidth, check_points, check_weights
from scalegp.kde._cv import (
    CV_BANDWIDTHS,
    DEFAULT_CV_SUBSAMPLE,
    CVResult,
    cross_validate_and_order,
)
from scalegp.kde._density import DEFAULT_BATCH_SIZE, compute_dtype, log_density, pad_weights
from scalegp.kde._loo import collapse_duplicates
from scalegp.kde._sample import sample
from scalegp.kde._spread import (
    BANDWIDTH_RULES,
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
        built once at fit where the scoring engine takes the host-planned pruned path (one
        device, xla, ``prune`` True or an "auto" that pays), else None; ``data_order`` is then
        its order. Every `log_density` on that path reuses it: nothing sorts the data again.
        After a cross-validation on that path it takes the cross-validation's k-d order of
        the same points (no second ordering).
      distinct: where ``data`` has exact duplicate rows, the keys that `log_density` sums
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
        """(n_queries, d) raw points -> (n_queries,) log p(x), Jacobian of the scaling included."""
        X = check_points(X, "X", min_samples=0)
        if X.shape[1] != self.n_features:
            raise ValueError(
                f"X has {X.shape[1]} features, but the KDE was fitted on {self.n_features}"
            )
        Z = as_compute_dtype(self.scaling.transform(X), self.data.dtype)
        keys, weights = ((self.data, self.weights) if self.distinct is None
                         else (self.distinct, self.distinct_weights))

        def score(queries):
            return log_density(
                queries, keys, self.bandwidth, weights, batch_size=batch_size, impl=impl,
                mesh=mesh, scheme=scheme, prune=prune, prune_tol=prune_tol,
                data_order=self.data_order, planned=self.planned,
            )

        if self.distinct is not None and Z.shape == self.data.shape and np.array_equal(
                Z, self.data):
            # the data themselves: each row takes its key's value, which it would get as a
            # query (rows are scored independently of their batch)
            values = score(self.distinct)[self.distinct_index]
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
    max_iter: int = 100,
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
        `FittedKDE.planned`) is also stored for scoring: the cross-validation's order where it
        made one on that path, else one made here.
    Returns:
      a `FittedKDE`.
    """
    X = check_points(X)
    n, d = X.shape
    w = check_weights(weights, n, "weights")
    bandwidth = check_bandwidth(bandwidth, BANDWIDTH_RULES + CV_BANDWIDTHS, n_features=d)
    scaling = fit_scaling(X, w, scale)
    dtype = compute_dtype(X)
    Z = as_compute_dtype(scaling.transform(X), dtype)
    # duplicates collapsed in raw coordinates: the scaling need not map equal rows to
    # bit-identical rows, and near-twins would act like the duplicates CV must ignore. Equal
    # rows do map to equal z (the scaling works row by row), so each row's z is its key's.
    unique, unique_w, inverse = collapse_duplicates(X, w)
    Zu = None  # the distinct rows in z, where cross-validation or the keys need them
    if unique.shape[0] < n or (isinstance(bandwidth, str) and bandwidth in CV_BANDWIDTHS):
        Zu = as_compute_dtype(scaling.transform(unique), dtype)
    cv_result = order = None
    if isinstance(bandwidth, str) and bandwidth in BANDWIDTH_RULES:
        if scale is None:
            bandwidth = rule_bandwidth(X, bandwidth, w)
        else:
            factor = scott_factor if bandwidth == "scott" else silverman_factor
            bandwidth = factor(effective_sample_size(w, n), d)
    elif isinstance(bandwidth, str):
        cv_result, order = _cross_validate(
            Zu, unique, unique_w, inverse, diagonal=bandwidth == "cv-diag",
            cv_subsample=cv_subsample, random_state=random_state, max_iter=max_iter, impl=impl,
            mesh=mesh, scheme=scheme, prune=prune, prune_tol=prune_tol)
        bandwidth = cv_result.bandwidth
    return _fitted(Z, w, bandwidth, scaling, cv_result, order, (Zu, unique_w, inverse),
                   Engine.create(impl, mesh, scheme, prune=prune, prune_tol=prune_tol))


def _cross_validate(Zu, unique, unique_w, inverse, **settings):
    """`cross_validate_and_order` on the distinct rows of positive weight (``Zu``, in z, and
    ``unique``, raw, with ``unique_w``; ``inverse`` each data row's), and the order of the
    scoring's keys it gives: the distinct rows' (those of zero weight last) where there are
    fewer than the data, the data's (equal rows together) where the data are the keys and
    none has zero weight, else None."""
    positive = unique_w > 0
    to_positive = np.where(positive, np.cumsum(positive) - 1, -1)
    cv_result, rank = cross_validate_and_order(
        Zu[positive], unique_w[positive], rows=to_positive[inverse], raw=unique[positive],
        **settings)
    if rank is None:
        return cv_result, None
    # the cross-validation's k-d order of these points (Scott's ratios across features): the
    # keys', with nothing sorted again
    if unique.shape[0] < inverse.shape[0]:
        return cv_result, np.concatenate([np.flatnonzero(positive)[np.argsort(rank)],
                                          np.flatnonzero(~positive)])
    return cv_result, None if not positive.all() else np.argsort(rank[inverse], kind="stable")


def _fitted(Z, w, bandwidth, scaling, cv_result, order, collapsed, engine) -> FittedKDE:
    """The `FittedKDE`, its keys (the distinct rows ``collapsed`` = (rows, weights, each data
    row's index) where there are fewer than the data's) ordered, with their tile tree where the
    engine scores on the planned path; ``order``: the keys' k-d order from cross-validation."""
    n, d = Z.shape
    distinct, distinct_w, index = collapsed
    if distinct is None or distinct.shape[0] == n:  # no duplicates: the data are the keys
        distinct = distinct_w = index = None
        keys, key_w = Z, w
    else:
        keys, key_w = distinct, distinct_w
    m = keys.shape[0]
    planned = engine.planned_kde(keys, bandwidth,
                                 None if key_w is None else pad_weights(key_w, m, Z.dtype),
                                 order=order)
    order = None
    if planned is not None:
        order = planned.order
    elif engine.orders_keys(m, d):
        order = spatial_order(keys, bandwidth)
    return FittedKDE(data=Z, weights=w, bandwidth=bandwidth, scaling=scaling, cv_result=cv_result,
                     data_order=order, planned=planned, distinct=distinct,
                     distinct_weights=distinct_w, distinct_index=index)
