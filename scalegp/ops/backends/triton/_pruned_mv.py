"""The pruned ``K v`` in Pallas kernels (forward, query pass, key pass) over the visit lists of
`_pruned` (read its docstring first), with the plans of
`pruning._bounds.mv_include`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._tile_math import tile_product
from scalegp.ops._tiling import BlockSizes, next_power_of_2
from scalegp.ops.backends.triton._blocks import (
    accumulator_dtype,
    matmul,
    matmul_nt,
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
    mv_include,
    mv_setup,
)

# ----------------------------------------------------------------------------------------------
# K v kernels


def _mv_forward_kernel(idx_ref, count_ref, inc_ref, inv_ref, x_ref, y_ref, v_ref, out_ref, *,
                       block, d):
    i = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    q = feature_columns(x_ref[...], d)

    def body(k, acc):
        t = idx_ref[i, k]
        keys = pl.ds(t * block, block)
        kt = jnp.exp(kernel_exponents(q, feature_columns(y_ref[keys, :], d), inv))
        # rows that skip t (`mv_include`) add exact zeros
        kt = jnp.where(inc_ref[i, t, :][:, None] > 0, kt, 0.0)
        return acc + matmul(kt, v_ref[keys, :])

    acc = jnp.zeros(out_ref.shape, accumulator_dtype(out_ref.dtype))
    out_ref[...] = lax.fori_loop(0, count_ref[i], body, acc).astype(out_ref.dtype)


def _mv_query_kernel(idx_ref, count_ref, inc_ref, inv_ref, x_ref, g_ref, y_ref, v_ref, dx_ref,
                     dinv_ref, *, block, d):
    """Per query row ``Σ_j ω_ij D_ijf`` and per program ``Σ_ij ω_ij D_ijf²``, ``ω = K ⊙ g vᵀ``."""
    i = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    x, g = x_ref[...], g_ref[...]
    q = feature_columns(x, d)
    acc_dtype = accumulator_dtype(x.dtype)

    def body(k, carry):
        t = idx_ref[i, k]
        keys = pl.ds(t * block, block)
        cols = feature_columns(y_ref[keys, :], d)
        omega = jnp.exp(kernel_exponents(q, cols, inv)) * matmul_nt(g, v_ref[keys, :])
        omega = jnp.where(inc_ref[i, t, :][:, None] > 0, omega, 0.0)
        sums, squares = pair_sums(omega, q, cols, inv)
        return add_lists(carry[0], sums), add_lists(carry[1], squares)

    init = ([jnp.zeros((x.shape[0],), acc_dtype)] * d, [jnp.zeros((), acc_dtype)] * d)
    dx, dinv = lax.fori_loop(0, count_ref[i], body, init)
    dx_ref[...] = placed(dx, x.shape, 1).astype(dx_ref.dtype)
    dinv_ref[...] = vector_of(dinv, dinv_ref.shape[1], dinv_ref.dtype)[None, :]


def _mv_key_kernel(idx_ref, count_ref, inc_ref, inv_ref, y_ref, v_ref, x_ref, g_ref, dy_ref,
                   dv_ref, *, block, d):
    """Per key row ``Σ_i ω_ij D_ijf`` and ``(Kᵀ g)_j``, over the query tiles of the group that
    visit this key tile; tiles in the keys' orientation, of the same differences ``x_i - y_j``."""
    t = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    y, v = y_ref[...], v_ref[...]
    k_cols = feature_columns(y, d)
    acc_dtype = accumulator_dtype(y.dtype)

    def body(k, carry):
        dy, dv = carry
        j = idx_ref[t, k]
        queries = pl.ds(j * block, block)
        q = feature_columns(x_ref[queries, :], d)
        g = g_ref[queries, :]
        k_t = jnp.exp(kernel_exponents(q, k_cols, inv, keys_first=True))
        k_t = jnp.where(inc_ref[j, t, :][None, :] > 0, k_t, 0.0)
        sums, _ = pair_sums(k_t * matmul_nt(v, g), q, k_cols, inv, keys_first=True)
        return add_lists(dy, sums), dv + matmul(k_t, g)

    init = ([jnp.zeros((y.shape[0],), acc_dtype)] * d, jnp.zeros(dv_ref.shape, acc_dtype))
    dy, dv = lax.fori_loop(0, count_ref[t], body, init)
    dy_ref[...] = placed(dy, y.shape, 1).astype(dy_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# K v


def _mv_plans(x_group, k_boxes, levels, inv_scale):
    """(G, block, tk) the rows' plans of a group of query tiles (`mv_include`)."""
    return jax.vmap(
        lambda x_t: mv_include(x_t, k_boxes, levels, inv_scale))(x_group)


def _mv_prepared(x, y, v, inv_scale, tol, bs, group):
    """`prepared_inputs`, and for K v: o, o_pad, v_flat, the plans' setup, the group size."""
    block, d, d_pad, y_flat, inv = prepared_inputs(x, y, inv_scale, bs)
    o = v.shape[2]
    o_pad = next_power_of_2(o)
    group = group_size(x.shape[0], plan_entries(y.shape[0], block), group)
    return (block, d, d_pad, y_flat, inv, o, o_pad, flat_tiles(v, o_pad),
            mv_setup(y, v, tol), group)


def _mv_forward(x, y, v, inv_scale, tol, bs, interpret, group):
    block, d, d_pad, y_flat, inv, o, o_pad, v_flat, setup, group = _mv_prepared(
        x, y, v, inv_scale, tol, bs, group)
    tq = x.shape[0]

    def one_group(_, x_group):
        plan, _ = plan_inputs(_mv_plans(x_group, *setup, inv_scale))
        out = call_kernel(
            _mv_forward_kernel, (group,),
            [whole_array_spec(a.shape) for a in plan]
            + [whole_array_spec(inv.shape), row_block_spec(block, d_pad),
               whole_array_spec(y_flat.shape), whole_array_spec(v_flat.shape)],
            row_block_spec(block, o_pad), jax.ShapeDtypeStruct((group * block, o_pad), v.dtype), bs,
            interpret, "rbf_pruned_kernel_mv_fwd", block=block, d=d,
        )(*plan, inv, flat_tiles(x_group, d_pad), y_flat, v_flat)
        return None, out.reshape(group, block, o_pad)[:, :, :o]

    _, out = lax.scan(one_group, None, grouped(x, group))
    return ungrouped(out, tq)


def _mv_backward(x, y, v, inv_scale, tol, bs, interpret, group, g):
    block, d, d_pad, y_flat, inv, o, o_pad, v_flat, setup, group = _mv_prepared(
        x, y, v, inv_scale, tol, bs, group)
    tq = x.shape[0]

    def one_group(carry, rows):
        dy, dv, dinv = carry
        x_group, g_group = rows
        plan, t_plan = plan_inputs(_mv_plans(x_group, *setup, inv_scale))
        x_flat, g_flat = flat_tiles(x_group, d_pad), flat_tiles(g_group, o_pad)
        dx_sum, dinv_sums = query_pass(
            _mv_query_kernel, "rbf_pruned_kernel_mv_bwd_query", plan, inv, x_flat,
            [(g_flat, o_pad)], y_flat, [v_flat], bs, interpret, d)
        dy_sum, dv_group = key_pass(
            _mv_key_kernel, "rbf_pruned_kernel_mv_bwd_key", t_plan, inv, y_flat,
            [(v_flat, o_pad)], x_flat, [g_flat], o_pad, bs, interpret, d)
        dx = -dx_sum[:, :d].reshape(group, block, d) * inv_scale
        carry = (dy + dy_sum[:, :d], dv + dv_group[:, :o], dinv + jnp.sum(dinv_sums[:, :d], 0))
        return carry, dx

    m_pad = y_flat.shape[0]
    init = (jnp.zeros((m_pad, d), y.dtype), jnp.zeros((m_pad, o), v.dtype),
            jnp.zeros((d,), x.dtype))
    # padded query tiles of the last group get g = 0: they add exact zeros
    rows = (grouped(x, group), grouped_zeros(g, group))
    (dy, dv, dinv), dx = lax.scan(one_group, init, rows)
    dy = (dy * inv_scale).reshape(y.shape)
    return (ungrouped(dx, tq), dy, dv.reshape(v.shape), -dinv / inv_scale)


def _pruned_kernel_mv(x, y, v, inv_scale, tol: float, block_sizes: BlockSizes,
                      interpret: bool = False, group: int | None = None):
    """`xla_pruned_mv.pruned_kernel_mv` in Pallas kernels: x (tq, block, d), y (tk, block, d) raw
    coordinates in k-d order, v (tk, block, o), ``inv_scale = 1/l`` (d,) -> (tq, block, o).
    The same key tiles are visited (module docstring); ``group``: query tiles per pallas_call
    (default `group_size`). Differentiable in x, y, v and inv_scale."""
    return _mv_forward(x, y, v, inv_scale, tol, block_sizes, interpret, group), ()


def _pruned_kernel_mv_bwd(inputs, saved, g, tol, block_sizes, interpret, group):
    del saved
    return _mv_backward(*inputs, tol, block_sizes, interpret, group, g)


pruned_kernel_mv = tile_product(_pruned_kernel_mv, _pruned_kernel_mv_bwd, inputs=4, settings=4)
