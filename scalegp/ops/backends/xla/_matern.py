"""``K v`` for one smooth Matérn profile, ν = 3/2 or 5/2, on the blocked XLA loops
(`_blocks`), with the distance expansion; the accuracy limit that decides when
the caller may take it."""

from __future__ import annotations

import jax.numpy as jnp

from scalegp.ops._matmul import half_sq_norms, matern_of_squared
from scalegp.ops._tile_math import tile_product
from scalegp.ops._tiling import (
    BlockSizes,
    compensated_add,
    compensated_sum,
    compensated_zeros,
)
from scalegp.ops.backends.xla._blocks import (
    blocked,
    matmul,
    matmul_nt,
    two_sided_backward,
)

# The profiles are those of `scalegp.ops._kernels.matern_form`.
# The RBF's scheme with another profile: inputs prepared as for the RBF but divided by
# ``l / √(2ν)``, so that ``t = |a_i - b_j|`` is the profile's argument,
#     ν = 3/2:  k = (1 + t) e^{-t},            w = -2 ∂k/∂(t²) = e^{-t}
#     ν = 5/2:  k = (1 + t + t²/3) e^{-t},     w = (1 + t) e^{-t} / 3,
# and, with ``W = w ∘ (g vᵀ)``, the RBF's gradients:
#     dv_j = Σ_i K_ij g_i,   da_i = Σ_j W_ij (b_j - a_i),   db_j = Σ_i W_ij (a_i - b_j).
# w is finite at t = 0, so the point gradients are 0 at coincident points (the convention of
# `scalegp.ops._kernels`; up to the rounding of the two products, as for the RBF) with no guard. t²
# comes from the expansion, in one matrix product of the augmented points ``[-2a, |a|², 1]`` and
# ``[b, 1, |b|²]`` (`_augmented`): per pair that leaves a clamp, a square root, an exponential and a
# multiply-add, where the coordinate differences of `_expression.expression_mv` cost
# d subtractions, d multiply-adds and a reduction more. Its rounding is absolute, a few eps·(|a|² +
# |b|²) in t², and moves k by 1/2 (ν = 3/2) or 1/6 (ν = 5/2) of that at most (|∂k/∂(t²)|), |a|²
# being 2ν times the RBF's at the same lengthscale: as for the RBF
# (`RBF_EXPANSION_MEAN_LIMIT`), the caller takes the expansion only for keys
# whose mean squared norm keeps the norm-wise error within the accuracy target
# (`scalegp.ops._matmul.MATERN_EXPANSION_MEAN_LIMIT`) and the coordinate differences otherwise.
# ν = 1/2, whose √ magnifies the rounding near t = 0 without bound, always takes the
# differences. The profile of t² (`scalegp.ops._matmul.matern_of_squared`) is
# `scalegp.ops._profiles.matern_values_and_slopes` written in t² = 2ν s instead of s, kept
# apart on purpose: the expansion hands it t² (that function would rescale it to s
# and back, one more multiply and rounding per pair), its multiply-add form is the one this
# loop's cost and `MATERN_EXPANSION_MEAN_LIMIT` were measured with, and its w is the
# derivative in t², not s.
# With one column of values the tile's row sums replace the product with v (`_times_values`).


def _augmented(a, b):
    """``([-2a, |a|², 1] (n, d + 2), [b, 1, |b|²] (m, d + 2))``: their product is
    ``|a_i - b_j|²``. ×(-2) is exact, so ``a`` can be read back from the first. The squared
    norms are the RBF's (`half_sq_norms`, doubled exactly): a row's norm whatever the number
    of rows, where ``jnp.sum`` over the features rounded rows apart by the call's size."""
    ones_a, ones_b = jnp.ones((a.shape[0], 1), a.dtype), jnp.ones((b.shape[0], 1), b.dtype)
    return (jnp.concatenate([-2.0 * a, 2.0 * half_sq_norms(a)[:, None], ones_a], axis=1),
            jnp.concatenate([b, ones_b, 2.0 * half_sq_norms(b)[:, None]], axis=1))


def matern_tile(a_aug, b_aug, nu):
    """``(K, w)`` (p, q) of ν = 3/2 or 5/2 for augmented tiles (`_augmented`) of points scaled
    by ``√(2ν) / l`` (formulas above). t² is clamped at 0 (rounding)."""
    return matern_of_squared(jnp.maximum(matmul_nt(a_aug, b_aug), 0.0), nu)


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
    return blocked(
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
    """(da, db, dv) in one sweep over the tiles, as the RBF's (formulas above)."""
    a_aug, b_aug = _augmented(a, b)
    return two_sided_backward(a, b, v, g, (a_aug,), (b_aug,),
                               lambda rt, ct: matern_tile(rt[0], ct[0], nu), bs)


def _matern_mv(a, b, v, nu, block_sizes: BlockSizes):
    """``K(a, b) @ v`` of the Matérn ν (1.5 or 2.5) for points scaled by ``√(2ν) / l`` and
    centred, a (n, d), b (m, d), v (m, o) -> (n, o); memory O((n + m)(d + o)). Coordinates
    must keep ``4 d max|coordinate|²`` finite (`matern_coordinate_limit`)."""
    return _matern_forward(a, b, v, nu, block_sizes), ()


def _matern_mv_bwd(inputs, saved, g, nu, block_sizes):
    del saved
    return _matern_backward(*inputs, g, nu, block_sizes)


matern_mv = tile_product(_matern_mv, _matern_mv_bwd, inputs=3, settings=2)
