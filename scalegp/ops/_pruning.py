"""Pruned RBF (and Matérn) reductions: visit only the tiles that can matter (CPU/XLA path).

Points are put in k-d order (`kd_order`): recursive median splits along the widest scaled axis,
so that every tile of ``block`` consecutive points is one leaf with a small bounding box. For a
query row i and a key tile T, the row's gaps to T's box give a rigorous lower bound ``δ²_iT`` on
the scaled squared distance to every key in T, hence an upper bound ``exp(-δ²_iT / 2)`` on its
kernel values. Each row decides from its own bounds which key tiles it adds (never from its
tile-mates'); a query tile visits, in key order, the key tiles any of its rows adds (found from
the tiles' boxes, loosened a little (`loosened`) so that rounding cannot drop one a row needs),
and a row that does not add a visited tile leaves its running sum as it is. So the cost is the
number of visited tile pairs rather than n·m, and a row's result is bitwise the same whatever
other rows share the call.

Rules (``tol`` is ``prune_tol``; the bounds are rigorous, rounding included):

- ``K v`` (`pruned_kernel_mv`): row i skips key tile T when its bound is at most
  ``τ_T = tol/2 · max(1, 1 / (tk s_T))``, ``s_T = max_c ‖v_Tc‖₁ / ‖v_c‖₁`` (`mv_levels`). As
  ``Σ_T τ_T ‖v_Tc‖₁ <= tol ‖v_c‖₁``, the skipped part of ``(K v)_ic`` is at most
  ``tol · ‖v_c‖₁`` for every row and column. With ``tol = 0`` a row skips only tiles whose
  values all underflow to 0 (or whose v is zero): the result is the unpruned sum, term for term.
- KDE (`pruned_kernel_logsumexp`, ``log Σ_j w_j exp(-|(x_i - y_j) / l|² / 2)``): row i first adds
  its near key tiles, those whose bound ``W_T exp(-δ²_iT / 2)`` (``W_T = Σ_{j∈T} w_j``) is within
  ``tol^(1/2)`` of its largest (`lse_near`; `lse_candidates` finds them from the boxes). Their
  sum ``L_i`` is a lower bound on the row's density; the row then adds every other key tile with
  ``exp(-δ²_iT / 2) > tol L_i / W`` (``W = Σ_T W_T``; `lse_rest`), so that what it skips is at
  most ``Σ_T W_T tol L_i / W = tol L_i``: a relative error ``<= tol``. With ``tol = 0`` the level
  is where a term underflows against ``L_i``.

The gradients (custom VJPs) add the same pairs; every skipped gradient term carries the factor
``r e^{-r²/2}`` (r the scaled distance, ``r >= δ_iT``), which for ``δ_iT >= 1`` is at most
``δ_iT e^{-δ²_iT/2}``: the same bound as the values times ``δ_iT``.

``K v`` also takes the Matérn profiles (ν = 1/2, 3/2, 5/2; `profile_values`): the same rule with
the profile's value at the box gap as the bound (every profile decreases in r), so the skipped
part of each output is again at most ``tol · ‖v_c‖₁`` (times the outputscale). A skipped
Matérn gradient term is at most √(2ν) times the value bound. Their tails are exponential, not
Gaussian: at float32's eps/2 they reach 10-17 lengthscales where the RBF reaches 6, and pruning
pays only at correspondingly shorter lengthscales. The rational quadratic and sums and products
of profiles take the generic pruned path of `scalegp.ops._pruning_expression` (same tiles and
rule, a bound built from the expression's terms).

Accuracy: pairs are formed from the raw coordinates, ``((x_i - y_j) / l)²`` summed over features,
not from centred, scaled points and the expansion ``|a|² + |b|² - 2 a·b``: one rounding of the
difference itself, so a narrow kernel on data far from the origin (where pruning pays) keeps full
relative precision.

The Pallas kernels of `scalegp.ops._pallas_pruning` run the same rules (`mv_include`,
`lse_plan`), each row's against every key tile, built there per group of query tiles.

Memory: the plan is built per query tile inside the scan (O(number of key tiles) at a time; a
row's test against one key tile is made where the tile is visited), so no list of tile pairs is
stored; the KDE's backward pass gets each row's level, (n,). O((n + m)(d + o)) in all, forward
and backward.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp.ops._kernels import matern_values_and_slopes
from scalegp.ops._matmul import matmul, matmul_nt, matmul_tn
from scalegp.ops._prepare import centre_of
from scalegp.ops._tiling import (compensated_add, compensated_sum, compensated_zeros, log_weights,
                                 round_up)

#: Tile height of the pruned path (queries and keys): smaller tiles have tighter boxes (more
#: pruning), larger ones less loop overhead per tile pair.
PRUNE_BLOCK = 256


# ----------------------------------------------------------------------------------------------
# spatial order


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


def kd_order(x, scale, block: int):
    """A permutation that puts the rows of x (n, d) in k-d order, tiles of ``block`` rows as
    leaves: at each level every segment of tiles is sorted along its widest axis (in units of
    ``scale``) and cut at a tile boundary near its median. jit-compatible (static shapes).

    Each level is one sort of 32-bit integers: the segment in the high bits, the coordinate
    quantised within the segment's extent in the low ones (cheaper than sorting float keys
    within segments; ties from the quantisation only loosen the boxes a little).

    Returns (n_pad,) int32, ``n_pad = round_up(n, block)``; entries ``>= n`` are padding, and
    they all come last."""
    n, d = x.shape
    n_pad = round_up(n, block)
    num_tiles = n_pad // block
    scaled = jnp.concatenate([x * (1 / scale), jnp.zeros((n_pad - n, d), x.dtype)])
    valid = jnp.arange(n_pad) < n
    perm = jnp.arange(n_pad, dtype=jnp.int32)
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
        top = 2 ** key_bits - 2  # real keys in [0, top], padding top + 1: last in its segment
        start = jnp.take_along_axis(lo, axis[:, None], axis=1)[:, 0][segment]
        span = jnp.take_along_axis(width, axis[:, None], axis=1)[:, 0][segment]
        coordinate = jnp.take_along_axis(points, axis[segment][:, None], axis=1)[:, 0]
        fraction = jnp.where(span > 0, (coordinate - start) / jnp.where(span > 0, span, 1.0), 0.0)
        key = jnp.where(real, jnp.clip(fraction * top, 0, top).astype(jnp.uint32),
                        jnp.uint32(top + 1))
        key = key | (jnp.asarray(segment, jnp.uint32) << key_bits)
        _, perm = lax.sort((key, perm), num_keys=1, is_stable=False)
    return perm


def ordered_tiles(x, perm, block: int):
    """x (n, d) in the order ``perm`` (from `kd_order`), as (tiles, block, d); padded rows repeat
    the last real row, so that they do not widen the last tile's box."""
    n = x.shape[0]
    last_real = perm[n - 1]
    rows = jnp.where(perm < n, perm, last_real)
    return x[rows].reshape(-1, block, x.shape[1])


