"""Blocked (chunked) XLA implementation: portable, memory-linear, the CPU default.

The query rows are cut into blocks of ``block_q`` and, inside each, the keys into blocks of
``block_k`` (two nested ``lax.scan``), so only one ``block_q x block_k`` tile of the kernel matrix
exists at a time. The backward pass recomputes the tiles instead of storing K.

Inputs are *prepared* (divided by the lengthscale and centred; see `scalegp.ops.dispatch`), so
``K_ij = exp(-|a_i - b_j|^2 / 2)``. Gradients (derivation shared with `pallas.py`), with
``W_ij = K_ij (g_i . v_j)`` for the product ``f = K v`` and upstream cotangent ``g``::

    dv_j = sum_i K_ij g_i
    da_i = sum_j W_ij (b_j - a_i)
    db_j = sum_i W_ij (a_i - b_j)

``db`` is ``da`` with the roles of (a, g) and (b, v) swapped, and ``dv`` is the forward product
with the roles swapped, so one "pair" routine serves both backward passes. A single fused pass
(each tile computed once, with row and column sums accumulated together) would save one exp per
kernel entry, but its column sums need matrix products with a transposed tile, which XLA's CPU
backend runs about 4x slower than plain ones: measured, two plain passes are 25% faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops.reference import half_sq_norms, matmul, matmul_nt, matmul_tn, neg_half_sqdist
from scalegp.ops.tiling import MASK_VALUE, BlockSizes, log_weights, pad_axis, round_up


def _blocked_two_sided(rows, cols, col_pads, row_init, step, block_rows, block_cols, col_init):
    """Folds ``step`` over every (row tile, column tile) pair, rows outside, columns inside.

    Args:
      rows: tuple of arrays with leading dimension n (cut into tiles of ``block_rows``).
      cols: tuple of arrays with leading dimension m (cut into tiles of ``block_cols``), padded
        with ``col_pads`` so that padded columns contribute nothing.
      row_init: function of the row tile giving the initial per-row accumulators.
      step: ``step(row_acc, col_acc_tile, row_tile, col_tile) -> (row_acc, col_acc_tile)``.
      col_init: tuple of per-column accumulators (leading dimension m), for sums over rows: they
        let one pass produce both sides of a gradient, so every kernel tile is computed once.
    Returns:
      (row accumulators with leading dimension n, column accumulators with leading dimension m).
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
    col_acc = tiles(col_init, m_pad, block_cols, (0.0,) * len(col_init))

    def one_row_tile(col_acc, row_tile):
        def one_col_tile(row_acc, xs):
            col_tile, col_acc_tile = xs
            return step(row_acc, col_acc_tile, row_tile, col_tile)

        row_acc, col_acc = lax.scan(one_col_tile, row_init(row_tile), (col_tiles, col_acc))
        return col_acc, row_acc

    col_acc, row_acc = lax.scan(one_row_tile, col_acc, row_tiles)

    def untile(t, size):
        return t.reshape(-1, *t.shape[2:])[:size]

    return (
        jax.tree_util.tree_map(lambda t: untile(t, n), row_acc),
        jax.tree_util.tree_map(lambda t: untile(t, m), col_acc),
    )


def _blocked(rows, cols, col_pads, init, step, block_rows, block_cols):
    """`_blocked_two_sided` with per-row accumulators only: ``step(acc, row_tile, col_tile) -> acc``."""
    acc, _ = _blocked_two_sided(
        rows,
        cols,
        col_pads,
        init,
        lambda acc, col_acc, row_tile, col_tile: (step(acc, row_tile, col_tile), col_acc),
        block_rows,
        block_cols,
        col_init=(),
    )
    return acc




# ----------------------------------------------------------------------------------------------
# K v


