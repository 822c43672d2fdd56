"""Gaussian kernel density estimation at scale, on the engine's memory-linear log-sum-exp.

Model
-----
For data ``x_1 .. x_n`` (rows of an (n, d) array) with weights ``w_j >= 0`` (``W = sum_j w_j``),
a scaling ``z(x) = (x - mu) A`` (see `fit_scaling`; A is the identity for ``scale=None``) and a
bandwidth ``h`` (a scalar or a (d,) vector, in the units of z), the density is::

    p(x) = |det A| * (1 / W) * sum_j w_j N(z(x); z_j, diag(h^2))

so ``log p(x) = log p_z(z(x)) + log|det A|`` (the Jacobian of the scaling). ``scale="covariance"``
with a scalar h reproduces scipy.stats.gaussian_kde (kernel covariance ``h^2 Sigma``);
``scale=None`` reproduces scikit-learn's KernelDensity(kernel="gaussian", bandwidth=h).

Weights
-------
Weights are relative importances, normalised by W. With a fixed or cross-validated bandwidth,
integer weights give exactly the density of the data with repeated rows. The spread-based pieces
(the ``scott``/``silverman`` rules and the ``standardize``/``covariance`` scalings) follow
scipy.stats.gaussian_kde: weighted covariance with ``aweights`` and Kish's effective sample size
``n_eff = W^2 / sum_j w_j^2``, so multiplying all weights by a constant changes nothing (repeating
rows, in contrast, raises n and so shrinks a rule-based bandwidth).

Bandwidth selection by cross-validation
---------------------------------------
`cross_validate_bandwidth` maximises the mean leave-one-out (LOO) log-likelihood::

    L(h) = sum_{i in H} w_i log p_{-i}(x_i) / sum_{i in H} w_i,
    p_{-i}(x_i) = sum_{j != i} w_j N(x_i; x_j, diag(h^2)) / (W - w_i)

over ``log h`` (a scalar, or one per feature for the "diagonal" bandwidth) with L-BFGS-B, the
gradient coming from the engine's VJP. Details that matter:

- Exact duplicates are collapsed into one point carrying the summed weight before anything else,
  and a held-out point leaves out *every* copy of itself. Otherwise a point's twin, at distance 0,
  would reward ``h -> 0`` without limit; with the copies collapsed the LOO likelihood goes to
  -inf as h -> 0 and has an interior maximum. For integer weights this also makes weights and
  repeated rows give the identical objective.
- The self term is removed exactly, not subtracted: held-out points are processed in groups of at
  most 1024; for a group the engine sums over all points *outside* the group (the group's
  weights set to zero) and a small dense block adds the other members of the group with its
  diagonal masked. Subtracting the self term from the full sum instead would cancel
  catastrophically for isolated points, the ones that decide how small h may be, in float32.
- For large n the held-out set H is a random subset of ``cv_subsample`` distinct points (default
  8192), each scored against *all* the other data: an unbiased estimate of the full LOO mean at
  a cost of ``cv_subsample * n`` kernel evaluations per step instead of ``n^2``. The selected
  bandwidth then carries subsampling noise: a few percent for a scalar bandwidth; per-feature
  bandwidths can move further along directions in which the likelihood is nearly flat (at
  almost no cost in likelihood). Raise ``cv_subsample`` (None: every point) to reduce it.
- Start and safeguards: a coarse scan of the common log-scale below Scott's rule (five values,
  from exp(-4.5) to 1 times Scott's bandwidth, forward passes only; Scott's rule is derived for
  a single Gaussian and oversmooths anything else) picks the start, so a multimodal LOO curve is
  not climbed from the wrong side; L-BFGS-B then runs inside bounds of
  exp(-10) to exp(5) times Scott's bandwidth, and the best point seen is returned. Reaching a
  bound raises a warning (typically a feature with few distinct values: ties in one coordinate
  make the LOO likelihood grow without limit as that coordinate's bandwidth shrinks).

Several devices
---------------
Every function that evaluates the engine takes ``mesh=None`` (one device) or a
`jax.sharding.Mesh` (or "all", a device count or a device list; see `scalegp.ops.sharded.as_mesh`)
and ``scheme`` ("allgather" or "ring"): queries are then sharded over the mesh and the data
gathered or passed around a ring (`scalegp.ops.sharded_kde_density`). Cross-validation with a
mesh always takes the grouped path, each group's held-out queries sharded over the devices, so the
objective is the same sum as on one device (equal up to float summation order). With "allgather"
the data are put on every device once for all groups (scheme "replicated" of
`sharded_kde_density`), and the backward pass sums only the bandwidth's gradient across devices.

Precision
---------
Arrays are computed in float64 when every input is float64 and JAX's x64 mode is enabled, in
float32 otherwise (see `compute_dtype`). Spread estimates, scalings and sampling use numpy
float64 throughout. Log-densities are finite for queries far from all data (the engine keeps a
running maximum per query).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.optimize
from jax import lax
from sklearn.exceptions import ConvergenceWarning

from scalegp._validation import (
    as_compute_dtype,
    check_bandwidth,
    check_int,
    check_option,
    check_points,
    check_weights,
)
from scalegp.ops import rbf_kde_density, sharded

__all__ = [
    "BANDWIDTH_RULES",
    "CV_BANDWIDTHS",
    "CVResult",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_CV_SUBSAMPLE",
    "FittedKDE",
    "SCALES",
    "Scaling",
    "collapse_duplicates",
    "compute_dtype",
    "cross_validate_bandwidth",
    "density",
    "effective_sample_size",
    "fit_kde",
    "fit_scaling",
    "log_density",
    "loo_log_density",
    "rule_bandwidth",
    "sample",
    "scott_factor",
    "silverman_factor",
    "weighted_covariance",
]

SCALES = (None, "standardize", "covariance")
BANDWIDTH_RULES = ("scott", "silverman")
CV_BANDWIDTHS = ("cv", "cv-diag")
DEFAULT_BATCH_SIZE = 1 << 16
DEFAULT_CV_SUBSAMPLE = 8192

# Held-out rows times data rows up to which the LOO objective builds one dense (s, n) exponent
# block (4M entries: 32 MB in float64 per copy); above it, the grouped engine path.
_DENSE_LOO_MAX_ENTRIES = 1 << 22
_LOO_GROUP = 1024
# The grouped path's backward pass keeps each group's engine residuals (about n * (d + 2) numbers
# per group) unless the group is recomputed (jax.checkpoint); recompute above this many.
_REMAT_MIN_ELEMENTS = 1 << 26
# Coarse scan of log(h / h_scott) before L-BFGS-B, and the L-BFGS-B bounds around log h_scott.
_SCAN_OFFSETS = np.linspace(-4.5, 0.0, 5)
_LOG_BOUND_BELOW, _LOG_BOUND_ABOVE = 10.0, 5.0
# Finite stand-in for log(0) (as in the engine): exp() of it is exactly 0, and it never turns a
# maximum into -inf, whose differences would give NaN.
_MASK = -0.7 * float(np.finfo(np.float32).max)
_HIGHEST = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------
# dtypes, sizes


def compute_dtype(*arrays) -> type:
    """The dtype KDE arrays are computed in: float64 when every given array is float64 and JAX's
    x64 mode is on (``jax.config.update("jax_enable_x64", True)``), float32 otherwise.

    float32 is the default because it is what accelerators run fast and what JAX uses unless x64
    is enabled; the engine keeps float32 log-densities accurate to about 1e-6 relative.
    """
    x64 = bool(jax.config.jax_enable_x64)
    if x64 and arrays and all(np.asarray(a).dtype == np.float64 for a in arrays if a is not None):
        return np.float64
    return np.float32


def _bucket(n: int) -> int:
    """n rounded up to one of a sparse set of sizes (powers of two up to 32, then multiples of
    1/32 to 1/16 of the next power of two), at most 6.25% larger above 32.

    Arrays are padded to these sizes (zero-weight rows, repeated queries) so that fits and
    queries of slightly different sizes, as in cross-validation folds, reuse one compiled
    program instead of compiling for every n.
    """
    n = int(n)
    if n <= 32:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()
    step = 1 << (n.bit_length() - 5)
    return -(-n // step) * step


def _pad_rows(x: np.ndarray, size: int) -> np.ndarray:
    """x padded to ``size`` rows by repeating its first row (padding rows get zero weight)."""
    extra = size - x.shape[0]
    if extra <= 0:
        return x
    return np.concatenate([x, np.repeat(x[:1], extra, axis=0)])


def _pad_weights(w: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([w, np.zeros(size - w.shape[0], w.dtype)]) if size > w.shape[0] else w


# ----------------------------------------------------------------------------------------------
# spread: effective sample size, covariance, bandwidth rules, scaling


def effective_sample_size(weights, n_samples: int | None = None) -> float:
    """Kish's effective sample size ``(sum w)^2 / sum w^2``; ``n_samples`` when weights is None."""
    if weights is None:
        if n_samples is None:
            raise ValueError("give weights or n_samples")
        return float(n_samples)
    w = np.asarray(weights, dtype=np.float64)
    return float(np.sum(w) ** 2 / np.sum(w**2))