def tile_values(v, perm, block: int):
    """v (n, ...) in the order ``perm``, zero on padded rows, as (tiles, block, ...)."""
    n = v.shape[0]
    out = jnp.where((perm < n).reshape((-1,) + (1,) * (v.ndim - 1)), v[jnp.minimum(perm, n - 1)],
                    0)
    return out.reshape((-1, block) + v.shape[1:])


def unordered(rows, perm, n: int):
    """Rows computed in the order ``perm`` (n_pad, ...) back in the caller's order (n, ...)."""
    return jnp.zeros((n,) + rows.shape[1:], rows.dtype).at[perm].set(rows, mode="drop")


# ----------------------------------------------------------------------------------------------
# bounds


def _bound_safety(dtype, d: int) -> float:
    """Relative shortfall allowed for a computed squared distance or box gap: each of its
    ``d + 3`` roundings is within eps, doubled to cover both the bound and the pair."""
    return 1.0 - 4.0 * (d + 3) * float(jnp.finfo(dtype).eps)


def underflow_exponent(dtype) -> float:
    """``x`` such that ``exp(-x)`` is below half the dtype's smallest subnormal number (it rounds
    to 0), with a margin for the exponential's own error."""
    info = jnp.finfo(dtype)
    return -math.log(float(info.smallest_subnormal)) + 2.0


def boxes(tiles):
    """(tiles, block, d) -> (lo, hi), each (tiles, d): the tiles' bounding boxes (raw
    coordinates; exact)."""
    return jnp.min(tiles, axis=1), jnp.max(tiles, axis=1)


def box_gaps(lo_q, hi_q, lo_k, hi_k):
    """Per-feature gaps (t, d) between the box (lo_q, hi_q) (d,) and each of the boxes (lo_k,
    hi_k) (t, d): every pair of points in them is at least this far apart in each feature."""
    return jnp.maximum(jnp.maximum(lo_k - hi_q, lo_q - hi_k), 0.0)


def min_half_sq_distance(lo_q, hi_q, lo_k, hi_k, inv_scale):
    """A lower bound on ``|(x - y) / l|² / 2`` for x in the box (lo_q, hi_q) (d,) and y in each
    of the boxes (lo_k, hi_k) (t, d) -> (t,)."""
    gap = box_gaps(lo_q, hi_q, lo_k, hi_k) * inv_scale
    return (0.5 * _bound_safety(gap.dtype, gap.shape[-1])) * jnp.sum(gap * gap, axis=-1)


def row_half_sq(x_t, k_boxes, inv_scale):
    """`min_half_sq_distance` from each row of x_t (p, d) (a box of one point) to each key box
    -> (p, tk): what decides whether the row needs the key tile, from the row alone."""
    lo_k, hi_k = k_boxes
    # features major, key tiles minor: XLA's CPU backend vectorises over the key tiles
    x_f = x_t.T[:, :, None]
    gap = jnp.maximum(jnp.maximum(lo_k.T[:, None, :] - x_f, x_f - hi_k.T[:, None, :]), 0.0)
    gap = gap * jnp.broadcast_to(inv_scale, (x_t.shape[1],))[:, None, None]
    return (0.5 * _bound_safety(gap.dtype, gap.shape[0])) * jnp.sum(gap * gap, axis=0)


def visit_list(visit):
    """(t,) bool -> (indices (t,), count): the visited tiles first, in tile order."""
    return jnp.argsort(~visit, stable=True).astype(jnp.int32), jnp.sum(visit, dtype=jnp.int32)


# ----------------------------------------------------------------------------------------------
# tile arithmetic on raw coordinates


def _differences(x_t, y_t, inv_scale):
    """``(x_i - y_j) / l`` for x_t (p, d), y_t (q, d) -> (p, d, q), keys feature-major (a
    broadcast over contiguous keys vectorises on XLA's CPU backend)."""
    return (x_t[:, :, None] - y_t.T[None, :, :]) * inv_scale[None, :, None]


def _sq(diff):
    """``|D_ij|²`` (p, q) of differences (p, d, q)."""
    return jnp.sum(diff * diff, axis=1)


