"""The rigorous bounds of the pruned products (`scalegp.ops.pruning._rules`, whose docstring states
the rules): tile boxes and their gaps, and from them each product's rule for which key tiles a
query row adds (``K v``: `mv_include`; the KDE: `lse_plan`, `lse_rest`) and which key tiles a
query tile visits (its rows' tiles, found from the boxes: `mv_box_visits`, `lse_candidates`,
`lse_rest_visits`). The xla and the Pallas pruned kernels both plan with these.

No kernel formula lives here: the bound on a tile pair's values is the kernel's profile's
(`scalegp.ops._profiles`, ``RBF.profile`` or ``Matern.profile``: its log value at the pair's
least half squared scaled distance), and the rounding margin of the distances is
`scalegp.ops._profiles.bound_safety`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from scalegp.ops._kernels import RBF
from scalegp.ops._prepare import feature_sum
from scalegp.ops._profiles import bound_safety
from scalegp.ops._tiling import log_weights


def underflow_exponent(dtype) -> float:
    """``x`` such that ``exp(-x)`` is below half the dtype's smallest subnormal number (it rounds
    to 0), with a margin for the exponential's own error."""
    info = jnp.finfo(dtype)
    return -math.log(float(info.smallest_subnormal)) + 2.0


def boxes(tiles):
    """(tiles, block, d) -> (lo, hi), each (tiles, d): the tiles' bounding boxes (raw
    coordinates; exact). Elementwise minima and maxima of halves, halving the block each time,
    rather than one reduction over it: XLA's CPU backend sends the reduction to a fusion whose
    fixed cost was most of a one-query call (docs/decisions.md #36)."""
    lo = hi = tiles
    while lo.shape[1] > 1:
        half = lo.shape[1] // 2
        rest_lo, rest_hi = lo[:, 2 * half:], hi[:, 2 * half:]  # an odd block's last row
        lo = jnp.concatenate([jnp.minimum(lo[:, :half], lo[:, half:2 * half]), rest_lo], axis=1)
        hi = jnp.concatenate([jnp.maximum(hi[:, :half], hi[:, half:2 * half]), rest_hi], axis=1)
    return lo[:, 0], hi[:, 0]


def box_gaps(lo_q, hi_q, lo_k, hi_k):
    """Per-feature gaps (t, d) between the box (lo_q, hi_q) (d,) and each of the boxes (lo_k,
    hi_k) (t, d): every pair of points in them is at least this far apart in each feature."""
    return jnp.maximum(jnp.maximum(lo_k - hi_q, lo_q - hi_k), 0.0)


def min_half_sq_distance(lo_q, hi_q, lo_k, hi_k, inv_scale):
    """A lower bound on ``|(x - y) / l|² / 2`` for x in the box (lo_q, hi_q) (d,) and y in each
    of the boxes (lo_k, hi_k) (t, d) -> (t,)."""
    gap = box_gaps(lo_q, hi_q, lo_k, hi_k) * inv_scale
    return (0.5 * bound_safety(gap.dtype, gap.shape[-1])) * feature_sum(gap * gap)


def row_half_sq(x_t, k_boxes, inv_scale):
    """`min_half_sq_distance` from each row of x_t (p, d) (a box of one point) to each key box
    -> (p, tk): what decides whether the row needs the key tile, from the row alone."""
    lo_k, hi_k = k_boxes
    # features major, key tiles minor: XLA's CPU backend vectorises over the key tiles
    x_f = x_t.T[:, :, None]
    gap = jnp.maximum(jnp.maximum(lo_k.T[:, None, :] - x_f, x_f - hi_k.T[:, None, :]), 0.0)
    gap = gap * jnp.broadcast_to(inv_scale, (x_t.shape[1],))[:, None, None]
    return (0.5 * bound_safety(gap.dtype, gap.shape[0])) * jnp.sum(gap * gap, axis=0)


def visit_list(visit):
    """(t,) bool -> (indices (t,), count): the visited tiles first, then the others, each in
    tile order (a stable partition). Each tile is scattered to its place, counted by a
    cumulative sum, not sorted: on XLA's CPU backend the sort cost more than many of the
    visits it lists (docs/decisions.md #39)."""
    tiles = jnp.arange(visit.shape[0], dtype=jnp.int32)
    visited_before = jnp.cumsum(visit, dtype=jnp.int32) - visit  # visited tiles before each
    count = jnp.sum(visit, dtype=jnp.int32)
    place = jnp.where(visit, visited_before, count + tiles - visited_before)
    return jnp.zeros_like(tiles).at[place].set(tiles, unique_indices=True), count


# ----------------------------------------------------------------------------------------------
# K v


