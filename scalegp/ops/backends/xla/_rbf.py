"""The RBF's product ``K v`` and the KDE's ``log sum_j w_j K_ij`` on the blocked XLA loops
(`_blocks`), with ``K_ij = exp(-|a_i - b_j|^2 / 2)`` on prepared points and the
one-sweep backward passes described there."""

from __future__ import annotations

import jax.numpy as jnp

from scalegp.ops._kernels import broadcast_squares
from scalegp.ops._matmul import half_sq_norms
from scalegp.ops._tile_math import lse_step, tile_product
from scalegp.ops._tiling import (
    MASK_VALUE,
    BlockSizes,
    compensated_add,
    compensated_sum,
    compensated_zeros,
    log_weights,
)
from scalegp.ops.backends.xla._blocks import (
    blocked,
    blocked_two_sided,
    matmul,
    matmul_tn,
    neg_half_sqdist,
    sum_of_differences,
    two_sided_backward,
    with_ones,
)

# ----------------------------------------------------------------------------------------------
# K v


def _mv_forward(a, b, v, bs: BlockSizes):
    def step(acc, row_tile, col_tile):
        a_t, a_hn = row_tile
        b_t, b_hn, v_t = col_tile
        return compensated_add(acc, matmul(jnp.exp(neg_half_sqdist(a_t, b_t, a_hn, b_hn)), v_t))

    return blocked(
        (a, half_sq_norms(a)),
        (b, half_sq_norms(b), v),
        (0.0, 0.0, 0.0),
        lambda rt: compensated_zeros((rt[0].shape[0], v.shape[1]), v.dtype),
        step,
        bs.block_q,
        bs.block_k,
        tile_finish=compensated_sum,
    )




def _rbf_tile(row_geometry, col_geometry):
    (a_t, a_hn), (b_t, b_hn) = row_geometry, col_geometry
    k = jnp.exp(neg_half_sqdist(a_t, b_t, a_hn, b_hn))
    return k, k


def _mv_backward(a, b, v, g, bs: BlockSizes):
    """(da, db, dv) of the RBF product in one sweep over the tiles."""
    return two_sided_backward(a, b, v, g, (a, half_sq_norms(a)), (b, half_sq_norms(b)),
                               _rbf_tile, bs)


def _kernel_mv(a, b, v, block_sizes: BlockSizes):
    """``K(a, b) @ v`` for a (n, d), b (m, d), v (m, o) -> (n, o), memory O((n + m)(d + o))."""
    return _mv_forward(a, b, v, block_sizes), ()


def kernel_mv_bwd(inputs, saved, g, block_sizes):
    """(da, db, dv) of `kernel_mv` at the cotangent g (n, o)."""
    del saved
    return _mv_backward(*inputs, g, block_sizes)


kernel_mv = tile_product(_kernel_mv, kernel_mv_bwd, inputs=3, settings=1)


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


def _exponents(a_t, b_t, a_hn, b_hn, direct):
    """``-|a_i - b_j|² / 2`` (p, q) of a tile: by the expansion (`neg_half_sqdist`), or from
    the coordinate differences with ``direct`` (d <= `DIRECT_MAX_D`; for points spread over
    many lengthscales, `RBF_EXPANSION_MEAN_LIMIT`)."""
    if direct:
        return -0.5 * broadcast_squares(a_t, b_t.T)
    return neg_half_sqdist(a_t, b_t, a_hn, b_hn)


def lse_forward(a, b, w, bs: BlockSizes, direct=False):
    """Returns the pair (M, L) with ``f = M + L``: M a running row maximum of e_ij + log w_j, and
    ``L = log sum_j w_j exp(e_ij - M_i)``. The terms are w_j exp(e_ij - M), not exp(e_ij + log w_j
    - M): rounding e + log w costs ~1e-4 absolute for far queries, and the backward pass must
    reproduce L exactly from the same terms. ``direct``: exponents from the coordinate
    differences (`_exponents`)."""

    def step(carry, row_tile, col_tile):
        run_max, run_sum = carry
        a_t, a_hn = row_tile
        b_t, b_hn, w_t, lw_t = col_tile
        e = _exponents(a_t, b_t, a_hn, b_hn, direct)
        return lse_step(run_max, run_sum, e, w_t[None, :], lw_t[None, :])[:2]

    def init(rt):
        p = rt[0].shape[0]
        return jnp.full((p,), -jnp.inf, a.dtype), jnp.zeros((p,), a.dtype)

    return blocked(
        (a, half_sq_norms(a)),
        (b, half_sq_norms(b), w, log_weights(w)),
        (0.0, 0.0, 0.0, MASK_VALUE),
        init,
        step,
        bs.block_q,
        bs.block_k,
        row_finish=lambda acc: (acc[0], jnp.log(acc[1])),
    )


