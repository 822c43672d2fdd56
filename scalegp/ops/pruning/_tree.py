"""Host plan of the pruned KDE (issue 41): which key tiles each query tile visits, found by
descending a tree over the key tiles instead of testing every key tile (numpy, not under jit).

The key tiles are in k-d order (`scalegp.ops.pruning._order.kd_order`), whose recursive split
makes consecutive tiles siblings: `build_tree` puts a balanced binary tree over them with the
same split (a segment of t >= 2 tiles into its first ``t // 2`` and the rest), each node holding
the union of its tiles' boxes (raw coordinates, so the tree serves every bandwidth) and its
largest tile weight. A plan is a list of (query tile, key tile) pairs, found breadth first for
all query tiles at once: at each depth the surviving (query tile, node) pairs are tested
together, those that fail are dropped with every tile below them, and those that pass are
split into their children. The cost is the number of pairs tested, O(visited · depth), not
O(query tiles · key tiles).

Rules (those of `scalegp.ops.pruning._rules`, tested with box bounds; Q a query tile's box, T a key
tile's, ``h(Q, T)`` half the smallest scaled squared distance between them, ``H(Q, T)`` half
the scaled squared gap from Q's far side to T (no row of Q is farther from T), ``W_T`` the tile
weight):

- near (`near_plan`): row i's near tiles have ``log W_T - δ²_iT / 2 >= top_i + log(tol) / 2``
  and ``top_i >= Λ_Q = max_T (log W_T - H(Q, T))``, so each is in
  ``{T : log W_T - h(Q, T) >= Λ_Q + log(tol) / 2}``, which also holds every row's largest bound
  (it is >= Λ_Q). A node N goes when ``log max_{T∈N} W_T - h(Q, N)`` (>= each of its tiles',
  as N's box holds theirs) is under the threshold. Λ_Q is bounded below by the tiles met so far
  (each node's middle tile on the way down, then the listed tiles): a lower Λ only lists more.
- rest (`rest_plan`): row i adds T when ``-δ²_iT / 2 > level_i``; with ``λ_Q = min_i level_i``
  (from the near pass, on the device) every such T has ``-h(Q, T) > λ_Q``. A tile that is near
  for every row of Q is left out: its rest rule is false for each. It is near for every row when
  ``log W_T - H(Q, T) >= max_i top_i + log(tol) / 2``.

Every test is made in float64 on the float32 boxes, with the bounds and levels loosened by
`LOOSE` (relative, in log units) against the rows' own float32 tests (which err by ~d eps), so a
plan lists every key tile that any row of the query tile adds: each row still applies its own
rule to each listed tile, and its result does not depend on its tile-mates.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from scalegp.ops.pruning._bounds import LOOSE, loosened


@dataclasses.dataclass(frozen=True)
class TileTree:
    """A balanced binary tree over ``tk`` key tiles in k-d order (`build_tree`). ``tile_lo``,
    ``tile_hi`` (tk, d) the tiles' boxes (raw coordinates, float64), ``log_weight`` (tk,)
    ``log W_T`` (-inf for empty tiles); ``levels`` one `Level` per depth, the root's first."""

    tile_lo: np.ndarray
    tile_hi: np.ndarray
    log_weight: np.ndarray
    levels: tuple


@dataclasses.dataclass(frozen=True)
class Level:
    """The nodes at one depth, segments ``[start, stop)`` of tiles covering all of them in
    order (a leaf of a shallower depth appears again, unsplit): their boxes ``lo``, ``hi``
    (s, d), ``log_max_weight`` (s,) and ``child`` (s,), the index of the first child in the next
    level (the second, if any, follows it)."""

    start: np.ndarray
    stop: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    log_max_weight: np.ndarray
    child: np.ndarray


def _log(weights):
    positive = weights > 0
    return np.where(positive, np.log(np.where(positive, weights, 1.0)), -np.inf)