def scott_factor(n_eff: float, d: int) -> float:
    """Scott's rule ``n_eff^(-1/(d+4))``: the bandwidth in units of the data's standard deviation
    (scipy.stats.gaussian_kde's ``scotts_factor``)."""
    return float(n_eff ** (-1.0 / (d + 4)))


def silverman_factor(n_eff: float, d: int) -> float:
    """Silverman's rule ``(n_eff (d + 2) / 4)^(-1/(d+4))`` (scipy's ``silverman_factor``)."""
    return float((n_eff * (d + 2) / 4.0) ** (-1.0 / (d + 4)))


def weighted_covariance(X, weights=None, *, what: str = "this") -> np.ndarray:
    """(d, d) covariance of the rows of X, as ``np.cov(X.T, aweights=weights)`` (unbiased for
    reliability weights: divided by ``W - sum w^2 / W``), in float64.

    Raises ValueError when fewer than 2 samples carry positive weight (``what`` names the setting
    that needed the spread).
    """
    X = np.asarray(X, dtype=np.float64)
    n_positive = X.shape[0] if weights is None else int(np.sum(np.asarray(weights) > 0))
    if n_positive < 2:
        raise ValueError(
            f"{what} needs the spread of the data, which takes at least 2 samples with positive "
            f"weight; got n_samples={n_positive}. Use a float bandwidth and scale=None for a "
            "single sample"
        )
    cov = np.cov(X, rowvar=False, aweights=weights)
    return np.atleast_2d(cov)