def lse_backward(a, b, w, f_max, f_log_sum, g, bs: BlockSizes, direct=False):
    """(da, db, dw) in one sweep over the tiles (formulas above; tile orientation and the column of
    ones: `_blocks`). T = exp(e - M - L) is built from exponents rounded exactly
    as in the forward pass (see above), which the forward's tile orientation and shapes
    guarantee."""
    d = a.shape[1]

    def step(p_b, col_acc, row_tile, col_tile):
        (gt_a,) = col_acc
        a_t, a_hn, max_t, log_sum_t, g_t, a1_t = row_tile
        b_t, b_hn, w_t, b1_t = col_tile
        e = _exponents(a_t, b_t, a_hn, b_hn, direct)
        t = jnp.exp((e - max_t[:, None]) - log_sum_t[:, None])
        p = jnp.where(w_t[None, :] > 0, t * w_t[None, :], 0.0)
        gt = t * g_t[:, None]
        if direct:
            rows, cols = difference_sums(p, gt, a_t, b_t)
            return p_b + rows, (gt_a + cols,)
        return p_b + matmul(p, b1_t), (gt_a + matmul_tn(a1_t, gt),)

    p_b, (gt_a,) = blocked_two_sided(
        (a, half_sq_norms(a), f_max, f_log_sum, g, with_ones(a)),
        (b, half_sq_norms(b), w, with_ones(b)),
        (0.0, 0.0, 0.0, 0.0),
        lambda rt: jnp.zeros((rt[0].shape[0], d + 1), a.dtype),
        step,
        bs.block_q,
        bs.block_k,
        col_init=(jnp.zeros((d + 1, b.shape[0]), b.dtype),),
    )
    p_diff = p_b[:, :d] if direct else sum_of_differences(p_b, a)
    t_diff = gt_a[:d].T if direct else sum_of_differences(gt_a.T, b)
    da = g[:, None] * p_diff
    db = jnp.where(w[:, None] > 0, w[:, None] * t_diff, 0.0)  # no 0 * inf
    return da, db, gt_a[d]


def difference_sums(p, gt, a_t, b_t):
    """A tile's ``[Σ_j P_ij (b_j - a_i), Σ_j P_ij]`` (p, d + 1) and ``[Σ_i G_ij (a_i - b_j);
    Σ_i G_ij]`` (d + 1, q), from the coordinate differences one feature at a time.

    Not ``Σ_j P_ij b_j - a_i Σ_j P_ij`` (one matrix product, the expansion's way): for points
    hundreds of bandwidths from the centre (the case of the differences) that subtraction loses
    ``eps |a|`` absolutely, and the bandwidth's gradient, ``-Σ_i da_i a_i - Σ_j db_j b_j``,
    multiplies the loss by ``|a|`` again (docs/decisions.md #35)."""
    rows, cols = [], []
    for f in range(a_t.shape[1]):
        s = b_t[:, f][None, :] - a_t[:, f][:, None]
        rows.append(jnp.sum(p * s, axis=1))
        cols.append(-jnp.sum(gt * s, axis=0))
    rows.append(jnp.sum(p, axis=1))
    cols.append(jnp.sum(gt, axis=0))
    return jnp.stack(rows, axis=1), jnp.stack(cols, axis=0)


def _logsumexp_pass(a, b, w, block_sizes: BlockSizes, direct: bool):
    f_max, f_log_sum = lse_forward(a, b, w, block_sizes, direct)
    return f_max + f_log_sum, (f_max, f_log_sum)


def _logsumexp_bwd(inputs, saved, g, block_sizes, direct):
    return lse_backward(*inputs, *saved, g, block_sizes, direct)


_logsumexp = tile_product(_logsumexp_pass, _logsumexp_bwd, inputs=3, settings=2)


def kernel_logsumexp(a, b, w, block_sizes: BlockSizes):
    """``log sum_j w_j exp(-|a_i - b_j|^2 / 2)`` for a (n, d), b (m, d), w (m,) >= 0 -> (n,)."""
    return _logsumexp(a, b, w, block_sizes, False)


def kernel_logsumexp_differences(a, b, w, block_sizes: BlockSizes):
    """`kernel_logsumexp` with the exponents from the coordinate differences (d <=
    `DIRECT_MAX_D`): accurate for points spread over many lengthscales, slower. The point
    gradients still come from products (``Σ_j P_ij b_j - a_i Σ_j P_ij``), which cancel to about
    eps·|a_i| absolute."""
    return _logsumexp(a, b, w, block_sizes, True)
