"""The stationary profiles of the squared scaled distance ``s = Σ_d ((x_d - y_d) / l_d)²`` that
the pruned products take by themselves, and the rounding margin of every kernel bound.

    RBF            exp(-s/2)
    Matern ν=1/2   e^{-t},                  t = √s
    Matern ν=3/2   (1 + t) e^{-t},          t = √(3s)
    Matern ν=5/2   (1 + t + t²/3) e^{-t},   t = √(5s)

`RBFProfile` and `MaternProfile` describe one profile without its lengthscale: static and
hashable, so that the pruned paths (`scalegp.ops.pruning._rules`) take them as static arguments of
``jit`` and ``custom_vjp``. The kernel nodes of `scalegp.ops._kernels` hand out their own
(``RBF.profile``, ``Matern.profile``) and evaluate and bound themselves with them; pruning asks
the profile for values, gradient weights, log bounds and reach, and holds no formula of its own.
`bound_safety` is the shrink of a computed squared distance that keeps the bounds rigorous under
rounding, for the kernels' bounds (`scalegp.ops._kernels.Kernel.bound_at_gap`) and the pruning
plans (`scalegp.ops.pruning._bounds`) alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp


def bound_safety(dtype, d: int) -> float:
    """Relative shortfall allowed for a computed squared distance or box gap: each of its
    ``d + 3`` roundings is within eps, doubled to cover both the bound and the pair. A bound
    evaluated at ``bound_safety · s`` (s from the gaps) bounds the values at every computed s."""
    return 1.0 - 4.0 * (d + 3) * float(jnp.finfo(dtype).eps)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def matern_profile(s, nu):
    """Matérn of the scaled squared distance s >= 0 (finite): ``(1 + t) e^{-t}`` for ν = 3/2,
    ``(1 + t + t²/3) e^{-t}`` for ν = 5/2 (``t = √(2ν s)``), ``e^{-√s}`` for ν = 1/2.

    Its derivative in s is written out (custom JVP) rather than differentiated through √s: for
    ν = 3/2 and 5/2 it is smooth, ``-(3/2) e^{-t}`` and ``-(5/6)(1 + t) e^{-t}``, with no
    ``0 · ∞`` at s = 0 and no guard on the forward pass (each extra elementwise operation costs
    the CPU tile loop several percent); for ν = 1/2 it is ``-e^{-√s} / (2√s)``, taken as 0 at
    s = 0 (the gradient convention of `scalegp.ops._kernels`)."""
    return matern_values_and_slopes(s, nu)[0]


def matern_values_and_slopes(s, nu):
    """``(value, ∂value/∂s)`` of `matern_profile`."""
    t = jnp.sqrt(s if nu == 0.5 else (2.0 * nu) * s)
    e = jnp.exp(-t)
    if nu == 0.5:
        positive = t > 0
        slope = jnp.where(positive, -0.5 * e / jnp.where(positive, t, 1.0), 0.0)
        return e, slope
    if nu == 1.5:
        return e + t * e, -1.5 * e
    return e * (1.0 + t + t * t / 3.0), (-5.0 / 6.0) * (1.0 + t) * e


@matern_profile.defjvp
def _matern_jvp(nu, primals, tangents):
    (s,), (ds,) = primals, tangents
    value, slope = matern_values_and_slopes(s, nu)
    return value, slope * ds


@dataclasses.dataclass(frozen=True)
class RBFProfile:
    """The RBF's profile ``k = exp(-s/2)`` of the squared scaled distance s, as the pruned
    products take it: static and hashable (no hyperparameter); ``RBF.profile``.

    ``value(s)``: k (any shape). ``values(s)``: ``(k, w)``, ``w = -2 ∂k/∂s`` the weight of a
    pair in every gradient (`backends.xla._pruned_tiles.pair_gradients`). ``log_at_half_sq(h)``:
    ``log k`` at ``s = 2h``; profiles decrease in s, so with h a lower bound on a tile pair's
    half squared distances it bounds the log of each of its values. ``reach_half_sq(level)``:
    the half squared scaled distance beyond which ``log k < level``, a static float."""

    def value(self, s):
        return jnp.exp(-0.5 * s)

    def values(self, s):
        k = self.value(s)
        return k, k

    def log_at_half_sq(self, half_sq):
        return -half_sq

    def reach_half_sq(self, log_level: float) -> float:
        return -log_level


@dataclasses.dataclass(frozen=True)
class MaternProfile:
    """The Matérn profile of smoothness ``nu`` (`matern_profile`), with the methods of
    `RBFProfile`; ``Matern(l, nu).profile``. ``w = 0`` at s = 0 for ν = 1/2 (as
    `matern_profile`'s slope)."""

    nu: float

    def value(self, s):
        return matern_profile(s, self.nu)

    def values(self, s):
        k, slope = matern_values_and_slopes(s, self.nu)
        return k, -2.0 * slope

    def log_at_half_sq(self, half_sq, log=jnp.log):
        """``log k = log(poly(t)) - t`` at ``s = 2 · half_sq`` (``log=math.log`` for floats)."""
        s = 2.0 * half_sq
        t = (2.0 * self.nu * s) ** 0.5
        poly = 1.0 if self.nu == 0.5 else (1.0 + t if self.nu == 1.5 else 1.0 + t + t * t / 3.0)
        return log(poly) - t

    def reach_half_sq(self, log_level: float) -> float:
        """By bisection on the half squared distance h, where ``log k`` decreases."""
        def above(h):
            return self.log_at_half_sq(h, math.log) >= log_level

        lo, hi = 0.0, 0.5
        while above(hi):
            hi *= 2.0
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if above(mid) else (lo, mid)
        return hi
