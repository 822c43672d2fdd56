"""The pruned KDE log-sum-exp over a host plan (issue 41): `_pruned_lse`'s forward
pass with each query tile's visit lists taken from `pruning._tree` (a tree descent,
O(visited · depth) host work) instead of testing every key tile inside the program (O(n · m /
block²) per call).

Two compiled programs, one per pass of the rule (`pruning._rules`): `near_pass` folds in
each row's near tiles from the near plan and gives each row's level; the rest plan needs the
smallest level of each query tile, so it is made on the host between the two, and `rest_pass`
folds in the rest. Each row applies its own rule to each listed tile, in ascending key order,
as `_pruned_lse.lse_forward` does over its own (smaller or equal) lists: a listed tile that a
row does not add leaves its state as it is, so the results equal `pruned_kernel_logsumexp`'s
(bitwise in the tests at the default tolerance; elsewhere a level may differ by an ulp, as the
two programs fold the constant ``log(tol)`` apart, which moves only a tile whose bound sits at
the level) and do not depend on the row's tile-mates.

Forward only. Cross-validation needs no backward pass: `PlannedDensity.loo_log_density` leaves
each held-out row's own key out inside the tile sums (`loo_tile`) and folds the bandwidth
moments in beside them, which give the gradient in log h directly (and a fourth moment, the
second derivative in a common log-scale).

`PlannedDensity` orders the keys once (on the host, `host_kd_order`, or in an order it is given,
such as a cross-validation's of the same points) and builds their tree (`build_tree`) once; each
call then plans for its bandwidth and queries. Scoring the data themselves plans one chunk of
tiles on the host while the device runs another's passes (`pipelined_logsumexp`), and a plan
is padded to a length its passes were compiled for where it fits (`PLAN_GROWTH`). The query
tiles are taken in runs, one thread per usable core (`plan_threads`): XLA runs a pass's loop
over query tiles on one core, and passes dispatched from several threads run side by side.
`planned_block` is its tile height per number of features (`planned_query_block` that of a
batch of queries), and `PlannedDensity.pays` the
``prune="auto"`` test (`pruning._rules.pays_in_order` on the
keys in the order the plan put them, so that the decision sorts nothing more);
`scalegp.ops.Engine` builds one where its KDE scoring takes this path (`Engine.planned_kde`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp._runtime import usable_cores
from scalegp.ops._compat import in_callers_x64_mode
from scalegp.ops._tile_math import gaussian_log_norm, lse_step
from scalegp.ops.backends.xla._pruned_lse import lse_tile
from scalegp.ops.backends.xla._pruned_tiles import (
    fold_visits,
    scaled_differences,
    sq_distances,
)
from scalegp.ops.pruning import (
    PRUNE_BLOCK,
    OrderedKeys,
    Plan,
    build_tree,
    default_tolerance,
    host_kd_order,
    joined,
    lse_bounds,
    lse_level,
    lse_log_tol,
    lse_near,
    lse_rest,
    lse_setup,
    near_plan,
    ordered_keys,
    ordered_queries,
    ordered_tiles,
    padded_length,
    pays_in_order,
    reach_allows_pruning,
    rest_plan,
    tile_values,
    unordered,
)


def _fold_list(tiles, start, count, body, init):
    """``body(t, state)`` for the key tiles ``tiles[start : start + count]`` in order."""
    return fold_visits(count, lambda k, state: body(tiles[start + k], state), init)


def loo_tile(x_t, own_t, y_t, w_t, lw_t, first_key, inv_scale, state):
    """`lse_tile` with each row's own key left out: row i of x_t (p, d) skips the key whose
    flat index (``first_key + j`` for column j of this tile) is ``own_t[i]`` (p,). With third
    and fourth state entries ((p, d), (p,)), the moments ``Σ_j w_j exp(e_ij - max_i) D_ijd²``
    and ``Σ_j w_j exp(e_ij - max_i) |D_ij|⁴`` (D the scaled differences) are folded in beside
    the scaled sum: over it, they give ``∂ log Σ_j w_j K_ij / ∂ log h_d``, the bandwidth
    gradient, and the second derivative in a common log-scale (`loo_log_density`), in the
    forward pass."""
    diff = scaled_differences(x_t, y_t, inv_scale)
    sq = sq_distances(diff)
    e = -0.5 * sq
    keep = own_t[:, None] != first_key + jnp.arange(y_t.shape[0])
    new_max, new_sum, rescale, terms = lse_step(*state[:2], e, w_t[None, :], lw_t[None, :], keep)
    new = (new_max, new_sum)
    if len(state) == 4:
        new += (state[2] * rescale[:, None] + jnp.einsum("pq,pdq->pd", terms, diff * diff),
                state[3] * rescale + jnp.sum(terms * (sq * sq), axis=1))
    return new


def _fold_tile(x_t, y, w, lw, inv_scale, t, include, state, own_t):
    """Key tile t folded into the state of the rows that ``include`` (p,): (max, scaled sum),
    or with ``own_t`` (rows' own keys, left out) `loo_tile`'s state."""
    if own_t is None:
        new = lse_tile(x_t, y[t], w[t], lw[t], inv_scale, *state)
    else:
        new = loo_tile(x_t, own_t, y[t], w[t], lw[t], t * y.shape[1], inv_scale, state)
    return tuple(jnp.where(include.reshape(include.shape + (1,) * (a.ndim - 1)), a, b)
                 for a, b in zip(new, state))


@functools.partial(jax.jit, static_argnames=("log_tol", "moments"))
def near_pass(x, y, w, inv_scale, tiles, start, count, log_tol: float, own=None,
              moments: bool = False):
    """x (tq, p, d) query tiles, y (tk, q, d) key tiles, w (tk, q), inv_scale (d,); the near
    plan's lists (`Plan`'s arrays). -> ((max, scaled sum), top, level), each (tq, p): the rows'
    running state over their near tiles, their largest bound and their level (`lse_level`).
    With ``own`` (tq, p), each row's own key's flat index, that key is left out (`loo_tile`),
    and with ``moments`` the state also holds the bandwidth moments (tq, p, d) and (tq, p)."""
    setup, lw = lse_setup(y, w)
    p, d = x.shape[1], x.shape[2]
    own = jnp.full(x.shape[:2], -1, jnp.int32) if own is None and moments else own

    def one_row_tile(_, row):
        x_t, s, c, own_t = row
        top = _fold_list(tiles, s, c, lambda t, top: jnp.maximum(
            top, lse_bounds(x_t, setup, inv_scale, t)[1]), jnp.full((p,), -jnp.inf, x.dtype))

        def add(t, state):
            near = lse_near(lse_bounds(x_t, setup, inv_scale, t)[1], top, setup[1][t] > 0,
                            log_tol)
            return _fold_tile(x_t, y, w, lw, inv_scale, t, near, state, own_t)

        init = (jnp.full((p,), -jnp.inf, x.dtype), jnp.zeros((p,), x.dtype))
        init += (jnp.zeros((p, d), x.dtype), jnp.zeros((p,), x.dtype)) if moments else ()
        state = _fold_list(tiles, s, c, add, init)
        return None, (state, top, lse_level(*state[:2], setup[1], y.shape[1], log_tol))

    return lax.scan(one_row_tile, None, (x, start, count, own))[1]


@functools.partial(jax.jit, static_argnames=("log_tol",))
def rest_pass(x, y, w, inv_scale, tiles, start, count, state, top, level, log_tol: float,
              own=None):
    """The log-sums (tq, p): `near_pass`'s state, top and level with each row's rest tiles
    (`lse_rest`) from the rest plan's lists folded in. With moments in the state: (log-sums,
    second moments over the sums (tq, p, d), fourth moments over the sums (tq, p))."""
    setup, lw = lse_setup(y, w)
    own = jnp.full(x.shape[:2], -1, jnp.int32) if own is None and len(state) == 4 else own

    def one_row_tile(_, row):
        x_t, s, c, state_t, top_t, level_t, own_t = row

        def add(t, state):
            neg_half_sq, bound = lse_bounds(x_t, setup, inv_scale, t)
            positive = setup[1][t] > 0
            rest = lse_rest(neg_half_sq, lse_near(bound, top_t, positive, log_tol), positive,
                            level_t)
            return _fold_tile(x_t, y, w, lw, inv_scale, t, rest, state, own_t)

        run_max, run_sum, *moments = _fold_list(tiles, s, c, add, state_t)
        out = run_max + jnp.log(run_sum)
        if not moments:
            return None, out
        return None, (out, moments[0] / run_sum[:, None], moments[1] / run_sum)

    return lax.scan(one_row_tile, None, (x, start, count, state, top, level, own))[1]


#: When a plan outgrows the length its pass was compiled for (`planned_kernel_logsumexp`'s
#: ``lengths``), the new length holds this many times its pairs: a bandwidth search whose plans
#: grow by up to this factor then compiles each pass once (a compilation costs far more than
#: storing the padding, which is never visited; docs/decisions.md #30).
PLAN_GROWTH = 8


def _device(plan: Plan, lengths=None, kind=None):
    tiles = plan.tiles
    if lengths is not None:
        if tiles.shape[0] > lengths.get(kind, 0):
            lengths[kind] = padded_length(PLAN_GROWTH * plan.pairs)
        tiles = np.zeros(lengths[kind], np.int32)
        tiles[: plan.pairs] = plan.tiles[: plan.pairs]
    return jnp.asarray(tiles), jnp.asarray(plan.start), jnp.asarray(plan.count)


def planned_kernel_logsumexp(x, y, w, inv_scale, tol: float, tree, own=None,
                             moments: bool = False, lengths: dict | None = None):
    """``log Σ_j w_j exp(-|(x_i - y_j) / l|² / 2)`` as `pruned_kernel_logsumexp` (same shapes
    and rule: x (tq, p, d), y (tk, q, d) in k-d order, w (tk, q), inv_scale (d,) -> (tq, p)),
    planned on the host with ``tree = build_tree(y, w)``. Not under jit. ``own`` (tq, p): each
    row's own key (flat index into y's rows) left out of its sum; ``moments``: also the
    bandwidth moments (`loo_tile`) over the sums, (tq, p, d) and (tq, p).

    ``lengths``: optional dict, the lengths the near and rest lists were last padded to (read
    and updated here): a plan that fits is padded to it, so its pass is not compiled again;
    one that does not sets a length of `PLAN_GROWTH` times its pairs.

    The query tiles are split into `plan_threads` equal runs (the last padded with copies of
    its last tile), each planned and passed in a thread (a pass runs on one core). A tile's
    plan and sums do not depend on the other tiles, so the results are those of one run.

    Returns (log-sums or (log-sums, moments, fourth moments), near plan, rest plan); a plan's
    ``pairs`` is its number of tile pairs."""
    x_host = np.asarray(x)
    tq = x_host.shape[0]
    boxes = x_host.min(axis=1).astype(np.float64), x_host.max(axis=1).astype(np.float64)
    runs = plan_threads(tq)
    if runs == 1:
        return _rest_stage(_near_stage(x, boxes, y, w, inv_scale, tol, tree, own, moments,
                                       lengths))
    size = -(-tq // runs)
    fill = np.minimum(np.arange(runs * size), tq - 1)  # the last run padded with its last tile
    x_runs, lo, hi = x_host[fill], boxes[0][fill], boxes[1][fill]
    own_runs = None if own is None else np.asarray(own)[fill]

    def run(k):
        part = slice(k * size, (k + 1) * size)
        return _rest_stage(_near_stage(
            x_runs[part], (lo[part], hi[part]), y, w, inv_scale, tol, tree,
            None if own_runs is None else own_runs[part], moments, lengths))

    results = _in_threads([functools.partial(run, k) for k in range(runs)])
    out = jax.tree.map(lambda *parts: jnp.concatenate(parts)[:tq], *[r[0] for r in results])
    return (out, joined([r[1] for r in results], tq), joined([r[2] for r in results], tq))


#: Query tiles per thread at least (`plan_threads`): a small call stays in one run, with no
#: threads and no passes compiled for the shape of a run.
MIN_TILES_PER_THREAD = 16


def plan_threads(query_tiles: int) -> int:
    """Runs of query tiles the host-planned passes take in parallel: one per usable core
    (`scalegp._runtime.usable_cores`), each of `MIN_TILES_PER_THREAD` tiles at least."""
    return max(1, min(usable_cores(), query_tiles // MIN_TILES_PER_THREAD))


def _in_threads(calls, stop=None) -> list:
    """The results of ``calls`` (callables without arguments), each in a thread of its own, in
    order. The first error, or Ctrl-C, sets ``stop`` (a `threading.Event` the calls may watch
    to end early) and is raised once the threads are joined. Each runs in the caller's x64 mode
    (`in_callers_x64_mode`)."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(in_callers_x64_mode(call)) for call in calls]
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
        except BaseException:
            if stop is not None:
                stop.set()
            raise
        return [future.result() for future in futures]


