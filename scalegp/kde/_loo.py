"""The leave-one-out log-likelihood of a KDE: exact self-exclusion, duplicates left out together,
held-out points in groups on the engine (see the package docstring)."""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp._validation import check_points, check_weights
from scalegp.kde._density import (
    bucket_size,
    check_bandwidth_value,
    compute_dtype,
    pad_rows,
    pad_weights,
)
from scalegp.ops import (
    MASK_VALUE,
    Engine,
    gaussian_log_norm,
    log_weights,
    spatial_order,
    sq_differences,
)

# Held-out rows times data rows up to which the LOO objective builds one dense (s, n) exponent
# block (4M entries: 32 MB in float64 per copy); above it, the grouped engine path.
_DENSE_LOO_MAX_ENTRIES = 1 << 22
_LOO_GROUP = 1024
# The step in log h of the grouped objective's per-row derivatives (central differences).
_ROW_STEP = 0.05
# The grouped path's backward pass keeps each group's engine residuals (about n * (d + 2) numbers
# per group) unless the group is recomputed (jax.checkpoint); recompute above this many.
_REMAT_MIN_ELEMENTS = 1 << 26


def collapse_duplicates(X, weights=None, *, drop_zero: bool = False):
    """Exact duplicate rows merged into one row carrying their summed weight.

    Returns ``(unique_rows (u, d), unique_weights (u,) float64, inverse (n,))`` with
    ``X == unique_rows[inverse]`` (``-0.0`` counts as ``0.0``), the rows in lexicographic order.
    With ``drop_zero``, rows of zero weight are removed first and ``inverse`` is -1 for them.
    X (n, d) and ``weights`` (n,) or None come checked (`check_points`, `check_weights`) from the
    caller: the public function that took them (each collapses once).
    """
    n = X.shape[0]
    assert X.ndim == 2 and (weights is None or weights.shape == (n,))
    w = np.ones(n) if weights is None else weights
    keep = w > 0 if drop_zero else np.ones(n, bool)
    unique, inverse_kept = _unique_rows(X[keep] + 0.0)
    unique_w = np.bincount(inverse_kept, weights=w[keep], minlength=unique.shape[0])
    inverse = np.full(n, -1, np.int64)
    inverse[keep] = inverse_kept
    return unique, unique_w, inverse