def _mv_forward(a, b, v, bs: BlockSizes):
    def step(acc, row_tile, col_tile):
        a_t, a_hn = row_tile
        b_t, b_hn, v_t = col_tile
        return acc + matmul(jnp.exp(neg_half_sqdist(a_t, b_t, a_hn, b_hn)), v_t)

    return _blocked(
        (a, half_sq_norms(a)),
        (b, half_sq_norms(b), v),
        (0.0, 0.0, 0.0),
        lambda rt: jnp.zeros((rt[0].shape[0], v.shape[1]), v.dtype),
        step,
        bs.block_q,
        bs.block_k,
    )


def _mv_pair(x, ux, y, uy, bs: BlockSizes, with_mv: bool):
    """For each row x_i: ``(sum_j K_ij uy_j, sum_j W_ij (y_j - x_i))`` with ``W_ij = K_ij ux_i.uy_j``.

    The first output is only computed when ``with_mv``.
    """
    d, o = x.shape[1], uy.shape[1]

    def init(rt):
        p = rt[0].shape[0]
        mv = jnp.zeros((p, o), x.dtype) if with_mv else None
        return mv, jnp.zeros((p,), x.dtype), jnp.zeros((p, d), x.dtype)

    def step(acc, row_tile, col_tile):
        mv, w_rowsum, w_y = acc
        x_t, x_hn, ux_t = row_tile
        y_t, y_hn, uy_t = col_tile
        k = jnp.exp(neg_half_sqdist(x_t, y_t, x_hn, y_hn))
        w = k * matmul_nt(ux_t, uy_t)
        if with_mv:
            mv = mv + matmul(k, uy_t)
        return mv, w_rowsum + jnp.sum(w, axis=1), w_y + matmul(w, y_t)

    mv, w_rowsum, w_y = _blocked(
        (x, half_sq_norms(x), ux),
        (y, half_sq_norms(y), uy),
        (0.0, 0.0, 0.0),
        init,
        step,
        bs.block_q,
        bs.block_k,
    )
    return mv, w_y - x * w_rowsum[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def kernel_mv(a, b, v, block_sizes: BlockSizes):
    """``K(a, b) @ v`` for a (n, d), b (m, d), v (m, o) -> (n, o), memory O((n + m)(d + o))."""
    return _mv_forward(a, b, v, block_sizes)


def _kernel_mv_fwd(a, b, v, block_sizes):
    return _mv_forward(a, b, v, block_sizes), (a, b, v)


def _kernel_mv_bwd(block_sizes, residuals, g):
    a, b, v = residuals
    _, da = _mv_pair(a, g, b, v, block_sizes, with_mv=False)
    dv, db = _mv_pair(b, v, a, g, block_sizes, with_mv=True)
    return da, db, dv


kernel_mv.defvjp(_kernel_mv_fwd, _kernel_mv_bwd)


# ----------------------------------------------------------------------------------------------
# log sum_j w_j K_ij   (KDE)
#
# Forward: online log-sum-exp with a running row maximum (as in FlashAttention), so a query far
# from every key gets its true, very negative value instead of log(0). Backward, with f the
# forward output, T_ij = exp(e_ij - f_i) and P_ij = w_j T_ij (rows of P sum to one):
#     da_i = g_i sum_j P_ij (b_j - a_i)
#     dw_j = sum_i g_i T_ij
#     db_j = w_j sum_i g_i T_ij (a_i - b_j)
# T_ij <= 1 / w_j, so it only overflows for (nearly) zero-weight keys, whose true gradient is
# then that large; padded keys are masked out of P so that they cannot produce inf * 0, and
# padded queries have g = 0 and M = L = 0 (so T <= 1).
# f is kept as the pair (running max M, log of the scaled sum L), not rounded to one number: for a
# far query M ~ -1e3, where one float32 ulp is ~1e-4, and T = exp((e - M) - L) stays accurate
# only if e - M is formed before L is added (e and M are close, so that difference is exact).


def _lse_forward(a, b, w, bs: BlockSizes):
    """Returns the pair (M, L) with ``f = M + L``: M a running row maximum of e_ij + log w_j, and
    ``L = log sum_j w_j exp(e_ij - M_i)``. The terms are w_j exp(e_ij - M), not exp(e_ij + log w_j
    - M): rounding e + log w costs ~1e-4 absolute for far queries, and the backward pass must
    reproduce L exactly from the same terms."""

    def step(carry, row_tile, col_tile):
        run_max, run_sum = carry
        a_t, a_hn = row_tile
        b_t, b_hn, w_t, lw_t = col_tile
        e = neg_half_sqdist(a_t, b_t, a_hn, b_hn)
        new_max = jnp.maximum(run_max, jnp.max(e + lw_t[None, :], axis=1))
        terms = jnp.where(w_t[None, :] > 0, jnp.exp(e - new_max[:, None]) * w_t[None, :], 0.0)
        run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.sum(terms, axis=1)
        return new_max, run_sum

    def init(rt):
        p = rt[0].shape[0]
        return jnp.full((p,), -jnp.inf, a.dtype), jnp.zeros((p,), a.dtype)

    run_max, run_sum = _blocked(
        (a, half_sq_norms(a)),
        (b, half_sq_norms(b), w, log_weights(w)),
        (0.0, 0.0, 0.0, MASK_VALUE),
        init,
        step,
        bs.block_q,
        bs.block_k,
    )
    return run_max, jnp.log(run_sum)


def _lse_backward(a, b, w, f_max, f_log_sum, g, bs: BlockSizes):
    """(da, db, dw) in one pass over the tiles (formulas above).

    Unlike the kernel product's backward (two passes, plain matmuls), this pass also accumulates
    the key-side column sums, with a slower transposed matmul: T = exp(e - M - L) must be built
    from exponents rounded exactly as in the forward pass (see above), and only the forward's tile
    orientation and shapes guarantee that.
    """
    m, d = b.shape

    def row_init(rt):
        p = rt[0].shape[0]
        return jnp.zeros((p,), a.dtype), jnp.zeros((p, d), a.dtype)

    def step(row_acc, col_acc, row_tile, col_tile):
        p_rowsum, p_b = row_acc
        gt_colsum, gt_a = col_acc
        a_t, a_hn, max_t, log_sum_t, g_t = row_tile
        b_t, b_hn, w_t = col_tile
        e = neg_half_sqdist(a_t, b_t, a_hn, b_hn)
        t = jnp.exp((e - max_t[:, None]) - log_sum_t[:, None])
        p = jnp.where(w_t[None, :] > 0, t * w_t[None, :], 0.0)
        gt = t * g_t[:, None]
        row_acc = (p_rowsum + jnp.sum(p, axis=1), p_b + matmul(p, b_t))
        col_acc = (gt_colsum + jnp.sum(gt, axis=0), gt_a + matmul_tn(gt, a_t))
        return row_acc, col_acc

    (p_rowsum, p_b), (dw, gt_a) = _blocked_two_sided(
        (a, half_sq_norms(a), f_max, f_log_sum, g),
        (b, half_sq_norms(b), w),
        (0.0, 0.0, 0.0),
        row_init,
        step,
        bs.block_q,
        bs.block_k,
        col_init=(jnp.zeros((m,), b.dtype), jnp.zeros((m, d), b.dtype)),
    )
    da = g[:, None] * (p_b - a * p_rowsum[:, None])
    db = jnp.where(w[:, None] > 0, w[:, None] * (gt_a - b * dw[:, None]), 0.0)  # no 0 * inf from zero weights
    return da, db, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def kernel_logsumexp(a, b, w, block_sizes: BlockSizes):
    """``log sum_j w_j exp(-|a_i - b_j|^2 / 2)`` for a (n, d), b (m, d), w (m,) >= 0 -> (n,)."""
    return sum(_lse_forward(a, b, w, block_sizes))


def _kernel_logsumexp_fwd(a, b, w, block_sizes):
    f_max, f_log_sum = _lse_forward(a, b, w, block_sizes)
    return f_max + f_log_sum, (a, b, w, f_max, f_log_sum)


def _kernel_logsumexp_bwd(block_sizes, residuals, g):
    return _lse_backward(*residuals, g, block_sizes)


kernel_logsumexp.defvjp(_kernel_logsumexp_fwd, _kernel_logsumexp_bwd)