def _pair_gradients(omega, diff, inv_scale):
    """For weights omega (p, q) on pairs, ``D = (x_i - y_j) / l`` (diff, (p, d, q)): the
    cotangents of x (p, d), y (q, d) and ``1/l`` (d,) of ``Σ_ij omega_ij · (-|D_ij|²/2)``. With
    ``omega = w ∘ (g vᵀ)`` (w of `profile_values`; the RBF's ``w = k``) they are those of
    ``Σ_ij g_i K_ij v_j``, since ``∂k/∂(-|D|²/2) = w``."""
    wd = omega[:, None, :] * diff
    dx = -jnp.sum(wd, axis=2) * inv_scale
    dy = jnp.sum(wd, axis=0).T * inv_scale
    dinv = -jnp.sum(wd * diff, axis=(0, 2)) / inv_scale
    return dx, dy, dinv


# ----------------------------------------------------------------------------------------------
# profiles: the kernel as a function of s = |(x - y) / l|², decreasing in s

#: The RBF, ``exp(-s/2)``; ``("matern", ν)`` is the Matérn of ν in `_kernels.MATERN_NUS`.
RBF_PROFILE = ("rbf",)


def profile_values(profile, s):
    """``(k, w)`` of squared scaled distances s (any shape): the kernel values and
    ``w = -2 ∂k/∂s``, the weight of the pair in every gradient (`_pair_gradients`); the Matérn
    from `scalegp.ops._kernels` (w = 0 at s = 0 for ν = 1/2, its gradient convention)."""
    if profile == RBF_PROFILE:
        k = jnp.exp(-0.5 * s)
        return k, k
    k, slope = matern_values_and_slopes(s, profile[1])
    return k, -2.0 * slope


def _matern_log_value(nu: float, s, log=jnp.log):
    """``log k`` of the Matérn ν at squared scaled distance s (``log=math.log`` for floats)."""
    t = (2.0 * nu * s) ** 0.5
    poly = 1.0 if nu == 0.5 else (1.0 + t if nu == 1.5 else 1.0 + t + t * t / 3.0)
    return log(poly) - t


def log_bound(profile, half_sq):
    """``log k`` at ``s = 2 · half_sq``: with half_sq a lower bound on a tile pair's half squared
    distances, an upper bound on the log of each of its kernel values (profiles decrease)."""
    if profile == RBF_PROFILE:
        return -half_sq
    return _matern_log_value(profile[1], 2.0 * half_sq)


def reach_half_sq(profile, log_level: float) -> float:
    """The half squared scaled distance beyond which ``log k < log_level`` (a static float)."""
    if profile == RBF_PROFILE:
        return -log_level
    nu = profile[1]

    def above(s):
        return _matern_log_value(nu, s, math.log) >= log_level

    lo, hi = 0.0, 1.0
    while above(hi):
        hi *= 2.0
    for _ in range(80):  # bisection on s, where log k decreases
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if above(mid) else (lo, mid)
    return hi / 2.0


# ----------------------------------------------------------------------------------------------
# K v


def mv_levels(v_norms, v_total, tol: float):
    """(tk,) ``log τ_T`` of the ``K v`` rule (module docstring): a row skips key tile T when its
    kernel bound to T's box is at most ``τ_T = tol/2 · max(1, 1 / (tk s_T))``, ``s_T = max_c
    ‖v_Tc‖₁ / ‖v_c‖₁`` (``+inf`` where v is zero on the tile)."""
    share = jnp.where(v_total > 0, v_norms / jnp.where(v_total > 0, v_total, 1.0), 0.0)
    s = jnp.max(share, axis=1)
    base = math.log(tol / 2) if tol > 0 else -math.inf
    level = base + jnp.maximum(0.0, -jnp.log(s.shape[0] * jnp.where(s > 0, s, 1.0)))
    return jnp.where(s > 0, level, jnp.inf)


def mv_include(x_t, k_boxes, levels, inv_scale, profile=RBF_PROFILE):
    """(p, tk) bool: which key tiles each row of the query tile x_t (p, d) adds, by the ``K v``
    rule on its own bounds (`row_half_sq`), so never by its tile-mates'."""
    log_k = log_bound(profile, row_half_sq(x_t, k_boxes, inv_scale))
    return (log_k >= -underflow_exponent(log_k.dtype)) & (log_k > levels[None, :])


#: The visit lists test tile boxes with their bounds and levels loosened by this (relative, in
#: log units), so that a list holds every key tile that a row's own test adds, whatever the
#: rounding of either (the row's gaps are at least the box's).
_LOOSE = 1e-3


def loosened(level):
    """``level`` a little lower (infinite levels as they are)."""
    return jnp.where(jnp.isfinite(level), level - _LOOSE * (1 + jnp.abs(level)), level)


def one_box(k_boxes, t):
    """Key tile t's box as a list of one box, ((1, d), (1, d))."""
    return k_boxes[0][t][None], k_boxes[1][t][None]


def mv_box_visits(x_t, k_boxes, levels, inv_scale, profile=RBF_PROFILE):
    """(tk,) bool: the key tiles the query tile x_t visits for ``K v``: every one that a row of
    it adds (`mv_include`), by the tiles' boxes."""
    lo_q, hi_q = tile_box(x_t)
    half_sq = (1 - _LOOSE) * min_half_sq_distance(lo_q, hi_q, *k_boxes, inv_scale)
    log_k = log_bound(profile, half_sq)
    return (log_k >= loosened(-underflow_exponent(log_k.dtype))) & (log_k > loosened(levels))


