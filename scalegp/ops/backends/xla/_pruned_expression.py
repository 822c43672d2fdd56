"""Pruned ``K v`` for kernel expressions (`scalegp.ops._kernels`): sums and products of RBF,
Matérn, rational-quadratic, periodic and constant kernels, on the CPU/XLA path.

The tiles, spatial order and skip rule are those of `pruning` (read its docstring
first); what changes is the bound ``B(g)``, which the kernel gives
(`scalegp.ops._kernels.Kernel.bound_at_gap`; this module holds no formula of its own). For a
pair of tile boxes with per-feature gaps ``g`` (raw coordinates), every pair of points in them
is at least ``g_d`` apart in feature d, so each term is bounded by its value at the gap (every
profile decreases in its scaled distance):

    RBF, Matérn, RationalQuadratic   profile(s_min),  s_min = Σ_d (g_d / l_d)²
    ExpSineSquared                   1                 (its values lie in (0, 1])
    Constant c                       |c|
    Sum                              Σ of the terms' bounds
    Product                          Π of the factors' bounds

and ``B(g) / B(0)`` bounds each kernel value relative to the largest one can take. Row i skips
key tile T as in `pruning` (from its own gaps to T's box, so never by its tile-mates'): when
``B(g_iT) / B(0) <= τ_T`` (`pruning.mv_levels`), so the skipped part of each output
``(K v)_ic`` is at most ``tol · B(0) · ‖v_c‖₁`` (for ``c · RBF``: ``tol · |c| · ‖v_c‖₁``,
`pruning`'s statement), and a row's result is bitwise the same in any call. With ``tol = 0``
only tiles whose bound underflows to 0 are skipped. An expression is pruned only where its
bound falls to 0 with distance (`scalegp.ops._kernels.Kernel.decays`): a product with one
decaying factor does, a sum only when every term does; a periodic or constant term alone never
does.

The rational quadratic decays only polynomially: its values fall under float32's eps/2 at
``√(2α (tol^(-1/α) - 1))`` lengthscales (5,800 at α = 1, 16 at α = 5), so ``prune="auto"``
(which estimates the visited share from the bounds) seldom prunes it, and rightly.

Gradients (custom VJP): the backward pass visits the same tiles and takes each tile's VJP of the
very expression the forward evaluated, so every hyperparameter (lengthscales, outputscales, α,
period) gets its exact gradient over the visited pairs. A skipped term of a gradient is the
value bound times a factor that grows at most polynomially in the distance (``s`` for an RBF
lengthscale, a polynomial in ``√(2ν s)`` for a Matérn one, ``log(1 + s/(2α))`` for α, ``ρ/p²``
for a period): the same kind of bound as the values', looser by that factor.

Memory: as `_pruned_mv`: per query tile the visit list (key tiles,), no list of tile pairs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops import pruning
from scalegp.ops._kernels import Kernel, kernel_tile, profiles_of
from scalegp.ops._tile_math import tile_product
from scalegp.ops._tiling import compensated_add, compensated_sum, compensated_zeros
from scalegp.ops.backends.xla import _pruned_tiles as pruned_tiles
from scalegp.ops.backends.xla._blocks import ARITHMETIC, matmul


def largest_value_bound(kernel, d: int, dtype):
    """``B(0)``: the bound at gap 0, at least the largest value the kernel takes."""
    return kernel.bound_at_gap(jnp.zeros((d,), dtype))


def _log_relative(kernel, gaps, norm):
    return jnp.log(kernel.bound_at_gap(gaps) / jnp.where(norm > 0, norm, 1.0))


def mv_include(kernel, x_t, k_box, level, norm):
    """(p,) bool: which rows of x_t (p, d) add the key tile of box ``k_box`` ((d,), (d,)) and
    level (`pruning.mv_levels`), from each row's own gaps to it; ``norm``:
    `largest_value_bound`."""
    lo_k, hi_k = k_box
    gaps = pruning.box_gaps(x_t, x_t, lo_k[None, :], hi_k[None, :])
    return _log_relative(kernel, gaps, norm) > level


def mv_box_visits(kernel, x_t, k_boxes, levels, norm):
    """(tk,) bool: the key tiles the query tile x_t visits: every one a row adds (`mv_include`),
    by the boxes (gaps and levels loosened as in `pruning.mv_box_visits`)."""
    (lo_q, hi_q), (lo_k, hi_k) = pruning.tile_box(x_t), k_boxes
    gaps = (1 - pruning.LOOSE) * pruning.box_gaps(lo_q, hi_q, lo_k, hi_k)
    return _log_relative(kernel, gaps, norm) > pruning.loosened(levels)


def _tile_product(kernel, x_t, y_t, v_t):
    return matmul(kernel_tile(kernel, x_t, y_t.T, ARITHMETIC), v_t)


def _setup(kernel, y, v, tol):
    """What every query tile's plan shares: the key boxes, `pruning.mv_levels` and
    ``B(0)``."""
    return (*pruning.mv_setup(y, v, tol), largest_value_bound(kernel, y.shape[-1], y.dtype))


def _plan(kernel, x_t, setup):
    """(include(t) (p,) bool, visited key tiles (indices, count))."""
    k_boxes, levels, norm = setup

    def include(t):
        return mv_include(kernel, x_t, (k_boxes[0][t], k_boxes[1][t]), levels[t], norm)

    return include, pruning.visit_list(mv_box_visits(kernel, x_t, k_boxes, levels, norm))


def _forward(kernel, x, y, v, tol):
    setup = _setup(kernel, y, v, tol)

    def one_row_tile(_, x_t):
        include, (idx, count) = _plan(kernel, x_t, setup)

        def body(k, acc):
            t = idx[k]
            new = compensated_add(acc, _tile_product(kernel, x_t, y[t], v[t]))
            keep = include(t)[:, None]  # rows that skip t keep their sum as it is
            return tuple(jnp.where(keep, a, b) for a, b in zip(new, acc))

        total = compensated_zeros((x_t.shape[0], v.shape[2]), v.dtype)
        return None, compensated_sum(pruned_tiles.fold_visits(count, body, total))

    return lax.scan(one_row_tile, None, x)[1]


def _backward(kernel, x, y, v, tol, g):
    setup = _setup(kernel, y, v, tol)

    def one_row_tile(carry, row):
        dkernel, dy, dv = carry
        x_t, g_t = row
        include, (idx, count) = _plan(kernel, x_t, setup)

        def body(k, state):
            dkernel, dx, dy, dv = state
            t = idx[k]
            _, pullback = jax.vjp(_tile_product, kernel, x_t, y[t], v[t])
            # the rows that skipped t in the forward pass: no cotangent through the pair
            gk, gx, gy, gv = pullback(jnp.where(include(t)[:, None], g_t, 0.0))
            dkernel = jax.tree_util.tree_map(jnp.add, dkernel, gk)
            return dkernel, dx + gx, dy.at[t].add(gy), dv.at[t].add(gv)

        dkernel, dx, dy, dv = pruned_tiles.fold_visits(count, body,
                                              (dkernel, jnp.zeros_like(x_t), dy, dv))
        return (dkernel, dy, dv), dx

    zeros = jax.tree_util.tree_map(jnp.zeros_like, kernel)
    (dkernel, dy, dv), dx = lax.scan(one_row_tile, (zeros, jnp.zeros_like(y), jnp.zeros_like(v)),
                                     (x, g))
    return dkernel, dx, dy, dv


def _pruned_expression_mv(kernel: Kernel, x, y, v, tol: float):
    """``K v`` on tiles in k-d order: x (tq, p, d), y (tk, q, d) centred coordinates, v (tk, q,
    o) -> (tq, p, o), ``K_ij = kernel(x_i, y_j)``; key tiles skipped by the rule in the module
    docstring. Differentiable in the kernel's hyperparameters, x, y and v."""
    return _forward(kernel, x, y, v, tol), ()