def _unique_rows(X):
    """``np.unique(X, axis=0, return_inverse=True)`` (rows in lexicographic order), by one sort
    of integer keys (`_row_keys`) where the rows fit in 64 bits, else by a lexicographic sort of
    the columns: np.unique sorts the rows as records, slower than the columns' sort, which is
    slower than the keys' (numpy's integer argsort is vectorised; docs/decisions.md #62).
    ``-0.0`` must have become ``0.0`` (the caller adds 0.0)."""
    if X.shape[0] == 0:
        return X, np.zeros(0, np.int64)
    keys = _row_keys(X)
    if keys is None:
        order = np.lexsort(X.T[::-1])
        ordered = X[order]
        new = np.ones(X.shape[0], bool)
        new[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    else:
        order = np.argsort(keys)  # equal keys are equal rows: their order is immaterial
        ordered, keys = X[order], keys[order]
        new = np.ones(X.shape[0], bool)
        new[1:] = keys[1:] != keys[:-1]
    inverse = np.empty(X.shape[0], np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def _row_keys(X):
    """(n,) uint64 keys in the rows' lexicographic order, equal exactly for equal rows, where a
    row's bits fit in 64 (one or two float32 features, one float64); else None. Each feature's
    bits are mapped to an unsigned integer of the same order as the float (the sign bit set on
    positives, every bit flipped on negatives), the first feature in the highest bits."""
    bits = 8 * X.dtype.itemsize
    if X.dtype.kind != "f" or X.shape[1] * bits > 64:
        return None
    unsigned = np.dtype(f"uint{bits}")
    sign = unsigned.type(1 << (bits - 1))
    keys = np.zeros(X.shape[0], np.uint64)
    for column in X.T:
        u = np.ascontiguousarray(column).view(unsigned)
        ordered = np.where(u & sign, ~u, u | sign).astype(np.uint64)
        keys = (keys << np.uint64(bits)) | ordered if bits < 64 else ordered
    return keys


def _log_kernel_block(x1, x2, h):
    """The exponents ``-1/2 sum_d ((x1_id - x2_jd) / h_d)^2``, (n, m), by ops' coordinate
    differences (`scalegp.ops.sq_differences`): the expansion ``|a|² + |b|² - 2 a·b`` rounds at
    the points' squared norms, hundreds of bandwidths at a narrow one: more than the
    objective's own differences between nearby bandwidths. Not `rbf_log_kernel_matrix`, which
    centres and checks its points on every call: these blocks are the objective's inner loop,
    on points the caller prepared once."""
    return -0.5 * sq_differences(x1, x2, jnp.broadcast_to(1 / h, (x1.shape[1],)),
                                 reverse_only=True)


def _loo_dense(h, data, weights, held_idx):
    """LOO log-densities of rows ``held_idx`` (entries >= u are padding) from one dense block."""
    u, d = data.shape
    total = jnp.sum(weights)
    e = _log_kernel_block(jnp.take(data, held_idx, axis=0, mode="clip"), data, h)
    leave_out = (held_idx[:, None] == jnp.arange(u)[None, :]) | ~(weights > 0)[None, :]
    terms = jnp.where(leave_out, MASK_VALUE, e + log_weights(weights)[None, :])
    w_held = jnp.take(weights, held_idx, mode="fill", fill_value=0.0)
    return jax.nn.logsumexp(terms, axis=1) + gaussian_log_norm(h, d) - jnp.log(total - w_held)


def _loo_grouped(h, data, weights, held_idx, *, group, remat, engine):
    """LOO log-densities by groups of held-out rows: the engine over the data outside the group,
    plus a dense (group, group) block for the group's other members."""
    u, d = data.shape
    total = jnp.sum(weights)
    if engine.mesh is not None and engine.scheme == "allgather":
        # Every group's keys are the same data with other weights: put them on every device once
        # here, instead of all-gathering them again for each group (forward and backward).
        replicated = jax.sharding.NamedSharding(engine.mesh, jax.sharding.PartitionSpec())
        data, weights = (lax.with_sharding_constraint(t, replicated) for t in (data, weights))
        engine = dataclasses.replace(engine, scheme="replicated")

    def one_group(idx):
        valid = idx < u
        q = jnp.take(data, idx, axis=0, mode="clip")
        w_group = jnp.where(valid, jnp.take(weights, idx, mode="clip"), 0.0)
        w_outside = weights.at[idx].set(0.0, mode="drop")
        total_outside = total - jnp.sum(w_group)
        has_outside = total_outside > 0
        # all-zero weights would make the engine divide 0 by 0: use any weights, then discard
        w_engine = jnp.where(has_outside, w_outside, weights)
        # Zero-weight keys (the group, padding) are moved onto a positive-weight key. The
        # engine's backward pass forms exp(e_ij - f_i) for every key, which overflows float32
        # for a zero-weight key far closer to query i than the keys that make up f_i (the query
        # itself, at distance 0, whenever its LOO density is below e^-88). On top of a
        # positive-weight key it is bounded by sum(w) / w_anchor instead. The anchor is the
        # heaviest key, or, for keys in spatial order (pruning), the nearest positive-weight
        # key in that order, which keeps every tile's box tight.
        keys = jnp.where((w_engine > 0)[:, None], data, _anchors(data, w_engine,
                                                                  engine.keys_in_order))
        outside = engine.kde_log_density(q, keys, h, w_engine)
        outside = jnp.where(
            has_outside, outside + jnp.log(jnp.where(has_outside, total_outside, 1.0)), MASK_VALUE
        )
        e = _log_kernel_block(q, q, h)
        leave_out = jnp.eye(idx.shape[0], dtype=bool) | ~(w_group > 0)[None, :]
        terms = jnp.where(leave_out, MASK_VALUE, e + log_weights(w_group)[None, :])
        inside = jax.nn.logsumexp(terms, axis=1)
        inside = inside + gaussian_log_norm(h, d)
        return jnp.logaddexp(outside, inside) - jnp.log(total - w_group)

    if remat:
        one_group = jax.checkpoint(one_group)
    return lax.map(one_group, held_idx.reshape(-1, group)).reshape(-1)


def _anchors(data, weights, in_order: bool):
    """For each key, a positive-weight key to stand on (see `_loo_grouped`): (u, d)."""
    if not in_order:
        return data[jnp.argmax(weights)][None, :]
    u = weights.shape[0]
    position = jnp.arange(u)
    before = _running(jnp.where(weights > 0, position, -1), -1, maximum=True)
    after = _running(jnp.where(weights > 0, position, u), u, maximum=False, reverse=True)
    return data[jnp.where(before >= 0, before, jnp.minimum(after, u - 1))]


def _running(x, identity, *, maximum: bool, reverse=False, block=1024):
    """`lax.cummax` (``maximum``) or `lax.cummin` of a 1-D array, in rows of ``block``: each
    row's own, then the rows' carries (recursively). XLA lowers a cumulative reduction for a
    TPU to one window the length of the axis, whose compilation grows with it: at a million
    keys it outweighed the rest of the cross-validation's programs; rows of 1024 do not
    (docs/decisions.md #51). ``identity``: the value that changes nothing (the padding)."""
    cumulative, combine = (lax.cummax, jnp.maximum) if maximum else (lax.cummin, jnp.minimum)
    n = x.shape[0]
    if n <= block:
        return cumulative(x, reverse=reverse)
    rows = -(-n // block)
    within = cumulative(jnp.pad(x, (0, rows * block - n), constant_values=identity)
                        .reshape(rows, block), axis=1, reverse=reverse)
    carried = _running(within[:, 0] if reverse else within[:, -1], identity, maximum=maximum,
                       reverse=reverse, block=block)
    fill = jnp.full((1,), identity, x.dtype)
    # each row's carry from the rows before it (after it, reversed)
    prior = (jnp.concatenate([carried[1:], fill]) if reverse
             else jnp.concatenate([fill, carried[:-1]]))
    return combine(within, prior[:, None]).reshape(-1)[:n]


def _loo_values(log_h, data, weights, held_idx, *, group, remat, engine):
    h = jnp.exp(log_h)
    if group == 0:
        return _loo_dense(h, data, weights, held_idx)
    return _loo_grouped(h, data, weights, held_idx, group=group, remat=remat, engine=engine)


def _neg_mean_loo(log_h, data, weights, held_idx, *, group, remat, engine):
    loo = _loo_values(log_h, data, weights, held_idx, group=group, remat=remat, engine=engine)
    w_held = jnp.take(weights, held_idx, mode="fill", fill_value=0.0)
    return -jnp.sum(w_held * loo) / jnp.sum(w_held)


_STATIC = ("group", "remat", "engine")
_loo_values_jit = jax.jit(_loo_values, static_argnames=_STATIC)
#: The objective of bandwidth cross-validation, ``-(weighted mean held-out LOO log-density)`` as
#: a function of log h, with its gradient; arguments from `loo_problem`. (Its value alone is
#: the mean of `_loo_values_jit`'s rows: `GroupedObjective`.)
neg_mean_loo_value_and_grad = jax.jit(jax.value_and_grad(_neg_mean_loo), static_argnames=_STATIC)


def loo_is_dense(u: int, s: int, engine: Engine) -> bool:
    """Whether the LOO objective of ``s`` held-out rows among ``u`` takes one dense block: on
    one device, up to `_DENSE_LOO_MAX_ENTRIES` pairs (padded)."""
    return engine.mesh is None and s * bucket_size(u) <= _DENSE_LOO_MAX_ENTRIES


def loo_problem(unique, unique_w, held, dtype, engine: Engine, slots: int | None = None):
    """Device arrays and static settings of the LOO objective for held-out rows ``held`` of the
    collapsed data (rows and held set padded to bucketed sizes; padding has zero weight). With a
    mesh the grouped (engine) path is used at every size: the dense path would run on one
    device. ``slots``: size the held set as if it had that many rows (at least ``len(held)``),
    so that a subset of an earlier held set runs that set's compiled programs."""
    u, d = unique.shape
    u_pad, s_pad, static = loo_layout(u, d, held.shape[0] if slots is None else slots, engine)
    held_pad = np.concatenate([held, np.full(s_pad - held.shape[0], u_pad, np.int64)])
    arrays = (
        jnp.asarray(pad_rows(unique, u_pad), dtype),
        jnp.asarray(pad_weights(unique_w, u_pad, dtype)),
        jnp.asarray(held_pad, jnp.int32),
    )
    return arrays, static


def loo_layout(u: int, d: int, s: int, engine: Engine):
    """The shapes of `loo_problem` for ``s`` held-out rows among ``u`` points of ``d``
    features, from the sizes alone: ``(u_pad, s_pad, static)``, the padded rows and held set
    and the objective's static settings (a dense block, ``group`` 0, or groups of at most
    `_LOO_GROUP` held-out rows, recomputed in the backward pass above `_REMAT_MIN_ELEMENTS`)."""
    u_pad = bucket_size(u)
    if loo_is_dense(u, s, engine):
        group, s_pad = 0, bucket_size(s)
    else:
        n_groups = -(-s // _LOO_GROUP)
        group = -(-(-(-s // n_groups)) // 8) * 8
        s_pad = n_groups * group
    remat = group > 0 and (s_pad // group) * u_pad * (d + 2) > _REMAT_MIN_ELEMENTS
    return u_pad, s_pad, {"group": group, "remat": bool(remat), "engine": engine}


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
    h = check_bandwidth_value(bandwidth, d)
    rows = np.arange(n) if held_out is None else np.arange(n)[np.asarray(held_out)]
    engine = Engine.create(impl, mesh, scheme)
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
    arrays, static = loo_problem(unique, unique_w, held_unique, dtype, engine)
    values = _loo_values_jit(jnp.log(jnp.asarray(h, dtype)), *arrays, **static)
    return np.asarray(values)[: held_unique.shape[0]][back.reshape(-1)]


class GroupedObjective:
    """``objective(theta, with_grad) -> (value, grad or None)`` on the engine's LOO program
    (`loo_problem`: a dense block, or groups of held-out rows, differentiated by the engine's
    VJP); the data put in `spatial_order` first where the engine may prune them. ``held``:
    the held-out rows (collapsed indices), in the order `rows` gives them."""

    curvature = False
    _KEPT_VALUES = 8  # forward evaluations whose per-row values `values` keeps

    def __init__(self, unique, unique_w, held, initial, diagonal, dtype, engine):
        self.diagonal, self.dtype, self.position = diagonal, dtype, None
        if engine.orders_keys(*unique.shape, dtype):
            order = spatial_order(unique, initial)
            unique, unique_w = unique[order], unique_w[order]
            self.position = np.argsort(order)
            engine = dataclasses.replace(engine, keys_in_order=True)
        self.data, self.weights, self.engine = unique, unique_w, engine
        self.slots = held.shape[0]
        self._hold(held)

    def _hold(self, held):
        at = held if self.position is None else self.position[held]
        sort = np.argsort(at, kind="stable")
        self.held, self._values = held[sort], {}
        self.w_held = self.weights[at[sort]] / np.sum(self.weights[at[sort]])
        self.arrays, self.static = loo_problem(self.data, self.weights, at[sort], self.dtype,
                                               self.engine, self.slots)

    def restricted(self, held) -> "GroupedObjective":
        """This objective over the held-out rows ``held`` (collapsed indices) only."""
        other = copy.copy(self)
        other._hold(held)
        return other

    def _log_h(self, theta, shift=0.0):
        return jnp.asarray((theta if self.diagonal else theta[0]) + shift, self.dtype)

    def __call__(self, theta, with_grad):
        if with_grad:
            value, grad = neg_mean_loo_value_and_grad(self._log_h(theta), *self.arrays,
                                                      **self.static)
            return float(value), np.asarray(grad, dtype=np.float64).reshape(theta.shape)
        # the mean of the rows' values (kept for `rows`), not a program of its own
        return -float(self.w_held @ self.values(theta)), None

    def values(self, theta, shift=0.0) -> np.ndarray:
        """Per held-out row, ``log p_{-i}(x_i)`` at ``theta`` (plus ``shift`` in log h)."""
        log_h = self._log_h(theta, shift)
        key = np.asarray(log_h).tobytes()
        if key not in self._values:
            self._values[key] = np.asarray(_loo_values_jit(log_h, *self.arrays, **self.static),
                                           np.float64)[: self.held.shape[0]]
            while len(self._values) > self._KEPT_VALUES:
                del self._values[next(iter(self._values))]
        return self._values[key]

    def rows(self, theta):
        """Per held-out row: ``log p_{-i}(x_i)`` at ``theta`` and its first and negated second
        derivatives in the common log-scale (central differences, step `_ROW_STEP`)."""
        low, mid, high = (self.values(theta, k * _ROW_STEP) for k in (-1, 0, 1))
        with np.errstate(invalid="ignore"):
            return mid, (high - low) / (2 * _ROW_STEP), -(high - 2 * mid + low) / _ROW_STEP**2


class PlannedObjective:
    """The same objective on the host-planned pruned path (`scalegp.ops.Engine.planned_loo`):
    the data ordered and their tile tree built once here, then per evaluation one plan and two
    compiled passes, with the gradient (and, for the scalar bandwidth, the second derivative)
    from the forward pass's moments (no backward pass). ``planned``: the data's
    `scalegp.ops.PlannedDensity`, kept for scoring (`scalegp.kde.FittedKDE.planned`)."""

    curvature = True
    _KEPT_ROWS = 8  # evaluations whose per-row values `rows` keeps

    def __init__(self, unique, unique_w, held, initial, diagonal, dtype, engine):
        self.planned = engine.planned_loo(np.asarray(unique, dtype), unique_w, initial)
        self.diagonal, self.dtype, self.tol = diagonal, dtype, engine.prune_tol
        self.unique_w = unique_w
        self._hold(held)

    def _hold(self, held):
        self.held, self.w_held = held, self.unique_w[held] / np.sum(self.unique_w[held])
        self._rows = {}

    def restricted(self, held) -> "PlannedObjective":
        """This objective over the held-out rows ``held`` only (the same tree)."""
        other = copy.copy(self)
        other._hold(held)
        return other

    def _log_h(self, theta):
        return np.asarray(theta if self.diagonal else theta[0], self.dtype)  # as grouped

    def __call__(self, theta, with_grad, with_curvature=False):
        """``(value, grad or None)``, or with ``with_curvature`` (scalar bandwidth)
        ``(value, grad, second derivative)`` of the negated mean in log h."""
        values, grads, second = self._pass(self._log_h(theta))
        value = -float(self.w_held @ values)
        if not with_grad:
            return value, None
        grad = -(self.w_held @ grads)
        grad = grad if self.diagonal else np.array([np.sum(grad)])
        if with_curvature:
            return value, grad, -float(self.w_held @ second)
        return value, grad

    def _pass(self, log_h):
        """(values, gradients, second derivatives) per held-out row at ``log_h``, kept for
        the last `_KEPT_ROWS` bandwidths (`rows` asks for the search's best again)."""
        key = log_h.tobytes()
        if key not in self._rows:
            # with the moments even where the gradient is not asked for: they cost a few
            # percent, and one program (not two) is compiled per plan length
            self._rows[key] = self.planned.loo_log_density(
                np.exp(log_h.astype(np.float64)), self.held, self.tol, moments=True,
                curvature=True)
            while len(self._rows) > self._KEPT_ROWS:
                del self._rows[next(iter(self._rows))]
        return self._rows[key]

    def values(self, theta) -> np.ndarray:
        """Per held-out row, ``log p_{-i}(x_i)`` at ``theta``."""
        return self._pass(self._log_h(theta))[0]

    def rows(self, theta):
        """Per held-out row: ``log p_{-i}(x_i)`` at ``theta`` and its first and negated second
        derivatives in the common log-scale, from the pass's moments."""
        values, grads, second = self._pass(self._log_h(theta))
        return values, grads.sum(axis=1), -second
