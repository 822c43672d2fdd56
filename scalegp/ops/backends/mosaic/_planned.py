"""The host-planned pruned KDE on Mosaic kernels (issue 61): the passes of
`scalegp.ops.pruning.PlannedDensity` (read its module first), each one kernel over a flat
sequence of visits.

Why: the in-program plans of `_pruned` test every query row against every key tile, O(n · m /
block) work per call (at 10^7 points, 4·10^11 tests), while the host's tree descent lists only
the tile pairs within reach. These kernels run the listed pairs, one grid step per (query tile,
key tile) pair read from scalar-prefetched arrays, as megablox's grouped matmul walks its
groups::

    grid (steps s,)   query tile i = rows[s] >> MODE_BITS, key tile t = keys[s], and the
                      step's mode (rows[s]'s low bits: FIRST, LAST, EMPTY)
    near pass         per query tile its near list, each row adding the tiles its near test
                      admits (`lse_near`) against its largest bound ``top``, which gathers
                      over the listed pairs give beforehand (`largest_bounds`), not a sweep
                      of its own (a Mosaic sweep of the bounds alone took several times as
                      long on a TPU v5e: docs/decisions.md #55)
    rest pass         per query tile its rest list, each row adding the tiles `lse_rest` admits
                      against its level

A query tile's steps are consecutive, so its rows' running sums stay in VMEM scratch across
them and its output block is written back once, when the next query tile's steps begin (the
grid's one axis is "arbitrary"). A query tile with an empty list takes one step that only writes
its state out. Each row's tests come from its own coordinates and the key tile's box, as
`pruning._bounds.lse_bounds` forms them, so a row's result does not depend on its tile-mates;
the pairs come from the coordinate differences, one feature at a time
(`_pruned.scaled_exponents`, no expansion: narrow kernels on offset data keep their digits),
the final log from `accurate_log` (the TPU's log errs by 1e-4).

Key operands are laid out once per density (`KeyOperands`): the keys feature-major with their
weights and log-weights as two more rows, (d + 2, m), and the tiles' boxes one lane per tile.
The boxes sit whole in VMEM (one copy per call); the key tiles stay in device memory and the
kernel copies each `PREFETCH_DEPTH` - 1 steps ahead of its use (`KeyTileRing`), so that a step
shorter than a copy's latency need not wait for it. A call's steps are at most
`MAX_STEPS` (the prefetched arrays live in SMEM, 1 MiB on a v5e); a longer plan runs as several
calls over runs of whole query tiles, each writing its tiles' rows into the outputs the earlier
calls filled (aliased).

Forward only, with no leave-one-out form (its `PlannedPasses` say ``loo=False``): the chip's
cross-validation runs on the in-program objective (`scalegp.kde._loo`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._profiles import bound_safety
from scalegp.ops._tile_math import accurate_log, lse_step
from scalegp.ops._tiling import BlockSizes, pad_axis, round_up
from scalegp.ops.backends.mosaic._blocks import (
    LANES,
    KeyTileRing,
    call,
    device_memory_spec,
    smem_spec,
    vmem_spec,
)
from scalegp.ops.backends.mosaic._pruned import scaled_exponents
from scalegp.ops.pruning import (
    PRUNE_BLOCK,
    Plan,
    PlannedPasses,
    lse_level,
    lse_setup,
    padded_length,
)
from scalegp.ops.pruning import PlannedDensity as HostPlannedDensity

#: A step's mode, the low bits of its ``rows`` entry: the query tile's first step (set up its
#: running state), its last (write it out), a tile with nothing listed (no pair work).
FIRST, LAST, EMPTY = 1, 2, 4
MODE_BITS = 3
#: Steps per kernel call at most: two int32 arrays of this length in SMEM (1 MiB on a v5e).
MAX_STEPS = 1 << 15
#: Key tiles in VMEM at once (`KeyTileRing`): each step's copy starts this many steps less one
#: ahead, to land while the steps before it run.
PREFETCH_DEPTH = 8
#: The tiles' height of the chip's host-planned path, queries' and keys' alike: four lane
#: widths. Taller tiles have looser boxes (more pairs visited) but fewer grid steps, and a
#: step's fixed work (its rows' bounds, the row reductions of the log-sum-exp) is spread over
#: more pairs; on a TPU v5e 512 scored faster than 256 at 10^6 and 10^7 points (docs/decisions.md
#: #55).
PLANNED_BLOCK = 2 * PRUNE_BLOCK


def planned_block(d: int) -> int:
    """The tile height of the Mosaic `PlannedDensity` (`PLANNED_BLOCK` at every d)."""
    del d
    return PLANNED_BLOCK


class KeyOperands(NamedTuple):
    """The keys as the kernels read them, made once per density: ``keys`` (d + 2, m_pad)
    float32, the coordinates feature-major with the weights and their logs (`lse_setup`'s) as
    the last two rows; ``boxes`` (round_up(2d + 2, 8), tk_pad) float32, per key tile (one lane
    each) its lower corner, its upper corner, the log of its weight and its weight; the tiles'
    total weight (tk,)."""

    keys: jax.Array
    boxes: jax.Array
    tile_weight: jax.Array

    @property
    def height(self) -> int:
        """Keys per tile."""
        return self.keys.shape[1] // self.tile_weight.shape[0]


@jax.jit
def key_operands(y, w) -> KeyOperands:
    """`KeyOperands` of key tiles y (tk, q, d) and their weights w (tk, q)."""
    (tk, q, d), f32 = y.shape, jnp.float32
    ((lo, hi), tile_weight, log_tile_weight), lw = lse_setup(y, w)
    keys = jnp.concatenate([y.reshape(tk * q, d).T, w.reshape(1, -1), lw.reshape(1, -1)])
    boxes = jnp.concatenate([lo.T, hi.T, log_tile_weight[None], tile_weight[None]])
    boxes = pad_axis(pad_axis(boxes, round_up(2 * d + 2, 8), axis=0), round_up(tk, LANES),
                     axis=1)
    return KeyOperands(keys.astype(f32), boxes.astype(f32), tile_weight)


def visit_steps(plan: Plan):
    """A plan's visits as grid steps: (keys, rows) int32, each (steps,), grouped by query tile
    in order, a query tile with an empty list taking one step."""
    count = plan.count.astype(np.int64)
    per = np.maximum(count, 1)
    tile = np.repeat(np.arange(count.shape[0]), per)
    first = np.cumsum(per) - per
    k = np.arange(tile.shape[0]) - first[tile]
    listed = count[tile] > 0
    keys = np.where(listed, plan.tiles[np.where(listed, plan.start[tile] + k, 0)], 0)
    mode = FIRST * (k == 0) | LAST * (k == per[tile] - 1) | EMPTY * ~listed
    return keys.astype(np.int32), ((tile << MODE_BITS) | mode).astype(np.int32)


def _pair_tiles(plan: Plan) -> np.ndarray:
    """(plan.pairs,) int32: each listed pair's query tile (the runs lie in query-tile order, as
    `pruning._tree` makes them)."""
    return np.repeat(np.arange(plan.count.shape[0], dtype=np.int32), plan.count)


#: Listed pairs per gather of `_tops`: one compiled shape whatever a plan's length, and a
#: gather of at most this many query tiles' rows at once (a plan's padding is not gathered).
TOPS_PAIRS = 1 << 14


@functools.partial(jax.jit, static_argnames=("safety",), donate_argnames=("top",))
def _tops(top, x, pair_tiles, key_tiles, boxes, inv_scale, safety: float):
    """``top`` (tq, p) raised to each row's largest bound ``log W_T - δ²_iT / 2`` over some of
    its query tile's near pairs, as `_kernel` forms a bound: x (tq, p, d) query tiles, the
    pairs (query tile ``pair_tiles``, -1 for padding; key tile ``key_tiles``), the
    `KeyOperands` boxes. A gather over the listed pairs, not a sweep of the kernel: a near list
    is then visited once."""
    tq, p, d = x.shape
    valid = pair_tiles >= 0
    box = boxes.T[key_tiles]  # (P, rows): lower corner, upper corner, log W, W
    rows = x[jnp.where(valid, pair_tiles, 0)].astype(jnp.float32)  # (P, p, d)
    lo, hi = box[:, None, :d], box[:, None, d:2 * d]
    gap = jnp.maximum(jnp.maximum(lo - rows, rows - hi), 0.0) * inv_scale.astype(jnp.float32)
    total = gap[..., 0] * gap[..., 0]
    for f in range(1, d):
        total = total + gap[..., f] * gap[..., f]
    bound = box[:, None, 2 * d] - (0.5 * safety) * total
    bound = jnp.where(valid[:, None], bound, -jnp.inf)
    return jnp.maximum(top, jax.ops.segment_max(bound, jnp.where(valid, pair_tiles, tq),
                                                num_segments=tq))


def largest_bounds(x, plan: Plan, boxes, inv_scale):
    """Each row's largest bound over its query tile's near list (`_tops`), (tq, p) float32
    (-inf where the list is empty), gathered `TOPS_PAIRS` listed pairs at a time."""
    tq, p, d = x.shape
    top = jnp.full((tq, p), -jnp.inf, jnp.float32)
    pair_tiles = _pair_tiles(plan)
    for begin in range(0, plan.pairs, TOPS_PAIRS):
        end = min(begin + TOPS_PAIRS, plan.pairs)
        tiles, keys = np.full(TOPS_PAIRS, -1, np.int32), np.zeros(TOPS_PAIRS, np.int32)
        tiles[: end - begin], keys[: end - begin] = pair_tiles[begin:end], plan.tiles[begin:end]
        top = _tops(top, x, tiles, keys, boxes, inv_scale, safety=bound_safety(jnp.float32, d))
    return top


def _segments(rows: np.ndarray, length: int):
    """Cuts of the steps into runs of whole query tiles, each of at most ``length`` steps or of
    one query tile whose steps alone are more: [(begin, end)]."""
    starts = np.append(np.flatnonzero(rows & FIRST), rows.shape[0])
    cuts, begin = [], 0
    while begin < rows.shape[0]:
        end = int(starts[np.searchsorted(starts, begin + length, side="right") - 1])
        if end <= begin:  # one query tile longer than ``length``: alone
            end = int(starts[np.searchsorted(starts, begin, side="right")])
        cuts.append((begin, end))
        begin = end
    return cuts


def _row_bounds(box_ref, t, x, inv_ref, d: int, safety: float):
    """Each row's bound on key tile t, ``log W_t - safety · δ²/2`` (`lse_bounds`'s), (block,
    1), from the tile's box column (one lane of its 128 in ``box_ref``), and whether the tile
    holds any weight."""
    box = box_ref[:, pl.ds(pl.multiple_of(lax.div(t, jnp.int32(LANES)) * LANES, LANES), LANES)]
    lane = lax.broadcasted_iota(jnp.int32, box.shape, 1)
    column = jnp.sum(jnp.where(lane == lax.rem(t, jnp.int32(LANES)), box, 0.0), axis=1,
                     keepdims=True)
    total = None
    for f in range(d):
        xf = x[:, f:f + 1]
        gap = jnp.maximum(jnp.maximum(column[f:f + 1] - xf, xf - column[d + f:d + f + 1]),
                          0.0) * inv_ref[f]
        total = gap * gap if total is None else total + gap * gap
    neg_half_sq = -((0.5 * safety) * total)
    return neg_half_sq, column[2 * d:2 * d + 1], column[2 * d + 1:2 * d + 2] > 0


def _kernel(keys, rows, inv_ref, x_ref, key_source, box_ref, *refs, d: int, near: bool,
            log_tol: float, safety: float):
    *refs, buffers, semaphores = refs
    key_ref = KeyTileRing(key_source, buffers, semaphores, lambda step: keys[step],
                          buffers.shape[2]).current()
    if near:
        top_ref, _, _, max_out, sum_out, run_max, run_sum = refs
    else:
        max_in, sum_in, top_ref, level_ref, _, out_ref, run_max, run_sum = refs
    s = pl.program_id(0)
    mode, t = rows[s] & (2 ** MODE_BITS - 1), keys[s]

    @pl.when((mode & FIRST) != 0)
    def _():
        if near:
            run_max[...] = jnp.full(run_max.shape, -jnp.inf, jnp.float32)
            run_sum[...] = jnp.zeros(run_sum.shape, jnp.float32)
        else:
            run_max[...], run_sum[...] = max_in[...], sum_in[...]

    @pl.when((mode & EMPTY) == 0)
    def _():
        x = x_ref[...]
        neg_half_sq, log_weight, positive = _row_bounds(box_ref, t, x, inv_ref, d, safety)
        near_tile = (log_weight + neg_half_sq >= top_ref[...] + 0.5 * log_tol) & positive
        add = near_tile if near else (neg_half_sq > level_ref[...]) & positive & ~near_tile
        block = key_ref[...]
        e = scaled_exponents(x, block[:d], inv_ref, d)
        old_max, old_sum = run_max[...], run_sum[...]
        new_max, new_sum, _, _ = lse_step(old_max, old_sum, e, block[d:d + 1],
                                          block[d + 1:d + 2])
        run_max[...] = jnp.where(add, new_max, old_max)
        run_sum[...] = jnp.where(add, new_sum, old_sum)

    @pl.when((mode & LAST) != 0)
    def _():
        if near:
            max_out[...], sum_out[...] = run_max[...], run_sum[...]
        else:
            out_ref[...] = run_max[...] + accurate_log(run_sum[...])


@functools.partial(jax.jit, static_argnames=("block", "near", "log_tol", "depth", "interpret"),
                   donate_argnames=("outs",))
def _call(keys, rows, steps, inv, x_rows, operands: KeyOperands, per_row, outs, *, block: int,
          near: bool, log_tol: float, depth: int, interpret: bool):
    """One kernel call of the near or the rest pass over the first ``steps`` (a device
    scalar) of the prefetched (keys, rows): query rows x_rows (n, d) in tiles of ``block``, the
    rows' inputs ``per_row`` and the outputs so far ``outs`` ((n, 1) float32 each), returned
    with this call's query tiles written (the rest as they came)."""
    (n, d), q = x_rows.shape, operands.height
    tile_rows = lambda s, keys, rows: (rows[s] >> MODE_BITS, 0)  # noqa: E731
    row_spec = pl.BlockSpec((block, 1), tile_rows)
    in_specs = [
        smem_spec(),
        pl.BlockSpec((block, d), tile_rows),
        device_memory_spec(),
        vmem_spec(),
    ] + [row_spec] * (len(per_row) + len(outs))
    first_out = 4 + len(per_row)
    return tuple(call(
        functools.partial(_kernel, d=d, near=near, log_tol=log_tol,
                          safety=bound_safety(jnp.float32, d)),
        (steps,), in_specs, [row_spec] * len(outs),
        [jax.ShapeDtypeStruct((n, 1), jnp.float32)] * len(outs),
        [(block, 1)] * 2 + KeyTileRing.scratch(d + 2, q, depth),
        BlockSizes(block_q=block, block_k=q), interpret,
        f"rbf_planned_logsumexp_{'near' if near else 'rest'}",
        prefetch=(keys, rows), aliases={first_out + k: k for k in range(len(outs))},
        semantics=("arbitrary",),
    )(inv, x_rows, operands.keys, operands.boxes, *per_row, *outs))