def mv_setup(y, v, tol: float):
    """What every query tile's ``K v`` plan shares: the key boxes and `mv_levels`."""
    v_norms = jnp.sum(jnp.abs(v), axis=1)  # (tk, o)
    return boxes(y), mv_levels(v_norms, jnp.sum(v_norms, axis=0), tol)


def tile_box(x_t):
    return jnp.min(x_t, axis=0), jnp.max(x_t, axis=0)


def _visit(count, body, init):
    """``body(k, state) -> state`` for k = 0, ..., count - 1 (count traced)."""
    def step(carry):
        k, state = carry
        return k + 1, body(k, state)

    return lax.while_loop(lambda carry: carry[0] < count, step, (jnp.int32(0), init))[1]


def _mv_forward(x, y, v, inv_scale, tol, profile):
    k_boxes, levels = mv_setup(y, v, tol)

    def one_row_tile(_, x_t):
        idx, count = visit_list(mv_box_visits(x_t, k_boxes, levels, inv_scale, profile))

        def body(k, acc):
            t = idx[k]
            kt = profile_values(profile, _sq(_differences(x_t, y[t], inv_scale)))[0]
            # rows that skip t keep their sum as it is
            keep = mv_include(x_t, one_box(k_boxes, t), levels[t][None], inv_scale, profile)
            return tuple(jnp.where(keep, new, old)
                         for new, old in zip(compensated_add(acc, matmul(kt, v[t])), acc))

        total = compensated_zeros((x_t.shape[0], v.shape[2]), v.dtype)
        return None, compensated_sum(_visit(count, body, total))

    _, out = lax.scan(one_row_tile, None, x)
    return out


def _mv_backward(x, y, v, inv_scale, tol, profile, g):
    k_boxes, levels = mv_setup(y, v, tol)

    def one_row_tile(carry, row):
        dy, dv, dinv = carry
        x_t, g_t = row
        idx, count = visit_list(mv_box_visits(x_t, k_boxes, levels, inv_scale, profile))

        def body(k, state):
            dx, dy, dv, dinv = state
            t = idx[k]
            diff = _differences(x_t, y[t], inv_scale)
            keep = mv_include(x_t, one_box(k_boxes, t), levels[t][None], inv_scale, profile)
            kt, wt = (jnp.where(keep, a, 0.0) for a in profile_values(profile, _sq(diff)))
            omega = wt * matmul_nt(g_t, v[t])
            gx, gy, ginv = _pair_gradients(omega, diff, inv_scale)
            return dx + gx, dy.at[t].add(gy), dv.at[t].add(matmul_tn(kt, g_t)), dinv + ginv

        dx, dy, dv, dinv = _visit(count, body, (jnp.zeros_like(x_t), dy, dv, dinv))
        return (dy, dv, dinv), dx

    init = (jnp.zeros_like(y), jnp.zeros_like(v), jnp.zeros_like(inv_scale))
    (dy, dv, dinv), dx = lax.scan(one_row_tile, init, (x, g))
    return dx, dy, dv, dinv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def pruned_kernel_mv(x, y, v, inv_scale, tol: float, profile=RBF_PROFILE):
    """``K v`` on tiles in k-d order: x (tq, p, d), y (tk, q, d) raw coordinates, v (tk, q, o),
    ``inv_scale = 1/l`` (d,) -> (tq, p, o), ``K_ij = k(|(x_i - y_j) / l|²)`` for the profile k
    (`profile_values`; the RBF ``exp(-s/2)`` by default); key tiles skipped by the rule in the
    module docstring. Differentiable in x, y, v and inv_scale."""
    return _mv_forward(x, y, v, inv_scale, tol, profile)


def _pruned_kernel_mv_fwd(x, y, v, inv_scale, tol, profile):
    return _mv_forward(x, y, v, inv_scale, tol, profile), (x, y, v, inv_scale)


def _pruned_kernel_mv_bwd(tol, profile, residuals, g):
    x, y, v, inv_scale = residuals
    return _mv_backward(x, y, v, inv_scale, tol, profile, g)


pruned_kernel_mv.defvjp(_pruned_kernel_mv_fwd, _pruned_kernel_mv_bwd)


# ----------------------------------------------------------------------------------------------
# log Σ_j w_j K_ij   (KDE), running maximum as in `scalegp.ops._xla_rbf.lse_forward`


def _lse_tile(x_t, y_t, w_t, lw_t, inv_scale, run_max, run_sum):
    """One key tile folded into the running (max, scaled sum) of each row, as in `_xla_rbf`."""
    e = -0.5 * _sq(_differences(x_t, y_t, inv_scale))
    new_max = jnp.maximum(run_max, jnp.max(e + lw_t[None, :], axis=1))
    terms = jnp.where(w_t[None, :] > 0, jnp.exp(e - new_max[:, None]) * w_t[None, :], 0.0)
    return new_max, run_sum * jnp.exp(run_max - new_max) + jnp.sum(terms, axis=1)


def lse_log_tol(tol: float, dtype) -> float:
    """``log tol``, or for ``tol = 0`` the level under which a term underflows against a sum."""
    return math.log(tol) if tol > 0 else -underflow_exponent(dtype)


def lse_setup(y, w):
    """What every query tile's KDE plan shares: key boxes, tile weights and their logs; and the
    keys' log-weights (tk, q)."""
    tile_weight = jnp.sum(w, axis=1)  # (tk,)
    return (boxes(y), tile_weight, log_weights(tile_weight)), log_weights(w)


