"""The host-planned pruned KDE, backend-neutral: the data in k-d order and their tile tree built
once (`PlannedDensity`), each call's visit lists planned on the host by a tree descent (`_tree`,
O(visited · depth) work) instead of testing every key tile inside the program (O(n · m / block²)
per call), and the passes over those lists run by a backend (`PlannedPasses`).

Two passes per call, one per half of the rule (`_rules`): the near pass folds in each row's near
tiles from the near plan and gives each row's level; the rest plan needs the smallest level of
each query tile, so it is made on the host between the two, and the rest pass folds in the rest.
Each row applies its own rule to each listed tile, in ascending key order, so a row's result does
not depend on its tile-mates.

Scoring the data themselves plans one chunk of tiles on the host while the device runs another's
passes (`pipelined_logsumexp`), and a plan is padded to a length its passes were compiled for
where it fits (`PLAN_GROWTH`). The query tiles are taken in runs, one thread per usable core
(`plan_threads`): a pass's loop runs on one core of a CPU, and passes dispatched from several
threads run side by side; on an accelerator the threads plan while the device works.

A backend subclasses `PlannedDensity` with its `PlannedPasses` (xla's ``lax.scan`` loops, the
Mosaic kernels over a flat visit sequence) and its tile heights; `scalegp.ops.Engine` builds one
where its KDE scoring takes this path (`Engine.planned_kde`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scalegp._runtime import usable_cores
from scalegp.ops._compat import in_callers_x64_mode
from scalegp.ops._tile_math import gaussian_log_norm
from scalegp.ops.pruning._order import host_kd_order, ordered_tiles, tile_values, unordered
from scalegp.ops.pruning._rules import (
    AUTO_MAX_VISITED,
    PRUNE_BLOCK,
    OrderedKeys,
    default_tolerance,
    ordered_keys,
    ordered_queries,
    pays_in_order,
    reach_allows_pruning,
)
from scalegp.ops.pruning._bounds import lse_log_tol
from scalegp.ops.pruning._tree import Plan, build_tree, joined, near_plan, padded_length, rest_plan


class PlannedPasses(NamedTuple):
    """A backend's passes over host plans (each dispatched, not awaited).

    Attributes:
      near: ``(x, y, w, inv_scale, plan, log_tol, own, moments) -> (state, top,
        level)``: x (tq, p, d) query tiles, y (tk, q, d) key tiles in k-d order, w (tk, q),
        inv_scale (d,), ``plan`` the near `Plan`; the rows' running state over their near tiles
        ((max, scaled sum), each (tq, p), with ``moments`` also the bandwidth moments), their
        largest bound and their level (`lse_level`), each (tq, p). ``own`` (tq, p): each row's
        own key's flat index, left out of its sum (None: none). The plan comes padded to a
        length its pass was compiled for (`padded_plan`).
      rest: ``(x, y, w, inv_scale, plan, state, top, level, log_tol, own) -> out``:
        the log-sums (tq, p) with the rest plan's tiles folded in (with moments: (log-sums,
        second moments (tq, p, d), fourth moments (tq, p)), each over the sums).
      loo: whether ``own`` and ``moments`` are supported (the leave-one-out objective).
    """

    near: Callable
    rest: Callable
    loo: bool


#: When a plan outgrows the length its pass was compiled for (`planned_kernel_logsumexp`'s
#: ``lengths``), the new length holds this many times its pairs: a bandwidth search whose plans
#: grow by up to this factor then compiles each pass once (a compilation costs far more than
#: storing the padding, which is never visited; docs/decisions.md #30).
PLAN_GROWTH = 8


def padded_plan(plan: Plan, lengths=None, kind=None) -> Plan:
    """``plan`` with its tiles padded to the length ``lengths[kind]`` its pass was compiled for
    (``lengths`` None: as it is), or, where it outgrows that, to a new length of `PLAN_GROWTH`
    times its pairs (recorded in ``lengths``)."""
    if lengths is None:
        return plan
    if plan.tiles.shape[0] > lengths.get(kind, 0):
        lengths[kind] = padded_length(PLAN_GROWTH * plan.pairs)
    tiles = np.zeros(lengths[kind], np.int32)
    tiles[: plan.pairs] = plan.tiles[: plan.pairs]
    return Plan(tiles, plan.start, plan.count)


def planned_kernel_logsumexp(passes: PlannedPasses, x, y, w, inv_scale, tol: float, tree,
                             own=None, moments: bool = False, lengths: dict | None = None):
    """``log Σ_j w_j exp(-|(x_i - y_j) / l|² / 2)`` as `pruned_kernel_logsumexp` (same shapes
    and rule: x (tq, p, d), y (tk, q, d) in k-d order, w (tk, q), inv_scale (d,) -> (tq, p)),
    planned on the host with ``tree = build_tree(y, w)``, passed by ``passes``. Not under
    jit. ``own`` (tq, p): each row's own key (flat index into y's rows) left out of its sum;
    ``moments``: also the bandwidth moments (the xla passes' `loo_tile`) over the sums, (tq,
    p, d) and (tq, p).

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
        return _rest_stage(_near_stage(passes, x, boxes, y, w, inv_scale, tol, tree, own, moments,
                                       lengths))
    size = -(-tq // runs)
    fill = np.minimum(np.arange(runs * size), tq - 1)  # the last run padded with its last tile
    x_runs, lo, hi = x_host[fill], boxes[0][fill], boxes[1][fill]
    own_runs = None if own is None else np.asarray(own)[fill]

    def run(k):
        part = slice(k * size, (k + 1) * size)
        return _rest_stage(_near_stage(
            passes, x_runs[part], (lo[part], hi[part]), y, w, inv_scale, tol, tree,
            None if own_runs is None else own_runs[part], moments, lengths))

    results = _in_threads([functools.partial(run, k) for k in range(runs)])
    out = _runs_joined(tuple(r[0] for r in results), tq)
    return (out, joined([r[1] for r in results], tq), joined([r[2] for r in results], tq))


@functools.partial(jax.jit, static_argnums=1)
def _runs_joined(outputs, tq: int):
    """The runs' outputs (a tuple of like trees of arrays) joined, their first ``tq`` rows."""
    return jax.tree.map(lambda *parts: jnp.concatenate(parts)[:tq], *outputs)


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


def _near_stage(passes, x, boxes, y, w, inv_scale, tol, tree, own=None, moments=False,
                lengths=None):
    """`planned_kernel_logsumexp`'s first half: the near plan from the query tiles' boxes
    ((tq, d) float64 each), and the near pass dispatched (not awaited)."""
    log_tol = lse_log_tol(tol, x.dtype)
    inv = np.asarray(inv_scale, np.float64)
    near = near_plan(tree, *boxes, inv, log_tol)
    state, top, level = passes.near(x, y, w, inv_scale, padded_plan(near, lengths, "near"),
                                    log_tol, own, moments)
    return passes, x, boxes, y, w, inv_scale, log_tol, tree, own, lengths, near, state, top, level


def _rest_stage(staged):
    """The second half: waits for the near pass's levels, plans the rest, dispatches the rest
    pass. -> (its output, near plan, rest plan)."""
    passes, x, boxes, y, w, inv_scale, log_tol, tree, own, lengths, near, state, top, level = staged
    rest = rest_plan(tree, *boxes, np.asarray(inv_scale, np.float64), log_tol,
                     np.asarray(level, np.float64).min(axis=1),
                     np.asarray(top, np.float64).max(axis=1))
    out = passes.rest(x, y, w, inv_scale, padded_plan(rest, lengths, "rest"), state, top, level,
                      log_tol, own)
    return out, near, rest


def pipelined_logsumexp(passes: PlannedPasses, chunks, y, w, inv_scale, tol: float, tree,
                        lengths=None):
    """`planned_kernel_logsumexp` of several chunks of query tiles, ``chunks`` a list of
    (x (tq, p, d), boxes ((tq, d), (tq, d)) float64) of one shape, in up to `plan_threads`
    runs of chunks, one thread each; within a run the host plans one chunk while another's
    passes run. Each chunk's results are those of its own call. Returns (the outputs (tq, p)
    per chunk, the plans of each run's last chunk, joined)."""
    runs = min(len(chunks), plan_threads(len(chunks) * chunks[0][0].shape[0]))
    if runs == 1:
        return _pipeline(passes, chunks, y, w, inv_scale, tol, tree, lengths)
    bounds = [len(chunks) * k // runs for k in range(runs + 1)]
    stop = threading.Event()  # an error in a run, or Ctrl-C: the others end at their next chunk
    results = _in_threads([functools.partial(
        _pipeline, passes, chunks[bounds[k]:bounds[k + 1]], y, w, inv_scale, tol, tree, lengths,
        stop)
        for k in range(runs)], stop)
    return ([out for outs, _ in results for out in outs],
            [joined([plans[i] for _, plans in results]) for i in range(2)])


def _pipeline(passes, chunks, y, w, inv_scale, tol, tree, lengths, stop=None):
    """`pipelined_logsumexp` of one run of chunks, in this thread (cut short once ``stop``, a
    `threading.Event`, is set)."""
    outs, plans = [], None
    staged = _near_stage(passes, *chunks[0], y, w, inv_scale, tol, tree, lengths=lengths)
    for k in range(len(chunks)):
        if stop is not None and stop.is_set():
            break
        # the next chunk's near plan is made while this chunk's near pass runs, and this
        # chunk's rest plan while the next one's near pass runs
        ahead = (_near_stage(passes, *chunks[k + 1], y, w, inv_scale, tol, tree, lengths=lengths)
                 if k + 1 < len(chunks) else None)
        out, *plans = _rest_stage(staged)
        outs.append(out)
        staged = ahead
    return outs, plans


# Steps on the device's arrays around the passes, each one compiled program: eager, a gather
# by host indices or a scatter back to the caller's order is several small programs, and on a
# TPU each is a compilation (or a load from the compilation cache) of its own.
_taken = jax.jit(lambda values, rows: values[rows])


@functools.partial(jax.jit, static_argnums=(1, 3))
def _densities(parts, kept, perm, n: int, log_norm, far):
    """(n,) log-densities in the caller's order from the passes' log-sums ``parts`` (a tuple
    of (t, p) query tiles' sums, of which the first ``kept`` tiles each are real) in the
    order ``perm``, with the normalisation ``log_norm`` added and far rows at -inf."""
    out = jnp.concatenate([part[:k] for part, k in zip(parts, kept)])
    out = unordered(out.reshape(-1), perm, n) + log_norm
    return jnp.where(far, -jnp.inf, out)


def on_host():
    """JAX's default device set to the host CPU: a density's build (far rows, tiles, weights,
    the ``prune="auto"`` tests) is small programs on host data (the k-d order and the tree are
    numpy already), which compile for the CPU in a fraction of an accelerator's time."""
    return jax.default_device(jax.local_devices(backend="cpu")[0])


def default_device():
    """The device JAX places new arrays on: `jax.default_device`'s (a device, or a platform's
    first), else the default backend's first."""
    device = jax.config.jax_default_device
    if isinstance(device, jax.Device):
        return device
    return jax.devices(device)[0] if device else jax.devices()[0]


_reach_allows_pruning = jax.jit(reach_allows_pruning, static_argnums=(2,))


def reach_gate(data, bandwidth, tol: float) -> bool:
    """`pruning._rules.reach_allows_pruning` of ``data`` (m, d) at ``bandwidth``, on the host
    (`on_host`): the test before a density is built."""
    with on_host():
        data = jnp.asarray(np.asarray(data))
        return bool(_reach_allows_pruning(data, jnp.asarray(np.asarray(bandwidth), data.dtype),
                                          tol))


_pays_in_order = jax.jit(pays_in_order, static_argnums=(2,), static_argnames=("max_visited",))


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
      interpret: the backend's kernels run in interpret mode here (its `Plan`'s; a backend
        whose passes are XLA's ignores it).

    A backend's subclass sets `passes` (its `PlannedPasses`), `query_block` (the height of a
    batch of queries' tiles) and may set `max_visited` (the share of visited tile pairs up to
    which ``prune="auto"`` takes this path, `pays`).
    """

    passes: PlannedPasses
    max_visited: float = AUTO_MAX_VISITED

    @staticmethod
    def query_block(d: int, block: int) -> int:
        """The query tiles' height of `log_density` for ``d`` features against key tiles of
        ``block`` rows: the keys' own."""
        del d
        return block

    def __init__(self, data, weights=None, scale=1.0, block: int = PRUNE_BLOCK, order=None,
                 interpret: bool = False):
        self.interpret = bool(interpret)
        data = np.asarray(data)
        with on_host():
            data = jnp.asarray(data)
            scale = jnp.asarray(np.asarray(scale), data.dtype)
            weights = (jnp.ones(data.shape[0], data.dtype) if weights is None
                       else jnp.asarray(np.asarray(weights), data.dtype))
            self.keys = _ordered_keys(data, scale, block, order)
            self.weights = _tile_weights(weights, self.keys)
            self.tree = build_tree(self.keys.tiles, self.weights)
            self._host_build()
        # the order kept on the host as well: read back from an accelerator, it held up the
        # fit's prune test there (docs/decisions.md #62)
        self._perm = np.asarray(self.keys.perm)
        self._place(default_device())
        self.plans = None  # the (near, rest) plans of the last call
        self.lengths = {}  # per kind of call, the plans' padded lengths (`planned_kernel_...`)
        self._held_order = None  # (held rows, their k-d order) of the last LOO call

    def _host_build(self):
        """What a backend lays out from the keys and weights once, on the host (`on_host`)."""

    def _place(self, device):
        """The device arrays moved to ``device`` (the passes' device)."""
        self.keys, self.weights = jax.device_put((self.keys, self.weights), device)

    def __getstate__(self):  # a pickle holds the order and the tree, not the last call's plans
        state = {**self.__dict__, "plans": None, "lengths": {}, "_held_order": None}
        del state["_perm"]  # the keys' own, read again at load
        return state

    def __setstate__(self, state):  # pickles from before ``lengths`` and ``interpret`` too
        self.__dict__.update({"lengths": {}, "_held_order": None, "interpret": False, **state})
        self._perm = np.asarray(self.keys.perm)

    @property
    def order(self) -> np.ndarray:
        """(m,) the data's rows in the k-d order of the tiles (`scalegp.ops.spatial_order`'s
        kind of permutation, at this tile height)."""
        return self._perm[self._perm < self.keys.far.shape[0]]

    def pays(self, data, bandwidth, tol: float) -> bool:
        """``prune="auto"``'s test on these keys (``data``, the (m, d) points this was built on)
        at ``bandwidth``: `pruning._rules.pays_in_order` on the data in this object's order
        in tiles of `PRUNE_BLOCK`, as the in-jit path decides on keys given in order. Depends
        on the keys and the bandwidth only (row independence)."""
        with on_host():
            x = jnp.asarray(np.asarray(data)[self.order])  # ordered on the host: no gather
            return bool(_pays_in_order(x, jnp.asarray(np.asarray(bandwidth), x.dtype),
                                       float(tol), max_visited=self.max_visited))

    def log_density(self, bandwidth, queries=None, tol=None, chunk_rows: int | None = None):
        """(n,) log-densities at ``queries`` (n, d) (None: the data themselves, in their order),
        each query's skipped mass at most ``tol`` (None: half the dtype's epsilon) times its
        density, as `scalegp.ops.rbf_kde_density(..., log=True, prune=True)`.

        The data themselves are scored with their own tiles as the query tiles (the tightest
        there are: a batch of them in a new k-d order would be looser), ``chunk_rows`` rows
        of consecutive tiles per plan (None: all at once), which bounds the plans' memory."""
        keys, (tk, q, d) = self.keys, self.keys.tiles.shape
        bandwidth = np.broadcast_to(np.asarray(bandwidth, keys.tiles.dtype), (d,))
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
                chunks.append((_taken(keys.tiles, tiles), (self.tree.tile_lo[tiles],
                                                           self.tree.tile_hi[tiles])))
            parts, self.plans = pipelined_logsumexp(self.passes, chunks, keys.tiles, self.weights,
                                                    1 / bandwidth, tol, self.tree,
                                                    self.lengths.setdefault("own", {}))
            kept = tuple(min(step, tk - first) for first in range(0, tk, step))
        else:
            queries = jnp.asarray(queries, keys.tiles.dtype)
            x, perm, far = _ordered_queries(queries, keys, jnp.asarray(bandwidth), False,
                                            self.query_block(d, q))
            n = queries.shape[0]
            out, *self.plans = planned_kernel_logsumexp(
                self.passes, x, keys.tiles, self.weights, 1 / bandwidth, tol, self.tree,
                lengths=self.lengths.setdefault(("queries", x.shape[0]), {}))
            parts, kept = (out,), (out.shape[0],)
        # the normalisation on the host, in float64 at the bandwidth the sums used: a TPU's
        # log errs by 1e-4 (its `accurate_log` by its exp's 5e-6, d times over)
        log_norm = gaussian_log_norm(np.asarray(bandwidth, np.float64), d)
        return _densities(tuple(parts), kept, perm, n,
                          np.asarray(log_norm, keys.tiles.dtype), far)

    def loo_log_density(self, bandwidth, held, tol=None, moments: bool = False,
                        rows_per_tile: int | None = None, curvature: bool = False):
        """Leave-one-out log-densities of the data rows ``held`` (s,) (indices into the (m, d)
        data this was built on, distinct): ``log p_{-i}(x_i)``, the KDE of the other rows
        (their weights renormalised), each row's own key left out of its sum exactly (never
        subtracted), with the same pruning rule and tolerance as `log_density`. Not under
        jit.

        With ``moments``, also ``∂ log p_{-i}(x_i) / ∂ log h_d`` (s, d): the forward pass's
        moments (the xla passes' `loo_tile`) less one per feature. They are those of the pruned
        sum, so they leave out the skipped tiles' share too: at most ``tol`` times the row's
        mass, each term weighted by its ``D²`` (about ``-2 log tol`` at the skip threshold).

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
        x = _taken(keys.tiles, (rows // q, rows % q))
        if not self.passes.loo:
            raise NotImplementedError(f"{type(self).__module__}'s passes have no leave-one-out "
                                      "form; cross-validate on a backend that declares "
                                      "'planned_loo'")
        out, *self.plans = planned_kernel_logsumexp(
            self.passes, x, keys.tiles, self.weights, 1 / bandwidth, tol, self.tree,
            rows.astype(np.int32), moments, self.lengths.setdefault(("loo", p), {}))
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
        perm = self._perm
        slots = np.flatnonzero(perm < self.keys.far.shape[0])
        positions = np.empty(self.keys.far.shape[0], np.int64)
        positions[perm[slots]] = slots
        return positions
