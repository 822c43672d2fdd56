"""The pruned ``K v`` on tiles in k-d order (xla path): each query tile folds in the key tiles
it visits, each row only those its own bound adds (rules: `pruning._rules`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from scalegp.ops._kernels import RBF
from scalegp.ops._tile_math import tile_product
from scalegp.ops._tiling import compensated_add, compensated_sum, compensated_zeros
from scalegp.ops.backends.xla._blocks import matmul, matmul_nt, matmul_tn
from scalegp.ops.backends.xla._pruned_tiles import (
    fold_visits,
    pair_gradients,
    scaled_differences,
    sq_distances,
)
from scalegp.ops.pruning import (
    mv_box_visits,
    mv_include,
    mv_setup,
    one_box,
    visit_list,
)


def _mv_forward(x, y, v, inv_scale, tol, profile):
    k_boxes, levels = mv_setup(y, v, tol)

    def one_row_tile(_, x_t):
        idx, count = visit_list(mv_box_visits(x_t, k_boxes, levels, inv_scale, profile))

        def body(k, acc):
            t = idx[k]
            kt = profile.value(sq_distances(scaled_differences(x_t, y[t], inv_scale)))
            # rows that skip t keep their sum as it is
            keep = mv_include(x_t, one_box(k_boxes, t), levels[t][None], inv_scale, profile)
            return tuple(jnp.where(keep, new, old)
                         for new, old in zip(compensated_add(acc, matmul(kt, v[t])), acc))

        total = compensated_zeros((x_t.shape[0], v.shape[2]), v.dtype)
        return None, compensated_sum(fold_visits(count, body, total))

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
            diff = scaled_differences(x_t, y[t], inv_scale)
            keep = mv_include(x_t, one_box(k_boxes, t), levels[t][None], inv_scale, profile)
            kt, wt = (jnp.where(keep, a, 0.0) for a in profile.values(sq_distances(diff)))
            omega = wt * matmul_nt(g_t, v[t])
            gx, gy, ginv = pair_gradients(omega, diff, inv_scale)
            return dx + gx, dy.at[t].add(gy), dv.at[t].add(matmul_tn(kt, g_t)), dinv + ginv

        dx, dy, dv, dinv = fold_visits(count, body, (jnp.zeros_like(x_t), dy, dv, dinv))
        return (dy, dv, dinv), dx

    init = (jnp.zeros_like(y), jnp.zeros_like(v), jnp.zeros_like(inv_scale))
    (dy, dv, dinv), dx = lax.scan(one_row_tile, init, (x, g))
    return dx, dy, dv, dinv


def _pruned_kernel_mv(x, y, v, inv_scale, tol: float, profile=RBF.profile):
    """``K v`` on tiles in k-d order: x (tq, p, d), y (tk, q, d) raw coordinates, v (tk, q, o),
    ``inv_scale = 1/l`` (d,) -> (tq, p, o), ``K_ij = k(|(x_i - y_j) / l|²)`` for the profile k
    (``RBF.profile`` or ``Matern.profile``, `scalegp.ops._profiles`; the RBF ``exp(-s/2)`` by
    default); key tiles skipped by the rule of
    `pruning._rules`. Differentiable in x, y, v and inv_scale."""
    return _mv_forward(x, y, v, inv_scale, tol, profile), ()


def _pruned_kernel_mv_bwd(inputs, saved, g, tol, profile):
    del saved
    return _mv_backward(*inputs, tol, profile, g)


pruned_kernel_mv = tile_product(_pruned_kernel_mv, _pruned_kernel_mv_bwd, inputs=4, settings=2)