def lse_bounds(x_t, setup, inv_scale, tiles=None):
    """(``-δ²_iT / 2``, ``log W_T - δ²_iT / 2``): each row's bounds, (p, tk), or (p,) for the
    one key tile ``tiles``."""
    k_boxes, _, log_tile_weight = setup
    if tiles is not None:
        k_boxes, log_tile_weight = one_box(k_boxes, tiles), log_tile_weight[tiles][None]
    neg_half_sq = -row_half_sq(x_t, k_boxes, inv_scale)
    out = neg_half_sq, log_tile_weight[None, :] + neg_half_sq
    return out if tiles is None else tuple(a[:, 0] for a in out)


def lse_near(bound, top, positive, log_tol: float):
    """Near key tiles (module docstring): bounds ``log W_T - δ²_iT / 2`` within ``tol^(1/2)`` of
    the row's largest, ``top``; ``positive``: ``W_T > 0``."""
    return (bound >= top + 0.5 * log_tol) & positive


def lse_level(run_max, run_sum, tile_weight, q: int, log_tol: float):
    """(p,) each row's level ``log(tol L_i / W)`` from its (max, scaled sum) over its near tiles;
    the computed L_i and W err by O((q + tk) eps), and the level sits that much lower."""
    slack = 2.0 * (q + tile_weight.shape[0] + 4) * float(jnp.finfo(run_max.dtype).eps)
    return (log_tol + run_max + jnp.log(run_sum) - jnp.log(jnp.sum(tile_weight))) - slack


def lse_rest(neg_half_sq, near, positive, level):
    """The key tiles besides its near ones that each row adds: ``exp(-δ²_iT / 2) > exp(level_i)``
    (level (p,) against bounds (p, tk), or (p,) against (p,))."""
    above = neg_half_sq > level.reshape(level.shape + (1,) * (neg_half_sq.ndim - 1))
    return above & positive & ~near


def lse_plan(x_t, setup, inv_scale, log_tol: float):
    """Every row's bounds and near tiles against all key tiles, (p, tk) each (the Pallas path's
    plan; the xla path tests only the tiles `lse_candidates` lists)."""
    neg_half_sq, bound = lse_bounds(x_t, setup, inv_scale)
    near = lse_near(bound, jnp.max(bound, axis=1, keepdims=True), (setup[1] > 0)[None, :],
                    log_tol)
    return neg_half_sq, near


def lse_added(x_t, setup, inv_scale, log_tol: float, level):
    """(p, tk) bool: the pairs the forward pass added (near tiles and the rest), from the rows'
    levels (the Pallas backward's plan)."""
    neg_half_sq, near = lse_plan(x_t, setup, inv_scale, log_tol)
    return near | lse_rest(neg_half_sq, near, (setup[1] > 0)[None, :], level)


def lse_candidates(x_t, setup, inv_scale, log_tol: float):
    """(tk,) bool: key tiles that may be near to a row of x_t: every row's largest bound is at
    least ``Λ = max_T (log W_T - H_T)``, ``H_T`` the half squared distance from the far side of
    the query tile's box to T's box (no row of it is farther), and a near tile's box bound is at
    least ``Λ + log(tol) / 2``."""
    k_boxes, tile_weight, log_tile_weight = setup
    (lo_q, hi_q), (lo_k, hi_k) = tile_box(x_t), k_boxes
    far = jnp.maximum(jnp.maximum(lo_k - lo_q, hi_q - hi_k), 0.0) * inv_scale
    positive = tile_weight > 0
    least_top = jnp.max(jnp.where(positive, log_tile_weight - 0.5 * jnp.sum(far * far, axis=1),
                                  -jnp.inf))
    box_bound = log_tile_weight - (1 - _LOOSE) * min_half_sq_distance(lo_q, hi_q, lo_k, hi_k,
                                                                      inv_scale)
    return (box_bound >= loosened(least_top + 0.5 * log_tol)) & positive


def lse_rest_visits(x_t, setup, inv_scale, level):
    """(tk,) bool: the key tiles the query tile visits for its rows' rest (`lse_rest`)."""
    (lo_q, hi_q), (lo_k, hi_k) = tile_box(x_t), setup[0]
    bound = -(1 - _LOOSE) * min_half_sq_distance(lo_q, hi_q, lo_k, hi_k, inv_scale)
    return (bound > loosened(jnp.min(level))) & (setup[1] > 0)


def _lse_top(x_t, setup, inv_scale, candidates):
    """(p,) each row's largest bound ``log W_T - δ²_iT / 2`` (over the candidates, which hold
    it)."""
    idx, count = visit_list(candidates)
    init = jnp.full((x_t.shape[0],), -jnp.inf, x_t.dtype)
    return _visit(count, lambda k, top: jnp.maximum(
        top, lse_bounds(x_t, setup, inv_scale, idx[k])[1]), init)


def _lse_row_rule(x_t, setup, inv_scale, t, top, log_tol, level=None):
    """(near, rest) (p,) of key tile t for each row (rest None without ``level``)."""
    neg_half_sq, bound = lse_bounds(x_t, setup, inv_scale, t)
    near = lse_near(bound, top, setup[1][t] > 0, log_tol)
    if level is None:
        return near, None
    return near, lse_rest(neg_half_sq, near, setup[1][t] > 0, level)


def _lse_pass(x_t, y, w, lw, inv_scale, visits, include, state):
    """The (max, scaled sum) of each row of x_t after folding in, in key order, the ``visits``
    (tk,) key tiles that ``include(t)`` (p,) gives it."""
    idx, count = visit_list(visits)

    def body(k, state):
        t = idx[k]
        new = _lse_tile(x_t, y[t], w[t], lw[t], inv_scale, *state)
        return tuple(jnp.where(include(t), a, b) for a, b in zip(new, state))

    return _visit(count, body, state)


