"""Blocked (chunked) XLA implementation: portable, memory-linear, the CPU default.

The query rows are cut into blocks of ``block_q`` and, inside each, the keys into blocks of
``block_k`` (two nested ``lax.scan``), so only one ``block_q x block_k`` tile of the kernel matrix
exists at a time. The backward pass recomputes the tiles instead of storing K.

Inputs are *prepared* (divided by the lengthscale and centred; see `scalegp.ops._dispatch`), so
``K_ij = exp(-|a_i - b_j|^2 / 2)``. Gradients (derivation shared with `_pallas.py`), with
``W_ij = K_ij (g_i . v_j)`` for the product ``f = K v`` and upstream cotangent ``g``::

    dv_j = sum_i K_ij g_i
    da_i = sum_j W_ij (b_j - a_i)
    db_j = sum_i W_ij (a_i - b_j)

The backward pass is one sweep over the tiles: each K tile is computed once (one exp per kernel
entry), and both its row sums (da) and its column sums (db, dv) are accumulated. Column sums are
kept feature-major, (c, m), so that they come from products ``x^T K`` in which the big tile keeps
its orientation (XLA's CPU backend runs ``K^T x`` markedly slower). Row and column sums of W ride
along as a column of ones appended to the points, so that ``W [b, 1]`` gives ``sum_j W_ij b_j``
and ``sum_j W_ij`` in one product. The measured costs (forward+backward against the forward, one
sweep against two) are in benchmarks/README.md (`benchmarks/grad_ratio.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp.ops._kernels import (
    DIRECT_MAX_D,
    broadcast_squares,
    own_lengthscales,
    kernel_tile,
    profile_tile,
    tile_distances,
    with_own_gradients,
)
from scalegp.ops._reference import half_sq_norms, matmul, matmul_nt, matmul_tn, neg_half_sqdist
from scalegp.ops._tiling import (
    MASK_VALUE,
    BlockSizes,
    compensated_add,
    compensated_sum,
    compensated_zeros,
    log_weights,
    pad_axis,
    round_up,
    rowwise_padded,
)


def _blocked_two_sided(
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
        row_acc = rowwise_padded(row_finish, row_acc, n_pad)
    return (
        jax.tree_util.tree_map(lambda t: t[:n], row_acc),
        tuple(jnp.swapaxes(t, 0, 1).reshape(t.shape[1], -1)[:, :m] for t in col_acc),
    )


def _blocked(rows, cols, col_pads, init, step, block_rows, block_cols, row_finish=None,
             tile_finish=None):
    """`_blocked_two_sided` with per-row accumulators only:
    ``step(acc, row_tile, col_tile) -> acc``."""
    acc, _ = _blocked_two_sided(
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


def _with_ones(x):
    """(p, d) -> (p, d + 1): x with a column of ones, so that one product also sums the weights."""
    return jnp.concatenate([x, jnp.ones((x.shape[0], 1), x.dtype)], axis=1)


def _sum_of_differences(sums, x):
    """``sum_j W_ij (y_j - x_i)`` from ``sums = W [y, 1]`` (p, d + 1) and x (p, d)."""
    return sums[:, :-1] - x * sums[:, -1:]


# ----------------------------------------------------------------------------------------------
# K v


def _mv_forward(a, b, v, bs: BlockSizes):
    def step(acc, row_tile, col_tile):
        a_t, a_hn = row_tile
        b_t, b_hn, v_t = col_tile
        return compensated_add(acc, matmul(jnp.exp(neg_half_sqdist(a_t, b_t, a_hn, b_hn)), v_t))

    return _blocked(
        (a, half_sq_norms(a)),
        (b, half_sq_norms(b), v),
        (0.0, 0.0, 0.0),
        lambda rt: compensated_zeros((rt[0].shape[0], v.shape[1]), v.dtype),
        step,
        bs.block_q,
        bs.block_k,
        tile_finish=compensated_sum,
    )


def _two_sided_backward(a, b, v, g, row_geometry, col_geometry, tile, bs: BlockSizes):
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

    w_b, (dv_t, w_a) = _blocked_two_sided(
        tuple(row_geometry) + (g, _with_ones(a)),
        tuple(col_geometry) + (v, _with_ones(b)),
        (0.0,) * (len(col_geometry) + 2),
        lambda rt: jnp.zeros((rt[0].shape[0], d + 1), a.dtype),
        step,
        bs.block_q,
        bs.block_k,
        col_init=(jnp.zeros((o, m), v.dtype), jnp.zeros((d + 1, m), b.dtype)),
    )
    return _sum_of_differences(w_b, a), _sum_of_differences(w_a.T, b), dv_t.T


def _rbf_tile(row_geometry, col_geometry):
    (a_t, a_hn), (b_t, b_hn) = row_geometry, col_geometry
    k = jnp.exp(neg_half_sqdist(a_t, b_t, a_hn, b_hn))
    return k, k


def _mv_backward(a, b, v, g, bs: BlockSizes):
    """(da, db, dv) of the RBF product in one sweep over the tiles."""
    return _two_sided_backward(a, b, v, g, (a, half_sq_norms(a)), (b, half_sq_norms(b)),
                               _rbf_tile, bs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def kernel_mv(a, b, v, block_sizes: BlockSizes):
    """``K(a, b) @ v`` for a (n, d), b (m, d), v (m, o) -> (n, o), memory O((n + m)(d + o))."""
    return _mv_forward(a, b, v, block_sizes)


def _kernel_mv_fwd(a, b, v, block_sizes):
    return _mv_forward(a, b, v, block_sizes), (a, b, v)


def kernel_mv_bwd(block_sizes, residuals, g):
    a, b, v = residuals
    return _mv_backward(a, b, v, g, block_sizes)


kernel_mv.defvjp(_kernel_mv_fwd, kernel_mv_bwd)


#: The largest mean scaled squared norm of the keys, ``mean_j |b_j|²``, for which the RBF takes
#: `kernel_mv`'s distance expansion; above it the coordinate differences
#: (`scalegp.ops._dispatch.rbf_kernel_mv`, d <= `DIRECT_MAX_D`).
#:
#: The expansion ``a·b - |a|²/2 - |b|²/2`` rounds with an absolute error of a few ``u (|a|² +
#: |b|²)`` (u = eps/2), and K_ij moves by K_ij times that: largest at (nearly) coincident points
#: far from the keys' centre in lengthscales, i.e. at lengthscales short against the spread. The
#: accuracy target is norm-wise (issue #17: 2e-5 = 336 u in float32, forward), and the rows'
#: errors average: measured (benchmarks/expansion_accuracy.py), ``|ΔKv| / |Kv|`` was 0.35 to
#: 1.04 times ``u · mean_j |b_j|²`` for K(x, x) v over d = 1 to 16, uniform and Gaussian
#: points, lengthscales 1 to 0.01 of their spread, wherever that mean is 50 or more. So 140
#: keeps the estimate within half the target (1.04 · 140 u ≈ 8.7e-6;
#: tests/ops/test_rbf_expansion.py checks the switch). A mean, not the maximum: the worst case
#: over pairs would be entry-wise and, for Gaussian keys at d = 8, 4-5 times the mean, sending
#: ordinary lengthscales to the slower differences (benchmarks/README.md). A
#: query far beyond the keys rounds worse than the estimate in its own row, by its squared
#: norm over the mean, but its kernel values fall as e^{-|a - b|²/2}. The same in units of any
#: dtype's eps.
RBF_EXPANSION_MEAN_LIMIT = 140.0


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
        new_max = jnp.maximum(run_max, jnp.max(e + lw_t[None, :], axis=1))
        terms = jnp.where(w_t[None, :] > 0, jnp.exp(e - new_max[:, None]) * w_t[None, :], 0.0)
        run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.sum(terms, axis=1)
        return new_max, run_sum

    def init(rt):
        p = rt[0].shape[0]
        return jnp.full((p,), -jnp.inf, a.dtype), jnp.zeros((p,), a.dtype)

    return _blocked(
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
    ones: module docstring). T = exp(e - M - L) is built from exponents rounded exactly as in the
    forward pass (see above), which the forward's tile orientation and shapes guarantee."""
    d = a.shape[1]

    def step(p_b, col_acc, row_tile, col_tile):
        (gt_a,) = col_acc
        a_t, a_hn, max_t, log_sum_t, g_t, a1_t = row_tile
        b_t, b_hn, w_t, b1_t = col_tile
        e = _exponents(a_t, b_t, a_hn, b_hn, direct)
        t = jnp.exp((e - max_t[:, None]) - log_sum_t[:, None])
        p = jnp.where(w_t[None, :] > 0, t * w_t[None, :], 0.0)
        gt = t * g_t[:, None]
        return p_b + matmul(p, b1_t), (gt_a + matmul_tn(a1_t, gt),)

    p_b, (gt_a,) = _blocked_two_sided(
        (a, half_sq_norms(a), f_max, f_log_sum, g, _with_ones(a)),
        (b, half_sq_norms(b), w, _with_ones(b)),
        (0.0, 0.0, 0.0, 0.0),
        lambda rt: jnp.zeros((rt[0].shape[0], d + 1), a.dtype),
        step,
        bs.block_q,
        bs.block_k,
        col_init=(jnp.zeros((d + 1, b.shape[0]), b.dtype),),
    )
    da = g[:, None] * _sum_of_differences(p_b, a)
    db = jnp.where(w[:, None] > 0, w[:, None] * _sum_of_differences(gt_a.T, b), 0.0)  # no 0 * inf
    return da, db, gt_a[d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _logsumexp(a, b, w, block_sizes: BlockSizes, direct: bool):
    return sum(lse_forward(a, b, w, block_sizes, direct))


def _logsumexp_fwd(a, b, w, block_sizes, direct):
    f_max, f_log_sum = lse_forward(a, b, w, block_sizes, direct)
    return f_max + f_log_sum, (a, b, w, f_max, f_log_sum)


def _logsumexp_bwd(block_sizes, direct, residuals, g):
    return lse_backward(*residuals, g, block_sizes, direct)


_logsumexp.defvjp(_logsumexp_fwd, _logsumexp_bwd)


def kernel_logsumexp(a, b, w, block_sizes: BlockSizes):
    """``log sum_j w_j exp(-|a_i - b_j|^2 / 2)`` for a (n, d), b (m, d), w (m,) >= 0 -> (n,)."""
    return _logsumexp(a, b, w, block_sizes, False)


def kernel_logsumexp_differences(a, b, w, block_sizes: BlockSizes):
    """`kernel_logsumexp` with the exponents from the coordinate differences (d <=
    `DIRECT_MAX_D`): accurate for points spread over many lengthscales, slower. The point
    gradients still come from products (``Σ_j P_ij b_j - a_i Σ_j P_ij``), which cancel to about
    eps·|a_i| absolute."""
    return _logsumexp(a, b, w, block_sizes, True)


# ----------------------------------------------------------------------------------------------
# K v for any kernel expression (scalegp.ops._kernels)
#
# Two nested scans as above, with the tile from `kernel_tile` on centred, unscaled points and
# the keys feature-major, (d, block_k) per tile. The backward pass is one sweep too, and, as for
# the RBF, made of matrix products: per tile, the VJP of `profile_tile` (the kernel as a function
# of its tile distances and hyperparameters) at the cotangent ``C = g vᵀ`` gives the
# hyperparameter gradients and, for each distance array D, ``W = C ∘ ∂K/∂D``. A distance
# ``D = Σ_d w_d (x_id - y_jd)²`` (w = 1 for the shared one, 1/l² for a term's own) then gives
#     dx_i = 2 w ∘ Σ_j W_ij (x_i - y_j) = 2 w ∘ (x_i Σ_j W_ij - (W y)_i)
#     dy_j = -2 w ∘ Σ_i W_ij (x_i - y_j)
#     ∂/∂w_d = Σ_ij W_ij (x_id - y_jd)²  = Σ_i x_id P_id - Σ_j y_jd Q_jd,
# with P, Q the two sums of differences: two products per distance array, ``W [y, 1]`` and
# ``[x, 1]ᵀ W``, instead of autodiff through the (p, d, q) differences (slower: the products
# run in BLAS, the differences' reductions do not).
# Key-side sums are feature-major, (d, m) and (o, m); hyperparameter gradients are summed in the
# scan carry, so memory stays O((n + m)(d + o)) plus the hyperparameters.


def _row_tiles(a, block):
    """(n, c) -> (n_pad / block, block, c), zero padded."""
    size = round_up(a.shape[0], block)
    return pad_axis(a, size).reshape(size // block, block, a.shape[1])


def _feature_major_tiles(a, block):
    """(m, c) -> (m_pad / block, c, block), zero padded: tiles of aᵀ."""
    return jnp.swapaxes(_row_tiles(a, block), 1, 2)


def _expression_forward(kernel, x, y, v, bs: BlockSizes):
    keys = (_feature_major_tiles(y, bs.block_k), _row_tiles(v, bs.block_k))

    def one_row_tile(_, x_t):
        def one_col_tile(acc, key_tile):
            keys_t, v_t = key_tile  # padded keys have v = 0
            return compensated_add(acc, matmul(kernel_tile(kernel, x_t, keys_t), v_t)), None

        init = compensated_zeros((x_t.shape[0], v.shape[1]), v.dtype)
        acc, _ = lax.scan(one_col_tile, init, keys)
        return None, compensated_sum(acc)

    _, out = lax.scan(one_row_tile, None, _row_tiles(x, bs.block_q))
    return out.reshape(-1, v.shape[1])[: x.shape[0]]


def _distance_gradients(w, x_t, x1_t, keys_t, keys1_t, direct_weights=False):
    """For ``W = C ∘ ∂K/∂D`` (p, q) of one distance array: ``(P (p, d), Q (d, q), ∂/∂w (d,))``
    with ``P_i = Σ_j W_ij (x_i - y_j)``, ``Q_j = Σ_i W_ij (x_i - y_j)`` (formulas above);
    ∂/∂w from the differences themselves with ``direct_weights`` (for d <= `DIRECT_MAX_D`)."""
    rows = matmul_nt(w, keys1_t)  # (p, d + 1): W y and the row sums
    cols = matmul_tn(x1_t, w)  # (d + 1, q): xᵀ W and the column sums
    p = x_t * rows[:, -1:] - rows[:, :-1]
    q = cols[:-1] - keys_t * cols[-1:]
    if not direct_weights or x_t.shape[1] > DIRECT_MAX_D:
        return p, q, jnp.sum(x_t * p, axis=0) - jnp.sum(keys_t * q, axis=1)
    # ``Σ_i x_i P_i - Σ_j y_j Q_j`` cancels terms of size |x| |P| down to one of size
    # |x - y| |P|: a relative error of about eps·(|x| / |x - y|)² (in lengthscales), which
    # reached 1.8e-3 for ∂/∂l of c·Matern(ν = 3/2) at coincident points and ARD lengthscales
    # 0.018-0.03 of a unit spread, d = 4. From the (p, d, q) differences instead it costs a
    # (p, d, q) temporary and d multiply-adds per pair more in the backward pass, so only the
    # Matérn path's fallback asks for it (`expression_mv_direct_weights`). Squares
    # are capped at the dtype's largest number, so that a pair of zero weight (far apart) gives
    # 0, not inf · 0.
    big = jnp.finfo(w.dtype).max
    squares = jnp.minimum(jnp.square(x_t[:, :, None] - keys_t[None, :, :]), big)  # (p, d, q)
    return p, q, jnp.sum(w[:, None, :] * squares, axis=(0, 2))


def _expression_tile_backward(kernel, x_t, keys_t, g_t, v_t, direct_weights=False):
    """One tile's ``(dkernel, dx (p, d), dy (d, q) feature-major, ∂/∂w (d,) per term that owns
    its distance, K)``."""
    squared, own = tile_distances(kernel, x_t, keys_t)
    k, pullback = jax.vjp(profile_tile, kernel, squared, own)
    dkernel, w_squared, w_own = pullback(matmul_nt(g_t, v_t))  # padding: g = 0, v = 0
    ones = jnp.ones((1,), x_t.dtype)
    x1_t = jnp.concatenate([x_t, jnp.broadcast_to(ones, (x_t.shape[0], 1))], axis=1)
    keys1_t = jnp.concatenate([keys_t, jnp.broadcast_to(ones, (1, keys_t.shape[1]))], axis=0)
    dx, dy = jnp.zeros_like(x_t), jnp.zeros_like(keys_t)
    if squared is not None:
        p, q, _ = _distance_gradients(w_squared, x_t, x1_t, keys_t, keys1_t)
        dx, dy = dx + 2.0 * p, dy - 2.0 * q
    d_weights = []
    for lengthscale, w in zip(own_lengthscales(kernel), w_own):
        weight = jnp.broadcast_to(1.0 / (lengthscale * lengthscale), (x_t.shape[1],))
        p, q, d_weight = _distance_gradients(w, x_t, x1_t, keys_t, keys1_t, direct_weights)
        dx, dy = dx + 2.0 * weight * p, dy - 2.0 * weight[:, None] * q
        d_weights.append(d_weight)
    return dkernel, dx, dy, tuple(d_weights), k


def _expression_backward(kernel, x, y, v, g, bs: BlockSizes, direct_weights=False):
    """(dkernel, dx, dy, dv) in one sweep over the tiles."""
    (n, d), (m, o) = x.shape, v.shape
    keys = (_feature_major_tiles(y, bs.block_k), _row_tiles(v, bs.block_k))
    add = functools.partial(jax.tree_util.tree_map, jnp.add)

    def one_row_tile(carry, row_tile):
        key_acc, hyper = carry
        x_t, g_t = row_tile

        def one_col_tile(carry, xs):
            dx_t, hyper = carry
            keys_t, v_t, dy_t, dv_t = xs
            dkernel, dx, dy, d_weights, k = _expression_tile_backward(kernel, x_t, keys_t, g_t,
                                                                      v_t, direct_weights)
            hyper = add(hyper, (dkernel, d_weights))
            return (dx_t + dx, hyper), (dy_t + dy, dv_t + matmul_tn(g_t, k))

        (dx_t, hyper), key_acc = lax.scan(
            one_col_tile, (jnp.zeros_like(x_t), hyper), (*keys, *key_acc))
        return (key_acc, hyper), dx_t

    num_key_tiles = keys[0].shape[0]
    key_acc = (jnp.zeros((num_key_tiles, d, bs.block_k), y.dtype),
               jnp.zeros((num_key_tiles, o, bs.block_k), v.dtype))
    hyper = (jax.tree_util.tree_map(jnp.zeros_like, kernel),
             tuple(jnp.zeros((d,), x.dtype) for _ in own_lengthscales(kernel)))
    ((dy_t, dv_t), (dkernel, d_weights)), dx = lax.scan(
        one_row_tile, (key_acc, hyper), (_row_tiles(x, bs.block_q), _row_tiles(g, bs.block_q)))
    # w_d = 1/l_d² (one l for all d when it is a scalar): ∂/∂l = ∂/∂w · (-2 / l³)
    dkernel = with_own_gradients(dkernel, [
        jnp.reshape(jnp.sum(jnp.reshape(dw, (-1, jnp.size(l))), axis=0), jnp.shape(l))
        * (-2.0 / l**3) for dw, l in zip(d_weights, own_lengthscales(kernel))])

    def unfeature_major(t):  # (tiles, c, block) -> (m, c)
        return jnp.swapaxes(t, 1, 2).reshape(-1, t.shape[1])[:m]

    return dkernel, dx.reshape(-1, d)[:n], unfeature_major(dy_t), unfeature_major(dv_t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _expression_mv(kernel, x, y, v, block_sizes: BlockSizes, direct_weights: bool):
    return _expression_forward(kernel, x, y, v, block_sizes)


def _expression_mv_fwd(kernel, x, y, v, block_sizes, direct_weights):
    return _expression_forward(kernel, x, y, v, block_sizes), (kernel, x, y, v)


def _expression_mv_bwd(block_sizes, direct_weights, residuals, g):
    return _expression_backward(*residuals, g, block_sizes, direct_weights)


_expression_mv.defvjp(_expression_mv_fwd, _expression_mv_bwd)


def expression_mv(kernel, x, y, v, block_sizes: BlockSizes):
    """``K(x, y) @ v`` for a kernel expression, centred x (n, d), y (m, d), v (m, o) -> (n, o);
    memory O((n + m)(d + o))."""
    return _expression_mv(kernel, x, y, v, block_sizes, False)


def expression_mv_direct_weights(kernel, x, y, v, block_sizes: BlockSizes):
    """`expression_mv` whose own-distance lengthscale gradients come from the coordinate
    differences (`_distance_gradients`): accurate at lengthscales far below the points'
    distance from the centre, slower backward."""
    return _expression_mv(kernel, x, y, v, block_sizes, True)


def expression_mv_bwd(block_sizes, residuals, g, direct_weights=False):
    """(dkernel, dx, dy, dv) for the cotangent g (n, o); also the sharded ring's per-block
    backward. ``direct_weights`` as in `expression_mv_direct_weights`."""
    return _expression_backward(*residuals, g, block_sizes, direct_weights)


# ----------------------------------------------------------------------------------------------
# K v for one smooth Matérn profile, ν = 3/2 or 5/2 (`scalegp.ops._kernels.matern_form`)
#
# The RBF's scheme with another profile: inputs prepared as for the RBF but divided by
# ``l / √(2ν)``, so that ``t = |a_i - b_j|`` is the profile's argument,
#     ν = 3/2:  k = (1 + t) e^{-t},            w = -2 ∂k/∂(t²) = e^{-t}
#     ν = 5/2:  k = (1 + t + t²/3) e^{-t},     w = (1 + t) e^{-t} / 3,
# and, with ``W = w ∘ (g vᵀ)``, the RBF's gradients:
#     dv_j = Σ_i K_ij g_i,   da_i = Σ_j W_ij (b_j - a_i),   db_j = Σ_i W_ij (a_i - b_j).
# w is finite at t = 0, so the point gradients are 0 at coincident points (the convention of
# `scalegp.ops._kernels`; up to the rounding of the two products, as for the RBF) with no
# guard. t² comes from the expansion, in one matrix product of the augmented points
# ``[-2a, |a|², 1]`` and ``[b, 1, |b|²]`` (`_augmented`): per pair that leaves a clamp, a
# square root, an exponential and a multiply-add, where the coordinate differences of
# `expression_mv` cost d subtractions, d multiply-adds and a reduction more. Its rounding is
# absolute, a few eps·(|a|² + |b|²) in t², and moves k by 1/2 (ν = 3/2) or 1/6 (ν = 5/2) of
# that at most (|∂k/∂(t²)|), |a|² being 2ν times the RBF's at the same lengthscale: as for the
# RBF (`RBF_EXPANSION_MEAN_LIMIT`), the caller takes the expansion only for keys whose mean
# squared norm keeps the norm-wise error within the accuracy target
# (`MATERN_EXPANSION_MEAN_LIMIT`) and the coordinate differences otherwise. ν = 1/2, whose √
# magnifies the rounding near t = 0 without bound, always takes the differences.
# With one column of values the tile's row sums replace the product with v (`_times_values`).


def _augmented(a, b):
    """``([-2a, |a|², 1] (n, d + 2), [b, 1, |b|²] (m, d + 2))``: their product is
    ``|a_i - b_j|²``. ×(-2) is exact, so ``a`` can be read back from the first."""
    ones_a, ones_b = jnp.ones((a.shape[0], 1), a.dtype), jnp.ones((b.shape[0], 1), b.dtype)
    return (jnp.concatenate([-2.0 * a, jnp.sum(a * a, axis=1, keepdims=True), ones_a], axis=1),
            jnp.concatenate([b, ones_b, jnp.sum(b * b, axis=1, keepdims=True)], axis=1))


def matern_tile(a_aug, b_aug, nu):
    """``(K, w)`` (p, q) of ν = 3/2 or 5/2 for augmented tiles (`_augmented`) of points scaled
    by ``√(2ν) / l`` (formulas above). t² is clamped at 0 (rounding)."""
    s = jnp.maximum(matmul_nt(a_aug, b_aug), 0.0)
    t = jnp.sqrt(s)
    e = jnp.exp(-t)
    u = e + t * e  # (1 + t) e^{-t} as a multiply-add
    if nu == 1.5:
        return u, e
    return u + (s * (1.0 / 3.0)) * e, u * (1.0 / 3.0)


def _times_values(k, v_t):
    """``k @ v_t`` for a tile k (p, q) and v_t (q, o). For one column as the row sums of
    ``k ∘ v_tᵀ``, which XLA fuses into the loop that computes k: the tile is never written to
    memory, and no matrix-vector product reads it back."""
    if v_t.shape[1] == 1:
        return jnp.sum(k * v_t[:, 0][None, :], axis=1, keepdims=True)
    return matmul(k, v_t)


def _matern_forward(a, b, v, nu, bs: BlockSizes):
    def step(acc, row_tile, col_tile):
        (a_t,), (b_t, v_t) = row_tile, col_tile  # padded keys have v = 0
        return compensated_add(acc, _times_values(matern_tile(a_t, b_t, nu)[0], v_t))

    a_aug, b_aug = _augmented(a, b)
    return _blocked(
        (a_aug,),
        (b_aug, v),
        (0.0, 0.0),
        lambda rt: compensated_zeros((rt[0].shape[0], v.shape[1]), v.dtype),
        step,
        bs.block_q,
        bs.block_k,
        tile_finish=compensated_sum,
    )


def _matern_backward(a, b, v, g, nu, bs: BlockSizes):
    """(da, db, dv) in one sweep over the tiles, as `_mv_backward` (formulas above)."""
    a_aug, b_aug = _augmented(a, b)
    return _two_sided_backward(a, b, v, g, (a_aug,), (b_aug,),
                               lambda rt, ct: matern_tile(rt[0], ct[0], nu), bs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def matern_mv(a, b, v, nu, block_sizes: BlockSizes):
    """``K(a, b) @ v`` of the Matérn ν (1.5 or 2.5) for points scaled by ``√(2ν) / l`` and
    centred, a (n, d), b (m, d), v (m, o) -> (n, o); memory O((n + m)(d + o)). Coordinates
    must keep ``4 d max|coordinate|²`` finite (`matern_coordinate_limit`)."""
    return _matern_forward(a, b, v, nu, block_sizes)


def _matern_mv_fwd(a, b, v, nu, block_sizes):
    return _matern_forward(a, b, v, nu, block_sizes), (a, b, v)


def _matern_mv_bwd(nu, block_sizes, residuals, g):
    return _matern_backward(*residuals, g, nu, block_sizes)


matern_mv.defvjp(_matern_mv_fwd, _matern_mv_bwd)


def matern_coordinate_limit(d: int, dtype) -> float:
    """A bound on the coordinates of `matern_mv` that keeps every partial sum of the augmented
    product (at most ``4 d max|coordinate|²``) finite, so that t is finite and ``t e^{-t}`` is
    not ``inf · 0``. Points this far from the keys' centre (in lengthscales) have kernel values
    0 with every point near it."""
    return float(np.sqrt(np.finfo(dtype).max / (8 * max(d, 1))))


#: `RBF_EXPANSION_MEAN_LIMIT` for `matern_mv`, per ν, on its points (scaled by ``√(2ν) / l``):
#: measured as there, ``|ΔKv| / |Kv|`` was 0.18 to 0.98 (ν = 3/2) and 0.12 to 0.33 (ν = 5/2)
#: times ``u · mean_j |b_j|²``, so these keep the estimate within half the target (2e-5 = 336 u).
#: They replace a worst-case bound over pairs ((3d + 4) u (|a|² + |b|²) in t², from the keys'
#: largest norm), ~100x pessimistic, which sent Gaussian keys at d = 4 and a lengthscale of their
#: spread to the differences.
MATERN_EXPANSION_MEAN_LIMIT = {1.5: 140.0, 2.5: 420.0}
