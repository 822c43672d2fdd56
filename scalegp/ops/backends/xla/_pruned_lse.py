"""The pruned KDE ``log Σ_j w_j K_ij`` on tiles in k-d order (xla path), with the running
maximum of `_rbf.lse_forward`: each row adds its near key tiles, then the rest
above its level (rules: `pruning._rules`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from scalegp.ops._tile_math import lse_step, tile_product
from scalegp.ops.backends.xla._pruned_tiles import (
    fold_visits,
    pair_gradients,
    scaled_differences,
    sq_distances,
)
from scalegp.ops.pruning import (
    lse_bounds,
    lse_candidates,
    lse_level,
    lse_log_tol,
    lse_near,
    lse_rest,
    lse_rest_visits,
    lse_setup,
    visit_list,
)


def lse_tile(x_t, y_t, w_t, lw_t, inv_scale, run_max, run_sum):
    """One key tile folded into the running (max, scaled sum) of each row, as in `_rbf`."""
    e = -0.5 * sq_distances(scaled_differences(x_t, y_t, inv_scale))
    return lse_step(run_max, run_sum, e, w_t[None, :], lw_t[None, :])[:2]



def _lse_top(x_t, setup, inv_scale, candidates):
    """(p,) each row's largest bound ``log W_T - δ²_iT / 2`` (over the candidates, which hold
    it)."""
    idx, count = visit_list(candidates)
    init = jnp.full((x_t.shape[0],), -jnp.inf, x_t.dtype)
    return fold_visits(count, lambda k, top: jnp.maximum(
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
    (tk,) key tiles that ``include(t)`` (p,) gives it; and (tk,) bool: the visited tiles that
    every row included."""
    idx, count = visit_list(visits)

    def body(k, carry):
        state, by_all = carry
        t = idx[k]
        rows = include(t)
        new = lse_tile(x_t, y[t], w[t], lw[t], inv_scale, *state)
        state = tuple(jnp.where(rows, a, b) for a, b in zip(new, state))
        return state, by_all.at[t].set(jnp.all(rows))

    return fold_visits(count, body, (state, jnp.zeros(visits.shape, bool)))


def lse_forward(x, y, w, inv_scale, tol):
    """(M, L, level) per query tile: ``f = M + L`` per row (as `_rbf.lse_forward`),
    and each row's level (`lse_level`), for the backward pass; (tq, p) each."""
    setup, lw = lse_setup(y, w)
    log_tol = lse_log_tol(tol, x.dtype)
    tile_weight, p = setup[1], x.shape[1]

    def one_row_tile(_, x_t):
        candidates = lse_candidates(x_t, setup, inv_scale, log_tol)
        top = _lse_top(x_t, setup, inv_scale, candidates)
        init = (jnp.full((p,), -jnp.inf, x.dtype), jnp.zeros((p,), x.dtype))
        state, near_to_all = _lse_pass(x_t, y, w, lw, inv_scale, candidates, lambda t:
                                       _lse_row_rule(x_t, setup, inv_scale, t, top, log_tol)[0],
                                       init)
        level = lse_level(*state, tile_weight, y.shape[1], log_tol)
        # a tile near to every row is in no row's rest (`lse_rest` excludes near): not revisited
        (run_max, run_sum), _ = _lse_pass(
            x_t, y, w, lw, inv_scale,
            lse_rest_visits(x_t, setup, inv_scale, level) & ~near_to_all,
            lambda t: _lse_row_rule(x_t, setup, inv_scale, t, top, log_tol, level)[1], state)
        return None, (run_max, jnp.log(run_sum), level)

    return lax.scan(one_row_tile, None, x)[1]


def _lse_backward(x, y, w, inv_scale, tol, f_max, f_log_sum, levels, g):
    """Cotangents of x, y, w, inv_scale, over the pairs the forward pass added. With
    ``T_ij = exp(e_ij - f_i)`` and ``P_ij = w_j T_ij``: ``∂f_i/∂e_ij = P_ij`` and
    ``∂f_i/∂w_j = T_ij`` (see `_rbf`)."""
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
            diff = scaled_differences(x_t, y[t], inv_scale)
            near, rest = _lse_row_rule(x_t, setup, inv_scale, t, top, log_tol, level)
            big_t = jnp.where(
                (near | rest)[:, None],
                jnp.exp((-0.5 * sq_distances(diff) - m_t[:, None]) - l_t[:, None]), 0.0)
            p = jnp.where(w[t][None, :] > 0, big_t * w[t][None, :], 0.0)
            gx, gy, ginv = pair_gradients(g_t[:, None] * p, diff, inv_scale)
            return dx + gx, dy.at[t].add(gy), dw.at[t].add(g_t @ big_t), dinv + ginv

        dx, *carry = fold_visits(count, body, (jnp.zeros_like(x_t),) + carry)
        return tuple(carry), dx

    init = (jnp.zeros_like(y), jnp.zeros_like(w), jnp.zeros_like(inv_scale))
    (dy, dw, dinv), dx = lax.scan(one_row_tile, init, (x, f_max, f_log_sum, levels, g))
    return dx, dy, dw, dinv


def _pruned_kernel_logsumexp(x, y, w, inv_scale, tol: float):
    """``log Σ_j w_j exp(-|(x_i - y_j) / l|² / 2)`` on tiles in k-d order: x (tq, p, d),
    y (tk, q, d) raw coordinates, w (tk, q) >= 0, ``inv_scale = 1/l`` (d,) -> (tq, p); key tiles
    skipped by the KDE rule of `pruning._rules` (relative error <= tol)."""
    f_max, f_log_sum, levels = lse_forward(x, y, w, inv_scale, tol)
    return f_max + f_log_sum, (f_max, f_log_sum, levels)


def _pruned_lse_bwd(inputs, saved, g, tol):
    return _lse_backward(*inputs, tol, *saved, g)


pruned_kernel_logsumexp = tile_product(_pruned_kernel_logsumexp, _pruned_lse_bwd, inputs=4,
                                       settings=1)