def _lse_forward(x, y, w, inv_scale, tol):
    """(M, L, level) per query tile: ``f = M + L`` per row (as `scalegp.ops._xla_rbf.lse_forward`),
    and each row's level (`lse_level`), for the backward pass; (tq, p) each."""
    setup, lw = lse_setup(y, w)
    log_tol = lse_log_tol(tol, x.dtype)
    tile_weight, p = setup[1], x.shape[1]

    def one_row_tile(_, x_t):
        candidates = lse_candidates(x_t, setup, inv_scale, log_tol)
        top = _lse_top(x_t, setup, inv_scale, candidates)
        init = (jnp.full((p,), -jnp.inf, x.dtype), jnp.zeros((p,), x.dtype))
        state = _lse_pass(x_t, y, w, lw, inv_scale, candidates, lambda t: _lse_row_rule(
            x_t, setup, inv_scale, t, top, log_tol)[0], init)
        level = lse_level(*state, tile_weight, y.shape[1], log_tol)
        run_max, run_sum = _lse_pass(
            x_t, y, w, lw, inv_scale, lse_rest_visits(x_t, setup, inv_scale, level),
            lambda t: _lse_row_rule(x_t, setup, inv_scale, t, top, log_tol, level)[1], state)
        return None, (run_max, jnp.log(run_sum), level)

    return lax.scan(one_row_tile, None, x)[1]


def _lse_backward(x, y, w, inv_scale, tol, f_max, f_log_sum, levels, g):
    """Cotangents of x, y, w, inv_scale, over the pairs the forward pass added. With
    ``T_ij = exp(e_ij - f_i)`` and ``P_ij = w_j T_ij``: ``∂f_i/∂e_ij = P_ij`` and
    ``∂f_i/∂w_j = T_ij`` (see `_xla_rbf`)."""
    setup, _ = lse_setup(y, w)
    log_tol = lse_log_tol(tol, x.dtype)

    def one_row_tile(carry, row):
        x_t, m_t, l_t, level, g_t = row
        candidates = lse_candidates(x_t, setup, inv_scale, log_tol)
        top = _lse_top(x_t, setup, inv_scale, candidates)
        idx, count = visit_list(candidates | lse_rest_visits(x_t, setup, inv_scale, level))

        def body(k, state):
            dx, dy, dw, dinv = state
            t = idx[k]
            diff = _differences(x_t, y[t], inv_scale)
            near, rest = _lse_row_rule(x_t, setup, inv_scale, t, top, log_tol, level)
            big_t = jnp.where((near | rest)[:, None],
                              jnp.exp((-0.5 * _sq(diff) - m_t[:, None]) - l_t[:, None]), 0.0)
            p = jnp.where(w[t][None, :] > 0, big_t * w[t][None, :], 0.0)
            gx, gy, ginv = _pair_gradients(g_t[:, None] * p, diff, inv_scale)
            return dx + gx, dy.at[t].add(gy), dw.at[t].add(g_t @ big_t), dinv + ginv

        dx, *carry = _visit(count, body, (jnp.zeros_like(x_t),) + carry)
        return tuple(carry), dx

    init = (jnp.zeros_like(y), jnp.zeros_like(w), jnp.zeros_like(inv_scale))
    (dy, dw, dinv), dx = lax.scan(one_row_tile, init, (x, f_max, f_log_sum, levels, g))
    return dx, dy, dw, dinv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def pruned_kernel_logsumexp(x, y, w, inv_scale, tol: float):
    """``log Σ_j w_j exp(-|(x_i - y_j) / l|² / 2)`` on tiles in k-d order: x (tq, p, d),
    y (tk, q, d) raw coordinates, w (tk, q) >= 0, ``inv_scale = 1/l`` (d,) -> (tq, p); key tiles
    skipped by the KDE rule in the module docstring (relative error <= tol)."""
    f_max, f_log_sum, _ = _lse_forward(x, y, w, inv_scale, tol)
    return f_max + f_log_sum


def _pruned_lse_fwd(x, y, w, inv_scale, tol):
    f_max, f_log_sum, levels = _lse_forward(x, y, w, inv_scale, tol)
    return f_max + f_log_sum, (x, y, w, inv_scale, f_max, f_log_sum, levels)


def _pruned_lse_bwd(tol, residuals, g):
    x, y, w, inv_scale, *rest = residuals
    return _lse_backward(x, y, w, inv_scale, tol, *rest, g)


pruned_kernel_logsumexp.defvjp(_pruned_lse_fwd, _pruned_lse_bwd)


# ----------------------------------------------------------------------------------------------
# entry points on unordered points (one problem, no batch dimensions)


def default_tolerance(dtype) -> float:
    """``prune_tol=None``: half the dtype's machine epsilon, so that the bound on what is skipped
    sits under the rounding of the result (6e-8 in float32)."""
    return 0.5 * float(jnp.finfo(dtype).eps)