def _near_stage(x, boxes, y, w, inv_scale, tol, tree, own=None, moments=False, lengths=None):
    """`planned_kernel_logsumexp`'s first half: the near plan from the query tiles' boxes
    ((tq, d) float64 each), and the near pass dispatched (not awaited)."""
    log_tol = lse_log_tol(tol, x.dtype)
    inv = np.asarray(inv_scale, np.float64)
    near = near_plan(tree, *boxes, inv, log_tol)
    state, top, level = near_pass(x, y, w, inv_scale, *_device(near, lengths, "near"), log_tol,
                                  own, moments)
    return x, boxes, y, w, inv_scale, log_tol, tree, own, lengths, near, state, top, level


def _rest_stage(staged):
    """The second half: waits for the near pass's levels, plans the rest, dispatches the rest
    pass. -> (its output, near plan, rest plan)."""
    x, boxes, y, w, inv_scale, log_tol, tree, own, lengths, near, state, top, level = staged
    rest = rest_plan(tree, *boxes, np.asarray(inv_scale, np.float64), log_tol,
                     np.asarray(level, np.float64).min(axis=1),
                     np.asarray(top, np.float64).max(axis=1))
    out = rest_pass(x, y, w, inv_scale, *_device(rest, lengths, "rest"), state, top, level,
                    log_tol, own)
    return out, near, rest