def mv_levels(v_norms, v_total, tol: float):
    """(tk,) ``log τ_T`` of the ``K v`` rule (`scalegp.ops.pruning._rules`): a row skips key tile T
    when its kernel bound to T's box is at most ``τ_T = tol/2 · max(1, 1 / (tk s_T))``,
    ``s_T = max_c ‖v_Tc‖₁ / ‖v_c‖₁`` (``+inf`` where v is zero on the tile)."""
    share = jnp.where(v_total > 0, v_norms / jnp.where(v_total > 0, v_total, 1.0), 0.0)
    s = jnp.max(share, axis=1)
    base = math.log(tol / 2) if tol > 0 else -math.inf
    level = base + jnp.maximum(0.0, -jnp.log(s.shape[0] * jnp.where(s > 0, s, 1.0)))
    return jnp.where(s > 0, level, jnp.inf)


def mv_include(x_t, k_boxes, levels, inv_scale, profile=RBF.profile):
    """(p, tk) bool: which key tiles each row of the query tile x_t (p, d) adds, by the ``K v``
    rule on its own bounds (`row_half_sq`, the ``profile``'s log value there), so never by its
    tile-mates'."""
    log_k = profile.log_at_half_sq(row_half_sq(x_t, k_boxes, inv_scale))
    return (log_k >= -underflow_exponent(log_k.dtype)) & (log_k > levels[None, :])


#: The visit lists test tile boxes with their bounds and levels loosened by this (relative, in
#: log units), so that a list holds every key tile that a row's own test adds, whatever the
#: rounding of either (the row's gaps are at least the box's).
LOOSE = 1e-3


def loosened(level, xp=jnp):
    """``level`` a little lower (infinite levels as they are); ``xp=numpy`` for host plans."""
    return xp.where(xp.isfinite(level), level - LOOSE * (1 + xp.abs(level)), level)


def one_box(k_boxes, t):
    """Key tile t's box as a list of one box, ((1, d), (1, d))."""
    return k_boxes[0][t][None], k_boxes[1][t][None]


def mv_box_visits(x_t, k_boxes, levels, inv_scale, profile=RBF.profile):
    """(tk,) bool: the key tiles the query tile x_t visits for ``K v``: every one that a row of
    it adds (`mv_include`), by the tiles' boxes."""
    lo_q, hi_q = tile_box(x_t)
    half_sq = (1 - LOOSE) * min_half_sq_distance(lo_q, hi_q, *k_boxes, inv_scale)
    log_k = profile.log_at_half_sq(half_sq)
    return (log_k >= loosened(-underflow_exponent(log_k.dtype))) & (log_k > loosened(levels))


def mv_setup(y, v, tol: float):
    """What every query tile's ``K v`` plan shares: the key boxes and `mv_levels`."""
    v_norms = jnp.sum(jnp.abs(v), axis=1)  # (tk, o)
    return boxes(y), mv_levels(v_norms, jnp.sum(v_norms, axis=0), tol)


def tile_box(x_t):
    return jnp.min(x_t, axis=0), jnp.max(x_t, axis=0)



# ----------------------------------------------------------------------------------------------
# log Σ_j w_j K_ij   (KDE)

#: The KDE's kernel, the RBF: its log bound at a half squared distance δ²/2 is ``-δ²/2``.
KDE_PROFILE = RBF.profile


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
    neg_half_sq = KDE_PROFILE.log_at_half_sq(row_half_sq(x_t, k_boxes, inv_scale))
    out = neg_half_sq, log_tile_weight[None, :] + neg_half_sq
    return out if tiles is None else tuple(a[:, 0] for a in out)


def lse_near(bound, top, positive, log_tol: float):
    """Near key tiles (`scalegp.ops.pruning._rules`): bounds ``log W_T - δ²_iT / 2`` within
    ``tol^(1/2)`` of the row's largest, ``top``; ``positive``: ``W_T > 0``."""
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
    far_bound = log_tile_weight + KDE_PROFILE.log_at_half_sq(0.5 * feature_sum(far * far))
    least_top = jnp.max(jnp.where(positive, far_bound, -jnp.inf))
    box_bound = log_tile_weight + KDE_PROFILE.log_at_half_sq(
        (1 - LOOSE) * min_half_sq_distance(lo_q, hi_q, lo_k, hi_k, inv_scale))
    return (box_bound >= loosened(least_top + 0.5 * log_tol)) & positive


def lse_rest_visits(x_t, setup, inv_scale, level):
    """(tk,) bool: the key tiles the query tile visits for its rows' rest (`lse_rest`)."""
    (lo_q, hi_q), (lo_k, hi_k) = tile_box(x_t), setup[0]
    bound = KDE_PROFILE.log_at_half_sq(
        (1 - LOOSE) * min_half_sq_distance(lo_q, hi_q, lo_k, hi_k, inv_scale))
    return (bound > loosened(jnp.min(level))) & (setup[1] > 0)