def _constant_features(std: np.ndarray, location: np.ndarray) -> np.ndarray:
    """Indices of features whose spread is zero up to rounding of their mean."""
    tiny = 16 * np.finfo(np.float64).eps * np.maximum(np.abs(location), np.finfo(np.float64).tiny)
    return np.flatnonzero(~(std > tiny))


def _raise_constant(features, what: str):
    raise ValueError(
        f"feature(s) {features.tolist()} of the data are constant (zero spread), so {what} cannot "
        "be computed from the spread; drop constant features, or use a float bandwidth with "
        "scale=None"
    )


def rule_bandwidth(X, rule: str = "scott", weights=None) -> np.ndarray:
    """Per-feature rule-of-thumb bandwidth ``factor(n_eff, d) * std_k`` as a float64 (d,) array.

    ``rule`` is "scott" (`scott_factor`) or "silverman" (`silverman_factor`); std_k is the
    weighted standard deviation of feature k (see `weighted_covariance`) and n_eff the effective
    sample size. The bandwidth scales with the data (multiplying a feature by c multiplies its
    bandwidth by c), unlike scikit-learn's KernelDensity rules, which ignore the spread.
    """
    check_option("rule", rule, BANDWIDTH_RULES)
    X = check_points(X)
    w = check_weights(weights, X.shape[0], "weights")
    n, d = X.shape
    cov = weighted_covariance(X, w, what=f"bandwidth={rule!r}")
    std = np.sqrt(np.diag(cov))
    constant = _constant_features(std, np.average(X, axis=0, weights=w))
    if constant.size:
        _raise_constant(constant, f"bandwidth={rule!r}")
    factor = scott_factor if rule == "scott" else silverman_factor
    return factor(effective_sample_size(w, n), d) * std


@dataclasses.dataclass(frozen=True, eq=False)
class Scaling:
    """An affine map of the features, ``z = (x - location) @ matrix``, and its inverse.

    Attributes:
      kind: None, "standardize" or "covariance" (see `fit_scaling`).
      location: (d,) weighted mean (zeros for kind None).
      matrix: (d, d) A in ``z = (x - location) A``: diagonal 1/std for "standardize", the inverse
        transposed Cholesky factor ``L^-T`` of the covariance ``Sigma = L L^T`` for "covariance"
        (so z has identity covariance).
      inverse: (d, d) A^-1, for ``x = z A^-1 + location``.
      log_abs_det: ``log|det A|``, added to log-densities computed in z.
    """

    kind: str | None
    location: np.ndarray
    matrix: np.ndarray
    inverse: np.ndarray
    log_abs_det: float

    def transform(self, X) -> np.ndarray:
        """(n, d) -> (n, d) z, in float64 (X unchanged, same dtype, for kind None)."""
        if self.kind is None:
            return X
        return _rowwise_affine(np.asarray(X, dtype=np.float64) - self.location, self.matrix)

    def inverse_transform(self, Z) -> np.ndarray:
        """(n, d) z -> (n, d) x in float64."""
        Z = np.asarray(Z, dtype=np.float64)
        if self.kind is None:
            return Z
        return _rowwise_affine(Z, self.inverse) + self.location


def _rowwise_affine(X, matrix) -> np.ndarray:
    """``X @ matrix`` for X (n, d), summed over features in a fixed order with elementwise
    operations. A BLAS product picks its kernels (and rounding) by n, so a row's z would depend
    on which rows it is transformed with; here it depends on the row alone, and equal rows give
    bit-identical z."""
    out = X[:, :1] * matrix[0]
    for k in range(1, X.shape[1]):
        out += X[:, k : k + 1] * matrix[k]
    return out


def fit_scaling(X, weights=None, scale: str | None = None) -> Scaling:
    """The `Scaling` for ``scale``: None (identity), "standardize" (per feature: subtract the
    weighted mean, divide by the weighted standard deviation) or "covariance" (full whitening by
    the weighted covariance, as scipy.stats.gaussian_kde does).

    Raises ValueError for constant features ("standardize") and for a singular covariance
    ("covariance": linearly dependent features or fewer samples than features).
    """
    check_option("scale", scale, SCALES)
    X = check_points(X)
    n, d = X.shape
    if scale is None:
        eye = np.eye(d)
        return Scaling(None, np.zeros(d), eye, eye, 0.0)
    w = check_weights(weights, n, "weights")
    cov = weighted_covariance(X, w, what=f"scale={scale!r}")
    location = np.average(X.astype(np.float64), axis=0, weights=w)
    std = np.sqrt(np.diag(cov))
    constant = _constant_features(std, location)
    if constant.size:
        _raise_constant(constant, f"scale={scale!r}")
    if scale == "standardize":
        return Scaling(
            "standardize", location, np.diag(1.0 / std), np.diag(std), float(-np.sum(np.log(std)))
        )
    # Judge singularity on the correlation matrix, so that features of very different units do
    # not make a well-posed problem look singular.
    eigenvalues = np.linalg.eigvalsh(cov / np.outer(std, std))
    if eigenvalues[0] <= 100 * d * np.finfo(np.float64).eps * eigenvalues[-1]:
        rank = int(np.sum(eigenvalues > 100 * d * np.finfo(np.float64).eps * eigenvalues[-1]))
        raise ValueError(
            f"scale='covariance' needs an invertible covariance, but the covariance of the data "
            f"is singular (numerical rank {rank} of {d} features, n_samples={n}): features are "
            "linearly dependent or there are too few samples. Use scale='standardize', or drop "
            "dependent features"
        )
    chol = np.linalg.cholesky(cov)
    matrix = scipy.linalg.solve_triangular(chol, np.eye(d), lower=True).T
    return Scaling(
        "covariance", location, matrix, chol.T.copy(), float(-np.sum(np.log(np.diag(chol))))
    )


