"""Log-densities of a weighted Gaussian KDE at any number of queries, in batches on the engine."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from scalegp._validation import (
    as_compute_dtype,
    check_bandwidth,
    check_int,
    check_points,
    check_weights,
)
from scalegp.ops import Engine, host_centre_of, spatial_order

DEFAULT_BATCH_SIZE = 1 << 16


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


def bucket_size(n: int) -> int:
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


def pad_rows(x: np.ndarray, size: int) -> np.ndarray:
    """x padded to ``size`` rows by repeating its last row (padding rows get zero weight; next
    to the last row, they do not widen the last tile of a pruned product)."""
    extra = size - x.shape[0]
    if extra <= 0:
        return x
    return np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])


def pad_weights(w: np.ndarray, size: int, dtype) -> np.ndarray:
    """Weights (as `check_weights` returns them) relative to the largest, in ``dtype``, padded
    with zeros to ``size``. Relative to the largest, w and c w round to the same float32 numbers
    (a power-of-two scaling would not), so they give the same densities and cross-validated
    bandwidth. A ratio below ``dtype``'s smallest normal number (1.2e-38 in float32), which the
    engine would flush to zero, is set to zero with a RuntimeWarning."""
    w = w / w.max()
    lost = (w > 0) & (w < np.finfo(dtype).tiny)
    if lost.any():
        warnings.warn(
            f"{int(lost.sum())} weight(s) are below {np.finfo(dtype).tiny:.3g} times the largest "
            f"weight, the smallest ratio {np.dtype(dtype).name} holds, and count as zero; compute "
            "in float64 (float64 data with jax.config.update(\"jax_enable_x64\", True)) to keep "
            "them",
            RuntimeWarning,
            stacklevel=3,
        )
        w = np.where(lost, 0.0, w)
    out = np.zeros(max(size, w.shape[0]), dtype)
    out[: w.shape[0]] = w
    return out


@functools.partial(jax.jit, static_argnames=("engine",))
def _log_density_block(queries, data, bandwidth, weights, engine):
    return engine.kde_log_density(queries, data, bandwidth, weights)


def check_bandwidth_value(bandwidth, d: int):
    """A float or a (d,) array of positive, finite bandwidths (no strings here)."""
    return check_bandwidth(bandwidth, (), n_features=d)


def log_density(
    queries, data, bandwidth, weights=None, *, batch_size: int = DEFAULT_BATCH_SIZE, impl="auto",
    mesh=None, scheme="allgather", prune="auto", prune_tol=None, data_order=None, planned=None,
) -> np.ndarray:
    """Log of the Gaussian KDE ``p(q) = sum_j w_j N(q; x_j, diag(h^2)) / sum_j w_j`` at each query.

    The user-level entry: the arguments are checked and one `scalegp.ops.Engine` built from
    ``impl``, ``mesh``, ``scheme``, ``prune`` and ``prune_tol``; the evaluation itself is
    `engine_log_density`.

    Args:
      queries: (n_queries, d) points; any number (possibly 0).
      data: (n, d) sample points, n >= 1.
      bandwidth: positive float, or (d,) positive per-feature bandwidths (kernel standard
        deviations).
      weights: optional (n,) non-negative sample weights, not all zero; None for equal weights.
      batch_size: queries per engine call. Queries are processed in batches of this size, so the
        memory in use is O((batch_size + n) d) however many queries there are.
      impl: engine implementation ("auto", "dense", "xla", "triton", "pallas"); see `scalegp.ops`.
      mesh, scheme: None for one device, or the devices to shard each batch's queries over and
        how the data reach them (see the module docstring).
      prune, prune_tol: skip the data tiles that cannot matter to a batch of queries, each
        query's skipped mass at most ``prune_tol`` times its density (see
        `scalegp.ops.rbf_kde_density`); where pruning may pay the data are put in
        `scalegp.ops.spatial_order`, by ``data_order`` or, without it, once per call.
      data_order: optional (n,) permutation of the data's rows into `scalegp.ops.spatial_order`
        (as `fit_kde` stores it), so that pruned calls skip sorting the data; ignored when
        pruning cannot pay. Any permutation gives the same densities; the order only decides
        how much pruning skips.
      planned: optional `scalegp.ops.Engine.planned_kde` of these data (in the compute dtype),
        weights and (the ratios of) this bandwidth, as `fit_kde` stores it: where the engine
        scores on it (`scalegp.ops.Engine.scores_planned`), each batch is scored on the
        host-planned pruned path against the ordered data and their tile tree (nothing is
        sorted but the batch), with the same bound on each query's skipped mass; queries
        equal to the data are scored in the data's own tiles (`PlannedDensity.log_density`
        without queries, ``batch_size`` rows per plan). Otherwise ignored.
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
    h = check_bandwidth_value(bandwidth, d)
    batch_size = check_int("batch_size", batch_size, 1)
    engine = Engine.create(impl, mesh, scheme, prune=prune, prune_tol=prune_tol)
    if data_order is not None and engine.orders_keys(n, d, compute_dtype(Q, X)):
        data_order = _check_order(data_order, n)
    return engine_log_density(engine, Q, X, h, w, batch_size=batch_size, data_order=data_order,
                              planned=planned)