def _run(plan: Plan, x, inv_scale, operands, per_row, outs, **settings):
    """The kernel calls of one pass over ``plan``: its steps (`visit_steps`) in runs of whole
    query tiles, each run's arrays `MAX_STEPS` long (one compiled shape; the grid stops at the
    run's own steps). -> the outputs."""
    keys, rows = visit_steps(plan)
    tq, p, d = x.shape
    x_rows = x.reshape(tq * p, d).astype(jnp.float32)
    inv = inv_scale.astype(jnp.float32)
    for begin, end in _segments(rows, MAX_STEPS):
        size = max(MAX_STEPS, padded_length(end - begin))  # more only for one long tile
        run_keys, run_rows = (np.zeros(size, np.int32) for _ in range(2))
        run_keys[: end - begin], run_rows[: end - begin] = keys[begin:end], rows[begin:end]
        outs = _call(run_keys, run_rows, np.int32(end - begin), inv, x_rows, operands, per_row,
                     outs, block=p, depth=PREFETCH_DEPTH, **settings)
    return outs


def _columns(count: int, n: int):
    return tuple(jnp.zeros((n, 1), jnp.float32) for _ in range(count))


@functools.partial(jax.jit, static_argnames=("q", "log_tol"))
def _levels(run_max, run_sum, tile_weight, q: int, log_tol: float):
    return lse_level(run_max, run_sum, tile_weight, q, log_tol)


