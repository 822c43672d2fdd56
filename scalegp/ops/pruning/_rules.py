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

``K v`` also takes the Matérn profiles (ν = 1/2, 3/2, 5/2): the same rule with the profile's
value at the box gap as the bound (every profile decreases in r), so the skipped
part of each output is again at most ``tol · ‖v_c‖₁`` (times the outputscale). A skipped
Matérn gradient term is at most √(2ν) times the value bound. Their tails are exponential, not
Gaussian: at float32's eps/2 they reach 10-17 lengthscales where the RBF reaches 6, and pruning
pays only at correspondingly shorter lengthscales. The rational quadratic and sums and products
of profiles take the generic pruned path of `backends.xla._pruned_expression` (same tiles and
rule, a bound built from the expression's terms).

Accuracy: pairs are formed from the raw coordinates, ``((x_i - y_j) / l)²`` summed over features,
not from centred, scaled points and the expansion ``|a|² + |b|² - 2 a·b``: one rounding of the
difference itself, so a narrow kernel on data far from the origin (where pruning pays) keeps full
relative precision.

The Pallas kernels of `backends.triton._pruned` run the same rules (`mv_include`,
`lse_plan`), each row's against every key tile, built there per group of query tiles.

Memory: the plan is built per query tile inside the scan (O(number of key tiles) at a time; a
row's test against one key tile is made where the tile is visited), so no list of tile pairs is
stored; the KDE's backward pass gets each row's level, (n,). O((n + m)(d + o)) in all, forward
and backward.

Every formula of a kernel comes from the kernel: the products take its profile (``RBF.profile``,
``Matern.profile``; `scalegp.ops._profiles`), which gives the values and gradient weights of the
tiles, the log bound at a box gap and the reach that ``prune="auto"`` estimates from.

Modules: `_order` (the k-d order), `_bounds` (the bounds and the rules above), `_tree` (the
tile tree and visit lists), this one (the entry points on unordered points and
``prune="auto"``); the pruned kernels on ordered tiles are each backend's (`PrunedCore`: xla's
`_pruned_tiles`, `_pruned_mv`, `_pruned_lse`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp.ops._kernels import RBF
from scalegp.ops._prepare import centre_of, far_rows, feature_sum
from scalegp.ops.pruning._bounds import boxes, min_half_sq_distance, underflow_exponent
from scalegp.ops.pruning._order import (
    host_kd_order,
    kd_order,
    ordered_tiles,
    tile_values,
    unordered,
)

#: Tile height of the pruned path (queries and keys): smaller tiles have tighter boxes (more
#: pruning), larger ones less loop overhead per tile pair.
PRUNE_BLOCK = 256


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
    keys' centre), ``perm`` (tk·block,) from `kd_order` or None (the keys came in order),
    ``far`` (m,) as in `_prepare.prepare`."""

    tiles: jax.Array
    perm: jax.Array | None
    far: jax.Array
    centre: jax.Array


def _finite_rows(x, centre, inv_scale):
    """x with its far rows (`scalegp.ops._prepare.prepare`) moved to ``centre``, and far."""
    far = far_rows((x - centre) * inv_scale)
    return jnp.where(far[:, None], centre, x), far


def _inverse_scale(lengthscale, d):
    return jnp.broadcast_to(1 / lengthscale, (d,))


def ordered_keys(x2, lengthscale, block: int = PRUNE_BLOCK, in_order: bool = False
                 ) -> OrderedKeys:
    """The keys x2 (m, d) in k-d order, in tiles of ``block`` (scaled by ``lengthscale``);
    ``in_order``: x2 is in that order already (`spatial_order`), so no sort is needed."""
    centre = centre_of(x2)
    x2, far = _finite_rows(x2, centre, _inverse_scale(lengthscale, x2.shape[1]))
    perm = None if in_order else kd_order(lax.stop_gradient(x2), lax.stop_gradient(lengthscale),
                                          block)
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

    Computed on the host (`host_kd_order`: the splits of `kd_order`, ties perhaps ordered
    otherwise), with no program to compile: the jitted `kd_order`'s compilation outweighed the
    ordering itself on a CPU, and far more on a TPU (docs/decisions.md #51).
    """
    x = np.asarray(x)
    perm = host_kd_order(x, scale, PRUNE_BLOCK)
    return perm[perm < x.shape[0]]


def ordered_queries(x1, keys: OrderedKeys, lengthscale, x1_is_keys: bool, block=None):
    """x1 (n, d) in k-d order, in tiles of ``block`` rows (None: the keys' height), with the
    order and the far rows; the keys' own tiles when ``x1_is_keys``."""
    block = keys.tiles.shape[1] if block is None else block
    if x1_is_keys:  # a product of the keys with themselves: one order for both
        return keys.tiles, keys.perm, keys.far
    x1, far = _finite_rows(x1, keys.centre, _inverse_scale(lengthscale, x1.shape[1]))
    perm = kd_order(lax.stop_gradient(x1), lax.stop_gradient(lengthscale), block)
    return ordered_tiles(x1, perm, block), perm, far


def kernel_mv(x1, keys: OrderedKeys, v, lengthscale, tol: float, core, x1_is_keys: bool = False,
              profile=RBF.profile):
    """``K(x1, x2) v`` for x1 (n, d), the keys x2 (m, d) in order (`ordered_keys`), v (m, o),
    pruned (module docstring) by the backend's ``core`` (`scalegp.ops._interface.PrunedCore`),
    for the RBF or the ``profile``; rows whose scaled distance from the keys' centre overflows
    give 0, as unpruned."""
    (n, d), o = x1.shape, v.shape[1]
    x, perm_q, far_1 = ordered_queries(x1, keys, lengthscale, x1_is_keys)
    v = tile_values(jnp.where(keys.far[:, None], 0.0, v).astype(x.dtype), keys.perm,
                    keys.tiles.shape[1])
    out = core.mv(x, keys.tiles, v, _inverse_scale(lengthscale, d), tol, profile)
    return jnp.where(far_1[:, None], 0.0, unordered(out.reshape(-1, o), perm_q, n))


def pruned_product(unpruned, lengthscale, always: bool, tol: float, keys_in_order: bool,
                   self_product: bool, core, *, profile=RBF.profile, scale=None):
    """``single(x1, x2, v)``: ``scale · K(x1, x2) v`` by `kernel_mv` with the backend's
    ``core`` for the profile, always or (``always=False``, ``prune="auto"``) where `auto_keys`
    finds that pruning pays, else ``unpruned(x1, x2, v)`` (which includes the scale)."""
    block = core.block

    def pruned(x1, v, keys):
        out = kernel_mv(x1, keys, v, lengthscale, tol, core, self_product, profile)
        return out if scale is None else scale * out

    def single(x1, x2, v):
        if always:
            return pruned(x1, v, ordered_keys(x2, lengthscale, block, in_order=keys_in_order))
        pays, keys = auto_keys(x2, lengthscale, tol, keys_in_order, profile)
        return lax.cond(pays, lambda: pruned(x1, v, keys()), lambda: unpruned(x1, x2, v))

    return single


#: The smallest query tile height `query_block` gives: at 8 rows XLA's CPU backend sums a
#: tile's rows in another order than at 16 or more, and a row's log-density then depends on
#: the height it was tiled at (in the last bits; tests/ops/pruning/test_rules.py).
MIN_QUERY_BLOCK = 16


def query_block(n: int, m: int, block: int) -> int:
    """The query tiles' height for ``n`` queries against ``m`` keys in tiles of ``block``: the
    power of 2 at or above ``block · n / m``, within [`MIN_QUERY_BLOCK`, ``block / 4``]
    (``block`` itself where that is smaller).

    Why not ``block``: queries sparser than the keys, in k-d tiles of ``block`` rows, make
    tiles far wider than the key tiles, whose box bound then admits most key tiles for every
    row (64 queries against 2^17 clustered keys visited nearly all of them). Tiles of about
    the key tiles' width keep the bounds tight; very short ones pay the per-tile test of every
    key tile more often. The bounds come from `benchmarks/kde_million.py`'s engine case
    (docs/decisions.md #34, #39). Each row applies its own rule to each key tile, so the height
    changes the cost only, never a row's result (the KDE's tile sums reduce each row alone;
    ``K v`` keeps the keys' height: its tile products are matrix products, whose rounding XLA
    may choose by their number of rows)."""
    target = block * n / max(m, 1)
    p = 1 << max(0, math.ceil(math.log2(max(target, 1))))
    return int(min(block, max(block // 4, MIN_QUERY_BLOCK), max(MIN_QUERY_BLOCK, p)))


def kernel_logsumexp(x1, keys: OrderedKeys, w, lengthscale, tol: float, core):
    """``log Σ_j w_j exp(-|(x1_i - x2_j) / l|² / 2)`` for x1 (n, d), the keys x2 in order
    (`ordered_keys`), w (m,) >= 0 -> (n,), pruned (module docstring) by the backend's ``core``
    (its query tiles `query_block` high where it takes them so, else the keys'); far queries
    give -inf, far keys weigh nothing."""
    n, d = x1.shape
    block = (query_block(n, keys.far.shape[0], keys.tiles.shape[1]) if core.query_block
             else None)
    x, perm_q, far_1 = ordered_queries(x1, keys, lengthscale, False, block)
    w = tile_values(jnp.where(keys.far, 0.0, w).astype(x.dtype), keys.perm, keys.tiles.shape[1])
    out = core.lse(x, keys.tiles, w, _inverse_scale(lengthscale, d), tol)
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
#: The in-program KDE (`scalegp.ops.rbf_kde_density`) of one feature prunes up to this share: a
#: visited pair's difference is one subtraction, and tiles of sorted keys are tight intervals,
#: so at Scott's bandwidth pruning loses a little at a thousand queries and wins more at tens
#: of thousands; at d = 2 it did not pay (docs/decisions.md #41).
KDE_LOW_D_MAX_VISITED = 0.4
KDE_LOW_D = 1
AUTO_SAMPLE_TILES = 256
#: Tiles `pays_in_order` samples from keys in order (each against the others).
AUTO_IN_ORDER_SAMPLE = 32
#: `reach_allows_pruning`'s estimate must be under this fraction of the share that prunes
#: before the keys are sorted for the real estimate: the sort is a real cost to products that
#: stay unpruned.
AUTO_GATE_FRACTION = 1 / 3
AUTO_GATE = AUTO_MAX_VISITED * AUTO_GATE_FRACTION


def kde_max_visited(d: int) -> float:
    """The share of visited tile pairs up to which the in-program KDE of ``d`` features prunes
    under ``prune="auto"`` (`KDE_LOW_D_MAX_VISITED` at d <= `KDE_LOW_D`, else
    `AUTO_MAX_VISITED`)."""
    return KDE_LOW_D_MAX_VISITED if d <= KDE_LOW_D else AUTO_MAX_VISITED


def considered_by_auto(m: int, d: int, batched: bool) -> bool:
    """The static part of ``prune="auto"``: only these shapes get the estimate `pruning_pays`."""
    return not batched and m >= AUTO_MIN_KEYS and d <= AUTO_MAX_D


def worth_ordering(prune, m: int, d: int) -> bool:
    """Whether ``m`` keys of ``d`` features may be pruned under ``prune`` (so that a caller who
    calls many times with them should keep them in `spatial_order`)."""
    return prune is True or (prune == "auto" and considered_by_auto(m, d, batched=False))


def _threshold(tol: float, dtype, profile=RBF.profile) -> float:
    """Half squared scaled distance beyond which a kernel value counts as skippable."""
    return profile.reach_half_sq(math.log(tol) if tol > 0 else -underflow_exponent(dtype))


def reach_allows_pruning(x2, lengthscale, tol: float, profile=RBF.profile,
                         max_visited: float = AUTO_MAX_VISITED):
    """Traced bool, O(m d): False when the kernel's reach (the distance at which values fall
    under ``tol``) spans so much of the keys' extent that, were the keys spread evenly over
    their bounding box, more than `AUTO_GATE_FRACTION` of ``max_visited`` of all pairs would
    be within it. A heuristic gate before `pruning_pays`, which needs the keys sorted: a cost
    ``prune="auto"`` must not add to the products it then leaves unpruned."""
    d = x2.shape[1]
    reach = 2 * math.sqrt(2 * _threshold(tol, x2.dtype, profile))
    extent = (jnp.max(x2, axis=0) - jnp.min(x2, axis=0)) * _inverse_scale(lengthscale, d)
    share = jnp.minimum(1.0, reach / jnp.where(extent > 0, extent, 1.0))
    return jnp.prod(jnp.where(extent > 0, share, 1.0)) <= max_visited * AUTO_GATE_FRACTION


def auto_keys(x2, lengthscale, tol: float, in_order: bool, profile=RBF.profile,
              max_visited: float = AUTO_MAX_VISITED):
    """``prune="auto"``: (prune?, ``keys()``, which gives the keys for the pruned path: call it
    inside that branch). Keys are sorted only when `reach_allows_pruning`; keys in order are
    tested on a sample of their tiles (`pays_in_order`) and tiled only in the pruned branch,
    so that a product left unpruned pays almost nothing for the test. Prunes where at most
    ``max_visited`` of the tile pairs would be visited."""
    if in_order:
        return (pays_in_order(x2, lengthscale, tol, profile, max_visited=max_visited),
                lambda: ordered_keys(x2, lengthscale, in_order=True))

    def sorted_keys():
        keys = ordered_keys(x2, lengthscale)
        return pruning_pays(keys, lengthscale, tol, profile, max_visited), keys

    def not_sorted():
        # zeros in the keys' shapes, never read (the pruned path is not taken): the keys built
        # unsorted were a gather of every row that the unpruned product paid for and never read
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(sorted_keys))

    pays, keys = lax.cond(reach_allows_pruning(x2, lengthscale, tol, profile, max_visited),
                          sorted_keys, not_sorted)
    return pays, lambda: keys


def _visited_share(lo_q, hi_q, lo, hi, lengthscale, tol: float, profile):
    """The share of (query box, key box) pairs within the profile's reach."""
    inv_scale = _inverse_scale(lengthscale, lo.shape[1])
    half_sq = jax.vmap(lambda a, b: min_half_sq_distance(a, b, lo, hi, inv_scale))(lo_q, hi_q)
    return jnp.mean(half_sq < _threshold(tol, lo.dtype, profile))


def pays_in_order(x2, lengthscale, tol: float, profile=RBF.profile, block: int = PRUNE_BLOCK,
                  max_visited: float = AUTO_MAX_VISITED):
    """`pruning_pays` for keys x2 (m, d) already in k-d order, from a strided sample of
    `AUTO_IN_ORDER_SAMPLE` of their tiles against each other (`sampled_boxes`): O(sample), not
    a pass over all keys (which is what a product of a few queries costs in all). Sampled pairs
    estimate the share of all tile pairs, as `pruning_pays`'s sampled queries against every key
    tile do. Depends on the keys only."""
    lo, hi = sampled_boxes(x2, lengthscale, block)
    return _visited_share(lo, hi, lo, hi, lax.stop_gradient(lengthscale), tol,
                          profile) <= max_visited


def sampled_boxes(x2, lengthscale, block: int = PRUNE_BLOCK):
    """(lo, hi), each (s, d): the boxes of a strided sample of ``s`` (at most about
    `AUTO_IN_ORDER_SAMPLE`) of the tiles of ``block`` keys in order x2 (m, d), far rows left
    out (a tile of far rows alone: an empty box, lo = inf, hi = -inf)."""
    m, d = x2.shape
    full = m // block
    tiles = lax.stop_gradient(x2[None] if full == 0 else x2[: full * block].reshape(
        full, block, d)[:: max(1, full // AUTO_IN_ORDER_SAMPLE)])
    # Far rows (their scaled squares overflow) are left out rather than moved to the keys'
    # centre as the pruned path moves them: the centre is a median, a sort this test does
    # without. Rows are tested one by one only where a box's largest corner overflows (or is
    # NaN): no row inside a box whose corner is finite is far, and the rows' squares cost more
    # than the rest of the test.
    inv_scale = _inverse_scale(lax.stop_gradient(lengthscale), d)

    def without_far_rows():
        far = far_rows(tiles * inv_scale)[..., None]
        return boxes(jnp.where(far, jnp.inf, tiles))[0], boxes(jnp.where(far, -jnp.inf, tiles))[1]

    lo, hi = boxes(tiles)
    corner = feature_sum(jnp.square(jnp.maximum(jnp.abs(lo), jnp.abs(hi)) * inv_scale))
    return lax.cond(jnp.all(jnp.isfinite(corner)), lambda: (lo, hi), without_far_rows)


def pruning_pays(keys: OrderedKeys, lengthscale, tol: float, profile=RBF.profile,
                 max_visited: float = AUTO_MAX_VISITED):
    """Traced bool: whether, with the keys as queries, the share of tile pairs whose bound
    exceeds ``tol`` (the pairs that would be visited) is at most ``max_visited``. Depends on
    the keys only, so the choice never depends on which queries share a call (row
    independence). A strided sample of query tiles keeps it O(tk)."""
    lo, hi = boxes(keys.tiles)
    sample = slice(None, None, max(1, lo.shape[0] // AUTO_SAMPLE_TILES))
    return _visited_share(lo[sample], hi[sample], lo, hi, lengthscale, tol,
                          profile) <= max_visited
