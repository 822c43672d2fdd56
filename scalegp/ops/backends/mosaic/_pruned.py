"""Pruned Mosaic kernels: the RBF's ``K v`` and the KDE's log-sum-exp over visit lists, forward
and backward, and the backend's `PrunedCore` (`pruned_core`).

The skip rules, the bounds, the k-d order and the tiled inputs are those of `pruning` (read its
`_rules` docstring first). The plans are built in XLA by `pruning`'s own rules, exactly as the
Triton backend builds them: each query row's test against every key tile (`mv_include`;
`lse_plan`, `lse_rest`, `lse_added`), vmapped over the query tiles of a group, so that a row
adds the same key tiles on every backend and its result is bitwise the same whatever other rows
share the call. These kernels run the visits.

The splash-attention pattern (jax's ``pallas/ops/tpu``): the visit lists are scalar-prefetch
operands (``PrefetchScalarGridSpec(num_scalar_prefetch > 0)``, in SMEM), and the BlockSpecs of
the visited tiles read the tile index from them, so that only listed tiles are DMA'd into
VMEM::

    query passes  grid (the group's query tiles i, visit steps k)
                  key tile t = lists[i, min(k, counts[i] - 1)]  (a step past the count repeats
                  the last listed tile: no new DMA, and ``pl.when(k < counts[i])`` skips it)
    key passes    grid (the key tiles the group visits c, visit steps k)
                  key tile T = keys[c], query tile j = lists_T[T, min(k, counts_T[T] - 1)]

The visit steps are a dynamic grid extent (the group's largest count, at least 1: read from a
device scalar, no host sync), and so is the key passes' number of rows, so a group pays for
its own visits, not for all ``tq x tk`` tile pairs; the key passes run only over the key tiles
the group visits, adding into the gradients of the earlier groups in place
(``input_output_aliases``): key tiles no row of the group adds are neither read nor written.
Running sums live in VMEM scratch, zeroed at the first step and written out at the last, as
in `_rbf`.

::

    mv forward      queries x keys   out_Q = Σ_{T in list_Q} K_QT v_T   (rows that add T)
    mv query pass   queries x keys   dx_Q, and Σ ω D² per row for d(1/l)
    mv key pass     keys x queries   dy_T, dv_T += over the group's query tiles that visit T
    lse forward     queries x keys   each row's near tiles, then (a second call) the rest
    lse query pass  queries x keys   dx_Q, Σ ω D², over the pairs the forward added
    lse key pass    keys x queries   dy_T, dw_T += over the group's query tiles that visited T

Orientation. The query passes hold the query tile as rows (block, d) and the key tiles
feature-major (d, block), keys along the lanes, as `_rbf` does, so each row's running sums
are (block, ·) scratch and the online log-sum-exp is `lse_step`'s. The key passes swap the
roles: key rows (block, d), queries feature-major (d, block). Which rows of a query tile add a
visited key tile (the per-row include flags of the Triton kernels) arrive per visit step, laid
out for each side:

- query side: ``flags[i, :, k]``, (G, block, tk rounded up to 128) float32 0/1, the rows of
  query tile i that add the k-th key tile on its list, blocked (block, 128): 128 steps per DMA,
  the step's column picked by a masked lane sum (Mosaic has no dynamic lane slice; a column
  (block, 1) of a lane-sparse array would take 128 times its size in HBM);
- key side: ``flags_T[T, k, :]``, (tk, G, block), the rows of the k-th query tile that
  visits key tile T, blocked (8, block) (a group of fewer query tiles: all its rows in one
  block): the step's row by a masked sublane sum.

Arithmetic. Pairs from raw coordinates, ``((x_f - y_f) · (1/l_f))²`` summed one feature at a
time (as the xla and Triton pruned paths: no expansion, so narrow kernels on offset data keep
their digits), 1/l from SMEM. ``K v`` and ``Kᵀ g`` by `split_dot` (bfloat16 passes, at most
``1.25 · 2^-16`` relative per element, the forward's tile sums compensated), the products
``g·v`` of the ``K v`` backward by `piece_operands` (float32 accuracy); gradient sums by the
coordinate differences, ``Σ_j ω_ij D_ijf`` and ``Σ_j ω_ij D_ijf²`` (the latter for d(1/l),
never ``x·dx + y·dy``, which cancels on offset data). The final log of the KDE is
`accurate_log` (the TPU's log errs by 1e-4). Everything runs in float32 (the inputs' dtype
outside the kernels: the plans, and the results cast back).

Groups and memory: the query tiles are taken ``G`` at a time (`group_size`) inside a
``lax.scan``, as the Triton backend does, so that a group's plan (the rows' tests (G, block,
tk), both flag layouts, the lists (G, tk) in SMEM) holds at most `LIST_ENTRIES` entries
whatever n is; the key passes' sums are carried across groups. O((n + m)(d + o)) in all,
forward and backward, with the lanes' constant: the thin operands of the matrix unit (v and g
split into bfloat16 pieces, the sums of ``Kᵀ g``) take 128 lanes whatever o is, about 1.3 KB
per key for the ``K v`` backward (a TPU pads an (m, o) float32 array to 128 lanes anyway).

Padding: one tile height ``block`` for queries and keys, a multiple of 128 (`LANES`), 256 by
default (`BLOCK`, pruning's `PRUNE_BLOCK`: the xla path's tiles); padded keys carry v = 0 and
w = 0 (`pruning._order.tile_values`); a group's padding tiles (copies of its last tile) add no
key tile. On a CPU the kernels run with ``interpret=True`` (tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._interface import PrunedCore
from scalegp.ops._kernels import RBF
from scalegp.ops._tile_math import accurate_log, lse_step, tile_product
from scalegp.ops._tiling import BlockSizes, compensated_add, pad_axis, round_up
from scalegp.ops.backends.mosaic._blocks import (
    LANES,
    call,
    fold,
    key_pieces,
    over_column_chunks,
    row_pieces,
    smem_spec,
    split_dot,
    split_thin,
    split_width,
)
from scalegp.ops.pruning import (
    PRUNE_BLOCK,
    lse_added,
    lse_level,
    lse_log_tol,
    lse_plan,
    lse_rest,
    lse_setup,
    mv_include,
    mv_setup,
    visit_list,
)

#: The default tile height of queries and keys: pruning's `PRUNE_BLOCK` (the xla path's
#: tiles), two lane widths. Smaller tiles have tighter boxes (more pruning), larger ones fewer
#: grid steps (about 0.35 µs each on a TPU). Not yet timed on a TPU.
BLOCK = PRUNE_BLOCK
#: At most this many plan entries per group of query tiles (the rows' tests, each flag layout
#: float32: 16 MiB each), as the Triton backend's groups.
LIST_ENTRIES = 1 << 22
#: The sublanes of a key-side flag block (8 visit steps per DMA; a group of fewer query tiles
#: takes them all in one block, `flag_rows`).
SUBLANES = 8


def default_block_sizes(d: int = 1) -> BlockSizes:
    """The pruned kernels' tiles: `BLOCK` rows of queries and of keys (``block_q = block_k``);
    ``block_o`` is not used (a kernel holds all o value columns)."""
    del d
    return BlockSizes(block_q=BLOCK, block_k=BLOCK)


def check_block_sizes(bs: BlockSizes) -> int:
    """The one tile height of ``bs``, checked: ``block_q == block_k``, a multiple of `LANES`."""
    if bs.block_q != bs.block_k:
        raise ValueError("the pruned Mosaic kernels tile queries and keys alike: block_q must "
                         f"equal block_k, got {bs.block_q} and {bs.block_k}")
    if bs.block_k % LANES:
        raise ValueError(f"the pruned Mosaic kernels need tiles of a multiple of {LANES} rows, "
                         f"got {bs.block_k}")
    return bs.block_k


def group_size(num_query_tiles: int, tk: int, block: int, per_row: int = 3,
               group: int | None = None) -> int:
    """Query tiles per group: ``group`` if given, else as many as keep a group's plan (its
    visit lists and ``per_row`` arrays over its rows and the key tiles) within
    `LIST_ENTRIES` (at least 1, at most all)."""
    if group is None:
        group = LIST_ENTRIES // max(1, tk * (1 + per_row * block))
    return max(1, min(num_query_tiles, int(group)))


# ----------------------------------------------------------------------------------------------
# groups and their plans (XLA)


def grouped(tiles, group):
    """(tq, ...) -> (groups, group, ...), padded with copies of the last tile, and which tiles
    are real (groups, group)."""
    tq = tiles.shape[0]
    num = -(-tq // group)
    extra = num * group - tq
    if extra:
        tiles = jnp.concatenate([tiles, jnp.repeat(tiles[-1:], extra, axis=0)])
    real = (jnp.arange(num * group) < tq).reshape(num, group)
    return tiles.reshape((num, group) + tiles.shape[1:]), real


def grouped_zeros(a, group):
    """(tq, ...) -> (groups, group, ...), zero padded (cotangents: padding adds nothing)."""
    num = -(-a.shape[0] // group)
    return pad_axis(a, num * group).reshape((num, group) + a.shape[1:])


def ungrouped(out, num_tiles):
    return out.reshape((-1,) + out.shape[2:])[:num_tiles]


class QueryPlan(NamedTuple):
    """The query passes' plan of a group: ``lists`` (G·tk,) int32 the key tiles each query
    tile visits, in key order (`visit_list`), ``counts`` (G,), ``flags`` (G, block, tk_pad)
    float32 (``flags[i, :, k]``: the rows that add the k-th tile on i's list), ``steps`` the
    grid's second extent (the largest count, at least 1)."""

    lists: jax.Array
    counts: jax.Array
    flags: jax.Array
    steps: jax.Array


class KeyPlan(NamedTuple):
    """The key passes' plan of a group: ``keys`` (tk,) the key tiles any query tile of the
    group visits first (`visit_list`), ``num_keys`` the grid's first extent (their number, at
    least 1); ``lists`` (tk·G,) for each key tile the group's query tiles that visit it, in
    order, ``counts`` (tk,); ``flags`` (tk, G_pad, block) float32 (``flags[T, k, :]``: the
    rows of the k-th of them that add T; G_pad a multiple of `flag_rows`); ``steps`` the
    largest count (at least 1)."""

    keys: jax.Array
    num_keys: jax.Array
    lists: jax.Array
    counts: jax.Array
    flags: jax.Array
    steps: jax.Array


def query_plan(include) -> QueryPlan:
    """A group's rows' plans (G, block, tk) bool -> the query passes' `QueryPlan`."""
    tk = include.shape[2]
    lists, counts = jax.vmap(visit_list)(jnp.any(include, axis=1))
    flags = jnp.take_along_axis(include, lists[:, None, :], axis=2).astype(jnp.float32)
    flags = pad_axis(flags, round_up(tk, LANES), axis=2)
    return QueryPlan(lists.reshape(-1), counts, flags, jnp.maximum(jnp.max(counts), 1))


def key_plan(include) -> KeyPlan:
    """A group's rows' plans (G, block, tk) bool -> the key passes' `KeyPlan`."""
    group = include.shape[0]
    visits = jnp.any(include, axis=1)  # (G, tk)
    keys, num_keys = visit_list(jnp.any(visits, axis=0))
    lists, counts = jax.vmap(visit_list)(visits.T)  # (tk, G), (tk,)
    by_key = jnp.transpose(include, (2, 0, 1))  # (tk, G, block)
    flags = jnp.take_along_axis(by_key, lists[:, :, None], axis=1).astype(jnp.float32)
    flags = pad_axis(flags, round_up(group, flag_rows(group)), axis=1)
    return KeyPlan(keys, jnp.maximum(num_keys, 1), lists.reshape(-1), counts, flags,
                   jnp.maximum(jnp.max(counts), 1))


def flag_rows(group: int) -> int:
    """Visit steps per key-side flag block: `SUBLANES`, or a smaller group's all (a block
    as high as the array: no padding to 8)."""
    return min(group, SUBLANES)


def _clamped(k, count):
    """The visit step grid step k reads: k, or past the count the last one listed."""
    return jnp.maximum(jnp.minimum(k, count - 1), 0)


class QueryGrid:
    """BlockSpecs of a query pass: grid (the group's query tiles i, visit steps k), prefetched
    (lists, counts) of a `QueryPlan`."""

    def __init__(self, tk: int, block: int):
        self.tk, self.block = tk, block

    def _key(self, i, k, lists, counts):
        return lists[i * self.tk + _clamped(k, counts[i])]

    def rows(self, width):
        """The query tile's (block, width) rows."""
        return pl.BlockSpec((self.block, width), lambda i, k, *_: (i, 0))

    def key_cols(self, height):
        """The visited key tile of a feature-major array (height, m_pad)."""
        return pl.BlockSpec((height, self.block),
                            lambda i, k, *p: (0, self._key(i, k, *p)))

    def flags(self):
        return pl.BlockSpec((None, self.block, LANES), lambda i, k, lists, counts: (
            i, 0, lax.div(_clamped(k, counts[i]), jnp.int32(LANES))))


class KeyGrid:
    """BlockSpecs of a key pass: grid (the key tiles the group visits c, visit steps k),
    prefetched (keys, lists, counts) of a `KeyPlan`."""

    def __init__(self, group: int, block: int):
        self.group, self.block = group, block

    def _query(self, c, k, keys, lists, counts):
        t = keys[c]
        return lists[t * self.group + _clamped(k, counts[t])]

    def rows(self, width):
        """The key tile's (block, width) rows (also the aliased sums)."""
        return pl.BlockSpec((self.block, width), lambda c, k, keys, *_: (keys[c], 0))

    def query_cols(self, height):
        """The visiting query tile of a feature-major array (height, group · block)."""
        return pl.BlockSpec((height, self.block), lambda c, k, *p: (0, self._query(c, k, *p)))

    def flags(self):
        rows = flag_rows(self.group)
        return pl.BlockSpec((None, rows, self.block), lambda c, k, keys, lists, counts: (
            keys[c], lax.div(_clamped(k, counts[keys[c]]), jnp.int32(rows)), 0))


# ----------------------------------------------------------------------------------------------
# tile arithmetic inside a kernel body


def _difference(q, k, inv_ref, f, keys_major):
    """``(x_f - y_f) · (1/l_f)`` of feature f: queries q (p, d) against feature-major keys k
    (d, q) -> (p, q); ``keys_major``: key rows k (q, d) against feature-major queries q (d, p)
    -> (q, p), the same numbers transposed."""
    if keys_major:
        return (q[f:f + 1, :] - k[:, f:f + 1]) * inv_ref[f]
    return (q[:, f:f + 1] - k[f:f + 1, :]) * inv_ref[f]


def scaled_exponents(q, k, inv_ref, d, keys_major=False):
    """``-Σ_f ((x_f - y_f) / l_f)² / 2``, one feature at a time (as the Triton and xla pruned
    kernels)."""
    total = None
    for f in range(d):
        diff = _difference(q, k, inv_ref, f, keys_major)
        total = diff * diff if total is None else total + diff * diff
    return -0.5 * total


def _pair_sums(acc, omega, q, k, inv_ref, d, keys_major=False, squares=True):
    """``acc[:, f] += Σ ω ⊙ D_f`` along the tile's lanes for each feature f, and where
    ``squares`` ``acc[:, d + f] += Σ ω ⊙ D_f²`` (D_f the scaled differences, recomputed)."""
    for f in range(d):
        diff = _difference(q, k, inv_ref, f, keys_major)
        wd = omega * diff
        acc[:, f:f + 1] += jnp.sum(wd, axis=1, keepdims=True)
        if squares:
            acc[:, d + f:d + f + 1] += jnp.sum(wd * diff, axis=1, keepdims=True)


def _query_flags(flags_ref, k):
    """(block, 1): the query tile's rows that add its k-th listed key tile (a masked lane sum:
    the column k mod 128 of the (block, 128) block)."""
    block = flags_ref[...]
    lane = lax.broadcasted_iota(jnp.int32, block.shape, 1)
    picked = jnp.where(lane == lax.rem(k, jnp.int32(LANES)), block, 0.0)
    return jnp.sum(picked, axis=1, keepdims=True)


def _key_flags(flags_ref, k):
    """(1, block): the rows of the k-th query tile visiting this key tile that add it (a
    masked sublane sum: the row k mod `flag_rows` of the block)."""
    block = flags_ref[...]
    sublane = lax.broadcasted_iota(jnp.int32, block.shape, 0)
    picked = jnp.where(sublane == lax.rem(k, jnp.int32(block.shape[0])), block, 0.0)
    return jnp.sum(picked, axis=0, keepdims=True)


def _steps(counts_of_row, body_first, body_visit, body_last):
    """The three phases of a grid row: zero the sums (first step), a listed visit (steps
    before the count), write out (last step)."""
    k = pl.program_id(1)
    pl.when(k == 0)(body_first)
    pl.when(k < counts_of_row)(body_visit)
    pl.when(k == pl.num_programs(1) - 1)(body_last)


def _zero(*refs):
    def body():
        for ref in refs:
            ref[...] = jnp.zeros_like(ref)
    return body


# ----------------------------------------------------------------------------------------------
# shared shapes


def _feature_major(tiles):
    """(tiles, block, d) -> (d, tiles · block) float32."""
    return tiles.reshape(-1, tiles.shape[-1]).astype(jnp.float32).T


def _flat(tiles):
    """(tiles, block, ...) -> (tiles · block, ...) float32."""
    return tiles.reshape((-1,) + tiles.shape[2:]).astype(jnp.float32)


def _pieces(a, as_rows: bool):
    """One side of `piece_operands` of a product ``a · b`` (rows (n, c)): the rows' pieces
    (n, k) (``as_rows``, `row_pieces`), else the columns' (k, n) (`key_pieces`); each side is
    built once, not per group."""
    return row_pieces(a) if as_rows else key_pieces(a)


def _checked(x, y, bs):
    block = check_block_sizes(bs)
    if x.shape[1] != block or y.shape[1] != block:
        raise ValueError(f"tiles of {x.shape[1]} query and {y.shape[1]} key rows, but block "
                         f"{block}")
    return block, x.shape[2]


# ----------------------------------------------------------------------------------------------
# K v kernels


def _mv_forward_kernel(lists, counts, inv_ref, x_ref, yt_ref, v_ref, flags_ref, out_ref, acc,
                       carry, *, d):
    i, k = pl.program_id(0), pl.program_id(1)

    def visit():
        kt = jnp.exp(scaled_exponents(x_ref[...], yt_ref[...], inv_ref, d))
        # rows that skip the tile (`mv_include`) add exact zeros
        kt = jnp.where(_query_flags(flags_ref, k) > 0, kt, 0.0)
        acc[...], carry[...] = compensated_add((acc[...], carry[...]),
                                               split_dot(kt, v_ref[...]))

    def last():
        out_ref[...] = acc[...] + carry[...]

    _steps(counts[i], _zero(acc, carry), visit, last)


def _mv_query_kernel(lists, counts, inv_ref, x_ref, gp_ref, yt_ref, vp_ref, flags_ref, out_ref,
                     acc, *, d):
    """Per query row ``Σ_j ω_ij D_ijf`` and ``Σ_j ω_ij D_ijf²``, ``ω = K ⊙ g vᵀ``."""
    i, k = pl.program_id(0), pl.program_id(1)

    def visit():
        x, yt = x_ref[...], yt_ref[...]
        gv = jnp.dot(gp_ref[...], vp_ref[...], preferred_element_type=jnp.float32)
        omega = jnp.exp(scaled_exponents(x, yt, inv_ref, d)) * gv
        omega = jnp.where(_query_flags(flags_ref, k) > 0, omega, 0.0)
        _pair_sums(acc, omega, x, yt, inv_ref, d)

    def last():
        out_ref[...] = acc[...]

    _steps(counts[i], _zero(acc), visit, last)


def _mv_key_kernel(keys, lists, counts, inv_ref, y_ref, vp_ref, xt_ref, gp_ref, gs_ref,
                   flags_ref, dy_in, dv_in, dy_out, dv_out, acc_dy, acc_dv, *, d):
    """Per key row ``Σ_i ω_ij D_ijf`` and ``(Kᵀ g)_j`` (split halves) over the group's query
    tiles that visit this key tile, added to the sums of the earlier groups."""
    c, k = pl.program_id(0), pl.program_id(1)

    def visit():
        y, xt = y_ref[...], xt_ref[...]
        kt = jnp.exp(scaled_exponents(xt, y, inv_ref, d, keys_major=True))
        kt = jnp.where(_key_flags(flags_ref, k) > 0, kt, 0.0)
        vg = jnp.dot(vp_ref[...], gp_ref[...], preferred_element_type=jnp.float32)
        _pair_sums(acc_dy, kt * vg, xt, y, inv_ref, d, keys_major=True, squares=False)
        acc_dv[...] += split_dot(kt, gs_ref[...])

    def last():
        dy_out[...] = dy_in[...] + acc_dy[...]
        dv_out[...] = dv_in[...] + acc_dv[...]

    _steps(counts[keys[c]], _zero(acc_dy, acc_dv), visit, last)


# ----------------------------------------------------------------------------------------------
# K v


def _mv_include(x_group, real, setup, inv_scale):
    """(G, block, tk): which key tiles each row of the group adds (`mv_include`); padding
    tiles none."""
    include = jax.vmap(lambda x_t: mv_include(x_t, *setup, inv_scale))(x_group)
    return include & real[:, None, None]


def _mv_forward(x, y, v, inv_scale, tol, bs, interpret, group):
    block, d = _checked(x, y, bs)
    (tq, tk), o = (x.shape[0], y.shape[0]), v.shape[2]
    setup = mv_setup(y, v, tol)
    yt, v_split = _feature_major(y), split_thin(_flat(v))
    width = v_split.shape[0]
    inv = inv_scale.astype(jnp.float32)
    group = group_size(tq, tk, block, per_row=3, group=group)
    grid = QueryGrid(tk, block)

    def one_group(_, rows):
        x_group, real = rows
        plan = query_plan(_mv_include(x_group, real, setup, inv_scale))
        out = call(
            functools.partial(_mv_forward_kernel, d=d), (group, plan.steps),
            [smem_spec(), grid.rows(d), grid.key_cols(d), grid.key_cols(width), grid.flags()],
            grid.rows(width), jax.ShapeDtypeStruct((group * block, width), jnp.float32),
            [(block, width)] * 2, bs, interpret, "rbf_pruned_kernel_mv_fwd",
            prefetch=(plan.lists, plan.counts),
        )(inv, _flat(x_group), yt, v_split, plan.flags)
        return None, fold(out, o).reshape(group, block, o)

    _, out = lax.scan(one_group, None, grouped(x, group))
    return ungrouped(out, tq).astype(v.dtype)


def _mv_backward(x, y, v, inv_scale, tol, bs, interpret, group, g):
    block, d = _checked(x, y, bs)
    (tq, tk), o = (x.shape[0], y.shape[0]), v.shape[2]
    setup = mv_setup(y, v, tol)
    y_rows, yt, inv = _flat(y), _feature_major(y), inv_scale.astype(jnp.float32)
    v_flat = _flat(v)
    vpt, vp = _pieces(v_flat, as_rows=False), _pieces(v_flat, as_rows=True)
    group = group_size(tq, tk, block, per_row=3, group=group)
    q_grid, k_grid = QueryGrid(tk, block), KeyGrid(group, block)

    def one_group(carry, rows):
        dy, dv, dinv = carry
        x_group, real, g_group = rows
        include = _mv_include(x_group, real, setup, inv_scale)
        x_rows, g_rows = _flat(x_group), _flat(g_group)
        qp, kp = query_plan(include), key_plan(include)
        gp = _pieces(g_rows, as_rows=True)
        sums = call(
            functools.partial(_mv_query_kernel, d=d), (group, qp.steps),
            [smem_spec(), q_grid.rows(d), q_grid.rows(gp.shape[1]), q_grid.key_cols(d),
             q_grid.key_cols(vpt.shape[0]), q_grid.flags()],
            q_grid.rows(2 * d), jax.ShapeDtypeStruct((group * block, 2 * d), jnp.float32),
            [(block, 2 * d)], bs, interpret, "rbf_pruned_kernel_mv_bwd_query",
            prefetch=(qp.lists, qp.counts),
        )(inv, x_rows, gp, yt, vpt, qp.flags)
        gpt = _pieces(g_rows, as_rows=False)
        g_split = split_thin(g_rows)
        dy, dv = call(
            functools.partial(_mv_key_kernel, d=d), (kp.num_keys, kp.steps),
            [smem_spec(), k_grid.rows(d), k_grid.rows(vp.shape[1]), k_grid.query_cols(d),
             k_grid.query_cols(gpt.shape[0]), k_grid.query_cols(g_split.shape[0]),
             k_grid.flags(), k_grid.rows(d), k_grid.rows(dv.shape[1])],
            [k_grid.rows(d), k_grid.rows(dv.shape[1])],
            [jax.ShapeDtypeStruct(dy.shape, jnp.float32),
             jax.ShapeDtypeStruct(dv.shape, jnp.float32)],
            [(block, d), (block, dv.shape[1])], bs, interpret, "rbf_pruned_kernel_mv_bwd_key",
            prefetch=(kp.keys, kp.lists, kp.counts), aliases={7: 0, 8: 1},
        )(inv, y_rows, vp, x_rows.T, gpt, g_split, kp.flags, dy, dv)
        dx = -sums[:, :d].reshape(group, block, d) * inv
        return (dy, dv, dinv + jnp.sum(sums[:, d:], axis=0)), dx

    m_pad = y_rows.shape[0]
    width = split_width(o)  # split_thin's halves of Kᵀ g
    init = (jnp.zeros((m_pad, d), jnp.float32), jnp.zeros((m_pad, width), jnp.float32),
            jnp.zeros((d,), jnp.float32))
    x_groups, real = grouped(x, group)
    (dy, dv, dinv), dx = lax.scan(one_group, init, (x_groups, real, grouped_zeros(g, group)))
    return (ungrouped(dx, tq).astype(x.dtype), (dy * inv).reshape(y.shape).astype(y.dtype),
            fold(dv, o).reshape(v.shape).astype(v.dtype),
            (-dinv / inv).astype(inv_scale.dtype))


def _pruned_kernel_mv(x, y, v, inv_scale, tol: float, block_sizes: BlockSizes,
                      interpret: bool = False, group: int | None = None):
    """The pruned ``K v`` in Mosaic kernels: x (tq, block, d), y (tk, block, d) raw
    coordinates in k-d order, v (tk, block, o), ``inv_scale = 1/l`` (d,) -> (tq, block, o);
    each row adds the key tiles `mv_include` gives it (module docstring). ``group``: query
    tiles per pallas_call (default `group_size`). Differentiable in x, y, v and inv_scale."""
    return _mv_forward(x, y, v, inv_scale, tol, block_sizes, interpret, group), ()


def _pruned_kernel_mv_bwd(inputs, saved, g, tol, block_sizes, interpret, group):
    del saved
    return _mv_backward(*inputs, tol, block_sizes, interpret, group, g)


pruned_kernel_mv = tile_product(_pruned_kernel_mv, _pruned_kernel_mv_bwd, inputs=4, settings=4)


# ----------------------------------------------------------------------------------------------
# KDE kernels; the running (max, scaled sum) of `lse_step`


def _lse_forward_kernel(lists, counts, inv_ref, x_ref, max0_ref, sum0_ref, yt_ref, w_ref,
                        lw_ref, flags_ref, max_out, sum_out, run_max, run_sum, *, d, final):
    """From each row's (max, scaled sum) so far, the listed key tiles in key order, each folded
    into the rows that add it; ``final``: the log of the sum written out (`accurate_log`)."""
    i, k = pl.program_id(0), pl.program_id(1)

    def first():
        run_max[...] = max0_ref[...]
        run_sum[...] = sum0_ref[...]

    def visit():
        e = scaled_exponents(x_ref[...], yt_ref[...], inv_ref, d)
        old_max, old_sum = run_max[...], run_sum[...]
        new_max, new_sum, _, _ = lse_step(old_max, old_sum, e, w_ref[...], lw_ref[...])
        add = _query_flags(flags_ref, k) > 0
        run_max[...] = jnp.where(add, new_max, old_max)
        run_sum[...] = jnp.where(add, new_sum, old_sum)

    def last():
        max_out[...] = run_max[...]
        sum_out[...] = accurate_log(run_sum[...]) if final else run_sum[...]

    _steps(counts[i], first, visit, last)


def _lse_query_kernel(lists, counts, inv_ref, x_ref, max_ref, log_sum_ref, g_ref, yt_ref, w_ref,
                      flags_ref, out_ref, acc, *, d):
    """``ω_ij = g_i P_ij``, ``P_ij = w_j exp(e_ij - M_i - L_i)``: per query row
    ``Σ_j ω_ij D_ijf`` and ``Σ_j ω_ij D_ijf²``, over the pairs the forward added."""
    i, k = pl.program_id(0), pl.program_id(1)

    def visit():
        x, yt = x_ref[...], yt_ref[...]
        big_t = jnp.exp((scaled_exponents(x, yt, inv_ref, d) - max_ref[...]) - log_sum_ref[...])
        w = w_ref[...]
        add = (w > 0) & (_query_flags(flags_ref, k) > 0)
        omega = g_ref[...] * jnp.where(add, big_t * w, 0.0)
        _pair_sums(acc, omega, x, yt, inv_ref, d)

    def last():
        out_ref[...] = acc[...]

    _steps(counts[i], _zero(acc), visit, last)


def _lse_key_kernel(keys, lists, counts, inv_ref, y_ref, w_ref, xt_ref, max_ref, log_sum_ref,
                    g_ref, flags_ref, sums_in, sums_out, acc, *, d):
    """Per key row ``Σ_i ω_ij D_ijf`` and ``Σ_i g_i T_ij`` over the group's query tiles that
    visited this key tile (keys' orientation), added to the earlier groups' sums."""
    c, k = pl.program_id(0), pl.program_id(1)

    def visit():
        y, xt = y_ref[...], xt_ref[...]
        e = scaled_exponents(xt, y, inv_ref, d, keys_major=True)
        big_t = jnp.exp((e - max_ref[...]) - log_sum_ref[...])
        big_t = jnp.where(_key_flags(flags_ref, k) > 0, big_t, 0.0)
        w, g = w_ref[...], g_ref[...]
        omega = g * jnp.where(w > 0, big_t * w, 0.0)
        _pair_sums(acc, omega, xt, y, inv_ref, d, keys_major=True, squares=False)
        acc[:, d:d + 1] += jnp.sum(g * big_t, axis=1, keepdims=True)

    def last():
        sums_out[...] = sums_in[...] + acc[...]

    _steps(counts[keys[c]], _zero(acc), visit, last)


# ----------------------------------------------------------------------------------------------
# KDE


def _lse_pass(include, state, x_group, inv, yt, w_row, lw_row, bs, interpret, d, final):
    """One call of the forward kernel over a group: the rows' (max, sum) (group · block, 1)
    after the key tiles ``include`` (G, block, tk) adds."""
    group, block, tk = include.shape
    plan, grid = query_plan(include), QueryGrid(tk, block)
    column = jax.ShapeDtypeStruct((group * block, 1), jnp.float32)
    return call(
        functools.partial(_lse_forward_kernel, d=d, final=final), (group, plan.steps),
        [smem_spec(), grid.rows(d), grid.rows(1), grid.rows(1), grid.key_cols(d),
         grid.key_cols(1), grid.key_cols(1), grid.flags()],
        [grid.rows(1), grid.rows(1)], [column, column], [(block, 1)] * 2, bs, interpret,
        "rbf_pruned_logsumexp_fwd", prefetch=(plan.lists, plan.counts),
    )(inv, _flat(x_group), *state, yt, w_row, lw_row, plan.flags)


def _lse_forward(x, y, w, inv_scale, tol, bs, interpret, group):
    """(M, L, levels): (tq, block) each, as the Triton backend's: two passes (near key tiles,
    then the rest) as two calls of the forward kernel, L the log of the scaled sum."""
    block, d = _checked(x, y, bs)
    tq, tk = x.shape[0], y.shape[0]
    setup, lw = lse_setup(y, w)
    yt, inv = _feature_major(y), inv_scale.astype(jnp.float32)
    w_row, lw_row = (a.reshape(1, -1).astype(jnp.float32) for a in (w, lw))
    log_tol = lse_log_tol(tol, x.dtype)
    group = group_size(tq, tk, block, per_row=3, group=group)
    positive = (setup[1] > 0)[None, :]

    def one_group(_, rows):
        x_group, real = rows
        neg_half_sq, near = jax.vmap(lambda x_t: lse_plan(x_t, setup, inv_scale, log_tol))(
            x_group)
        near = near & real[:, None, None]
        init = (jnp.full((group * block, 1), -jnp.inf, jnp.float32),
                jnp.zeros((group * block, 1), jnp.float32))
        args = (x_group, inv, yt, w_row, lw_row, bs, interpret, d)
        state = _lse_pass(near, init, *args, final=False)
        levels = lse_level(*(a.reshape(group, block).astype(x.dtype) for a in state),
                           setup[1], block, log_tol)
        rest = jax.vmap(lambda a, b, c: lse_rest(a, b, positive, c))(neg_half_sq, near, levels)
        f_max, f_log_sum = _lse_pass(rest & real[:, None, None], state, *args, final=True)
        return None, (f_max.reshape(group, block), f_log_sum.reshape(group, block), levels)

    _, (f_max, f_log_sum, levels) = lax.scan(one_group, None, grouped(x, group))
    return tuple(ungrouped(a, tq).astype(x.dtype) for a in (f_max, f_log_sum, levels))


def _lse_backward(x, y, w, inv_scale, f_max, f_log_sum, levels, g, tol, bs, interpret, group):
    block, d = _checked(x, y, bs)
    tq, tk = x.shape[0], y.shape[0]
    setup, _ = lse_setup(y, w)
    log_tol = lse_log_tol(tol, x.dtype)
    y_rows, yt, inv = _flat(y), _feature_major(y), inv_scale.astype(jnp.float32)
    w_row = w.reshape(1, -1).astype(jnp.float32)
    group = group_size(tq, tk, block, per_row=3, group=group)
    q_grid, k_grid = QueryGrid(tk, block), KeyGrid(group, block)

    def one_group(carry, rows):
        sums, dinv = carry
        x_group, real, m_group, l_group, level_group, g_group = rows
        added = jax.vmap(lambda x_t, level: lse_added(x_t, setup, inv_scale, log_tol, level))(
            x_group, level_group) & real[:, None, None]
        qp, kp = query_plan(added), key_plan(added)
        x_rows = _flat(x_group)
        per_row = [a.reshape(-1, 1).astype(jnp.float32) for a in (m_group, l_group, g_group)]
        q_sums = call(
            functools.partial(_lse_query_kernel, d=d), (group, qp.steps),
            [smem_spec(), q_grid.rows(d)] + [q_grid.rows(1)] * 3
            + [q_grid.key_cols(d), q_grid.key_cols(1), q_grid.flags()],
            q_grid.rows(2 * d), jax.ShapeDtypeStruct((group * block, 2 * d), jnp.float32),
            [(block, 2 * d)], bs, interpret, "rbf_pruned_logsumexp_bwd_query",
            prefetch=(qp.lists, qp.counts),
        )(inv, x_rows, *per_row, yt, w_row, qp.flags)
        sums = call(
            functools.partial(_lse_key_kernel, d=d), (kp.num_keys, kp.steps),
            [smem_spec(), k_grid.rows(d), k_grid.rows(1), k_grid.query_cols(d)]
            + [k_grid.query_cols(1)] * 3 + [k_grid.flags(), k_grid.rows(d + 1)],
            k_grid.rows(d + 1), jax.ShapeDtypeStruct(sums.shape, jnp.float32),
            [(block, d + 1)], bs, interpret, "rbf_pruned_logsumexp_bwd_key",
            prefetch=(kp.keys, kp.lists, kp.counts), aliases={8: 0},
        )(inv, y_rows, w.reshape(-1, 1).astype(jnp.float32), x_rows.T,
          *(a.reshape(1, -1) for a in per_row), kp.flags, sums)
        dx = -q_sums[:, :d].reshape(group, block, d) * inv
        return (sums, dinv + jnp.sum(q_sums[:, d:], axis=0)), dx

    init = (jnp.zeros((y_rows.shape[0], d + 1), jnp.float32), jnp.zeros((d,), jnp.float32))
    x_groups, real = grouped(x, group)
    rows = (x_groups, real, grouped(f_max, group)[0], grouped(f_log_sum, group)[0],
            grouped(levels, group)[0], grouped_zeros(g, group))
    (sums, dinv), dx = lax.scan(one_group, init, rows)
    dy = (sums[:, :d] * inv).reshape(y.shape).astype(y.dtype)
    return (ungrouped(dx, tq).astype(x.dtype), dy, sums[:, d].reshape(w.shape).astype(w.dtype),
            (-dinv / inv).astype(inv_scale.dtype))


def _pruned_kernel_logsumexp(x, y, w, inv_scale, tol: float, block_sizes: BlockSizes,
                             interpret: bool = False, group: int | None = None):
    """The pruned KDE log-sum-exp in Mosaic kernels: x (tq, block, d), y (tk, block, d) raw
    coordinates in k-d order, w (tk, block) >= 0, ``inv_scale = 1/l`` (d,) -> (tq, block);
    the rule of `pruning._rules` (relative error <= tol), the pairs `lse_plan` and `lse_rest`
    give each row."""
    f_max, f_log_sum, levels = _lse_forward(x, y, w, inv_scale, tol, block_sizes, interpret,
                                            group)
    return f_max + f_log_sum, (f_max, f_log_sum, levels)


def _pruned_lse_bwd(inputs, saved, g, tol, block_sizes, interpret, group):
    return _lse_backward(*inputs, *saved, g, tol, block_sizes, interpret, group)


pruned_kernel_logsumexp = tile_product(_pruned_kernel_logsumexp, _pruned_lse_bwd, inputs=4,
                                       settings=4)


# ----------------------------------------------------------------------------------------------
# the backend's core


def pruned_core(plan) -> PrunedCore:
    """The Mosaic backend's `PrunedCore` for a `scalegp.ops._interface.Plan` (its ``blocks``:
    one tile height, a multiple of 128, `default_block_sizes` by default; ``interpret``): the
    RBF's ``K v`` and the KDE (another profile is a ValueError: the products ask
    "pruned_profiles" first)."""
    bs, interpret = plan.blocks, plan.interpret
    block = check_block_sizes(bs)

    def mv(x, y, v, inv_scale, tol, profile):
        if profile != RBF.profile:
            raise ValueError("the Mosaic pruned kernels take the RBF only")
        # wide values a chunk of columns at a time, as the unpruned kernels take them; each
        # chunk's visits from its own columns (the tolerance is per column)
        return over_column_chunks(
            lambda v: (pruned_kernel_mv(x, y, v, inv_scale, tol, bs, interpret), ()), v)[0]

    def lse(x, y, w, inv_scale, tol):
        return pruned_kernel_logsumexp(x, y, w, inv_scale, tol, bs, interpret)

    return PrunedCore(block, mv, lse)
