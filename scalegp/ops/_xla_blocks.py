"""The blocked (chunked) XLA loops that every xla tile implementation folds over.

The query rows are cut into blocks of ``block_q`` and, inside each, the keys into blocks of
``block_k`` (two nested ``lax.scan``), so only one ``block_q x block_k`` tile of the kernel matrix
exists at a time. Backward passes recompute the tiles instead of storing K.

Inputs are *prepared* (divided by the lengthscale and centred; see `scalegp.ops._prepare`). For
a stationary kernel with ``W_ij = S_ij (g_i . v_j)`` (S = K for the RBF; formulas shared with
`_pallas.py`), the product ``f = K v`` and upstream cotangent ``g``::

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

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops._matmul import matmul, matmul_nt, matmul_tn
from scalegp.ops._tiling import FULL_TILE_ROWS, BlockSizes, pad_axis, round_up, rowwise_padded


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