# ----------------------------------------------------------------------------------------------
# density


def _engine_log_density(queries, data, bandwidth, weights, impl, mesh, scheme):
    """The engine's log-density, on one device (mesh None) or sharded over ``mesh``."""
    if mesh is None:
        return rbf_kde_density(queries, data, bandwidth, weights, log=True, impl=impl)
    return sharded.sharded_kde_density(queries, data, bandwidth, weights, log=True, mesh=mesh,
                                       scheme=scheme, impl=impl)


@functools.partial(jax.jit, static_argnames=("impl", "mesh", "scheme"))
def _log_density_block(queries, data, bandwidth, weights, impl, mesh=None, scheme="allgather"):
    return _engine_log_density(queries, data, bandwidth, weights, impl, mesh, scheme)


def _check_mesh(mesh, scheme):
    """(Mesh or None, scheme) from the user's settings."""
    check_option("scheme", scheme, sharded.SCHEMES)
    return sharded.as_mesh(mesh), scheme


def _check_bandwidth_value(bandwidth, d: int):
    """A float or a (d,) array of positive, finite bandwidths (no strings here)."""
    return check_bandwidth(bandwidth, (), n_features=d)


def log_density(
    queries, data, bandwidth, weights=None, *, batch_size: int = DEFAULT_BATCH_SIZE, impl="auto",
    mesh=None, scheme="allgather",
) -> np.ndarray:
    """Log of the Gaussian KDE ``p(q) = sum_j w_j N(q; x_j, diag(h^2)) / sum_j w_j`` at each query.

    Args:
      queries: (n_queries, d) points; any number (possibly 0).
      data: (n, d) sample points, n >= 1.
      bandwidth: positive float, or (d,) positive per-feature bandwidths (kernel standard
        deviations).
      weights: optional (n,) non-negative sample weights, not all zero; None for equal weights.
      batch_size: queries per engine call. Queries are processed in batches of this size, so the
        memory in use is O((batch_size + n) d) however many queries there are.
      impl: engine implementation ("auto", "dense", "xla", "pallas"); see `scalegp.ops`.
      mesh, scheme: None for one device, or the devices to shard each batch's queries over and
        how the data reach them (see the module docstring).
    Returns:
      (n_queries,) numpy array of log-densities in the compute dtype (`compute_dtype`), finite
      also far from all data.
    """
    Q = check_points(queries, "queries", min_samples=0)
    X = check_points(data, "data")
    if Q.shape[1] != X.shape[1]:
        raise ValueError(
            f"queries have {Q.shape[1]} features but data has {X.shape[1]}; both need the same "
            "number of features (columns)"
        )
    n, d = X.shape
    w = check_weights(weights, n, "weights")
    h = _check_bandwidth_value(bandwidth, d)
    batch_size = check_int("batch_size", batch_size, 1)
    mesh, scheme = _check_mesh(mesh, scheme)
    dtype = compute_dtype(Q, X)
    if Q.shape[0] == 0:
        return np.zeros(0, dtype)
    Q, X = as_compute_dtype(Q, dtype, "queries"), as_compute_dtype(X, dtype, "data")
    m_pad = _bucket(n)
    data_dev = jnp.asarray(_pad_rows(X, m_pad), dtype)
    w_dev = jnp.asarray(_pad_weights(np.ones(n) if w is None else w, m_pad), dtype)
    h_dev = jnp.asarray(h, dtype)
    out = np.empty(Q.shape[0], dtype)
    for start in range(0, Q.shape[0], batch_size):
        block = Q[start : start + batch_size]
        size = block.shape[0]
        padded = _pad_rows(block, min(_bucket(size), max(batch_size, size)))
        values = _log_density_block(jnp.asarray(padded, dtype), data_dev, h_dev, w_dev, impl,
                                    mesh, scheme)
        out[start : start + size] = np.asarray(values)[:size]
    return out


def density(queries, data, bandwidth, weights=None, **kwargs) -> np.ndarray:
    """``exp(log_density(...))``; see `log_density`. Underflows to 0 far from the data, where
    `log_density` stays finite."""
    return np.exp(log_density(queries, data, bandwidth, weights, **kwargs))


# ----------------------------------------------------------------------------------------------
# leave-one-out likelihood


