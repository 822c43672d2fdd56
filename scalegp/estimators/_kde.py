"""`ScalableKernelDensity`: scikit-learn's KernelDensity surface on `scalegp.kde`."""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from scalegp import kde
from scalegp.estimators._precision import float_dtype, in_precision
from scalegp.ops import SCHEMES, IMPLEMENTATIONS, Engine
from scalegp._validation import (
    check_bandwidth,
    check_int,
    check_option,
    check_weights,
    validate_data,
)

__all__ = ["ScalableKernelDensity"]

IMPLS = ("auto",) + IMPLEMENTATIONS


class ScalableKernelDensity(BaseEstimator):
    """Gaussian kernel density estimation for large data, with cross-validated bandwidths.

    A drop-in for scikit-learn's ``KernelDensity(kernel="gaussian")`` (fit, score_samples, score,
    sample) whose log-densities come from scalegp's memory-linear engine, exactly (no tree
    approximation), and whose bandwidth can be chosen by leave-one-out cross-validation in one
    fit instead of a grid search. The density of a query x is::

        p(x) = |det A| sum_j w_j N(z(x); z_j, diag(h^2)) / sum_j w_j,   z(x) = (x - mu) A

    where ``z`` is the ``scale``-ing of the features (A = I for ``scale=None``) and h the
    bandwidth in scaled units.

    Parameters
    ----------
    bandwidth : float, array of shape (n_features,), or {"scott", "silverman", "cv", "cv-diag"}, \
            default=1.0
        Standard deviation of the Gaussian kernel in scaled units (raw units for ``scale=None``):

        - float: as scikit-learn's ``bandwidth`` (``scale=None``) or scipy's ``bw_method`` factor
          (``scale="covariance"``); an array gives one bandwidth per feature;
        - "scott" / "silverman": the rule's factor ``n_eff^(-1/(d+4))`` /
          ``(n_eff (d+2)/4)^(-1/(d+4))`` times each feature's standard deviation, so rescaling
          the data rescales the bandwidth (unlike scikit-learn's rules). A per-feature array for
          ``scale=None``, the bare factor otherwise (scaled features have unit spread);
        - "cv": the scalar bandwidth maximising the leave-one-out log-likelihood, by gradient
          (a bracketed secant search on log h through the engine's VJP, or on the pruned path
          a Newton search from the pass's own moments); "cv-diag": one per feature (L-BFGS-B).
          Exact
          duplicate rows are merged into weights and left out together, so ties do not drive
          the bandwidth to zero. See `scalegp.kde.cross_validate_bandwidth`. The fit warns
          (UserWarning) where the data make the leave-one-out optimum a poor bandwidth: rows
          so far from the rest that they alone would set it (left out of the objective), a
          layout flatter than the features, heavy stacks of exact duplicates (``cv_result_``;
          docs/kde.md).
    scale : {None, "standardize", "covariance"}, default=None
        Feature scaling applied to fit, density and sampling alike: None (raw features),
        "standardize" (per-feature weighted mean and standard deviation) or "covariance" (full
        whitening by the weighted covariance, as scipy.stats.gaussian_kde). Log-densities include
        the Jacobian ``log|det A|``, so they are densities of the raw features.
    cv_subsample : int or None, default=8192
        For "cv"/"cv-diag": number of distinct points held out in the LOO objective, chosen at
        random (``random_state``) when there are more; each is scored against all the data.
        None holds out every point (n^2 kernel evaluations per optimisation step).
    batch_size : int, default=65536
        Queries per engine call in ``score_samples``: memory stays O((batch_size + n) d)
        however many queries are scored.
    random_state : int, RandomState instance or None, default=None
        Seeds the held-out subset of "cv"/"cv-diag" (sampling takes its own ``random_state``).
    impl : {"auto", "dense", "xla", "triton", "pallas"}, default="auto"
        Engine implementation (see `scalegp.ops`).
    mesh : None, jax.sharding.Mesh, "all", int or list of devices, default=None
        Devices for cross-validation and ``score_samples``: None uses one device (nothing
        changes); otherwise the queries are sharded over the mesh ("all": every device of every
        process; an int k: the first k devices). The results equal the one-device ones up to
        float summation order. A Mesh object cannot be pickled (its devices cannot): pass "all"
        or an int for an estimator that must be pickled.
    mesh_scheme : {"allgather", "ring"}, default="allgather"
        How the data reach the devices: gathered on each (fastest while they fit), or passed
        around a ring so that each device holds 1/p of them. See `scalegp.ops.sharded_kde_density`.
    prune : {"auto", True, False}, default="auto"
        Skip the data tiles that cannot matter to a tile of queries (one device only; see
        `scalegp.ops.rbf_kde_density`). "auto" considers it from 16,384 points in at most 8
        features and prunes when the data's own tile bounds say it pays: low-dimensional,
        clustered data at a narrow bandwidth.
    prune_tol : float or None, default=None
        Each query's skipped density is at most ``prune_tol`` times its computed density (a
        relative error); None: half the float epsilon (under rounding).
    dtype : None or a float32/float64 dtype, default=None
        Compute dtype, anything numpy reads as float32 or float64. None: float64 when X is
        float64 and JAX's x64 mode is on, float32 otherwise (see Notes). "float64" needs no
        global switch: with x64 off, ``fit``, ``score_samples``, ``score`` and ``sample`` turn
        it on for their own duration, with the results of a process with x64 on. On a TPU
        (no float64 hardware) "float64" runs on the host CPU.

    Attributes
    ----------
    bandwidth_ : float or ndarray of shape (n_features,)
        The bandwidth used, in scaled units.
    scaling_ : scalegp.kde.Scaling
        The fitted feature scaling (``location``, ``scale`` or the ``matrix`` and its
        ``inverse``, ``log_abs_det``).
    data_ : ndarray of shape (n_samples, n_features)
        The training data in scaled units (``scaling_.transform(X)``: shifted by
        ``scaling_.location`` for ``scale=None``), in the compute dtype.
    sample_weight_ : ndarray of shape (n_samples,) or None
        The training weights scaled by a power of two so that the largest lies in [0.5, 1)
        (weights are relative; the scaling is exact), or None for equal weights.
    cv_result_ : scalegp.kde.CVResult or None
        Details of the bandwidth cross-validation (None for other bandwidths), with what it
        found about the data: ``far_rows`` (rows whose own leave-one-out terms set the
        bandwidth, left out of the objective), ``flat_directions`` (a layout flatter than
        the kernel), ``stacked_share`` (heavy stacks of exact duplicates) and the warnings
        they gave (``findings``).
    distinct_data_ : ndarray of shape (n_distinct, n_features) or None
        Where ``data_`` has exact duplicate rows: its distinct rows, which ``score_samples``
        sums over, each carrying the summed weight of its copies (``distinct_weight_``), so
        that a stack of copies costs one kernel value; ``distinct_index_`` gives each row's.
        None otherwise: the sum runs over ``data_``.
    distinct_weight_ : ndarray of shape (n_distinct,) or None
    distinct_index_ : ndarray of shape (n_samples,) or None
    data_order_ : ndarray of shape (n_distinct,) or (n_samples,), or None
        The rows of ``distinct_data_`` (else ``data_``) in spatial order
        (``planned_density_``'s k-d order, else `scalegp.ops.spatial_order`), computed at fit
        when pruning may pay so that scoring need not sort the data each time; None otherwise.
    planned_density_ : object or None
        Those rows in that order with their tile tree (`scalegp.ops.Engine.planned_kde`), built
        at fit where ``score_samples`` takes the host-planned pruned path (one device, the xla
        implementation, ``prune=True`` or an "auto" that finds pruning pays for the data at
        ``bandwidth_``); every later ``score_samples`` reuses it. For "cv" and "cv-diag" on
        that path it is the cross-validation's own (ordered and built once per fit). None
        otherwise.
    n_features_in_ : int
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Defined only when X has feature names that are all strings.

    Notes
    -----
    Precision: with ``dtype=None``, computations run in float64 when X is float64 and JAX's x64
    mode is enabled (``jax.config.update("jax_enable_x64", True)``), in float32 otherwise --
    also for float64 input, since JAX without x64 has no float64 arrays; ``dtype="float64"``
    computes in float64 either way. float32 log-densities agree with float64
    ones to about 1e-5 absolute. ``score_samples`` returns arrays in the compute dtype.

    Weights are relative (normalised by their sum), at any scale: ``sample_weight`` and
    ``c * sample_weight`` give the same model (a weight below about 1e-38 times the largest
    counts as zero in float32). For a float or cross-validated bandwidth,
    integer weights give the same density as repeating rows; the rules and scalings use Kish's
    effective sample size and reliability-weighted covariance, as scipy.stats.gaussian_kde does.
    """

    def __init__(
        self,
        *,
        bandwidth=1.0,
        scale=None,
        cv_subsample=kde.DEFAULT_CV_SUBSAMPLE,
        batch_size=kde.DEFAULT_BATCH_SIZE,
        random_state=None,
        impl="auto",
        mesh=None,
        mesh_scheme="allgather",
        prune="auto",
        prune_tol=None,
        dtype=None,
    ):
        self.bandwidth = bandwidth
        self.scale = scale
        self.cv_subsample = cv_subsample
        self.batch_size = batch_size
        self.random_state = random_state
        self.impl = impl
        self.mesh = mesh
        self.mesh_scheme = mesh_scheme
        self.prune = prune
        self.prune_tol = prune_tol
        self.dtype = dtype

    def _check_params(self, n_features: int):
        """(bandwidth, engine): the parameters checked, and the one `scalegp.ops.Engine` of
        the fit built from them."""
        check_option("scale", self.scale, kde.SCALES)
        check_int("cv_subsample", self.cv_subsample, 2, allow_none=True)
        check_int("batch_size", self.batch_size, 1)
        check_option("impl", self.impl, IMPLS)
        check_option("mesh_scheme", self.mesh_scheme, SCHEMES)
        engine = self._engine()
        if self.dtype is not None:
            float_dtype(self.dtype)
        return check_bandwidth(
            self.bandwidth, kde.BANDWIDTH_RULES + kde.CV_BANDWIDTHS, n_features=n_features
        ), engine

    def _engine(self) -> Engine:
        """The engine of a fit or a scoring, from ``impl``, ``mesh``, ``mesh_scheme``,
        ``prune`` and ``prune_tol`` (checked there); built per call, not kept: a Mesh does not
        pickle."""
        return Engine.create(self.impl, self.mesh, self.mesh_scheme, prune=self.prune,
                             prune_tol=self.prune_tol)

    @in_precision
    def fit(self, X, y=None, sample_weight=None):
        """Fits the KDE to the rows of X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Finite values; NaN, inf, empty or 1-D input raises ValueError.
        y : None
            Ignored (present for Pipeline compatibility).
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights, not all zero; None for equal weights.

        Returns
        -------
        self : ScalableKernelDensity
        """
        # checked here once, with scikit-learn's helpers; scalegp.kde trusts what it is given
        X = validate_data(self, X, dtype=[np.float64, np.float32], ensure_min_samples=1)
        bandwidth, engine = self._check_params(X.shape[1])
        if self.dtype is not None:  # the data's dtype is the compute dtype (kde.compute_dtype)
            X = X.astype(float_dtype(self.dtype), copy=False)
        weights = check_weights(sample_weight, X.shape[0])
        seed = None
        if isinstance(bandwidth, str) and bandwidth in kde.CV_BANDWIDTHS:
            seed = check_random_state(self.random_state).randint(np.iinfo(np.int32).max)
        fitted = kde.fit_checked(
            X,
            weights,
            bandwidth=bandwidth,
            scale=self.scale,
            cv_subsample=self.cv_subsample,
            random_state=seed,
            engine=engine,
        )
        self.bandwidth_ = fitted.bandwidth
        self.scaling_ = fitted.scaling
        self.data_ = fitted.data
        self.sample_weight_ = fitted.weights
        self.cv_result_ = fitted.cv_result
        self.distinct_data_ = fitted.distinct
        self.distinct_weight_ = fitted.distinct_weights
        self.distinct_index_ = fitted.distinct_index
        self.data_order_ = fitted.data_order
        self.planned_density_ = fitted.planned
        return self

    def _fitted(self) -> kde.FittedKDE:
        check_is_fitted(self)
        return kde.FittedKDE(
            data=self.data_,
            weights=self.sample_weight_,
            bandwidth=self.bandwidth_,
            scaling=self.scaling_,
            cv_result=self.cv_result_,
            data_order=getattr(self, "data_order_", None),  # absent from older pickles
            planned=getattr(self, "planned_density_", None),
            distinct=getattr(self, "distinct_data_", None),
            distinct_weights=getattr(self, "distinct_weight_", None),
            distinct_index=getattr(self, "distinct_index_", None),
        )

    @in_precision
    def score_samples(self, X):
        """Log-density of the model at each row of X.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)

        Returns
        -------
        log_density : ndarray of shape (n_queries,)
            ``log p(x)`` (normalised: densities integrate to 1 over the raw features), finite
            also far from all training data.
        """
        fitted = self._fitted()
        X = validate_data(self, X, dtype=[np.float64, np.float32], reset=False)
        if self.dtype is not None:  # queries rounded as fit rounded the data (the training
            X = X.astype(float_dtype(self.dtype), copy=False)  # rows then score as themselves)
        return fitted.log_density_with(self._engine(), X,
                                       batch_size=check_int("batch_size", self.batch_size, 1))

    @in_precision
    def score(self, X, y=None):
        """Total log-likelihood ``sum_i log p(x_i)`` of the rows of X (as KernelDensity.score).

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        y : None
            Ignored.

        Returns
        -------
        logprob : float
        """
        return float(np.sum(self.score_samples(X), dtype=np.float64))

    @in_precision
    def sample(self, n_samples=1, random_state=None):
        """Random draws from the fitted density (weights and scaling respected).

        Parameters
        ----------
        n_samples : int, default=1
        random_state : int, RandomState instance or None, default=None
            Seed for reproducible draws.

        Returns
        -------
        X : ndarray of shape (n_samples, n_features), float64

        Draws that need more memory than this process can hold are a MemoryError before any
        work (`scalegp.kde.check_sample_memory`).
        """
        fitted = self._fitted()
        n_samples = check_int("n_samples", n_samples, 0)
        return fitted.sample(n_samples, random_state=check_random_state(random_state))
