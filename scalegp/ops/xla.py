"""Blocked (chunked) XLA implementation: portable, memory-linear, the CPU default.

The query rows are cut into blocks of ``block_q`` (``lax.map``) and, inside each, the keys into
blocks of ``block_k`` (``lax.scan``), so only one ``block_q x block_k`` tile of the kernel matrix
exists at a time. The backward pass recomputes the tiles instead of storing K.

Inputs are *prepared* (divided by the lengthscale and centred; see `scalegp.ops.dispatch`), so
``K_ij = exp(-|a_i - b_j|^2 / 2)``. Gradients (derivation shared with `pallas.py`), with
``W_ij = K_ij (g_i . v_j)`` for the product ``f = K v`` and upstream cotangent ``g``::

    dv_j = sum_i K_ij g_i
    da_i = sum_j W_ij (b_j - a_i)
    db_j = sum_i W_ij (a_i - b_j)

``db`` is ``da`` with the roles of (a, g) and (b, v) swapped, and ``dv`` is the forward product
with the roles swapped, so one "pair" routine serves both backward passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops.reference import HIGHEST, half_sq_norms, neg_half_sqdist
from scalegp.ops.tiling import MASK_VALUE, BlockSizes, log_weights, pad_axis, round_up


def _blocked(rows, cols, col_pads, init, step, block_rows, block_cols):
    """Folds ``step`` over column tiles for every row tile.

    Args:
      rows: tuple of arrays with leading dimension n (cut into blocks of ``block_rows``).
      cols: tuple of arrays with leading dimension m (cut into blocks of ``block_cols``), padded
        with ``col_pads`` so that padded columns contribute nothing.
      init: function of the row tile giving the initial carry.
      step: ``step(carry, row_tile, col_tile) -> carry``.
    Returns:
      The final carries, with the row-block axis merged back and trimmed to n rows.
    """
    n, m = rows[0].shape[0], cols[0].shape[0]
    n_pad, m_pad = round_up(n, block_rows), round_up(m, block_cols)
    row_tiles = tuple(
        pad_axis(r, n_pad).reshape(n_pad // block_rows, block_rows, *r.shape[1:]) for r in rows
    )
    col_tiles = tuple(
        pad_axis(c, m_pad, value=p).reshape(m_pad // block_cols, block_cols, *c.shape[1:])
        for c, p in zip(cols, col_pads)
    )

    def one_row_tile(row_tile):
        carry, _ = lax.scan(
            lambda carry, col_tile: (step(carry, row_tile, col_tile), None),
            init(row_tile),
            col_tiles,
        )
        return carry

    out = lax.map(one_row_tile, row_tiles)
    return jax.tree_util.tree_map(lambda t: t.reshape(n_pad, *t.shape[2:])[:n], out)


def _dot(x, y):
    return jnp.dot(x, y, precision=HIGHEST)


# ----------------------------------------------------------------------------------------------
# K v


def _mv_forward(a, b, v, bs: BlockSizes):
    def step(acc, row_tile, col_tile):
        a_t, a_hn = row_tile
        b_t, b_hn, v_t = col_tile
        return acc + _dot(jnp.exp(neg_half_sqdist(a_t, b_t, a_hn, b_hn)), v_t)

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

    def step(carry, row_tile, col_tile):
        mv, w_rowsum, w_y = carry
        x_t, x_hn, ux_t = row_tile
        y_t, y_hn, uy_t = col_tile
        k = jnp.exp(neg_half_sqdist(x_t, y_t, x_hn, y_hn))
        w = k * lax.dot_general(ux_t, uy_t, (((1,), (1,)), ((), ())), precision=HIGHEST)
        if with_mv:
            mv = mv + _dot(k, uy_t)
        return mv, w_rowsum + jnp.sum(w, axis=1), w_y + _dot(w, y_t)

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
# forward output and P_ij = w_j exp(e_ij - f_i) (rows of P sum to one):
#     da_i = g_i sum_j P_ij (b_j - a_i)
#     dw_j = sum_i g_i exp(e_ij - f_i)
#     db_j = w_j sum_i g_i exp(e_ij - f_i) (a_i - b_j)
# Both are "pair" sums  sum_j exp(e_ij + lw_j + r_i) u_j [1, (y_j - x_i)]  with different roles.



def _lse_forward(a, b, log_w, bs: BlockSizes):
    def step(carry, row_tile, col_tile):
        run_max, run_sum = carry
        a_t, a_hn = row_tile
        b_t, b_hn, lw_t = col_tile
        t = neg_half_sqdist(a_t, b_t, a_hn, b_hn) + lw_t[None, :]
        new_max = jnp.maximum(run_max, jnp.max(t, axis=1))
        run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.sum(
            jnp.exp(t - new_max[:, None]), axis=1
        )
        return new_max, run_sum

    def init(rt):
        p = rt[0].shape[0]
        return jnp.full((p,), -jnp.inf, a.dtype), jnp.zeros((p,), a.dtype)

    run_max, run_sum = _blocked(
        (a, half_sq_norms(a)),
        (b, half_sq_norms(b), log_w),
        (0.0, 0.0, MASK_VALUE),
        init,
        step,
        bs.block_q,
        bs.block_k,
    )
    return run_max + jnp.log(run_sum)


def _lse_pair(x, r, y, lw, u, bs: BlockSizes):
    """For each row x_i: ``(s_i, sum_j Q_ij (y_j - x_i))`` with ``Q_ij = exp(e_ij + lw_j + r_i) u_j``
    and ``s_i = sum_j Q_ij``."""
    d = x.shape[1]

    def init(rt):
        p = rt[0].shape[0]
        return jnp.zeros((p,), x.dtype), jnp.zeros((p, d), x.dtype)

    def step(carry, row_tile, col_tile):
        q_rowsum, q_y = carry
        x_t, x_hn, r_t = row_tile
        y_t, y_hn, lw_t, u_t = col_tile
        e = neg_half_sqdist(x_t, y_t, x_hn, y_hn) + lw_t[None, :] + r_t[:, None]
        q = jnp.exp(e) * u_t[None, :]
        return q_rowsum + jnp.sum(q, axis=1), q_y + _dot(q, y_t)

    q_rowsum, q_y = _blocked(
        (x, half_sq_norms(x), r),
        (y, half_sq_norms(y), lw, u),
        (0.0, 0.0, MASK_VALUE, 0.0),
        init,
        step,
        bs.block_q,
        bs.block_k,
    )
    return q_rowsum, q_y - x * q_rowsum[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def kernel_logsumexp(a, b, w, block_sizes: BlockSizes):
    """``log sum_j w_j exp(-|a_i - b_j|^2 / 2)`` for a (n, d), b (m, d), w (m,) >= 0 -> (n,)."""
    return _lse_forward(a, b, log_weights(w), block_sizes)


def _kernel_logsumexp_fwd(a, b, w, block_sizes):
    f = _lse_forward(a, b, log_weights(w), block_sizes)
    return f, (a, b, w, f)


def _kernel_logsumexp_bwd(block_sizes, residuals, g):
    a, b, w, f = residuals
    _, p_diff = _lse_pair(a, -f, b, log_weights(w), jnp.ones_like(w), block_sizes)
    dw, t_diff = _lse_pair(b, jnp.zeros_like(w), a, -f, g, block_sizes)
    return g[:, None] * p_diff, w[:, None] * t_diff, dw


kernel_logsumexp.defvjp(_kernel_logsumexp_fwd, _kernel_logsumexp_bwd)
