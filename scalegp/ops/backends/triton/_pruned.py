"""Pruned Pallas kernels: ``K v`` and the KDE log-sum-exp that visit only listed key tiles.

The skip rules, the bounds, the k-d order and the tiled inputs are those of `pruning` (read its
module docstring first); these kernels run the visits in fused kernels instead of XLA's scan.
The plans (which key tiles each query row adds) are built in XLA by `pruning`'s own rules
(`mv_include`, `lse_plan`), each row's against every key tile,
vmapped over query tiles: one bound logic for both paths, so that a row adds the same key tiles
here as there, and a row's result is bitwise the same whatever other rows share the call.

Modules: `_pruned_mv` (``K v``) and `_pruned_lse` (the KDE) hold the kernels;
this one what they share: the tile sizes, the groups of query tiles and their plans, the tile
arithmetic inside a kernel body and the ``pallas_call`` wrappers.

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
(tk, G), and each row's include flags, `plan_entries`). ``G`` is chosen so that a group holds
at most `LIST_ENTRIES` plan entries (and at least one query tile), so the plans take
O(max(LIST_ENTRIES, m)) memory whatever n is: never a list of all n · m / block² tile pairs.
The backward's key pass writes each group's dy and dv (O(m (d + o))) and they are summed over
groups in the scan's carry. So O((n + m)(d + o)) in all, forward
and backward, as the unpruned kernels (tests/ops/backends/triton/test_pruned.py checks it with XLA's
compiled memory analysis).

The transposed relation of the backward (for each key tile, which query tiles visited it) is
the transpose of the group's (G, tk) visit matrix, so the key pass visits exactly the pairs
the query pass does, in query-tile order within a group.

Arithmetic: pairs from raw coordinates, ``((x_f - y_f) · (1/l_f))²`` summed one feature at a time
(as xla's `_pruned_tiles`: no expansion, so narrow kernels on offset data keep their digits), and
the gradients from those differences too (``Σ_j ω_ij (x_if - y_jf)``, not ``x_i Σ_j ω_ij -
(ω y)_i``, whose cancellation would cost the same digits). A feature's column is picked out of a
tile by a masked sum (`_rbf.feature`): Triton cannot slice register tensors. Accumulation in
float32 (or the input's wider type); the products ``K v`` and ``Kᵀ g`` use ``precision=HIGHEST``,
so Triton emits no TF32 dots (`benchmarks/gpu/pallas_lowering.py`).

Padding: one tile height ``block`` (a power of two) for queries and keys (a self-product shares
one order); d and o to powers of two with zeros (zero features change no difference, and the
feature loops stop at the real d), padded keys carry v = 0 and w = 0 (`pruning._order.tile_values`).
On CPU the same kernels run with ``interpret=True`` (for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._tiling import BlockSizes, next_power_of_2, pad_axis
from scalegp.ops.backends.triton._blocks import (
    TritonLaunch,
    check_pow2,
    compiler_params,
    row_block_spec,
    whole_array_spec,
)
from scalegp.ops.backends.triton._rbf import feature
from scalegp.ops.pruning import (
    visit_list,
)

#: At most this many visit-list entries (int32) per group of query tiles: 16 MiB per list.
LIST_ENTRIES = 1 << 22


def default_block_sizes(d: int = 1) -> BlockSizes:
    """Tile height (queries and keys alike: ``block_q = block_k``) and Triton launch parameters
    of the pruned kernels. 64-row tiles, the unpruned kernels' (`_rbf.default_block_sizes`):
    not tuned on a GPU; smaller tiles have tighter boxes, larger ones fewer loop steps.
    ``block_o`` is not used: a kernel holds all o value columns (padded to a power of two)."""
    del d
    return BlockSizes(block_q=64, block_k=64, block_o=64, launch=TritonLaunch(4, 2))


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


def plan_entries(tk: int, block: int, per_row: int = 1) -> int:
    """Plan entries per query tile: its visit list and ``per_row`` arrays over its rows and the
    key tiles (the include flags of `plan_inputs`; for the KDE also the rows' bounds and near
    tiles)."""
    return tk * (1 + per_row * block)


# ----------------------------------------------------------------------------------------------
# tile arithmetic inside a kernel body


def feature_columns(tile, d):
    """The first d features of a (rows, d_pad) tile, as d (rows,) vectors."""
    return [feature(tile, f, 1) for f in range(d)]


def feature_differences(q, k, inv, f, keys_first):
    """``(x_if - y_jf) · (1/l_f)`` of feature f from the column vectors q (queries) and k
    (keys): (p, q), or (q, p) with ``keys_first`` (the same numbers, transposed)."""
    if keys_first:
        return (q[f][None, :] - k[f][:, None]) * inv[f]
    return (q[f][:, None] - k[f][None, :]) * inv[f]


def kernel_exponents(q, k, inv, keys_first=False):
    """``-Σ_f ((x_if - y_jf) / l_f)² / 2``, one feature at a time (as xla's `_pruned_tiles`)."""
    total = None
    for f in range(len(inv)):
        diff = feature_differences(q, k, inv, f, keys_first)
        total = diff * diff if total is None else total + diff * diff
    return -0.5 * total


def pair_sums(omega, q, k, inv, keys_first=False):
    """Per feature f: ``Σ ω ⊙ D_f`` along the tile's second axis and ``Σ ω ⊙ D_f²`` (a scalar),
    ``D_f`` the scaled differences (recomputed, not kept: fewer live tiles)."""
    sums, squares = [], []
    for f in range(len(inv)):
        wd = omega * feature_differences(q, k, inv, f, keys_first)
        sums.append(jnp.sum(wd, axis=1))
        squares.append(jnp.sum(wd * feature_differences(q, k, inv, f, keys_first)))
    return sums, squares


def vector_of(values, size, dtype):
    """A (size,) vector from scalars (entries past them 0), by masked selects (Triton)."""
    idx = lax.broadcasted_iota(jnp.int32, (size,), 0)
    out = jnp.zeros((size,), dtype)
    for f, value in enumerate(values):
        out = jnp.where(idx == f, value.astype(dtype), out)
    return out


def add_lists(a, b):
    return [s + t for s, t in zip(a, b)]


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers


def partials_spec(width):
    """One (1, width) row per program: partial sums, added up outside."""
    return pl.BlockSpec((1, width), lambda i: (i, 0))


def call_kernel(kernel, grid, in_specs, out_specs, out_shape, bs, interpret, name, **static):
    return pl.pallas_call(
        functools.partial(kernel, **static), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, compiler_params=compiler_params(bs, interpret), interpret=interpret,
        name=name)


def query_pass(kernel, name, plan, inv, x, per_row, y, per_key, bs, interpret, d):
    """Shared call of the two query-pass kernels: dx (rows, d_pad), dinv partials (G, d_pad).
    ``plan``: (lists, counts, include) (`plan_inputs`); ``per_row``: (array, width or None)
    inputs blocked with the query rows; ``per_key``: whole."""
    block = bs.block_k
    num, d_pad = plan[1].shape[0], x.shape[1]
    specs = [whole_array_spec(a.shape) for a in plan]
    specs += [whole_array_spec(inv.shape), row_block_spec(block, d_pad)]
    specs += [row_block_spec(block, width) for _, width in per_row]
    specs += [whole_array_spec(y.shape)] + [whole_array_spec(a.shape) for a in per_key]
    return call_kernel(
        kernel, (num,), specs, [row_block_spec(block, d_pad), partials_spec(d_pad)],
        [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((num, d_pad), x.dtype)],
        bs, interpret, name, block=block, d=d,
    )(*plan, inv, x, *(a for a, _ in per_row), y, *per_key)


def key_pass(kernel, name, plan, inv, y, per_key, x, per_query, out_width, bs, interpret, d):
    """Shared call of the two key-pass kernels: dy (m_pad, d_pad) and dv (m_pad, o_pad) or dw
    (m_pad,) (``out_width`` None); ``plan``: (transposed lists, counts, include)."""
    block = bs.block_k
    (m_pad, d_pad), num = y.shape, plan[1].shape[0]
    specs = [whole_array_spec(a.shape) for a in plan]
    specs += [whole_array_spec(inv.shape), row_block_spec(block, d_pad)]
    specs += [row_block_spec(block, width) for _, width in per_key]
    specs += [whole_array_spec(x.shape)] + [whole_array_spec(a.shape) for a in per_query]
    second = (m_pad,) if out_width is None else (m_pad, out_width)
    return call_kernel(
        kernel, (num,), specs, [row_block_spec(block, d_pad), row_block_spec(block, out_width)],
        [jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(second, y.dtype)],
        bs, interpret, name, block=block, d=d,
    )(*plan, inv, y, *(a for a, _ in per_key), x, *per_query)


# ----------------------------------------------------------------------------------------------
# groups of query tiles


def flat_tiles(tiles, width):
    """(tiles, block, w) -> (tiles · block, width), zero-padded columns."""
    return pad_axis(tiles.reshape(-1, tiles.shape[-1]), width, axis=1)


def grouped(tiles, group):
    """(tq, ...) -> (groups, group, ...), padded with copies of the last tile (cut afterwards)."""
    num = -(-tiles.shape[0] // group)
    extra = num * group - tiles.shape[0]
    if extra:
        tiles = jnp.concatenate([tiles, jnp.repeat(tiles[-1:], extra, axis=0)])
    return tiles.reshape((num, group) + tiles.shape[1:])


def ungrouped(out, num_tiles):
    return out.reshape((-1,) + out.shape[2:])[:num_tiles]


def grouped_zeros(a, group):
    """(tk, ...) -> (groups, group, ...), zero padded: as `grouped`, for arrays whose padding
    must add nothing."""
    num = -(-a.shape[0] // group)
    return pad_axis(a, num * group).reshape((num, group) + a.shape[1:])


def plan_inputs(include):
    """A group's per-row plan (G, block, tk) bool -> the query passes' inputs (lists (G, tk) of
    the key tiles each query tile visits, in key order; counts (G,); include as int32 (G, tk,
    block), a key tile's rows together) and the key passes' (the transposed lists (tk, G) and
    counts (tk,), the same include)."""
    visits = jnp.any(include, axis=1)
    rows = jnp.swapaxes(include, 1, 2).astype(jnp.int32)
    return ((*jax.vmap(visit_list)(visits), rows),
            (*jax.vmap(visit_list)(visits.T), rows))


def prepared_inputs(x, y, inv_scale, bs):
    """Common shapes: block, d, d_pad, the keys flat (m_pad, d_pad), inv (d,) in the points'
    dtype."""
    block = check_block_sizes(bs)
    if x.shape[1] != block or y.shape[1] != block:
        raise ValueError(f"tiles of {x.shape[1]} query and {y.shape[1]} key rows, but block "
                         f"{block}")
    d = x.shape[2]
    d_pad = next_power_of_2(d)
    return block, d, d_pad, flat_tiles(y, d_pad), inv_scale.astype(x.dtype)
