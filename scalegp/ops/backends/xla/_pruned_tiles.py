"""Tile arithmetic of the pruned products on raw coordinates (`pruning._rules`: one
rounding of each difference, no distance expansion), and the loop over a query tile's visit
list."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def scaled_differences(x_t, y_t, inv_scale):
    """``(x_i - y_j) / l`` for x_t (p, d), y_t (q, d) -> (p, d, q), keys feature-major (a
    broadcast over contiguous keys vectorises on XLA's CPU backend)."""
    return (x_t[:, :, None] - y_t.T[None, :, :]) * inv_scale[None, :, None]


def sq_distances(diff):
    """``|D_ij|²`` (p, q) of differences (p, d, q)."""
    return jnp.sum(diff * diff, axis=1)


def pair_gradients(omega, diff, inv_scale):
    """For weights omega (p, q) on pairs, ``D = (x_i - y_j) / l`` (diff, (p, d, q)): the
    cotangents of x (p, d), y (q, d) and ``1/l`` (d,) of ``Σ_ij omega_ij · (-|D_ij|²/2)``. With
    ``omega = w ∘ (g vᵀ)`` (w of a profile's ``values``, `scalegp.ops._profiles`; the RBF's
    ``w = k``) they are those of
    ``Σ_ij g_i K_ij v_j``, since ``∂k/∂(-|D|²/2) = w``."""
    wd = omega[:, None, :] * diff
    dx = -jnp.sum(wd, axis=2) * inv_scale
    dy = jnp.sum(wd, axis=0).T * inv_scale
    dinv = -jnp.sum(wd * diff, axis=(0, 2)) / inv_scale
    return dx, dy, dinv


def fold_visits(count, body, init):
    """``body(k, state) -> state`` for k = 0, ..., count - 1 (count traced)."""
    def step(carry):
        k, state = carry
        return k + 1, body(k, state)

    return lax.while_loop(lambda carry: carry[0] < count, step, (jnp.int32(0), init))[1]