def collapse_duplicates(X, weights=None, *, drop_zero: bool = False):
    """Exact duplicate rows merged into one row carrying their summed weight.

    Returns ``(unique_rows (u, d), unique_weights (u,) float64, inverse (n,))`` with
    ``X == unique_rows[inverse]`` (``-0.0`` counts as ``0.0``). With ``drop_zero``, rows of zero
    weight are removed first and ``inverse`` is -1 for them.
    """
    X = check_points(X)
    n = X.shape[0]
    w = np.ones(n) if weights is None else check_weights(weights, n, "weights")
    keep = w > 0 if drop_zero else np.ones(n, bool)
    unique, inverse_kept = np.unique(X[keep] + 0.0, axis=0, return_inverse=True)
    inverse_kept = inverse_kept.reshape(-1)
    unique_w = np.bincount(inverse_kept, weights=w[keep], minlength=unique.shape[0])
    inverse = np.full(n, -1, np.int64)
    inverse[keep] = inverse_kept
    return unique, unique_w, inverse


def _log_norm(h, d: int):
    """log of the Gaussian kernel's normalising constant (2 pi)^(-d/2) / prod(h)."""
    log_det = d * jnp.log(h) if h.ndim == 0 else jnp.sum(jnp.log(h))
    return -0.5 * d * math.log(2 * math.pi) - log_det


def _neg_half_sqdist(a, b):
    """``-|a_i - b_j|^2 / 2`` for a (p, d), b (q, d) -> (p, q), as one matrix product after
    centring both sets on the mean of the keys b (which keeps the expansion accurate for offset
    data, and no query moves it; the centre is constant under autodiff: the distances do not
    depend on it)."""
    centre = lax.stop_gradient(jnp.mean(b, axis=0))
    a, b = a - centre, b - centre
    cross = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST)
    e = cross - 0.5 * jnp.sum(a * a, axis=1)[:, None] - 0.5 * jnp.sum(b * b, axis=1)[None, :]
    return jnp.minimum(e, 0.0)


def _masked_log_weights(w):
    positive = w > 0
    return jnp.where(positive, jnp.log(jnp.where(positive, w, 1.0)), _MASK), positive


def _loo_dense(h, data, weights, held_idx):
    """LOO log-densities of rows ``held_idx`` (entries >= u are padding) from one dense block."""
    u, d = data.shape
    total = jnp.sum(weights)
    z = data / h
    e = _neg_half_sqdist(jnp.take(z, held_idx, axis=0, mode="clip"), z)
    log_w, positive = _masked_log_weights(weights)
    leave_out = (held_idx[:, None] == jnp.arange(u)[None, :]) | ~positive[None, :]
    terms = jnp.where(leave_out, _MASK, e + log_w[None, :])
    w_held = jnp.take(weights, held_idx, mode="fill", fill_value=0.0)
    return jax.nn.logsumexp(terms, axis=1) + _log_norm(h, d) - jnp.log(total - w_held)


def _loo_grouped(h, data, weights, held_idx, *, group, impl, remat, mesh=None, scheme="allgather"):
    """LOO log-densities by groups of held-out rows: the engine over the data outside the group,
    plus a dense (group, group) block for the group's other members."""
    u, d = data.shape
    total = jnp.sum(weights)
    if mesh is not None and scheme == "allgather":
        # Every group's keys are the same data with other weights: put them on every device once
        # here, instead of all-gathering them again for each group (forward and backward).
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        data, weights = (lax.with_sharding_constraint(t, replicated) for t in (data, weights))
        scheme = "replicated"

    def one_group(idx):
        valid = idx < u
        q = jnp.take(data, idx, axis=0, mode="clip")
        w_group = jnp.where(valid, jnp.take(weights, idx, mode="clip"), 0.0)
        w_outside = weights.at[idx].set(0.0, mode="drop")
        total_outside = total - jnp.sum(w_group)
        has_outside = total_outside > 0
        # all-zero weights would make the engine divide 0 by 0: use any weights, then discard
        w_engine = jnp.where(has_outside, w_outside, weights)
        # Zero-weight keys (the group, padding) are moved onto the heaviest remaining key. The
        # engine's backward pass forms exp(e_ij - f_i) for every key, which overflows float32
        # for a zero-weight key far closer to query i than the keys that make up f_i (the query
        # itself, at distance 0, whenever its LOO density is below e^-88). On top of a
        # positive-weight key it is bounded by sum(w) / w_anchor instead.
        anchor = data[jnp.argmax(w_engine)]
        keys = jnp.where((w_engine > 0)[:, None], data, anchor[None, :])
        outside = _engine_log_density(q, keys, h, w_engine, impl, mesh, scheme)
        outside = jnp.where(
            has_outside, outside + jnp.log(jnp.where(has_outside, total_outside, 1.0)), _MASK
        )
        e = _neg_half_sqdist(q / h, q / h)
        log_w, positive = _masked_log_weights(w_group)
        leave_out = jnp.eye(idx.shape[0], dtype=bool) | ~positive[None, :]
        inside = jax.nn.logsumexp(jnp.where(leave_out, _MASK, e + log_w[None, :]), axis=1)
        inside = inside + _log_norm(h, d)
        return jnp.logaddexp(outside, inside) - jnp.log(total - w_group)

    if remat:
        one_group = jax.checkpoint(one_group)
    return lax.map(one_group, held_idx.reshape(-1, group)).reshape(-1)


def _loo_values(log_h, data, weights, held_idx, *, group, impl, remat, mesh=None,
                scheme="allgather"):
    h = jnp.exp(log_h)
    if group == 0:
        return _loo_dense(h, data, weights, held_idx)
    return _loo_grouped(h, data, weights, held_idx, group=group, impl=impl, remat=remat,
                        mesh=mesh, scheme=scheme)


