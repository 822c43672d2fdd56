"""``K(x, y) v`` for any kernel expression (`scalegp.ops._kernels`) on blocked XLA loops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops._kernels import (
    DIRECT_MAX_D,
    kernel_tile,
    own_lengthscales,
    profile_tile,
    tile_distances,
    with_own_gradients,
)
from scalegp.ops._tile_math import tile_product
from scalegp.ops._tiling import (
    BlockSizes,
    compensated_add,
    compensated_sum,
    compensated_zeros,
    pad_axis,
    round_up,
)
from scalegp.ops.backends.xla._blocks import ARITHMETIC, matmul, matmul_nt, matmul_tn

# Two nested scans as in `_blocks`, with the tile from `kernel_tile` on centred,
# unscaled points and the keys feature-major, (d, block_k) per tile. The backward pass is one sweep
# too, and, as for the RBF, made of matrix products: per tile, the VJP of `profile_tile` (the kernel
# as a function of its tile distances and hyperparameters) at the cotangent ``C = g vᵀ`` gives the
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
            tile = kernel_tile(kernel, x_t, keys_t, ARITHMETIC)
            return compensated_add(acc, matmul(tile, v_t)), None

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
    squared, own = tile_distances(kernel, x_t, keys_t, ARITHMETIC)
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


def _expression_pass(kernel, x, y, v, block_sizes: BlockSizes, direct_weights: bool):
    del direct_weights  # the backward pass's choice
    return _expression_forward(kernel, x, y, v, block_sizes), ()


def expression_mv_bwd(inputs, saved, g, block_sizes, direct_weights):
    """(dkernel, dx, dy, dv) for the cotangent g (n, o) of the output; also the sharded ring's
    per-block backward. ``direct_weights`` as in `expression_mv_direct_weights`."""
    del saved
    return _expression_backward(*inputs, g, block_sizes, direct_weights)


_expression_mv = tile_product(_expression_pass, expression_mv_bwd, inputs=4, settings=2)


def expression_mv(kernel, x, y, v, block_sizes: BlockSizes):
    """``K(x, y) @ v`` for a kernel expression, centred x (n, d), y (m, d), v (m, o) -> (n, o);
    memory O((n + m)(d + o))."""
    return _expression_mv(kernel, x, y, v, block_sizes, False)


def expression_mv_direct_weights(kernel, x, y, v, block_sizes: BlockSizes):
    """`expression_mv` whose own-distance lengthscale gradients come from the coordinate
    differences (`_distance_gradients`): accurate at lengthscales far below the points'
    distance from the centre, slower backward."""
    return _expression_mv(kernel, x, y, v, block_sizes, True)