def check_prune(prune, prune_tol):
    """Validated ``(prune, prune_tol)`` of the public functions."""
    if not (prune is True or prune is False or (isinstance(prune, str) and prune == "auto")):
        raise ValueError(f'prune must be True, False or "auto", got {prune!r}')
    if prune_tol is not None:
        shape = np.shape(prune_tol)
        try:  # float() would take a one-element array, and fail on others without a name
            tol = math.nan if shape or np.iscomplexobj(prune_tol) else float(prune_tol)
        except (TypeError, ValueError):
            tol = math.nan
        if not (math.isfinite(tol) and 0.0 <= tol < 1.0):
            got = f"an array of shape {shape}; give one number" if shape else repr(prune_tol)
            raise ValueError(f"prune_tol must be in [0, 1) (None for the default), got {got}")
    return prune, prune_tol


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tiles", "perm", "far",
                                                                   "centre"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class OrderedKeys:
    """Keys in k-d order: ``tiles`` (tk, block, d) raw coordinates (far rows moved to the
    keys' centre), ``perm`` (tk·block,) from `kd_order`, ``far`` (m,) as in `_prepare.prepare`."""

    tiles: jax.Array
    perm: jax.Array
    far: jax.Array
    centre: jax.Array


def _finite_rows(x, centre, inv_scale):
    """x with its far rows (`scalegp.ops._prepare.prepare`) moved to ``centre``, and far."""
    far = ~jnp.isfinite(jnp.sum(jnp.square((x - centre) * inv_scale), axis=1))
    return jnp.where(far[:, None], centre, x), far


def _inverse_scale(lengthscale, d):
    return jnp.broadcast_to(1 / lengthscale, (d,))


def ordered_keys(x2, lengthscale, block: int = PRUNE_BLOCK, in_order: bool = False
                 ) -> OrderedKeys:
    """The keys x2 (m, d) in k-d order, in tiles of ``block`` (scaled by ``lengthscale``);
    ``in_order``: x2 is in that order already (`spatial_order`), so no sort is needed."""
    centre = centre_of(x2)
    x2, far = _finite_rows(x2, centre, _inverse_scale(lengthscale, x2.shape[1]))
    if in_order:
        perm = identity_order(x2.shape[0], block)
    else:
        perm = kd_order(lax.stop_gradient(x2), lax.stop_gradient(lengthscale), block)
    return OrderedKeys(ordered_tiles(x2, perm, block), perm, far, centre)


def spatial_order(x, scale=1.0):
    """The order in which the pruned products want their keys: ``x[spatial_order(x, l)]`` can
    be passed with ``keys_in_order=True`` to `scalegp.ops.rbf_kernel_mv` and
    `scalegp.ops.rbf_kde_density`, which then skip sorting the keys on every call. Any
    subsequence of it keeps most of its locality.

    Args:
      x: (n, d) points; scale: scalar or (d,) lengthscale or bandwidth (only its ratios across
        features matter).
    Returns:
      (n,) int32 numpy permutation.
    """
    x = jnp.asarray(x)
    perm = np.asarray(jax.jit(kd_order, static_argnums=2)(x, jnp.asarray(scale, x.dtype),
                                                          PRUNE_BLOCK))
    return perm[perm < x.shape[0]]


def _ordered_queries(x1, keys: OrderedKeys, lengthscale, x1_is_keys: bool):
    block = keys.tiles.shape[1]
    if x1_is_keys:  # a product of the keys with themselves: one order for both
        return keys.tiles, keys.perm, keys.far
    x1, far = _finite_rows(x1, keys.centre, _inverse_scale(lengthscale, x1.shape[1]))
    perm = kd_order(lax.stop_gradient(x1), lax.stop_gradient(lengthscale), block)
    return ordered_tiles(x1, perm, block), perm, far


def kernel_mv(x1, keys: OrderedKeys, v, lengthscale, tol: float, x1_is_keys: bool = False,
              profile=RBF_PROFILE, core=None):
    """``K(x1, x2) v`` for x1 (n, d), the keys x2 (m, d) in order (`ordered_keys`), v (m, o),
    pruned (module docstring), for the RBF or the ``profile``; rows whose scaled distance from
    the keys' centre overflows give 0, as unpruned. ``core``: the tiled product of the RBF with
    `pruned_kernel_mv`'s signature (`scalegp.ops._pallas_pruning.pruned_kernel_mv`); None:
    `pruned_kernel_mv`."""
    (n, d), o = x1.shape, v.shape[1]
    x, perm_q, far_1 = _ordered_queries(x1, keys, lengthscale, x1_is_keys)
    v = tile_values(jnp.where(keys.far[:, None], 0.0, v).astype(x.dtype), keys.perm,
                    keys.tiles.shape[1])
    inv_scale = _inverse_scale(lengthscale, d)
    if core is None:
        out = pruned_kernel_mv(x, keys.tiles, v, inv_scale, tol, profile)
    else:
        assert profile == RBF_PROFILE, "the pruned Pallas kernels are the RBF's"
        out = core(x, keys.tiles, v, inv_scale, tol)
    return jnp.where(far_1[:, None], 0.0, unordered(out.reshape(-1, o), perm_q, n))


def pruned_product(unpruned, lengthscale, always: bool, tol: float, keys_in_order: bool,
                   self_product: bool, *, profile=RBF_PROFILE, block: int = PRUNE_BLOCK,
                   core=None, scale=None):
    """``single(x1, x2, v)``: ``scale · K(x1, x2) v`` by `kernel_mv` for the profile, always or
    (``always=False``, ``prune="auto"``) where `auto_keys` finds that pruning pays, else
    ``unpruned(x1, x2, v)`` (which includes the scale)."""
    def pruned(x1, v, keys):
        out = kernel_mv(x1, keys, v, lengthscale, tol, self_product, profile, core)
        return out if scale is None else scale * out

    def single(x1, x2, v):
        if always:
            return pruned(x1, v, ordered_keys(x2, lengthscale, block, in_order=keys_in_order))
        pays, keys = auto_keys(x2, lengthscale, tol, keys_in_order, profile)
        return lax.cond(pays, lambda: pruned(x1, v, keys), lambda: unpruned(x1, x2, v))

    return single


