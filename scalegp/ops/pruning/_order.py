"""The k-d order of the pruned products (`scalegp.ops.pruning._rules`): points sorted so that every
tile of ``block`` consecutive points is one leaf with a small bounding box, and the tiles of
points and values in that order."""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp._runtime import usable_cores
from scalegp.ops._tiling import round_up


def _split_levels(num_tiles: int) -> list[np.ndarray]:
    """Static segment ids (one per tile) of each level of the balanced split of ``num_tiles``
    tiles: a segment of t >= 2 tiles is split into its first ``t // 2`` and the rest."""
    segments = [(0, num_tiles)]
    levels = []
    while any(t1 - t0 > 1 for t0, t1 in segments):
        ids = np.empty(num_tiles, np.int32)
        for k, (t0, t1) in enumerate(segments):
            ids[t0:t1] = k
        levels.append(ids)
        segments = [part for t0, t1 in segments
                    for part in (((t0, t0 + (t1 - t0) // 2), (t0 + (t1 - t0) // 2, t1))
                                 if t1 - t0 > 1 else ((t0, t1),))]
    return levels


def identity_order(m: int, block: int):
    """The permutation that keeps m points in their order, padded to whole tiles of ``block``
    (for keys already in `spatial_order`, or not worth sorting)."""
    return jnp.arange(round_up(m, block), dtype=jnp.int32)


#: `kd_order` packs a row's position under its key where this many bits (or more) are left
#: for the coordinate within its segment (4,096 steps: ties, which only loosen a box, are rare).
MIN_PACKED_COORDINATE_BITS = 12


def kd_order(x, scale, block: int):
    """A permutation that puts the rows of x (n, d) in k-d order, tiles of ``block`` rows as
    leaves: at each level every segment of tiles is sorted along its widest axis (in units of
    ``scale``) and cut at a tile boundary near its median. jit-compatible (static shapes).

    Each level is one sort of 32-bit integers: the segment in the high bits, the coordinate
    quantised within the segment's extent in the low ones (cheaper than sorting float keys
    within segments; ties from the quantisation only loosen the boxes a little). Where the
    bits allow (`MIN_PACKED_COORDINATE_BITS`), the row's position sits under the coordinate
    and the sort carries no permutation beside its keys.

    Returns (n_pad,) int32, ``n_pad = round_up(n, block)``; entries ``>= n`` are padding, and
    they all come last."""
    n, d = x.shape
    n_pad = round_up(n, block)
    num_tiles = n_pad // block
    scaled = jnp.concatenate([x * (1 / scale), jnp.zeros((n_pad - n, d), x.dtype)])
    valid = jnp.arange(n_pad) < n
    perm = jnp.arange(n_pad, dtype=jnp.int32)
    position_bits = max(1, (n_pad - 1).bit_length())
    for tile_segments in _split_levels(num_tiles):
        num_segments = int(tile_segments[-1]) + 1
        segment = np.repeat(tile_segments, block)
        points, real = scaled[perm], valid[perm]
        # per tile first (a reshape), then per segment of tiles: a scatter over tiles, not rows
        tiled = (num_tiles, block, d)
        lo = jax.ops.segment_min(
            jnp.min(jnp.where(real[:, None], points, jnp.inf).reshape(tiled), axis=1),
            tile_segments, num_segments, indices_are_sorted=True)
        hi = jax.ops.segment_max(
            jnp.max(jnp.where(real[:, None], points, -jnp.inf).reshape(tiled), axis=1),
            tile_segments, num_segments, indices_are_sorted=True)
        width = jnp.where(hi > lo, hi - lo, 0.0)  # 0 for segments of padding alone
        axis = jnp.argmax(width, axis=1)
        key_bits = 32 - max(1, (num_segments - 1).bit_length())
        # the row's position in the low bits when they leave room for a fine coordinate: a
        # sort of one array, not of keys and a permutation (docs/decisions.md #39)
        coordinate_bits = key_bits - position_bits if key_bits - position_bits >= \
            MIN_PACKED_COORDINATE_BITS else key_bits
        top = 2 ** coordinate_bits - 2  # real keys in [0, top], padding top + 1: last in segment
        start = jnp.take_along_axis(lo, axis[:, None], axis=1)[:, 0][segment]
        span = jnp.take_along_axis(width, axis[:, None], axis=1)[:, 0][segment]
        coordinate = jnp.take_along_axis(points, axis[segment][:, None], axis=1)[:, 0]
        fraction = jnp.where(span > 0, (coordinate - start) / jnp.where(span > 0, span, 1.0), 0.0)
        # clamped as an integer: float32 rounds ``top`` (up to 2^31 - 2) up to 2^key_bits, and
        # a key there lands in the next segment's range, which took a segment's farthest row
        # into its neighbour (a loose box below it at every later level)
        quantised = jnp.minimum(jnp.clip(fraction * top, 0, top).astype(jnp.uint32),
                                jnp.uint32(top))
        key = jnp.where(real, quantised, jnp.uint32(top + 1))
        segment_key = jnp.asarray(segment, jnp.uint32) << key_bits
        if coordinate_bits == key_bits:
            _, perm = lax.sort((key | segment_key, perm), num_keys=1, is_stable=False)
        else:
            key = segment_key | (key << position_bits) | jnp.arange(n_pad, dtype=jnp.uint32)
            position = lax.sort(key, is_stable=False) & jnp.uint32(2 ** position_bits - 1)
            perm = perm[position.astype(jnp.int32)]
    return perm


#: From this many rows `host_kd_order` splits the top levels of all rows, then orders each
#: part's rows in a thread of its own (numpy's sorts release the GIL; docs/decisions.md #53).
PARALLEL_ROWS = 1 << 20


def host_kd_order(x, scale, block: int) -> np.ndarray:
    """`kd_order` on the host (numpy, not under jit): the same splits (each segment of tiles
    along its widest axis in units of ``scale``, cut at the tile boundary ``t // 2``) and the
    same 32-bit keys (the segment in the high bits, the coordinate quantised within the
    segment's extent in the low ones), one integer sort per level, with no program to compile
    (`kd_order`'s compilation took most of a million-point fit's ordering). Ties may be
    ordered otherwise than `kd_order` orders them; either order is valid (it decides only how
    tight the tiles' boxes are). From `PARALLEL_ROWS` rows, the segments below the top levels
    are ordered apart, in threads (each with the keys of its own, finer, quantisation).

    Returns (n_pad,) int32, ``n_pad = round_up(n, block)``; entries ``>= n`` are padding, and
    they all come last."""
    x = np.asarray(x)
    inv = np.broadcast_to(1 / np.asarray(scale, np.float64), (x.shape[1],)).astype(x.dtype)
    perm = _host_order(x * inv, block, x.shape[0] >= PARALLEL_ROWS)
    n = x.shape[0]
    return np.concatenate([perm, np.arange(n, round_up(n, block))]).astype(np.int32)


def _host_order(points, block: int, parallel: bool) -> np.ndarray:
    """`host_kd_order`'s permutation of the real rows of ``points`` (scaled), with the
    segments below the top levels in threads where ``parallel`` (and several cores)."""
    n = points.shape[0]
    levels = _split_levels(round_up(n, block) // block)
    parts = min(usable_cores(), 1 << max(0, len(levels) - 1))
    top = (parts - 1).bit_length() if parallel and parts > 1 else len(levels)
    perm = _ordered_by_levels(points, np.arange(n, dtype=np.int64), levels[:top], block)
    if top == len(levels):
        return perm
    starts = np.flatnonzero(np.diff(levels[top], prepend=-1)) * block
    bounds = np.append(np.minimum(starts, n), n)

    def part(k):
        rows = perm[bounds[k]:bounds[k + 1]]
        return rows[_host_order(points[rows], block, False)]

    with concurrent.futures.ThreadPoolExecutor(parts) as pool:
        return np.concatenate(list(pool.map(part, range(starts.shape[0]))))


def _ordered_by_levels(points, perm, levels, block: int) -> np.ndarray:
    """``perm`` (the real rows) reordered by the split ``levels`` (`_split_levels`' first
    ones), one integer sort per level."""
    n = points.shape[0]
    for tile_segments in levels:
        num_segments = int(tile_segments[-1]) + 1
        seg_start = np.searchsorted(tile_segments, np.arange(num_segments)) * block
        seg_start = np.minimum(seg_start, n)
        seg_of_row = np.repeat(tile_segments, block)[:n]
        ordered = points[perm]
        lo = np.minimum.reduceat(ordered, seg_start, axis=0)
        hi = np.maximum.reduceat(ordered, seg_start, axis=0)
        empty = np.append(seg_start[1:], n) == seg_start  # segments of padding alone
        width = np.where(empty[:, None] | ~(hi > lo), 0.0, hi - lo)
        axis = np.argmax(width, axis=1)
        key_bits = 32 - max(1, (num_segments - 1).bit_length())
        top = 2 ** key_bits - 2
        start = np.take_along_axis(lo, axis[:, None], axis=1)[:, 0][seg_of_row]
        span = np.take_along_axis(width, axis[:, None], axis=1)[:, 0][seg_of_row]
        coordinate = ordered[np.arange(n), axis[seg_of_row]]
        # in float64: float32 would round the largest key (top < 2^31) up into the next
        # segment's range
        fraction = (coordinate - start).astype(np.float64) / np.where(span > 0, span, 1.0)
        key = np.clip(fraction * top, 0, top).astype(np.uint32)
        key |= seg_of_row.astype(np.uint32) << np.uint32(key_bits)
        perm = perm[np.argsort(key)]
    return perm


def ordered_tiles(x, perm, block: int):
    """x (n, d) in the order ``perm`` (from `kd_order`; None: x's own order), as
    (tiles, block, d); padded rows repeat the last real row, so that they do not widen the last
    tile's box. None pads instead of gathering: a gather by the identity costs a pass over
    every row, which a few queries' product against keys in order should not pay."""
    n = x.shape[0]
    if perm is None:
        pad = round_up(n, block) - n
        rows = jnp.concatenate([x, jnp.broadcast_to(x[n - 1:], (pad, x.shape[1]))]) if pad else x
        return rows.reshape(-1, block, x.shape[1])
    last_real = perm[n - 1]
    rows = jnp.where(perm < n, perm, last_real)
    return x[rows].reshape(-1, block, x.shape[1])


def tile_values(v, perm, block: int):
    """v (n, ...) in the order ``perm`` (None: v's own), zero on padded rows, as
    (tiles, block, ...)."""
    n = v.shape[0]
    if perm is None:
        pad = [(0, round_up(n, block) - n)] + [(0, 0)] * (v.ndim - 1)
        return jnp.pad(v, pad).reshape((-1, block) + v.shape[1:])
    out = jnp.where((perm < n).reshape((-1,) + (1,) * (v.ndim - 1)), v[jnp.minimum(perm, n - 1)],
                    0)
    return out.reshape((-1, block) + v.shape[1:])


def unordered(rows, perm, n: int):
    """Rows computed in the order ``perm`` (n_pad, ...; None: the caller's) back in the caller's
    order (n, ...)."""
    if perm is None:
        return rows[:n]
    return jnp.zeros((n,) + rows.shape[1:], rows.dtype).at[perm].set(rows, mode="drop")