def build_tree(tiles, weights) -> TileTree:
    """The tree over key tiles ``tiles`` (tk, block, d) (in k-d order) of weights (tk, block)
    >= 0: O(tk log tk) host work, once per set of keys (every bandwidth reuses it)."""
    tiles = np.asarray(tiles)
    tile_lo = tiles.min(axis=1).astype(np.float64)
    tile_hi = tiles.max(axis=1).astype(np.float64)
    tile_weight = np.asarray(weights, np.float64).sum(axis=1)
    start, stop = np.zeros(1, np.int64), np.full(1, tiles.shape[0], np.int64)
    levels = []
    while True:
        size = stop - start
        parts = np.where(size > 1, 2, 1)
        child = np.cumsum(parts) - parts
        levels.append(Level(start, stop, np.minimum.reduceat(tile_lo, start, axis=0),
                            np.maximum.reduceat(tile_hi, start, axis=0),
                            _log(np.maximum.reduceat(tile_weight, start)), child))
        if np.all(size == 1):
            break
        middle = start + size // 2
        split = size > 1
        bounds = np.sort(np.concatenate([start, middle[split]]))
        start, stop = bounds, np.append(bounds[1:], tiles.shape[0])
    return TileTree(tile_lo, tile_hi, _log(tile_weight), tuple(levels))


def _loosened(level):
    """`scalegp.ops.pruning._bounds.loosened` on the host: ``level`` a little lower."""
    return loosened(level, np)


def _raised(level):
    """The other way: ``level`` a little higher."""
    return -loosened(-level, np)


def min_half_sq(q_lo, q_hi, lo, hi, inv_scale):
    """``h``: half the smallest scaled squared distance between the boxes, pair by pair
    ((P, d) each) -> (P,), shrunk by `LOOSE` (a lower bound on the rows' float32 gaps)."""
    return (0.5 * (1 - LOOSE)) * _sq_norms(_scaled_gaps(lo - q_hi, q_lo - hi, inv_scale))


def far_half_sq(q_lo, q_hi, lo, hi, inv_scale):
    """``H``: half the scaled squared gap from the far side of the query box to the key box, at
    least every row's own half squared gap (grown by `LOOSE`)."""
    return (0.5 * (1 + LOOSE)) * _sq_norms(_scaled_gaps(lo - q_lo, q_hi - hi, inv_scale))


def _scaled_gaps(a, b, inv_scale):
    """``max(a, b, 0) * inv_scale``, in ``a``'s memory (the descent's largest temporaries)."""
    np.maximum(a, b, out=a)
    np.maximum(a, 0.0, out=a)
    a *= inv_scale
    return a


def _sq_norms(gap):
    return np.einsum("pd,pd->p", gap, gap)