def _bwd(inputs, saved, g, tol):
    del saved
    return _backward(*inputs, tol, g)


pruned_expression_mv = tile_product(_pruned_expression_mv, _bwd, inputs=4, settings=1)


# ----------------------------------------------------------------------------------------------
# order, "auto" and the product


def ordering_scale(kernel: Kernel, d: int, dtype):
    """(d,) the shortest lengthscale of any decaying term per feature: the units in which the
    k-d order splits (it decides only how tight the boxes are, never what is computed)."""
    scales = [jnp.broadcast_to(jnp.asarray(node.lengthscale, dtype), (d,))
              for node in profiles_of(kernel) if node.decays]
    return lax.stop_gradient(functools.reduce(jnp.minimum, scales))


def _visited_share(kernel, q_lo, q_hi, k_lo, k_hi, tol):
    """The share of (query box, key box) pairs whose relative bound exceeds ``tol``."""
    norm = largest_value_bound(kernel, q_lo.shape[-1], q_lo.dtype)
    gaps = jax.vmap(lambda lo, hi: pruning.box_gaps(lo, hi, k_lo, k_hi))(q_lo, q_hi)
    return jnp.mean(kernel.bound_at_gap(gaps) > tol * norm)


def pruning_pays(kernel, tiles, tol: float):
    """Traced bool: `pruning.pruning_pays` for the expression: with the keys' tiles (tk, q, d)
    as queries (a strided sample of them), at most `pruning.AUTO_MAX_VISITED` of the tile
    pairs would be visited. Depends on the keys only (row independence)."""
    lo, hi = pruning.boxes(lax.stop_gradient(tiles))
    sample = slice(None, None, max(1, lo.shape[0] // pruning.AUTO_SAMPLE_TILES))
    share = _visited_share(lax.stop_gradient(kernel), lo[sample], hi[sample], lo, hi, tol)
    return share <= pruning.AUTO_MAX_VISITED


def reach_allows_pruning(kernel, keys, tol: float):
    """Traced bool, O(m d): a strided sample of keys as single points, each against every
    sampled key (boxes of one point: the exact per-feature distances): whether the share of
    pairs within the kernel's reach is under `pruning.AUTO_GATE`. The gate before the sort
    that `pruning_pays` needs, as `pruning.reach_allows_pruning` is for the RBF."""
    keys = lax.stop_gradient(keys)
    sample = keys[::max(1, keys.shape[0] // pruning.AUTO_SAMPLE_TILES)]
    share = _visited_share(lax.stop_gradient(kernel), sample, sample, sample, sample, tol)
    return share <= pruning.AUTO_GATE


def kernel_mv(kernel, a, b, v, perm_k, tol: float, self_product: bool, block: int):
    """``K(a, b) v`` pruned, for centred rows a (n, d), keys b (m, d) whose k-d order is
    ``perm_k`` (`pruning.kd_order`), v (m, o) -> (n, o)."""
    n, d = a.shape
    o = v.shape[1]
    y = pruning.ordered_tiles(b, perm_k, block)
    if self_product:
        x, perm_q = y, perm_k
    else:
        perm_q = pruning.kd_order(lax.stop_gradient(a), ordering_scale(kernel, d, a.dtype),
                                   block)
        x = pruning.ordered_tiles(a, perm_q, block)
    v = pruning.tile_values(v, perm_k, block)
    out = pruned_expression_mv(kernel, x, y, v, tol)
    return pruning.unordered(out.reshape(-1, o), perm_q, n)


def key_order(kernel, b, keys_in_order: bool, block: int):
    """The k-d order of centred keys b (m, d) in the kernel's units (the identity for keys
    already in `spatial_order`)."""
    if keys_in_order:
        return pruning.identity_order(b.shape[0], block)
    return pruning.kd_order(lax.stop_gradient(b), ordering_scale(kernel, b.shape[1],
                                                                  b.dtype), block)


def auto_keys(kernel, b, tol: float, keys_in_order: bool, block: int):
    """``prune="auto"`` for centred keys b (m, d): (prune?, their `key_order`). They are sorted
    only past `reach_allows_pruning` (keys in order need no sort, so no gate)."""
    def sorted_and_pays():
        perm_k = key_order(kernel, b, keys_in_order, block)
        return pruning_pays(kernel, pruning.ordered_tiles(b, perm_k, block), tol), perm_k

    def not_sorted():
        return jnp.zeros((), bool), pruning.identity_order(b.shape[0], block)

    if keys_in_order:
        return sorted_and_pays()
    return lax.cond(reach_allows_pruning(kernel, b, tol), sorted_and_pays, not_sorted)


def pruned_product(kernel, unpruned, always: bool, tol: float, keys_in_order: bool,
                   self_product: bool, block: int = pruning.PRUNE_BLOCK):
    """``single(a, b, v)`` on centred points: ``K(a, b) v`` by `kernel_mv`, always or
    (``always=False``, ``prune="auto"``) where `auto_keys` finds that it pays, else
    ``unpruned(a, b, v)``."""
    def pruned(a, b, v, perm_k):
        return kernel_mv(kernel, a, b, v, perm_k, tol, self_product, block)

    def single(a, b, v):
        if always:
            return pruned(a, b, v, key_order(kernel, b, keys_in_order, block))
        pays, perm_k = auto_keys(kernel, b, tol, keys_in_order, block)
        return lax.cond(pays, lambda: pruned(a, b, v, perm_k), lambda: unpruned(a, b, v))

    return single