def _near(operands, interpret, x, y, w, inv_scale, plan, log_tol, own, moments):
    del y, w  # the keys read from ``operands``, laid out once
    if own is not None or moments:
        raise NotImplementedError("the Mosaic planned passes have no leave-one-out form")
    tq, p, d = x.shape
    top = largest_bounds(x, plan, operands.boxes, inv_scale)
    run_max, run_sum = (a.reshape(tq, p) for a in _run(
        plan, x, inv_scale, operands, (top.reshape(tq * p, 1),), _columns(2, tq * p),
        near=True, log_tol=log_tol, interpret=interpret))
    level = _levels(run_max, run_sum, operands.tile_weight, operands.height, log_tol)
    return (run_max, run_sum), top, level


def _rest(operands, interpret, x, y, w, inv_scale, plan, state, top, level, log_tol, own):
    del y, w, own
    tq, p, _ = x.shape
    per_row = tuple(a.reshape(tq * p, 1) for a in (*state, top, level))
    (out,) = _run(plan, x, inv_scale, operands, per_row, _columns(1, tq * p), near=False,
                  log_tol=log_tol, interpret=interpret)
    return out.reshape(tq, p).astype(x.dtype)


#: ``prune="auto"`` scores on this path up to this share of visited tile pairs (`pays`): a
#: visited pair costs several times an unpruned one on the chip (a grid step per tile pair,
#: each with its bounds), so the break-even share is far below the xla path's
#: (`AUTO_MAX_VISITED`; docs/decisions.md #53).
MAX_VISITED = 0.06


class PlannedDensity(HostPlannedDensity):
    """`scalegp.ops.pruning.PlannedDensity` on Mosaic kernels: the keys' operands laid out once
    (`key_operands`), each call's passes as in the module docstring; ``interpret`` runs the
    kernels in interpret mode (a CPU, for tests). A batch of queries takes tiles of the keys'
    height; ``prune="auto"`` takes this path up to `MAX_VISITED`."""

    max_visited = MAX_VISITED

    def _host_build(self):
        self.operands = key_operands(self.keys.tiles, self.weights)

    def _place(self, device):
        super()._place(device)
        self.operands = jax.device_put(self.operands, device)

    def __getstate__(self):  # the operands are made again from the keys
        return {**super().__getstate__(), "operands": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.operands = key_operands(self.keys.tiles, self.weights)

    @property
    def passes(self) -> PlannedPasses:
        return PlannedPasses(near=functools.partial(_near, self.operands, self.interpret),
                             rest=functools.partial(_rest, self.operands, self.interpret),
                             loo=False)