def kernel_logsumexp(x1, keys: OrderedKeys, w, lengthscale, tol: float, core=None):
    """``log Σ_j w_j exp(-|(x1_i - x2_j) / l|² / 2)`` for x1 (n, d), the keys x2 in order
    (`ordered_keys`), w (m,) >= 0 -> (n,), pruned (module docstring); far queries give -inf, far
    keys weigh nothing. ``core``: as in `kernel_mv` (default `pruned_kernel_logsumexp`)."""
    n, d = x1.shape
    x, perm_q, far_1 = _ordered_queries(x1, keys, lengthscale, False)
    w = tile_values(jnp.where(keys.far, 0.0, w).astype(x.dtype), keys.perm, keys.tiles.shape[1])
    out = (core or pruned_kernel_logsumexp)(x, keys.tiles, w, _inverse_scale(lengthscale, d),
                                            tol)
    return jnp.where(far_1, -jnp.inf, unordered(out.reshape(-1), perm_q, n))


# ----------------------------------------------------------------------------------------------
# prune="auto"

#: ``prune="auto"`` considers pruning from this many keys (below, ordering and bounds cost more
#: than they can save) and up to this many features (beyond, tile boxes rarely separate).
AUTO_MIN_KEYS = 16384
AUTO_MAX_D = 8
#: ... and prunes when the keys' own tile pairs suggest at most this fraction is visited: a
#: visited pair costs more than an unpruned one (differences instead of one matrix product).
AUTO_MAX_VISITED = 0.3
_AUTO_SAMPLE_TILES = 256
#: `reach_allows_pruning`'s estimate must be this far under AUTO_MAX_VISITED before the keys
#: are sorted for the real estimate: the sort is a real cost to products that stay unpruned.
_AUTO_GATE = AUTO_MAX_VISITED / 3


def considered_by_auto(m: int, d: int, batched: bool) -> bool:
    """The static part of ``prune="auto"``: only these shapes get the estimate `pruning_pays`."""
    return not batched and m >= AUTO_MIN_KEYS and d <= AUTO_MAX_D


def worth_ordering(prune, m: int, d: int) -> bool:
    """Whether ``m`` keys of ``d`` features may be pruned under ``prune`` (so that a caller who
    calls many times with them should keep them in `spatial_order`)."""
    return prune is True or (prune == "auto" and considered_by_auto(m, d, batched=False))


def _threshold(tol: float, dtype, profile=RBF_PROFILE) -> float:
    """Half squared scaled distance beyond which a kernel value counts as skippable."""
    return reach_half_sq(profile, math.log(tol) if tol > 0 else -underflow_exponent(dtype))


def reach_allows_pruning(x2, lengthscale, tol: float, profile=RBF_PROFILE):
    """Traced bool, O(m d): False when the kernel's reach (the distance at which values fall
    under ``tol``) spans so much of the keys' extent that, were the keys spread evenly over
    their bounding box, more than a third of `AUTO_MAX_VISITED` of all pairs would be within
    it. A heuristic gate before `pruning_pays`, which needs the keys sorted: a cost
    ``prune="auto"`` must not add to the products it then leaves unpruned."""
    d = x2.shape[1]
    reach = 2 * math.sqrt(2 * _threshold(tol, x2.dtype, profile))
    extent = (jnp.max(x2, axis=0) - jnp.min(x2, axis=0)) * _inverse_scale(lengthscale, d)
    share = jnp.minimum(1.0, reach / jnp.where(extent > 0, extent, 1.0))
    return jnp.prod(jnp.where(extent > 0, share, 1.0)) <= _AUTO_GATE


def auto_keys(x2, lengthscale, tol: float, in_order: bool, profile=RBF_PROFILE):
    """``prune="auto"``: (prune?, keys for the pruned path). Keys are sorted only when
    `reach_allows_pruning`; otherwise the pruned path is not taken and gets them as given."""
    if in_order:
        keys = ordered_keys(x2, lengthscale, in_order=True)
        return pruning_pays(keys, lengthscale, tol, profile), keys

    def sorted_keys():
        keys = ordered_keys(x2, lengthscale)
        return pruning_pays(keys, lengthscale, tol, profile), keys

    def not_sorted():
        # zeros in the keys' shapes, never read (the pruned path is not taken): the keys built
        # unsorted were a gather of every row that the unpruned product paid for and never read
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(sorted_keys))

    return lax.cond(reach_allows_pruning(x2, lengthscale, tol, profile), sorted_keys,
                    not_sorted)


def pruning_pays(keys: OrderedKeys, lengthscale, tol: float, profile=RBF_PROFILE):
    """Traced bool: whether, with the keys as queries, the share of tile pairs whose bound
    exceeds ``tol`` (the pairs that would be visited) is at most `AUTO_MAX_VISITED`. Depends on
    the keys only, so the choice never depends on which queries share a call (row
    independence). A strided sample of query tiles keeps it O(tk)."""
    lo, hi = boxes(keys.tiles)
    sample = slice(None, None, max(1, lo.shape[0] // _AUTO_SAMPLE_TILES))
    inv_scale = _inverse_scale(lengthscale, lo.shape[1])
    half_sq = jax.vmap(lambda a, b: min_half_sq_distance(a, b, lo, hi, inv_scale))(
        lo[sample], hi[sample])
    return jnp.mean(half_sq < _threshold(tol, lo.dtype, profile)) <= AUTO_MAX_VISITED