def _neg_mean_loo(log_h, data, weights, held_idx, *, group, impl, remat, mesh=None,
                  scheme="allgather"):
    loo = _loo_values(log_h, data, weights, held_idx, group=group, impl=impl, remat=remat,
                      mesh=mesh, scheme=scheme)
    w_held = jnp.take(weights, held_idx, mode="fill", fill_value=0.0)
    return -jnp.sum(w_held * loo) / jnp.sum(w_held)


_STATIC = ("group", "impl", "remat", "mesh", "scheme")
_loo_values_jit = jax.jit(_loo_values, static_argnames=_STATIC)
_neg_mean_loo_jit = jax.jit(_neg_mean_loo, static_argnames=_STATIC)
_neg_mean_loo_value_and_grad = jax.jit(jax.value_and_grad(_neg_mean_loo), static_argnames=_STATIC)


def _loo_problem(unique, unique_w, held, dtype, impl, mesh=None, scheme="allgather"):
    """Device arrays and static settings of the LOO objective for held-out rows ``held`` of the
    collapsed data (rows and held set padded to bucketed sizes; padding has zero weight). With a
    mesh the grouped (engine) path is used at every size: the dense path would run on one
    device."""
    u, d = unique.shape
    s = held.shape[0]
    u_pad = _bucket(u)
    if mesh is None and s * u_pad <= _DENSE_LOO_MAX_ENTRIES:
        group, s_pad = 0, _bucket(s)
    else:
        n_groups = -(-s // _LOO_GROUP)
        group = -(-(-(-s // n_groups)) // 8) * 8
        s_pad = n_groups * group
    remat = group > 0 and (s_pad // group) * u_pad * (d + 2) > _REMAT_MIN_ELEMENTS
    held_pad = np.concatenate([held, np.full(s_pad - s, u_pad, np.int64)])
    arrays = (
        jnp.asarray(_pad_rows(unique, u_pad), dtype),
        jnp.asarray(_pad_weights(unique_w, u_pad), dtype),
        jnp.asarray(held_pad, jnp.int32),
    )
    static = {"group": group, "impl": impl, "remat": bool(remat), "mesh": mesh, "scheme": scheme}
    return arrays, static


def loo_log_density(
    data, bandwidth, weights=None, *, held_out=None, impl="auto", mesh=None, scheme="allgather"
) -> np.ndarray:
    """Leave-one-out log-density ``log p_{-i}(x_i)`` of rows ``held_out`` (default: all rows).

    ``p_{-i}(x_i) = sum_{j ~ i} w_j N(x_i; x_j, diag(h^2)) / sum_{j ~ i} w_j``, where ``j ~ i``
    runs over the rows that are not exact copies of row i:
    every exact duplicate of row i is left out with it (see the module docstring), and the sum
    over the remaining points is formed directly, never by subtracting the self term.

    Args:
      data: (n, d) points; bandwidth: positive float or (d,) array; weights: optional (n,) >= 0.
      held_out: optional integer indices (or a boolean mask) of the rows to evaluate.
      impl, mesh, scheme: engine implementation and devices (see the module docstring).
    Returns:
      (len(held_out),) numpy array in the compute dtype.
    """
    X = check_points(data, "data")
    n, d = X.shape
    w = check_weights(weights, n, "weights")
    h = _check_bandwidth_value(bandwidth, d)
    rows = np.arange(n) if held_out is None else np.arange(n)[np.asarray(held_out)]
    mesh, scheme = _check_mesh(mesh, scheme)
    dtype = compute_dtype(X)
    unique, unique_w, inverse = collapse_duplicates(X, w)
    held_unique, back = np.unique(inverse[rows], return_inverse=True)
    left = unique_w.sum() - unique_w[held_unique]
    if np.any(left <= 0):
        raise ValueError(
            "the leave-one-out density of a point is undefined when it (with its exact "
            "duplicates) carries all the positive weight; the data need at least 2 distinct "
            "points with positive weight"
        )
    arrays, static = _loo_problem(unique, unique_w, held_unique, dtype, impl, mesh, scheme)
    values = _loo_values_jit(jnp.log(jnp.asarray(h, dtype)), *arrays, **static)
    return np.asarray(values)[: held_unique.shape[0]][back.reshape(-1)]


@dataclasses.dataclass(frozen=True, eq=False)
class CVResult:
    """Outcome of `cross_validate_bandwidth`.

    Attributes:
      bandwidth: the selected bandwidth: a float (scalar) or a (d,) array (diagonal), in the units
        of the data that was passed.
      log_likelihood: mean held-out LOO log-likelihood at ``bandwidth`` (in those units).
      initial_bandwidth: Scott's rule per feature, (d,), the centre of the scan and bounds.
      converged: whether L-BFGS-B met its tolerance (or stopped at the float noise floor).
      at_bound: (d,) or (1,) bool, the components that ended on a search bound.
      n_iter: L-BFGS-B iterations; n_evaluations: objective evaluations, scan included.
      n_unique: distinct points after collapsing duplicates (rows of zero weight dropped).
      n_held_out: held-out points in the objective (``min(cv_subsample, n_unique)``).
      message: L-BFGS-B's message.
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


def cross_validate_bandwidth(
    data,
    weights=None,
    *,
    diagonal: bool = False,
    cv_subsample: int | None = DEFAULT_CV_SUBSAMPLE,
    random_state=None,
    max_iter: int = 100,
    impl="auto",
    mesh=None,
    scheme="allgather",
) -> CVResult:
    """Bandwidth maximising the leave-one-out log-likelihood (see the module docstring).

    Args:
      data: (n, d) points, already in the coordinates the bandwidth is for.
      weights: optional (n,) non-negative weights (relative; duplicates are summed).
      diagonal: one bandwidth per feature (True) or one scalar (False).
      cv_subsample: number of distinct points held out in the objective, each scored against all
        the data; None holds out every point (n^2 work per step). Chosen at random (without
        replacement) with ``random_state`` when smaller than the number of distinct points.
      random_state: None, an int, or a numpy Generator/RandomState for the held-out subset.
      max_iter: L-BFGS-B iteration limit.
      impl: engine implementation for the grouped path.
      mesh, scheme: None for one device, or the devices each group's held-out points are sharded
        over and how the data reach them (see the module docstring).
    Returns:
      a `CVResult`; warns (ConvergenceWarning) when L-BFGS-B did not converge or a bound was hit.
    """
    X = check_points(data, "data")
    n, d = X.shape
    w = check_weights(weights, n, "weights")
    cv_subsample = check_int("cv_subsample", cv_subsample, 2, allow_none=True)
    max_iter = check_int("max_iter", max_iter, 1)
    mesh, scheme = _check_mesh(mesh, scheme)
    dtype = compute_dtype(X)
    unique, unique_w, _ = collapse_duplicates(X, w, drop_zero=True)
    u = unique.shape[0]
    if u < 2:
        raise ValueError(
            "bandwidth cross-validation needs at least 2 distinct points with positive weight "
            f"(exact duplicates count once), got {u} (n_samples={n}); use a float bandwidth"
        )
    std = np.sqrt(np.diag(weighted_covariance(unique, unique_w, what="bandwidth cross-validation")))
    constant = _constant_features(std, np.average(unique, axis=0, weights=unique_w))
    if constant.size:
        _raise_constant(constant, "a cross-validated bandwidth")
    initial = scott_factor(effective_sample_size(unique_w), d) * std
    theta0 = np.log(initial) if diagonal else np.array([np.mean(np.log(initial))])

    if cv_subsample is None or cv_subsample >= u:
        held = np.arange(u)
    else:
        held = np.sort(_rng(random_state).choice(u, size=cv_subsample, replace=False))
    arrays, static = _loo_problem(unique, unique_w, held, dtype, impl, mesh, scheme)

    def as_log_h(theta):
        return jnp.asarray(theta if diagonal else theta[0], dtype)

    best = {"f": np.inf, "theta": theta0, "count": 0, "nonfinite": 0}

    def record(f, theta):
        best["count"] += 1
        best["nonfinite"] += not np.isfinite(f)
        if np.isfinite(f) and f < best["f"]:
            best["f"], best["theta"] = f, np.array(theta, dtype=np.float64)

    # coarse scan of the common scale: forward passes only
    for offset in _SCAN_OFFSETS:
        theta = theta0 + offset
        record(float(_neg_mean_loo_jit(as_log_h(theta), *arrays, **static)), theta)
    start = best["theta"].copy()

    def fun(theta):
        value, grad = _neg_mean_loo_value_and_grad(as_log_h(theta), *arrays, **static)
        value, grad = float(value), np.asarray(grad, dtype=np.float64).reshape(theta.shape)
        finite = np.isfinite(value) and np.all(np.isfinite(grad))
        record(value if finite else np.nan, theta)
        if not finite:
            # a huge value makes the line search step back instead of stopping
            return 1e30, np.zeros_like(theta)
        return value, grad

    lower, upper = theta0 - _LOG_BOUND_BELOW, theta0 + _LOG_BOUND_ABOVE
    eps = float(np.finfo(dtype).eps)
    result = scipy.optimize.minimize(
        fun,
        start,
        jac=True,
        method="L-BFGS-B",
        bounds=list(zip(lower, upper)),
        options={"maxiter": max_iter, "ftol": max(4 * eps, 1e-12), "gtol": 1e-6},
    )
    theta = best["theta"]
    # Stopping because the line search hit float rounding (float32: ~1e-7 relative in the
    # objective) with a small gradient is convergence for our purpose.
    converged = best["nonfinite"] == 0 and (
        bool(result.success)
        or ("ABNORMAL" in str(result.message) and np.max(np.abs(result.jac)) < 1e-3)
    )
    at_bound = (theta - lower < 1e-6) | (upper - theta < 1e-6)
    if not converged:
        warnings.warn(
            f"bandwidth cross-validation did not converge ({result.message}; "
            f"{best['nonfinite']} non-finite objective evaluations); the best bandwidth seen is "
            "returned. Raise max_iter, or use float64 data with JAX x64 enabled",
            ConvergenceWarning,
            stacklevel=2,
        )
    if at_bound.any():
        which = np.flatnonzero(at_bound).tolist() if diagonal else "all"
        warnings.warn(
            f"the cross-validated bandwidth stopped at a search bound (features: {which}; bounds "
            f"exp(-{_LOG_BOUND_BELOW:g}) to exp({_LOG_BOUND_ABOVE:g}) times Scott's rule). This "
            "usually means a feature takes few distinct values (ties in one coordinate reward an "
            "ever smaller bandwidth); consider a rule ('scott') or jittering discrete features",
            ConvergenceWarning,
            stacklevel=2,
        )
    bandwidth = np.exp(theta) if diagonal else float(np.exp(theta[0]))
    return CVResult(
        bandwidth=bandwidth,
        log_likelihood=-float(best["f"]),
        initial_bandwidth=initial,
        converged=converged,
        at_bound=at_bound,
        n_iter=int(result.nit),
        n_evaluations=int(best["count"]),
        n_unique=int(u),
        n_held_out=int(held.shape[0]),
        message=str(result.message),
    )


# ----------------------------------------------------------------------------------------------
# sampling


def _rng(random_state):
    """A numpy Generator or RandomState (both have choice and standard_normal)."""
    if isinstance(random_state, (np.random.Generator, np.random.RandomState)):
        return random_state
    return np.random.default_rng(random_state)


def sample(data, bandwidth, n_samples: int = 1, weights=None, random_state=None) -> np.ndarray:
    """Draws from the KDE: pick row j with probability ``w_j / W``, add ``h * N(0, I)``.

    Drawn as scikit-learn's KernelDensity does (one uniform u per draw; the row is
    ``floor(u n)`` without weights, else the first whose cumulative weight reaches ``u W``; then
    the normals), so that for a given seed constant weights draw exactly as no weights, and
    integer weights exactly as the rows repeated.

    Args:
      data: (n, d) points; bandwidth: float or (d,); weights: optional (n,) >= 0.
      n_samples: number of draws (>= 0).
      random_state: None, an int seed, or a numpy Generator/RandomState (reproducible with a seed).
    Returns:
      (n_samples, d) float64 array.
    """
    X = check_points(data, "data").astype(np.float64)
    n, d = X.shape
    w = check_weights(weights, n, "weights")
    h = _check_bandwidth_value(bandwidth, d)
    n_samples = check_int("n_samples", n_samples, 0)
    rng = _rng(random_state)
    u = rng.uniform(0.0, 1.0, size=n_samples)
    if w is None:
        rows = (u * n).astype(np.int64)
    else:
        cumulative = np.cumsum(w)
        # a zero-weight tail makes several rows end at the total: the first of them is drawn
        rows = np.minimum(np.searchsorted(cumulative, u * cumulative[-1]), n - 1)
    return rng.normal(X[rows], np.asarray(h, dtype=np.float64))


# ----------------------------------------------------------------------------------------------
# a fitted KDE


@dataclasses.dataclass(frozen=True, eq=False)
class FittedKDE:
    """A fitted Gaussian KDE: the scaled data, weights, bandwidth and scaling (see `fit_kde`).

    Attributes:
      data: (n, d) the training data in scaled coordinates z, in the compute dtype.
      weights: (n,) float64 weights, or None for equal weights.
      bandwidth: float or (d,) float64 array, in scaled coordinates.
      scaling: the `Scaling` from raw features x to z.
      cv_result: the `CVResult` for a cross-validated bandwidth, else None.
    """

    data: np.ndarray
    weights: np.ndarray | None
    bandwidth: float | np.ndarray
    scaling: Scaling
    cv_result: CVResult | None = None

    @property
    def n_features(self) -> int:
        return self.data.shape[1]

    def log_density(
        self, X, *, batch_size: int = DEFAULT_BATCH_SIZE, impl="auto", mesh=None,
        scheme="allgather",
    ) -> np.ndarray:
        """(n_queries, d) raw points -> (n_queries,) log p(x), Jacobian of the scaling included."""
        X = check_points(X, "X", min_samples=0)
        if X.shape[1] != self.n_features:
            raise ValueError(
                f"X has {X.shape[1]} features, but the KDE was fitted on {self.n_features}"
            )
        Z = as_compute_dtype(self.scaling.transform(X), self.data.dtype)
        values = log_density(
            Z, self.data, self.bandwidth, self.weights, batch_size=batch_size, impl=impl,
            mesh=mesh, scheme=scheme,
        )
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
    cv_result = None
    if isinstance(bandwidth, str) and bandwidth in BANDWIDTH_RULES:
        if scale is None:
            bandwidth = rule_bandwidth(X, bandwidth, w)
        else:
            factor = scott_factor if bandwidth == "scott" else silverman_factor
            bandwidth = factor(effective_sample_size(w, n), d)
    elif isinstance(bandwidth, str):
        # collapse duplicates in raw coordinates: the scaling need not map equal rows to
        # bit-identical rows, and near-twins would act like the duplicates CV must ignore
        unique, unique_w, _ = collapse_duplicates(X, w, drop_zero=True)
        Zu = np.asarray(scaling.transform(unique)).astype(dtype, copy=False)
        cv_result = cross_validate_bandwidth(
            Zu,
            unique_w,
            diagonal=bandwidth == "cv-diag",
            cv_subsample=cv_subsample,
            random_state=random_state,
            max_iter=max_iter,
            impl=impl,
            mesh=mesh,
            scheme=scheme,
        )
        bandwidth = cv_result.bandwidth
    return FittedKDE(data=Z, weights=w, bandwidth=bandwidth, scaling=scaling, cv_result=cv_result)
