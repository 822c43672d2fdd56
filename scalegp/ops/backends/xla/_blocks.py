"""The blocked (chunked) XLA loops that every xla tile implementation folds over.

The query rows are cut into blocks of ``block_q`` and, inside each, the keys into blocks of
``block_k`` (two nested ``lax.scan``), so only one ``block_q x block_k`` tile of the kernel matrix
exists at a time. Backward passes recompute the tiles instead of storing K.

Inputs are *prepared* (divided by the lengthscale and centred; see `scalegp.ops._prepare`). For
a stationary kernel with ``W_ij = S_ij (g_i . v_j)`` (S = K for the RBF; formulas shared with
`triton/_rbf.py`), the product ``f = K v`` and upstream cotangent ``g``::

    dv_j = sum_i K_ij g_i
    da_i = sum_j W_ij (b_j - a_i)
    db_j = sum_i W_ij (a_i - b_j)

The backward pass is one sweep over the tiles: each K tile is computed once (one exp per kernel
entry), and both its row sums (da) and its column sums (db, dv) are accumulated. Column sums are
kept feature-major, (c, m), so that they come from products ``x^T K`` in which the big tile keeps
its orientation (XLA's CPU backend runs ``K^T x`` markedly slower). Row and column sums of W ride
along as a column of ones appended to the points, so that ``W [b, 1]`` gives ``sum_j W_ij b_j``
and ``sum_j W_ij`` in one product. The measured costs (forward+backward against the forward, one
sweep against two) are in docs/decisions.md #10.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops._kernels import TileArithmetic, broadcast_squares
from scalegp.ops._matmul import half_sq_norms, products
from scalegp.ops._tiling import (
    FULL_TILE_ROWS,
    BlockSizes,
    even_block,
    pad_axis,
    round_up,
    rowwise_padded,
)

#: The float32 matmul precision of this backend's products (its policy, `Backend.precision`):
#: full float32 on CPU and GPU, where TF32 or bfloat16 passes would cost digits.
PRECISION = lax.Precision.HIGHEST
matmul, matmul_nt, matmul_tn, neg_half_sqdist = products(PRECISION)
#: The expressions' tile distances (`scalegp.ops._kernels.TileArithmetic`): the differences
#: as one broadcast over a row of keys, past 16 features one product at `PRECISION`.
ARITHMETIC = TileArithmetic(broadcast_squares, half_sq_norms, PRECISION)

#: Height of the query tile: fixed, so that a row's arithmetic does not depend on how many
#: queries share the call. As tall as the tiles large problems had before (512 rows cost the
#: kernel product up to a tenth more).
BLOCK_Q = FULL_TILE_ROWS
MAX_BLOCK_K = 1024
#: Small batches, up to `SHORT_ROWS` queries on one device, take query tiles of
#: `SHORT_BLOCK_Q` rows instead (`shortened`), so that one query does not pay for 1,024: where
#: a row's arithmetic in such a tile is that of a full tile, bitwise (the same key tiles in the
#: same order, and per row the same reductions: see `shortened`) ...
SHORT_BLOCK_Q = 8
SHORT_ROWS = 64
#: ... and only against key tiles of at least this many rows: against shorter ones XLA's CPU
#: backend reduced a short tile's rows apart from a full tile's (the log-sum-exp and the
#: expressions, rows off by an ulp at 64 to 304 keys; none from 512 in the same sweep).
SHORT_MIN_BLOCK_K = 512


def block_sizes(family, n, m, d) -> BlockSizes:
    """The tiles for ``m`` keys: a fixed query height, keys in near-equal tiles (every
    family; the pruned one's are `scalegp.ops.pruning.PRUNE_BLOCK` high, its core's)."""
    del family, n, d
    return BlockSizes(block_q=BLOCK_Q, block_k=even_block(m, MAX_BLOCK_K))


def shortened(blocks: BlockSizes, queries: int | None, columns: int | None) -> BlockSizes:
    """``blocks`` with query tiles of `SHORT_BLOCK_Q` rows for a product of ``queries`` rows
    (None: unknown, or a batch) against ``columns`` value columns (None: a log-sum-exp) on
    one device: a small batch (`SHORT_ROWS`) against key tiles of `SHORT_MIN_BLOCK_K` rows or
    more, and a product whose per-row arithmetic does not depend on the tile's height. That
    holds for the log-sum-exp (its row reductions are over the key tile) and for one column
    of values (a matrix-vector product per tile, reduced row by row), but not for a product
    with two or more columns: XLA's CPU matrix products split their reduction by the number
    of rows (rows of 8 to 64 rounded apart from rows of 1,024 in a (1024, 1024) x (1024, 2)
    product), so those keep the full tile, and a lone query then pays for 1,024 rows.
    tests/ops/test_row_independence.py holds the tiles to it."""
    if (queries is not None and queries <= SHORT_ROWS and (columns is None or columns == 1)
            and blocks.block_k >= SHORT_MIN_BLOCK_K):
        return dataclasses.replace(blocks, block_q=SHORT_BLOCK_Q)
    return blocks


def blocked_two_sided(
    rows, cols, col_pads, row_init, step, block_rows, block_cols, col_init, row_finish=None,
    tile_finish=None,
):
    """Folds ``step`` over every (row tile, column tile) pair, rows outside, columns inside.

    Args:
      rows: tuple of arrays with leading dimension n (cut into tiles of ``block_rows``).
      cols: tuple of arrays with leading dimension m (cut into tiles of ``block_cols``), padded
        with ``col_pads`` so that padded columns contribute nothing.
      row_init: function of the row tile giving the initial per-row accumulators.
      step: ``step(row_acc, col_acc_tile, row_tile, col_tile) -> (row_acc, col_acc_tile)``.
      col_init: tuple of per-column accumulators, each (c, m), feature-major (see the module
        docstring); a step sees them as (c, block_cols). They let one sweep produce both sides of
        a gradient, so every kernel tile is computed once.
      row_finish: optional elementwise function applied to the row accumulators on all padded
        rows, before they are cut to n (see `rowwise_padded`).
      tile_finish: optional function of one row tile's accumulators, applied before they are
        stacked (e.g. `compensated_sum`, so that only its result is stored for all rows).
    Returns:
      (row accumulators with leading dimension n, column accumulators of shape (c, m)).
    """
    n, m = rows[0].shape[0], cols[0].shape[0]
    n_pad, m_pad = round_up(n, block_rows), round_up(m, block_cols)

    def tiles(arrays, size, block, pads):
        return tuple(
            pad_axis(x, size, value=p).reshape(size // block, block, *x.shape[1:])
            for x, p in zip(arrays, pads)
        )

    row_tiles = tiles(rows, n_pad, block_rows, (0.0,) * len(rows))
    col_tiles = tiles(cols, m_pad, block_cols, col_pads)
    col_acc = tuple(
        jnp.swapaxes(pad_axis(c, m_pad, axis=1).reshape(c.shape[0], -1, block_cols), 0, 1)
        for c in col_init
    )

    def one_row_tile(col_acc, row_tile):
        def one_col_tile(row_acc, xs):
            col_tile, col_acc_tile = xs
            return step(row_acc, col_acc_tile, row_tile, col_tile)

        row_acc, col_acc = lax.scan(one_col_tile, row_init(row_tile), (col_tiles, col_acc))
        return col_acc, row_acc if tile_finish is None else tile_finish(row_acc)

    col_acc, row_acc = lax.scan(one_row_tile, col_acc, row_tiles)
    row_acc = jax.tree_util.tree_map(lambda t: t.reshape(-1, *t.shape[2:]), row_acc)
    if row_finish is not None:
        # on whole full-height tiles, short ones too (`rowwise_padded`)
        row_acc = rowwise_padded(row_finish, row_acc, round_up(n_pad, FULL_TILE_ROWS))
    return (
        jax.tree_util.tree_map(lambda t: t[:n], row_acc),
        tuple(jnp.swapaxes(t, 0, 1).reshape(t.shape[1], -1)[:, :m] for t in col_acc),
    )


def blocked(rows, cols, col_pads, init, step, block_rows, block_cols, row_finish=None,
             tile_finish=None):
    """`blocked_two_sided` with per-row accumulators only:
    ``step(acc, row_tile, col_tile) -> acc``."""
    acc, _ = blocked_two_sided(
        rows,
        cols,
        col_pads,
        init,
        lambda acc, col_acc, row_tile, col_tile: (step(acc, row_tile, col_tile), col_acc),
        block_rows,
        block_cols,
        col_init=(),
        row_finish=row_finish,
        tile_finish=tile_finish,
    )
    return acc


def with_ones(x):
    """(p, d) -> (p, d + 1): x with a column of ones, so that one product also sums the weights."""
    return jnp.concatenate([x, jnp.ones((x.shape[0], 1), x.dtype)], axis=1)


def sum_of_differences(sums, x):
    """``sum_j W_ij (y_j - x_i)`` from ``sums = W [y, 1]`` (p, d + 1) and x (p, d)."""
    return sums[:, :-1] - x * sums[:, -1:]



def two_sided_backward(a, b, v, g, row_geometry, col_geometry, tile, bs: BlockSizes):
    """(da, db, dv) in one sweep over the tiles (formulas, tile orientation: module docstring)
    for a stationary kernel whose tile comes from ``tile(row_geometry_tile, col_geometry_tile)
    -> (K, S)``, with ``W = S ∘ (g vᵀ)`` the weight of the differences (S = K for the RBF).
    ``row_geometry`` and ``col_geometry`` are tuples of per-row arrays the tile is built from."""
    d, (m, o) = a.shape[1], v.shape
    r = len(row_geometry)

    def step(w_b, col_acc, row_tile, col_tile):
        dv_t, w_a = col_acc
        (g_t, a1_t), (v_t, b1_t) = row_tile[r:], col_tile[len(col_geometry):]
        k, w = tile(row_tile[:r], col_tile[:len(col_geometry)])
        w = w * matmul_nt(g_t, v_t)
        return w_b + matmul(w, b1_t), (dv_t + matmul_tn(g_t, k), w_a + matmul_tn(a1_t, w))

    w_b, (dv_t, w_a) = blocked_two_sided(
        tuple(row_geometry) + (g, with_ones(a)),
        tuple(col_geometry) + (v, with_ones(b)),
        (0.0,) * (len(col_geometry) + 2),
        lambda rt: jnp.zeros((rt[0].shape[0], d + 1), a.dtype),
        step,
        bs.block_q,
        bs.block_k,
        col_init=(jnp.zeros((o, m), v.dtype), jnp.zeros((d + 1, m), b.dtype)),
    )
    return sum_of_differences(w_b, a), sum_of_differences(w_a.T, b), dv_t.T