def engine_log_density(engine: Engine, Q, X, h, w, *, batch_size: int, data_order=None,
                       planned=None, planned_rows=None) -> np.ndarray:
    """`log_density` on ``engine`` for a caller that checked the rest: Q (n_queries, d) and X
    (n, d) finite float arrays, ``h`` and ``w`` as `check_bandwidth_value` and `check_weights`
    return them, ``data_order`` a permutation of X's rows or None. ``planned_rows``: where
    ``planned`` was built on X's rows in another order (`fit_kde` reuses the
    cross-validation's, built on the rows in theirs), X's row of each of its rows; it places
    the data's own values (None: ``planned`` was built on X)."""
    n, d = X.shape
    dtype = compute_dtype(Q, X)
    if Q.shape[0] == 0:
        return np.zeros(0, dtype)
    if planned is not None and X.dtype == dtype and engine.scores_planned(n, d, dtype):
        Q = as_compute_dtype(Q, dtype, "queries")
        if Q.shape == X.shape and np.array_equal(Q, X):  # the data themselves, in their tiles
            own = np.asarray(engine.kde_planned_log_density(planned, None, h, batch_size), dtype)
            if planned_rows is None:
                return own
            values = np.empty_like(own)
            values[planned_rows] = own
            return values
        return _batches(Q, batch_size, dtype,
                        lambda block: engine.kde_planned_log_density(planned, block, h))
    if engine.orders_keys(n, d, dtype):
        order = spatial_order(X, h) if data_order is None else data_order
        X, w = X[order], None if w is None else w[order]
        engine = dataclasses.replace(engine, keys_in_order=True)
    if np.dtype(dtype).itemsize < max(Q.dtype.itemsize, X.dtype.itemsize):
        # the compute dtype rounds the inputs: centre them first, in their own precision, or
        # data far from the origin lose their digits (float32 spaces numbers 0.06 apart at
        # 1e6); on the median, which one far outlier does not move
        centre = host_centre_of(X).astype(X.dtype)  # one of X's numbers: exact
        Q, X = Q - centre, X - centre
    Q, X = as_compute_dtype(Q, dtype, "queries"), as_compute_dtype(X, dtype, "data")
    m_pad = bucket_size(n)
    data_dev = jnp.asarray(pad_rows(X, m_pad), dtype)
    w_dev = jnp.asarray(pad_weights(np.ones(n) if w is None else w, m_pad, dtype))
    h_dev = jnp.asarray(h, dtype)
    return _batches(Q, batch_size, dtype, lambda block: _log_density_block(
        block, data_dev, h_dev, w_dev, engine))


def _batches(Q, batch_size: int, dtype, score) -> np.ndarray:
    """``score(block)`` (padded (k, d) device queries -> (k,)) over the rows of Q in batches of
    ``batch_size``, each padded to a `bucket_size` (one compilation for most batches)."""
    out = np.empty(Q.shape[0], dtype)
    for start in range(0, Q.shape[0], batch_size):
        block = Q[start : start + batch_size]
        size = block.shape[0]
        padded = pad_rows(block, min(bucket_size(size), max(batch_size, size)))
        out[start : start + size] = np.asarray(score(jnp.asarray(padded, dtype)))[:size]
    return out


def _check_order(order, n: int) -> np.ndarray:
    order = np.asarray(order)
    if order.shape != (n,) or order.dtype.kind not in "iu":
        raise ValueError(f"data_order must be an integer array of shape ({n},) (a permutation of "
                         f"the data's rows), got {order.dtype} of shape {order.shape}")
    if not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError(f"data_order must be a permutation of 0, ..., {n - 1} (each row once); "
                         "a repeated or missing row would change the density")
    return order


def density(queries, data, bandwidth, weights=None, **kwargs) -> np.ndarray:
    """``exp(log_density(...))``; see `log_density`. Underflows to 0 far from the data, where
    `log_density` stays finite."""
    return np.exp(log_density(queries, data, bandwidth, weights, **kwargs))