def _rows(a, index):
    """``a[index]`` along the first axis: `np.take`, several times faster than fancy indexing
    on an (n, d) array."""
    return np.take(a, index, axis=0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Pairs (query tile, key tile) as lists per query tile: ``tiles`` (P,) int32 key tiles,
    ascending within each query tile's run ``[start[i], start[i] + count[i])``; start, count
    (tq,) int32. ``tiles`` is padded (with 0) to a length that changes seldom, so that a new
    plan seldom needs a new compilation."""

    tiles: np.ndarray
    start: np.ndarray
    count: np.ndarray

    @property
    def pairs(self) -> int:
        return int(self.count.sum())


def joined(plans, n_q: int | None = None) -> Plan:
    """One plan of several plans' query tiles, in the order given, without their padding (for
    counting and inspection: a pass needs `padded_length`); only the first ``n_q`` query tiles
    (default all)."""
    count = np.concatenate([plan.count for plan in plans])[:n_q]
    tiles = np.concatenate([plan.tiles[:plan.pairs] for plan in plans])[:int(count.sum())]
    start = (np.cumsum(count) - count).astype(np.int32)
    return Plan(tiles, start, count)


def padded_length(p: int) -> int:
    """Length of a plan of p pairs: the next power of 2 (at least 8). Each length is a new
    compilation of the passes over the plan (seconds), while the padding is only stored, never
    visited (the passes stop at each run's count): one length per octave, as a bandwidth search
    moves through a few octaves of plan sizes."""
    return max(8, 1 << (p - 1).bit_length())


def _plan(q, t, n_q: int, n_t: int) -> Plan:
    """The pairs (query tile q, key tile t), each once, of n_q query and n_t key tiles as a
    `Plan`."""
    count = np.bincount(q, minlength=n_q).astype(np.int32)
    start = (np.cumsum(count) - count).astype(np.int32)
    tiles = np.zeros(padded_length(len(q)), np.int32)
    # distinct pairs: one sort of q·n_t + t orders them by query tile, then key tile (several
    # times faster than np.lexsort of the two)
    tiles[:len(q)] = np.sort(q.astype(np.int64) * n_t + t) % n_t
    return Plan(tiles, start, count)


def descend(tree: TileTree, n_q: int, keep):
    """(q, t): the pairs of query tile q and key tile t that ``keep(level, q, nodes)`` -> bool
    passed at every depth down to the tile, tested breadth first over all query tiles."""
    q, nodes = np.arange(n_q), np.zeros(n_q, np.int64)
    found_q, found_t = [], []
    for level in tree.levels:
        passed = keep(level, q, nodes)
        q, nodes = q[passed], nodes[passed]
        leaf = level.stop[nodes] - level.start[nodes] == 1
        found_q.append(q[leaf])
        found_t.append(level.start[nodes[leaf]])
        q, nodes = q[~leaf], level.child[nodes[~leaf]]
        q, nodes = np.repeat(q, 2), np.stack([nodes, nodes + 1], axis=1).reshape(-1)
    return np.concatenate(found_q), np.concatenate(found_t)


def near_plan(tree: TileTree, q_lo, q_hi, inv_scale, log_tol: float) -> Plan:
    """The key tiles that may be near to a row of each query tile (module docstring), from the
    query tiles' boxes (tq, d) each."""
    n_q = q_lo.shape[0]
    least_top = np.full(n_q, -np.inf)  # a lower bound on Λ_Q

    def met(q, t, q_box, t_box):
        value = tree.log_weight[t] - far_half_sq(*q_box, *t_box, inv_scale)
        np.maximum.at(least_top, q, _loosened(value))

    def threshold(q):  # formed per query tile, then gathered: the same numbers
        return _loosened(least_top + 0.5 * log_tol)[q]

    def keep(level, q, nodes):
        q_box = _rows(q_lo, q), _rows(q_hi, q)
        middle = (level.start[nodes] + level.stop[nodes]) // 2  # Λ_Q tightened first
        met(q, middle, q_box, (_rows(tree.tile_lo, middle), _rows(tree.tile_hi, middle)))
        bound = level.log_max_weight[nodes] - min_half_sq(
            *q_box, _rows(level.lo, nodes), _rows(level.hi, nodes), inv_scale)
        return bound >= threshold(q)

    q, t = descend(tree, n_q, keep)
    q_box, t_box = (_rows(q_lo, q), _rows(q_hi, q)), (_rows(tree.tile_lo, t),
                                                      _rows(tree.tile_hi, t))
    met(q, t, q_box, t_box)
    bound = tree.log_weight[t] - min_half_sq(*q_box, *t_box, inv_scale)
    kept = bound >= threshold(q)
    return _plan(q[kept], t[kept], n_q, tree.log_weight.shape[0])


def rest_plan(tree: TileTree, q_lo, q_hi, inv_scale, log_tol: float, least_level, most_top
              ) -> Plan:
    """The key tiles a row of each query tile may add for its rest (module docstring), given
    ``least_level`` (tq,) the smallest of its rows' levels and ``most_top`` (tq,) the largest of
    their largest bounds (both from the near pass)."""

    least = _loosened(least_level)  # per query tile, then gathered: the same numbers

    def keep(level, q, nodes):
        bound = -min_half_sq(_rows(q_lo, q), _rows(q_hi, q), _rows(level.lo, nodes),
                             _rows(level.hi, nodes), inv_scale)
        return (bound > least[q]) & np.isfinite(level.log_max_weight[nodes])

    q, t = descend(tree, q_lo.shape[0], keep)
    sure = tree.log_weight[t] - far_half_sq(_rows(q_lo, q), _rows(q_hi, q),
                                            _rows(tree.tile_lo, t), _rows(tree.tile_hi, t),
                                            inv_scale)
    listed = (_loosened(sure) < _raised(most_top + 0.5 * log_tol)[q]) & np.isfinite(
        tree.log_weight[t])
    return _plan(q[listed], t[listed], q_lo.shape[0], tree.log_weight.shape[0])
