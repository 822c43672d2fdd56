"""The pruned KDE log-sum-exp in Pallas kernels (forward in two calls: near key tiles, then the
rest; query pass; key pass) over the visit lists of `_pruned` (read its
docstring first), with the plans of `pruning._bounds.lse_plan`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._tile_math import lse_step, tile_product
from scalegp.ops._tiling import BlockSizes
from scalegp.ops.backends.triton._blocks import (
    accumulator_dtype,
    row_block_spec,
    whole_array_spec,
)
from scalegp.ops.backends.triton._pruned import (
    add_lists,
    call_kernel,
    feature_columns,
    flat_tiles,
    group_size,
    grouped,
    grouped_zeros,
    kernel_exponents,
    key_pass,
    pair_sums,
    plan_entries,
    plan_inputs,
    prepared_inputs,
    query_pass,
    ungrouped,
    vector_of,
)
from scalegp.ops.backends.triton._rbf import placed
from scalegp.ops.pruning import (
    lse_added,
    lse_level,
    lse_log_tol,
    lse_plan,
    lse_rest,
    lse_setup,
)

# ----------------------------------------------------------------------------------------------
# KDE kernels; the running (max, scaled sum) of `xla_pruned_lse.lse_tile`


def _lse_forward_kernel(idx_ref, count_ref, inc_ref, inv_ref, x_ref, init_max_ref,
                        init_sum_ref, y_ref, w_ref, lw_ref, max_ref, sum_ref, *, block, d):
    """From each row's (max, scaled sum) so far, the listed key tiles in key order, each folded
    into the rows that add it (one pass of `xla_pruned_lse.lse_forward`)."""
    i = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    q = feature_columns(x_ref[...], d)
    acc_dtype = accumulator_dtype(x_ref.dtype)

    def body(k, state):
        run_max, run_sum = state
        t = idx_ref[i, k]
        keys = pl.ds(t * block, block)
        e = kernel_exponents(q, feature_columns(y_ref[keys, :], d), inv)
        new_max, new_sum, _, _ = lse_step(run_max, run_sum, e, w_ref[keys][None, :],
                                          lw_ref[keys][None, :])
        add = inc_ref[i, t, :] > 0
        return jnp.where(add, new_max, run_max), jnp.where(add, new_sum, run_sum)

    init = (init_max_ref[...].astype(acc_dtype), init_sum_ref[...].astype(acc_dtype))
    run_max, run_sum = lax.fori_loop(0, count_ref[i], body, init)
    max_ref[...] = run_max.astype(max_ref.dtype)
    sum_ref[...] = run_sum.astype(sum_ref.dtype)


def _lse_query_kernel(idx_ref, count_ref, inc_ref, inv_ref, x_ref, max_ref, log_sum_ref, g_ref,
                      y_ref, w_ref, dx_ref, dinv_ref, *, block, d):
    """``ω_ij = g_i P_ij``, ``P_ij = w_j exp(e_ij - M_i - L_i)``: per query row ``Σ_j ω_ij D_ijf``
    and per program ``Σ_ij ω_ij D_ijf²``, over the tiles the forward pass visited."""
    i = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    x = x_ref[...]
    q = feature_columns(x, d)
    f_max, f_log_sum, g = max_ref[...][:, None], log_sum_ref[...][:, None], g_ref[...][:, None]
    acc_dtype = accumulator_dtype(x.dtype)

    def body(k, carry):
        t = idx_ref[i, k]
        keys = pl.ds(t * block, block)
        cols = feature_columns(y_ref[keys, :], d)
        big_t = jnp.exp((kernel_exponents(q, cols, inv) - f_max) - f_log_sum)
        w = w_ref[keys][None, :]
        omega = g * jnp.where((w > 0) & (inc_ref[i, t, :][:, None] > 0), big_t * w, 0.0)
        sums, squares = pair_sums(omega, q, cols, inv)
        return add_lists(carry[0], sums), add_lists(carry[1], squares)

    init = ([jnp.zeros((x.shape[0],), acc_dtype)] * d, [jnp.zeros((), acc_dtype)] * d)
    dx, dinv = lax.fori_loop(0, count_ref[i], body, init)
    dx_ref[...] = placed(dx, x.shape, 1).astype(dx_ref.dtype)
    dinv_ref[...] = vector_of(dinv, dinv_ref.shape[1], dinv_ref.dtype)[None, :]


def _lse_key_kernel(idx_ref, count_ref, inc_ref, inv_ref, y_ref, w_ref, x_ref, max_ref,
                    log_sum_ref, g_ref, dy_ref, dw_ref, *, block, d):
    """Per key row ``Σ_i ω_ij D_ijf`` and ``Σ_i g_i T_ij``, over the query tiles of the group
    that visited this key tile (keys' orientation, the forward's differences)."""
    t = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    y = y_ref[...]
    k_cols = feature_columns(y, d)
    w = w_ref[...][:, None]
    acc_dtype = accumulator_dtype(y.dtype)

    def body(k, carry):
        dy, dw = carry
        j = idx_ref[t, k]
        queries = pl.ds(j * block, block)
        q = feature_columns(x_ref[queries, :], d)
        g = g_ref[queries][None, :]
        e = kernel_exponents(q, k_cols, inv, keys_first=True)
        big_t = jnp.exp((e - max_ref[queries][None, :]) - log_sum_ref[queries][None, :])
        big_t = jnp.where(inc_ref[j, t, :][None, :] > 0, big_t, 0.0)
        omega = g * jnp.where(w > 0, big_t * w, 0.0)
        sums, _ = pair_sums(omega, q, k_cols, inv, keys_first=True)
        return add_lists(dy, sums), dw + jnp.sum(g * big_t, axis=1)

    init = ([jnp.zeros((y.shape[0],), acc_dtype)] * d, jnp.zeros(dw_ref.shape, acc_dtype))
    dy, dw = lax.fori_loop(0, count_ref[t], body, init)
    dy_ref[...] = placed(dy, y.shape, 1).astype(dy_ref.dtype)
    dw_ref[...] = dw.astype(dw_ref.dtype)


# ----------------------------------------------------------------------------------------------
# KDE


def _lse_forward(x, y, w, inv_scale, tol, bs, interpret, group):
    """(M, L, levels): (tq, block) each, as `xla_pruned_lse.lse_forward`: its two passes (near key
    tiles, then the rest) as two calls of the forward kernel."""
    block, d, d_pad, y_flat, inv = prepared_inputs(x, y, inv_scale, bs)
    tq, tk = x.shape[0], y.shape[0]
    setup, lw = lse_setup(y, w)
    w_flat, lw_flat = w.reshape(-1), lw.reshape(-1)
    log_tol = lse_log_tol(tol, x.dtype)
    group = group_size(tq, plan_entries(tk, block, per_row=3), group)
    positive = (setup[1] > 0)[None, :]

    def one_pass(include, x_flat, state):
        plan, _ = plan_inputs(include)
        return call_kernel(
            _lse_forward_kernel, (group,),
            [whole_array_spec(a.shape) for a in plan]
            + [whole_array_spec(inv.shape), row_block_spec(block, d_pad), row_block_spec(block),
               row_block_spec(block), whole_array_spec(y_flat.shape),
               whole_array_spec(w_flat.shape), whole_array_spec(lw_flat.shape)],
            [row_block_spec(block), row_block_spec(block)],
            [jax.ShapeDtypeStruct((group * block,), x.dtype)] * 2, bs, interpret,
            "rbf_pruned_logsumexp_fwd", block=block, d=d,
        )(*plan, inv, x_flat, *state, y_flat, w_flat, lw_flat)

    def one_group(_, x_group):
        neg_half_sq, near = jax.vmap(lambda x_t: lse_plan(
            x_t, setup, inv_scale, log_tol))(x_group)
        x_flat = flat_tiles(x_group, d_pad)
        init = (jnp.full((group * block,), -jnp.inf, x.dtype),
                jnp.zeros((group * block,), x.dtype))
        state = one_pass(near, x_flat, init)
        levels = lse_level(*(a.reshape(group, block) for a in state), setup[1],
                                    block, log_tol)
        rest = jax.vmap(lambda a, b, c: lse_rest(a, b, positive, c))(
            neg_half_sq, near, levels)
        f_max, f_sum = one_pass(rest, x_flat, state)
        return None, (f_max.reshape(group, block), jnp.log(f_sum).reshape(group, block), levels)

    _, (f_max, f_log_sum, levels) = lax.scan(one_group, None, grouped(x, group))
    return ungrouped(f_max, tq), ungrouped(f_log_sum, tq), ungrouped(levels, tq)


def _lse_backward(x, y, w, inv_scale, f_max, f_log_sum, levels, g, tol, bs, interpret, group):
    block, d, d_pad, y_flat, inv = prepared_inputs(x, y, inv_scale, bs)
    tq, tk = x.shape[0], y.shape[0]
    setup, _ = lse_setup(y, w)
    log_tol = lse_log_tol(tol, x.dtype)
    group = group_size(tq, plan_entries(tk, block, per_row=3), group)

    def added(x_t, level):
        return lse_added(x_t, setup, inv_scale, log_tol, level)

    w_flat = w.reshape(-1)

    def one_group(carry, rows):
        dy, dw, dinv = carry
        x_group, m_group, l_group, level_group, g_group = rows
        plan, t_plan = plan_inputs(jax.vmap(added)(x_group, level_group))
        x_flat = flat_tiles(x_group, d_pad)
        m_flat, l_flat, g_flat = (a.reshape(-1) for a in (m_group, l_group, g_group))
        dx_sum, dinv_sums = query_pass(
            _lse_query_kernel, "rbf_pruned_logsumexp_bwd_query", plan, inv, x_flat,
            [(m_flat, None), (l_flat, None), (g_flat, None)], y_flat, [w_flat], bs, interpret, d)
        dy_sum, dw_group = key_pass(
            _lse_key_kernel, "rbf_pruned_logsumexp_bwd_key", t_plan, inv, y_flat,
            [(w_flat, None)], x_flat, [m_flat, l_flat, g_flat], None, bs, interpret, d)
        dx = -dx_sum[:, :d].reshape(group, block, d) * inv_scale
        carry = (dy + dy_sum[:, :d], dw + dw_group, dinv + jnp.sum(dinv_sums[:, :d], 0))
        return carry, dx

    m_pad = y_flat.shape[0]
    init = (jnp.zeros((m_pad, d), y.dtype), jnp.zeros((m_pad,), w.dtype),
            jnp.zeros((d,), x.dtype))
    # padded query tiles of the last group: g = 0 (they add exact zeros)
    rows = (grouped(x, group), grouped(f_max, group), grouped(f_log_sum, group),
            grouped(levels, group), grouped_zeros(g, group))
    (dy, dw, dinv), dx = lax.scan(one_group, init, rows)
    dy = (dy * inv_scale).reshape(y.shape)
    return ungrouped(dx, tq), dy, dw.reshape(w.shape), -dinv / inv_scale


def _pruned_kernel_logsumexp(x, y, w, inv_scale, tol: float, block_sizes: BlockSizes,
                             interpret: bool = False, group: int | None = None):
    """xla's `pruned_kernel_logsumexp` in Pallas kernels: x (tq, block, d), y (tk, block, d)
    raw coordinates in k-d order, w (tk, block) >= 0, ``inv_scale = 1/l`` (d,) -> (tq, block);
    the same rule (relative error <= tol), the same pairs added."""
    f_max, f_log_sum, levels = _lse_forward(x, y, w, inv_scale, tol, block_sizes, interpret,
                                            group)
    return f_max + f_log_sum, (f_max, f_log_sum, levels)


def _pruned_lse_bwd(inputs, saved, g, tol, block_sizes, interpret, group):
    return _lse_backward(*inputs, *saved, g, tol, block_sizes, interpret, group)


pruned_kernel_logsumexp = tile_product(_pruned_kernel_logsumexp, _pruned_lse_bwd, inputs=4,
                                       settings=4)
