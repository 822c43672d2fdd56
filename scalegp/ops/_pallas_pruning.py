"""Pruned Pallas kernels: ``K v`` and the KDE log-sum-exp that visit only listed key tiles.

The skip rules, the bounds, the k-d order and the tiled inputs are those of `_pruning` (read its
module docstring first); this file runs the visits in fused kernels instead of XLA's scan. The
plans (which key tiles each query row adds) are built in XLA by `_pruning`'s own rules
(`_pruning.mv_include`, `_pruning.lse_plan`), each row's against every key tile, vmapped over
query tiles: one bound logic for both paths, so that a row adds the same key tiles here as
there, and a row's result is bitwise the same whatever other rows share the call.

Kernels (grid over tiles; every program reads its own row of an int32 visit list (in key order)
and a count, loads the listed tiles with ``pl.ds(t * block, block)``, a dynamic start of a
static size, and reads which of its rows add each tile from an int32 include array)::

    mv forward      grid (G,)   out_Q = Σ_{T in list_Q} K_QT v_T, rows that add T
    mv query pass   grid (G,)   dx_Q and Q's share of d(1/l), over list_Q
    mv key pass     grid (tk,)  dy_T, dv_T, over the query tiles of the group that visit T
    lse forward     grid (G,)   each row's near tiles, then (a second call) the rest
    lse query pass  grid (G,)   dx_Q, d(1/l), over the pairs the forward added
    lse key pass    grid (tk,)  dy_T, dw_T, over the query tiles of the group that visited T

Pallas on GPU (Triton) has no scalar-prefetch grid spec (that is TPU only), so the lists are
ordinary whole-array inputs, read one int32 at a time inside the kernel. Keys and their values
are whole-array inputs too (no blocking): each program reads only the tiles it visits.

Groups and memory: the query tiles are taken ``G`` at a time (`group_size`), inside a
``lax.scan`` with one pallas_call per kernel per group. A group's plan is O(G · block · tk)
int32 (the padded visit lists, ``tk = m / block`` key tiles, the backward's transposed lists
(tk, G), and each row's include flags, `_plan_entries`). ``G`` is chosen so that a group holds
at most `LIST_ENTRIES` plan entries (and at least one query tile), so the plans take
O(max(LIST_ENTRIES, m)) memory whatever n is: never a list of all n · m / block² tile pairs.
The backward's key pass writes each group's dy and dv (O(m (d + o))) and they are summed over
groups in the scan's carry. So O((n + m)(d + o)) in all, forward
and backward, as the unpruned kernels (tests/ops/test_pallas_pruning.py checks it with XLA's
compiled memory analysis).

The transposed relation of the backward (for each key tile, which query tiles visited it) is
the transpose of the group's (G, tk) visit matrix, so the key pass visits exactly the pairs
the query pass does, in query-tile order within a group.

Arithmetic: pairs from raw coordinates, ``((x_f - y_f) · (1/l_f))²`` summed one feature at a
time (as `_pruning`: no expansion, so narrow kernels on offset data keep their digits), and the
gradients from those differences too (``Σ_j ω_ij (x_if - y_jf)``, not ``x_i Σ_j ω_ij - (ω y)_i``,
whose cancellation would cost the same digits). A feature's column is picked out of a tile by a
masked sum (`_pallas.feature`): Triton cannot slice register tensors. Accumulation
in float32 (or the input's wider type); the products ``K v`` and ``Kᵀ g`` use
``precision=HIGHEST``, so Triton emits no TF32 dots (`benchmarks/gpu/pallas_lowering.py`).

Padding: one tile height ``block`` (a power of two) for queries and keys (a self-product shares
one order); d and o to powers of two with zeros (zero features change no difference, and the
feature loops stop at the real d), padded keys carry v = 0 and w = 0 (`_pruning.tile_values`).
On CPU the same kernels run with ``interpret=True`` (for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops import _pruning
from scalegp.ops._matmul import matmul, matmul_nt
from scalegp.ops._pallas import feature, placed
from scalegp.ops._pallas_blocks import (
    accumulator_dtype,
    check_pow2,
    compiler_params,
    row_block_spec,
    whole_array_spec,
)
from scalegp.ops._tiling import BlockSizes, next_power_of_2, pad_axis

#: At most this many visit-list entries (int32) per group of query tiles: 16 MiB per list.
LIST_ENTRIES = 1 << 22


def default_block_sizes(d: int = 1) -> BlockSizes:
    """Tile height (queries and keys alike: ``block_q = block_k``) and Triton launch parameters
    of the pruned kernels. 64-row tiles, the unpruned kernels' (`_pallas.default_block_sizes`):
    not tuned on a GPU; smaller tiles have tighter boxes, larger ones fewer loop steps.
    ``block_o`` is not used: a kernel holds all o value columns (padded to a power of two)."""
    del d
    return BlockSizes(block_q=64, block_k=64, block_o=64, num_warps=4, num_stages=2)


def check_block_sizes(bs: BlockSizes) -> int:
    """The one tile height of ``bs``, checked (a power of two >= 16, ``block_q == block_k``)."""
    check_pow2(bs)
    if bs.block_q != bs.block_k:
        raise ValueError("the pruned Pallas kernels tile queries and keys alike: block_q must "
                         f"equal block_k, got {bs.block_q} and {bs.block_k}")
    return bs.block_k


def group_size(num_query_tiles: int, entries_per_tile: int, group: int | None = None) -> int:
    """Query tiles per group: ``group`` if given, else as many as keep a group's plan within
    `LIST_ENTRIES` (at least 1, at most all)."""
    if group is None:
        group = LIST_ENTRIES // max(1, entries_per_tile)
    return max(1, min(num_query_tiles, int(group)))


def _plan_entries(tk: int, block: int, per_row: int = 1) -> int:
    """Plan entries per query tile: its visit list and ``per_row`` arrays over its rows and the
    key tiles (the include flags of `_plan_inputs`; for the KDE also the rows' bounds and near
    tiles)."""
    return tk * (1 + per_row * block)


# ----------------------------------------------------------------------------------------------
# tile arithmetic inside a kernel body


def _columns(tile, d):
    """The first d features of a (rows, d_pad) tile, as d (rows,) vectors."""
    return [feature(tile, f, 1) for f in range(d)]


def _differences(q, k, inv, f, keys_first):
    """``(x_if - y_jf) · (1/l_f)`` of feature f from the column vectors q (queries) and k
    (keys): (p, q), or (q, p) with ``keys_first`` (the same numbers, transposed)."""
    if keys_first:
        return (q[f][None, :] - k[f][:, None]) * inv[f]
    return (q[f][:, None] - k[f][None, :]) * inv[f]


def _kernel_exponents(q, k, inv, keys_first=False):
    """``-Σ_f ((x_if - y_jf) / l_f)² / 2``, one feature at a time (as `_pruning`)."""
    total = None
    for f in range(len(inv)):
        diff = _differences(q, k, inv, f, keys_first)
        total = diff * diff if total is None else total + diff * diff
    return -0.5 * total


def _pair_sums(omega, q, k, inv, keys_first=False):
    """Per feature f: ``Σ ω ⊙ D_f`` along the tile's second axis and ``Σ ω ⊙ D_f²`` (a scalar),
    ``D_f`` the scaled differences (recomputed, not kept: fewer live tiles)."""
    sums, squares = [], []
    for f in range(len(inv)):
        wd = omega * _differences(q, k, inv, f, keys_first)
        sums.append(jnp.sum(wd, axis=1))
        squares.append(jnp.sum(wd * _differences(q, k, inv, f, keys_first)))
    return sums, squares


def _vector(values, size, dtype):
    """A (size,) vector from scalars (entries past them 0), by masked selects (Triton)."""
    idx = lax.broadcasted_iota(jnp.int32, (size,), 0)
    out = jnp.zeros((size,), dtype)
    for f, value in enumerate(values):
        out = jnp.where(idx == f, value.astype(dtype), out)
    return out


def _add(a, b):
    return [s + t for s, t in zip(a, b)]


# ----------------------------------------------------------------------------------------------
# K v kernels


def _mv_forward_kernel(idx_ref, count_ref, inc_ref, inv_ref, x_ref, y_ref, v_ref, out_ref, *,
                       block, d):
    i = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    q = _columns(x_ref[...], d)

    def body(k, acc):
        t = idx_ref[i, k]
        keys = pl.ds(t * block, block)
        kt = jnp.exp(_kernel_exponents(q, _columns(y_ref[keys, :], d), inv))
        # rows that skip t (`_pruning.mv_include`) add exact zeros
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
    q = _columns(x, d)
    acc_dtype = accumulator_dtype(x.dtype)

    def body(k, carry):
        t = idx_ref[i, k]
        keys = pl.ds(t * block, block)
        cols = _columns(y_ref[keys, :], d)
        omega = jnp.exp(_kernel_exponents(q, cols, inv)) * matmul_nt(g, v_ref[keys, :])
        omega = jnp.where(inc_ref[i, t, :][:, None] > 0, omega, 0.0)
        sums, squares = _pair_sums(omega, q, cols, inv)
        return _add(carry[0], sums), _add(carry[1], squares)

    init = ([jnp.zeros((x.shape[0],), acc_dtype)] * d, [jnp.zeros((), acc_dtype)] * d)
    dx, dinv = lax.fori_loop(0, count_ref[i], body, init)
    dx_ref[...] = placed(dx, x.shape, 1).astype(dx_ref.dtype)
    dinv_ref[...] = _vector(dinv, dinv_ref.shape[1], dinv_ref.dtype)[None, :]


def _mv_key_kernel(idx_ref, count_ref, inc_ref, inv_ref, y_ref, v_ref, x_ref, g_ref, dy_ref,
                   dv_ref, *, block, d):
    """Per key row ``Σ_i ω_ij D_ijf`` and ``(Kᵀ g)_j``, over the query tiles of the group that
    visit this key tile; tiles in the keys' orientation, of the same differences ``x_i - y_j``."""
    t = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    y, v = y_ref[...], v_ref[...]
    k_cols = _columns(y, d)
    acc_dtype = accumulator_dtype(y.dtype)

    def body(k, carry):
        dy, dv = carry
        j = idx_ref[t, k]
        queries = pl.ds(j * block, block)
        q = _columns(x_ref[queries, :], d)
        g = g_ref[queries, :]
        k_t = jnp.exp(_kernel_exponents(q, k_cols, inv, keys_first=True))
        k_t = jnp.where(inc_ref[j, t, :][None, :] > 0, k_t, 0.0)
        sums, _ = _pair_sums(k_t * matmul_nt(v, g), q, k_cols, inv, keys_first=True)
        return _add(dy, sums), dv + matmul(k_t, g)

    init = ([jnp.zeros((y.shape[0],), acc_dtype)] * d, jnp.zeros(dv_ref.shape, acc_dtype))
    dy, dv = lax.fori_loop(0, count_ref[t], body, init)
    dy_ref[...] = placed(dy, y.shape, 1).astype(dy_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# KDE kernels; the running (max, scaled sum) of `_pruning._lse_tile`


def _lse_forward_kernel(idx_ref, count_ref, inc_ref, inv_ref, x_ref, init_max_ref,
                        init_sum_ref, y_ref, w_ref, lw_ref, max_ref, sum_ref, *, block, d):
    """From each row's (max, scaled sum) so far, the listed key tiles in key order, each folded
    into the rows that add it (one pass of `_pruning._lse_forward`)."""
    i = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    q = _columns(x_ref[...], d)
    acc_dtype = accumulator_dtype(x_ref.dtype)

    def body(k, state):
        run_max, run_sum = state
        t = idx_ref[i, k]
        keys = pl.ds(t * block, block)
        e = _kernel_exponents(q, _columns(y_ref[keys, :], d), inv)
        w = w_ref[keys][None, :]
        new_max = jnp.maximum(run_max, jnp.max(e + lw_ref[keys][None, :], axis=1))
        terms = jnp.where(w > 0, jnp.exp(e - new_max[:, None]) * w, 0.0)
        new_sum = run_sum * jnp.exp(run_max - new_max) + jnp.sum(terms, axis=1)
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
    q = _columns(x, d)
    f_max, f_log_sum, g = max_ref[...][:, None], log_sum_ref[...][:, None], g_ref[...][:, None]
    acc_dtype = accumulator_dtype(x.dtype)

    def body(k, carry):
        t = idx_ref[i, k]
        keys = pl.ds(t * block, block)
        cols = _columns(y_ref[keys, :], d)
        big_t = jnp.exp((_kernel_exponents(q, cols, inv) - f_max) - f_log_sum)
        w = w_ref[keys][None, :]
        omega = g * jnp.where((w > 0) & (inc_ref[i, t, :][:, None] > 0), big_t * w, 0.0)
        sums, squares = _pair_sums(omega, q, cols, inv)
        return _add(carry[0], sums), _add(carry[1], squares)

    init = ([jnp.zeros((x.shape[0],), acc_dtype)] * d, [jnp.zeros((), acc_dtype)] * d)
    dx, dinv = lax.fori_loop(0, count_ref[i], body, init)
    dx_ref[...] = placed(dx, x.shape, 1).astype(dx_ref.dtype)
    dinv_ref[...] = _vector(dinv, dinv_ref.shape[1], dinv_ref.dtype)[None, :]


def _lse_key_kernel(idx_ref, count_ref, inc_ref, inv_ref, y_ref, w_ref, x_ref, max_ref,
                    log_sum_ref, g_ref, dy_ref, dw_ref, *, block, d):
    """Per key row ``Σ_i ω_ij D_ijf`` and ``Σ_i g_i T_ij``, over the query tiles of the group
    that visited this key tile (keys' orientation, the forward's differences)."""
    t = pl.program_id(0)
    inv = [inv_ref[f] for f in range(d)]
    y = y_ref[...]
    k_cols = _columns(y, d)
    w = w_ref[...][:, None]
    acc_dtype = accumulator_dtype(y.dtype)

    def body(k, carry):
        dy, dw = carry
        j = idx_ref[t, k]
        queries = pl.ds(j * block, block)
        q = _columns(x_ref[queries, :], d)
        g = g_ref[queries][None, :]
        e = _kernel_exponents(q, k_cols, inv, keys_first=True)
        big_t = jnp.exp((e - max_ref[queries][None, :]) - log_sum_ref[queries][None, :])
        big_t = jnp.where(inc_ref[j, t, :][None, :] > 0, big_t, 0.0)
        omega = g * jnp.where(w > 0, big_t * w, 0.0)
        sums, _ = _pair_sums(omega, q, k_cols, inv, keys_first=True)
        return _add(dy, sums), dw + jnp.sum(g * big_t, axis=1)

    init = ([jnp.zeros((y.shape[0],), acc_dtype)] * d, jnp.zeros(dw_ref.shape, acc_dtype))
    dy, dw = lax.fori_loop(0, count_ref[t], body, init)
    dy_ref[...] = placed(dy, y.shape, 1).astype(dy_ref.dtype)
    dw_ref[...] = dw.astype(dw_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers


def _partials(width):
    """One (1, width) row per program: partial sums, added up outside."""
    return pl.BlockSpec((1, width), lambda i: (i, 0))


def _call(kernel, grid, in_specs, out_specs, out_shape, bs, interpret, name, **static):
    return pl.pallas_call(
        functools.partial(kernel, **static), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, compiler_params=compiler_params(bs, interpret), interpret=interpret,
        name=name)


def _query_pass(kernel, name, plan, inv, x, per_row, y, per_key, bs, interpret, d):
    """Shared call of the two query-pass kernels: dx (rows, d_pad), dinv partials (G, d_pad).
    ``plan``: (lists, counts, include) (`_plan_inputs`); ``per_row``: (array, width or None)
    inputs blocked with the query rows; ``per_key``: whole."""
    block = bs.block_k
    num, d_pad = plan[1].shape[0], x.shape[1]
    specs = [whole_array_spec(a.shape) for a in plan]
    specs += [whole_array_spec(inv.shape), row_block_spec(block, d_pad)]
    specs += [row_block_spec(block, width) for _, width in per_row]
    specs += [whole_array_spec(y.shape)] + [whole_array_spec(a.shape) for a in per_key]
    return _call(
        kernel, (num,), specs, [row_block_spec(block, d_pad), _partials(d_pad)],
        [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((num, d_pad), x.dtype)],
        bs, interpret, name, block=block, d=d,
    )(*plan, inv, x, *(a for a, _ in per_row), y, *per_key)


def _key_pass(kernel, name, plan, inv, y, per_key, x, per_query, out_width, bs, interpret, d):
    """Shared call of the two key-pass kernels: dy (m_pad, d_pad) and dv (m_pad, o_pad) or dw
    (m_pad,) (``out_width`` None); ``plan``: (transposed lists, counts, include)."""
    block = bs.block_k
    (m_pad, d_pad), num = y.shape, plan[1].shape[0]
    specs = [whole_array_spec(a.shape) for a in plan]
    specs += [whole_array_spec(inv.shape), row_block_spec(block, d_pad)]
    specs += [row_block_spec(block, width) for _, width in per_key]
    specs += [whole_array_spec(x.shape)] + [whole_array_spec(a.shape) for a in per_query]
    second = (m_pad,) if out_width is None else (m_pad, out_width)
    return _call(
        kernel, (num,), specs, [row_block_spec(block, d_pad), row_block_spec(block, out_width)],
        [jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(second, y.dtype)],
        bs, interpret, name, block=block, d=d,
    )(*plan, inv, y, *(a for a, _ in per_key), x, *per_query)


# ----------------------------------------------------------------------------------------------
# groups of query tiles


def _flat(tiles, width):
    """(tiles, block, w) -> (tiles · block, width), zero-padded columns."""
    return pad_axis(tiles.reshape(-1, tiles.shape[-1]), width, axis=1)


def _grouped(tiles, group):
    """(tq, ...) -> (groups, group, ...), padded with copies of the last tile (cut afterwards)."""
    num = -(-tiles.shape[0] // group)
    extra = num * group - tiles.shape[0]
    if extra:
        tiles = jnp.concatenate([tiles, jnp.repeat(tiles[-1:], extra, axis=0)])
    return tiles.reshape((num, group) + tiles.shape[1:])


def _ungrouped(out, num_tiles):
    return out.reshape((-1,) + out.shape[2:])[:num_tiles]


def _plan_inputs(include):
    """A group's per-row plan (G, block, tk) bool -> the query passes' inputs (lists (G, tk) of
    the key tiles each query tile visits, in key order; counts (G,); include as int32 (G, tk,
    block), a key tile's rows together) and the key passes' (the transposed lists (tk, G) and
    counts (tk,), the same include)."""
    visits = jnp.any(include, axis=1)
    rows = jnp.swapaxes(include, 1, 2).astype(jnp.int32)
    return ((*jax.vmap(_pruning.visit_list)(visits), rows),
            (*jax.vmap(_pruning.visit_list)(visits.T), rows))


def _prepared(x, y, inv_scale, bs):
    """Common shapes: block, d, d_pad, the keys flat (m_pad, d_pad), inv (d,) in the points'
    dtype."""
    block = check_block_sizes(bs)
    if x.shape[1] != block or y.shape[1] != block:
        raise ValueError(f"tiles of {x.shape[1]} query and {y.shape[1]} key rows, but block "
                         f"{block}")
    d = x.shape[2]
    d_pad = next_power_of_2(d)
    return block, d, d_pad, _flat(y, d_pad), inv_scale.astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# K v


def _mv_plans(x_group, k_boxes, levels, inv_scale):
    """(G, block, tk) the rows' plans of a group of query tiles (`_pruning.mv_include`)."""
    return jax.vmap(lambda x_t: _pruning.mv_include(x_t, k_boxes, levels, inv_scale))(x_group)


def _mv_prepared(x, y, v, inv_scale, tol, bs, group):
    """`_prepared`, and for K v: o, o_pad, v_flat, the plans' setup, the group size."""
    block, d, d_pad, y_flat, inv = _prepared(x, y, inv_scale, bs)
    o = v.shape[2]
    o_pad = next_power_of_2(o)
    group = group_size(x.shape[0], _plan_entries(y.shape[0], block), group)
    return (block, d, d_pad, y_flat, inv, o, o_pad, _flat(v, o_pad),
            _pruning.mv_setup(y, v, tol), group)


def _mv_forward(x, y, v, inv_scale, tol, bs, interpret, group):
    block, d, d_pad, y_flat, inv, o, o_pad, v_flat, setup, group = _mv_prepared(
        x, y, v, inv_scale, tol, bs, group)
    tq = x.shape[0]

    def one_group(_, x_group):
        plan, _ = _plan_inputs(_mv_plans(x_group, *setup, inv_scale))
        out = _call(
            _mv_forward_kernel, (group,),
            [whole_array_spec(a.shape) for a in plan]
            + [whole_array_spec(inv.shape), row_block_spec(block, d_pad),
               whole_array_spec(y_flat.shape), whole_array_spec(v_flat.shape)],
            row_block_spec(block, o_pad), jax.ShapeDtypeStruct((group * block, o_pad), v.dtype), bs,
            interpret, "rbf_pruned_kernel_mv_fwd", block=block, d=d,
        )(*plan, inv, _flat(x_group, d_pad), y_flat, v_flat)
        return None, out.reshape(group, block, o_pad)[:, :, :o]

    _, out = lax.scan(one_group, None, _grouped(x, group))
    return _ungrouped(out, tq)


def _mv_backward(x, y, v, inv_scale, tol, bs, interpret, group, g):
    block, d, d_pad, y_flat, inv, o, o_pad, v_flat, setup, group = _mv_prepared(
        x, y, v, inv_scale, tol, bs, group)
    tq = x.shape[0]

    def one_group(carry, rows):
        dy, dv, dinv = carry
        x_group, g_group = rows
        plan, t_plan = _plan_inputs(_mv_plans(x_group, *setup, inv_scale))
        x_flat, g_flat = _flat(x_group, d_pad), _flat(g_group, o_pad)
        dx_sum, dinv_sums = _query_pass(
            _mv_query_kernel, "rbf_pruned_kernel_mv_bwd_query", plan, inv, x_flat,
            [(g_flat, o_pad)], y_flat, [v_flat], bs, interpret, d)
        dy_sum, dv_group = _key_pass(
            _mv_key_kernel, "rbf_pruned_kernel_mv_bwd_key", t_plan, inv, y_flat,
            [(v_flat, o_pad)], x_flat, [g_flat], o_pad, bs, interpret, d)
        dx = -dx_sum[:, :d].reshape(group, block, d) * inv_scale
        carry = (dy + dy_sum[:, :d], dv + dv_group[:, :o], dinv + jnp.sum(dinv_sums[:, :d], 0))
        return carry, dx

    m_pad = y_flat.shape[0]
    init = (jnp.zeros((m_pad, d), y.dtype), jnp.zeros((m_pad, o), v.dtype),
            jnp.zeros((d,), x.dtype))
    # padded query tiles of the last group get g = 0: they add exact zeros
    rows = (_grouped(x, group), _grouped_zeros(g, group))
    (dy, dv, dinv), dx = lax.scan(one_group, init, rows)
    dy = (dy * inv_scale).reshape(y.shape)
    return (_ungrouped(dx, tq), dy, dv.reshape(v.shape), -dinv / inv_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def pruned_kernel_mv(x, y, v, inv_scale, tol: float, block_sizes: BlockSizes,
                     interpret: bool = False, group: int | None = None):
    """`_pruning.pruned_kernel_mv` in Pallas kernels: x (tq, block, d), y (tk, block, d) raw
    coordinates in k-d order, v (tk, block, o), ``inv_scale = 1/l`` (d,) -> (tq, block, o).
    The same key tiles are visited (module docstring); ``group``: query tiles per pallas_call
    (default `group_size`). Differentiable in x, y, v and inv_scale."""
    return _mv_forward(x, y, v, inv_scale, tol, block_sizes, interpret, group)


def _pruned_kernel_mv_fwd(x, y, v, inv_scale, tol, block_sizes, interpret, group):
    out = _mv_forward(x, y, v, inv_scale, tol, block_sizes, interpret, group)
    return out, (x, y, v, inv_scale)


def _pruned_kernel_mv_bwd(tol, block_sizes, interpret, group, residuals, g):
    return _mv_backward(*residuals, tol, block_sizes, interpret, group, g)


pruned_kernel_mv.defvjp(_pruned_kernel_mv_fwd, _pruned_kernel_mv_bwd)


def mv_reference(x, y, v, inv_scale, tol: float):
    """The plain reference beside the kernels: the xla pruned path (same tiles visited)."""
    return _pruning.pruned_kernel_mv(x, y, v, inv_scale, tol)


# ----------------------------------------------------------------------------------------------
# KDE


def _lse_forward(x, y, w, inv_scale, tol, bs, interpret, group):
    """(M, L, levels): (tq, block) each, as `_pruning._lse_forward`: its two passes (near key
    tiles, then the rest) as two calls of the forward kernel."""
    block, d, d_pad, y_flat, inv = _prepared(x, y, inv_scale, bs)
    tq, tk = x.shape[0], y.shape[0]
    setup, lw = _pruning.lse_setup(y, w)
    w_flat, lw_flat = w.reshape(-1), lw.reshape(-1)
    log_tol = _pruning.lse_log_tol(tol, x.dtype)
    group = group_size(tq, _plan_entries(tk, block, per_row=3), group)
    positive = (setup[1] > 0)[None, :]

    def one_pass(include, x_flat, state):
        plan, _ = _plan_inputs(include)
        return _call(
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
        neg_half_sq, near = jax.vmap(lambda x_t: _pruning.lse_plan(
            x_t, setup, inv_scale, log_tol))(x_group)
        x_flat = _flat(x_group, d_pad)
        init = (jnp.full((group * block,), -jnp.inf, x.dtype),
                jnp.zeros((group * block,), x.dtype))
        state = one_pass(near, x_flat, init)
        levels = _pruning.lse_level(*(a.reshape(group, block) for a in state), setup[1],
                                    block, log_tol)
        rest = jax.vmap(lambda a, b, c: _pruning.lse_rest(a, b, positive, c))(
            neg_half_sq, near, levels)
        f_max, f_sum = one_pass(rest, x_flat, state)
        return None, (f_max.reshape(group, block), jnp.log(f_sum).reshape(group, block), levels)

    _, (f_max, f_log_sum, levels) = lax.scan(one_group, None, _grouped(x, group))
    return _ungrouped(f_max, tq), _ungrouped(f_log_sum, tq), _ungrouped(levels, tq)


def _lse_backward(x, y, w, inv_scale, f_max, f_log_sum, levels, g, tol, bs, interpret, group):
    block, d, d_pad, y_flat, inv = _prepared(x, y, inv_scale, bs)
    tq, tk = x.shape[0], y.shape[0]
    setup, _ = _pruning.lse_setup(y, w)
    log_tol = _pruning.lse_log_tol(tol, x.dtype)
    group = group_size(tq, _plan_entries(tk, block, per_row=3), group)

    def added(x_t, level):
        return _pruning.lse_added(x_t, setup, inv_scale, log_tol, level)

    w_flat = w.reshape(-1)

    def one_group(carry, rows):
        dy, dw, dinv = carry
        x_group, m_group, l_group, level_group, g_group = rows
        plan, t_plan = _plan_inputs(jax.vmap(added)(x_group, level_group))
        x_flat = _flat(x_group, d_pad)
        m_flat, l_flat, g_flat = (a.reshape(-1) for a in (m_group, l_group, g_group))
        dx_sum, dinv_sums = _query_pass(
            _lse_query_kernel, "rbf_pruned_logsumexp_bwd_query", plan, inv, x_flat,
            [(m_flat, None), (l_flat, None), (g_flat, None)], y_flat, [w_flat], bs, interpret, d)
        dy_sum, dw_group = _key_pass(
            _lse_key_kernel, "rbf_pruned_logsumexp_bwd_key", t_plan, inv, y_flat,
            [(w_flat, None)], x_flat, [m_flat, l_flat, g_flat], None, bs, interpret, d)
        dx = -dx_sum[:, :d].reshape(group, block, d) * inv_scale
        carry = (dy + dy_sum[:, :d], dw + dw_group, dinv + jnp.sum(dinv_sums[:, :d], 0))
        return carry, dx

    m_pad = y_flat.shape[0]
    init = (jnp.zeros((m_pad, d), y.dtype), jnp.zeros((m_pad,), w.dtype),
            jnp.zeros((d,), x.dtype))
    # padded query tiles of the last group: g = 0 (they add exact zeros)
    rows = (_grouped(x, group), _grouped(f_max, group), _grouped(f_log_sum, group),
            _grouped(levels, group), _grouped_zeros(g, group))
    (dy, dw, dinv), dx = lax.scan(one_group, init, rows)
    dy = (dy * inv_scale).reshape(y.shape)
    return _ungrouped(dx, tq), dy, dw.reshape(w.shape), -dinv / inv_scale


def _grouped_zeros(a, group):
    num = -(-a.shape[0] // group)
    return pad_axis(a, num * group).reshape((num, group) + a.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def pruned_kernel_logsumexp(x, y, w, inv_scale, tol: float, block_sizes: BlockSizes,
                            interpret: bool = False, group: int | None = None):
    """`_pruning.pruned_kernel_logsumexp` in Pallas kernels: x (tq, block, d), y (tk, block, d)
    raw coordinates in k-d order, w (tk, block) >= 0, ``inv_scale = 1/l`` (d,) -> (tq, block);
    the same rule (relative error <= tol), the same pairs added."""
    f_max, f_log_sum, _ = _lse_forward(x, y, w, inv_scale, tol, block_sizes, interpret, group)
    return f_max + f_log_sum


def _pruned_lse_fwd(x, y, w, inv_scale, tol, block_sizes, interpret, group):
    f_max, f_log_sum, levels = _lse_forward(x, y, w, inv_scale, tol, block_sizes, interpret,
                                            group)
    return f_max + f_log_sum, (x, y, w, inv_scale, f_max, f_log_sum, levels)


def _pruned_lse_bwd(tol, block_sizes, interpret, group, residuals, g):
    return _lse_backward(*residuals, g, tol, block_sizes, interpret, group)


pruned_kernel_logsumexp.defvjp(_pruned_lse_fwd, _pruned_lse_bwd)


def logsumexp_reference(x, y, w, inv_scale, tol: float):
    """The plain reference beside the kernels: the xla pruned path (same rule)."""
    return _pruning.pruned_kernel_logsumexp(x, y, w, inv_scale, tol)