def pipelined_logsumexp(chunks, y, w, inv_scale, tol: float, tree, lengths=None):
    """`planned_kernel_logsumexp` of several chunks of query tiles, ``chunks`` a list of
    (x (tq, p, d), boxes ((tq, d), (tq, d)) float64) of one shape, in up to `plan_threads`
    runs of chunks, one thread each; within a run the host plans one chunk while another's
    passes run. Each chunk's results are those of its own call. Returns (the outputs (tq, p)
    per chunk, the plans of each run's last chunk, joined)."""
    runs = min(len(chunks), plan_threads(len(chunks) * chunks[0][0].shape[0]))
    if runs == 1:
        return _pipeline(chunks, y, w, inv_scale, tol, tree, lengths)
    bounds = [len(chunks) * k // runs for k in range(runs + 1)]
    stop = threading.Event()  # an error in a run, or Ctrl-C: the others end at their next chunk
    results = _in_threads([functools.partial(
        _pipeline, chunks[bounds[k]:bounds[k + 1]], y, w, inv_scale, tol, tree, lengths, stop)
        for k in range(runs)], stop)
    return ([out for outs, _ in results for out in outs],
            [joined([plans[i] for _, plans in results]) for i in range(2)])


def _pipeline(chunks, y, w, inv_scale, tol, tree, lengths, stop=None):
    """`pipelined_logsumexp` of one run of chunks, in this thread (cut short once ``stop``, a
    `threading.Event`, is set)."""
    outs, plans = [], None
    staged = _near_stage(*chunks[0], y, w, inv_scale, tol, tree, lengths=lengths)
    for k in range(len(chunks)):
        if stop is not None and stop.is_set():
            break
        # the next chunk's near plan is made while this chunk's near pass runs, and this
        # chunk's rest plan while the next one's near pass runs
        ahead = (_near_stage(*chunks[k + 1], y, w, inv_scale, tol, tree, lengths=lengths)
                 if k + 1 < len(chunks) else None)
        out, *plans = _rest_stage(staged)
        outs.append(out)
        staged = ahead
    return outs, plans


#: Tile height of the host-planned path by number of features (the largest d listed at most):
#: benchmarks/results/kde_plan_cpu.json, 10^6 overlapping-mixture points at d = 2 scored against
#: themselves at h = 0.006, gave 12-25 s at block 32, 30-32 s at 64, 41-78 s at 16, 62 s at 256
#: (and 32 the best of 16-256 at 10^5). Higher d is unmeasured here: tile boxes loosen with d and a
#: visited pair costs block² kernel values either way, so larger tiles (fewer, cheaper-to-plan
#: pairs) there, up to the in-jit path's `PRUNE_BLOCK` from d = 5.
PLANNED_BLOCKS = ((2, 32), (4, 64))


def planned_block(d: int) -> int:
    """The tile height of `PlannedDensity` for ``d`` features (`PLANNED_BLOCKS`)."""
    return next((block for most, block in PLANNED_BLOCKS if d <= most), PRUNE_BLOCK)


#: Query tiles of the host-planned path from 3 features: a batch of queries is usually sparser
#: than the data, and tiles of the keys' 64 or 256 rows span boxes that admit most key tiles.
#: Fixed, not chosen by the batch's size: XLA's CPU code rounds a row's sums differently at
#: some heights, and a row's result may not depend on its batch (docs/decisions.md #44).
PLANNED_QUERY_BLOCK = 16


def planned_query_block(d: int, block: int) -> int:
    """The query tiles' height of `PlannedDensity.log_density` for ``d`` features against key
    tiles of ``block`` rows: the keys' up to 2 features, else `PLANNED_QUERY_BLOCK`."""
    return block if d <= 2 else min(block, PLANNED_QUERY_BLOCK)


reach_gate = jax.jit(reach_allows_pruning, static_argnums=(2,))


_pays_in_order = jax.jit(pays_in_order, static_argnums=(2,))


_ordered_queries = jax.jit(ordered_queries, static_argnums=(3, 4))


@jax.jit
def _finite_keys(x, scale):
    """x (m, d) with its far rows moved to the centre, far (m,), centre: `ordered_keys`'s, in
    the rows' own order."""
    keys = ordered_keys(x, scale, 1, in_order=True)
    return keys.tiles.reshape(x.shape), keys.far, keys.centre


@functools.partial(jax.jit, static_argnums=(4,))
def _keys_in_order(x, far, centre, perm, block: int) -> OrderedKeys:
    return OrderedKeys(ordered_tiles(x, perm, block), perm, far, centre)


def _ordered_keys(data, scale, block: int, order=None) -> OrderedKeys:
    """`pruning._rules.ordered_keys` of the keys ``data`` (m, d), ordered on the host
    (`host_kd_order`: nothing to compile), or in the given ``order`` ((m,), a permutation of
    the rows, padded here)."""
    x, far, centre = _finite_keys(data, scale)
    m = data.shape[0]
    if order is None:
        perm = host_kd_order(np.asarray(x), np.asarray(scale), block)
    else:
        perm = np.concatenate([np.asarray(order, np.int64),
                               np.arange(m, -(-m // block) * block)]).astype(np.int32)
    return _keys_in_order(x, far, centre, jnp.asarray(perm), block)


@jax.jit
def _tile_weights(w, keys):
    w = jnp.where(keys.far, 0.0, w / jnp.sum(w)).astype(keys.tiles.dtype)
    return tile_values(w, keys.perm, keys.tiles.shape[1])


class PlannedDensity:
    """A Gaussian KDE's data in k-d order and their tile tree, made once (the order and the tree
    do not depend on the bandwidth, only on its ratios across features, given by ``scale``):
    `log_density` then plans and scores for any bandwidth and queries, not under jit.

    Args:
      data: (m, d) points; weights: optional (m,) >= 0 (normalised here); scale: scalar or
        (d,); block: tile height.
      order: optional (m,) permutation of the rows to take as their k-d order (another
        `PlannedDensity`'s `order` of the same points, say) instead of ordering them here
        (`pruning._order.host_kd_order`). Any permutation gives the same
        densities within the bound; the order decides only how tight the tiles are.
    """

    def __init__(self, data, weights=None, scale=1.0, block: int = PRUNE_BLOCK, order=None):
        data = jnp.asarray(data)
        scale = jnp.asarray(scale, data.dtype)
        weights = jnp.ones(data.shape[0], data.dtype) if weights is None else weights
        self.keys = _ordered_keys(data, scale, block, order)
        self.weights = _tile_weights(jnp.asarray(weights, data.dtype), self.keys)
        self.tree = build_tree(self.keys.tiles, self.weights)
        self.plans = None  # the (near, rest) plans of the last call
        self.lengths = {}  # per kind of call, the plans' padded lengths (`planned_kernel_...`)
        self._held_order = None  # (held rows, their k-d order) of the last LOO call

    def __getstate__(self):  # a pickle holds the order and the tree, not the last call's plans
        return {**self.__dict__, "plans": None, "lengths": {}, "_held_order": None}

    def __setstate__(self, state):  # pickles from before ``lengths``
        self.__dict__.update({"lengths": {}, "_held_order": None, **state})

    @property
    def order(self) -> np.ndarray:
        """(m,) the data's rows in the k-d order of the tiles (`scalegp.ops.spatial_order`'s
        kind of permutation, at this tile height)."""
        perm = np.asarray(self.keys.perm)
        return perm[perm < self.keys.far.shape[0]]

    def pays(self, data, bandwidth, tol: float) -> bool:
        """``prune="auto"``'s test on these keys (``data``, the (m, d) points this was built on)
        at ``bandwidth``: `pruning._rules.pays_in_order` on the data in this object's order
        in tiles of `PRUNE_BLOCK`, as the in-jit path decides on keys given in order. Depends
        on the keys and the bandwidth only (row independence)."""
        x = jnp.asarray(data)[self.order]
        return bool(_pays_in_order(x, jnp.asarray(bandwidth, x.dtype), float(tol)))

    def log_density(self, bandwidth, queries=None, tol=None, chunk_rows: int | None = None):
        """(n,) log-densities at ``queries`` (n, d) (None: the data themselves, in their order),
        each query's skipped mass at most ``tol`` (None: half the dtype's epsilon) times its
        density, as `scalegp.ops.rbf_kde_density(..., log=True, prune=True)`.

        The data themselves are scored with their own tiles as the query tiles (the tightest
        there are: a batch of them in a new k-d order would be looser), ``chunk_rows`` rows
        of consecutive tiles per plan (None: all at once), which bounds the plans' memory."""
        keys, (tk, q, d) = self.keys, self.keys.tiles.shape
        bandwidth = jnp.broadcast_to(jnp.asarray(bandwidth, keys.tiles.dtype), (d,))
        tol = default_tolerance(keys.tiles.dtype) if tol is None else tol
        if queries is None:
            perm, far, n = keys.perm, keys.far, keys.far.shape[0]
            step = tk if chunk_rows is None else max(1, min(tk, chunk_rows // q))
            step = min(step, -(-tk // plan_threads(tk)))  # a chunk per thread at least
            chunks = []
            for first in range(0, tk, step):
                # the last run padded with copies of its last tile: one compiled shape
                tiles = np.minimum(np.arange(first, first + step), tk - 1)
                # the query tiles' boxes are the key tiles': no wait for the device's copy
                chunks.append((keys.tiles[tiles], (self.tree.tile_lo[tiles],
                                                   self.tree.tile_hi[tiles])))
            parts, self.plans = pipelined_logsumexp(chunks, keys.tiles, self.weights,
                                                    1 / bandwidth, tol, self.tree,
                                                    self.lengths.setdefault("own", {}))
            out = jnp.concatenate([part[: min(step, tk - first)]
                                   for part, first in zip(parts, range(0, tk, step))])
        else:
            queries = jnp.asarray(queries, keys.tiles.dtype)
            x, perm, far = _ordered_queries(queries, keys, bandwidth, False,
                                            planned_query_block(d, q))
            n = queries.shape[0]
            out, *self.plans = planned_kernel_logsumexp(
                x, keys.tiles, self.weights, 1 / bandwidth, tol, self.tree,
                lengths=self.lengths.setdefault(("queries", x.shape[0]), {}))
        out = unordered(out.reshape(-1), perm, n) + gaussian_log_norm(bandwidth, d)
        return jnp.where(far, -jnp.inf, out)

    def loo_log_density(self, bandwidth, held, tol=None, moments: bool = False,
                        rows_per_tile: int | None = None, curvature: bool = False):
        """Leave-one-out log-densities of the data rows ``held`` (s,) (indices into the (m, d)
        data this was built on, distinct): ``log p_{-i}(x_i)``, the KDE of the other rows
        (their weights renormalised), each row's own key left out of its sum exactly (never
        subtracted), with the same pruning rule and tolerance as `log_density`. Not under
        jit.

        With ``moments``, also ``∂ log p_{-i}(x_i) / ∂ log h_d`` (s, d): the forward pass's
        moments (`loo_tile`) less one per feature. They are those of the pruned sum, so they
        leave out the skipped tiles' share too: at most ``tol`` times the row's mass, each
        term weighted by its ``D²`` (about ``-2 log tol`` at the skip threshold).

        With ``curvature`` (and ``moments``), also the second derivative in the common
        log-scale t of all the bandwidths (``h_d = c_d e^t``), (s,): with ``r² = |D|²`` and
        ``E`` the mean under the row's kernel weights ``w_j K_ij / Σ_j w_j K_ij``,
        ``∂ log Σ_j w_j K_ij / ∂t = E[r²]`` (as ``∂(-r²/2)/∂t = r²``), so
        ``∂² log p_{-i} / ∂t² = E[r⁴] - E[r²]² - 2 E[r²]``, from the fourth moment folded in the
        same pass (no second pass, no backward pass).

        ``rows_per_tile``: held rows per query tile (default half the key tiles' height).

        Returns (s,) log-densities, or a pair with the (s, d) gradients, or with ``curvature``
        a triple with the (s,) second derivatives, in ``held``'s order."""
        keys, (tk, q, d) = self.keys, self.keys.tiles.shape
        bandwidth = np.broadcast_to(np.asarray(bandwidth, keys.tiles.dtype), (d,))
        tol = default_tolerance(keys.tiles.dtype) if tol is None else tol
        held = np.asarray(held, np.int64)
        positions = self._positions()[held]
        # Held-out rows are a sparse subset of the data: tiles of q of them span q times the
        # area of a data tile, and their lists hold every key tile near any of them; shorter
        # tiles visit fewer pairs but pay more per tile pair (docs/decisions.md #23). They are
        # grouped by a k-d order of their own (on the host, at the first call's bandwidth for
        # these rows), which makes tighter tiles than runs of the data's order; each row's sum
        # is the same in any tile.
        p = rows_per_tile or max(8, q // 2)
        if self._held_order is None or not np.array_equal(self._held_order[0], held):
            points = np.asarray(keys.tiles).reshape(tk * q, d)[positions]
            perm = host_kd_order(points, bandwidth, p)
            self._held_order = (held.copy(), perm[perm < held.shape[0]].astype(np.int64))
        order = self._held_order[1]
        rows = positions[order]
        # pad to whole tiles with copies of the last row (its own key left out too), dropped
        rows = np.concatenate([rows, np.full(-rows.shape[0] % p, rows[-1])]).reshape(-1, p)
        x = keys.tiles.reshape(tk * q, d)[jnp.asarray(rows)]
        out, *self.plans = planned_kernel_logsumexp(
            x, keys.tiles, self.weights, 1 / jnp.asarray(bandwidth), tol, self.tree,
            jnp.asarray(rows, jnp.int32), moments, self.lengths.setdefault(("loo", p), {}))
        log_sum, gradient, fourth = out if moments else (out, None, None)
        flat_weights = np.asarray(self.weights, np.float64).reshape(-1)
        # the other rows' share of the (normalised) weight: 1 - w_i, formed in float64
        log_share = np.log1p(-flat_weights[positions])
        result = np.empty(held.shape[0], np.float64)
        result[order] = np.asarray(log_sum, np.float64).reshape(-1)[: held.shape[0]]
        # The normalisation in float64, at the bandwidth the sums used (in their dtype): rounded
        # to float32 (spacing ~5e-7 near 7), or taken at the float64 bandwidth (~1e-7 apart in
        # effect), it would make the mean step between neighbouring bandwidths by more than
        # the line search's tolerance and stall it.
        result += gaussian_log_norm(bandwidth.astype(np.float64), d) - log_share
        if not moments:
            return result
        grad = np.empty((held.shape[0], d), np.float64)
        second = np.asarray(gradient, np.float64).reshape(-1, d)[: held.shape[0]]
        grad[order] = second - 1.0
        if not curvature:
            return result, grad
        mean_sq = second.sum(axis=1)
        hessian = np.empty(held.shape[0], np.float64)
        hessian[order] = (np.asarray(fourth, np.float64).reshape(-1)[: held.shape[0]]
                          - mean_sq * mean_sq - 2 * mean_sq)
        return result, grad, hessian

    def _positions(self) -> np.ndarray:
        """(m,) each data row's flat index among the ordered key tiles' rows."""
        perm = np.asarray(self.keys.perm)
        slots = np.flatnonzero(perm < self.keys.far.shape[0])
        positions = np.empty(self.keys.far.shape[0], np.int64)
        positions[perm[slots]] = slots
        return positions
