"""Kernel descriptions: stationary profiles of a scaled distance, and sums and products of them.

A kernel is a small pytree whose leaves are its hyperparameters (arrays), so it passes through
``jit``, ``grad`` and ``custom_vjp`` like any other argument, and the GP's solvers,
preconditioners and variance cache take it without knowing which profile it holds::

    k = 2.0 * RBF(50.0) + 0.5 * RBF(100.0) * ExpSineSquared(1.0, period=1.0) + Matern(1.0, nu=1.5)

Profiles, of ``s = Σ_d ((x_d - x'_d) / l_d)²`` and ``r = √s`` (as scikit-learn defines them)::

    RBF                exp(-s/2)
    Matern ν=1/2       exp(-r)
    Matern ν=3/2       (1 + √3 r) exp(-√3 r)
    Matern ν=5/2       (1 + √5 r + 5s/3) exp(-√5 r)
    RationalQuadratic  (1 + s / (2α))^(-α)
    ExpSineSquared     exp(-2 sin²(π ρ / p) / l²),  ρ = |x - x'| (Euclidean, unscaled)

RBF and Matern take a scalar or per-feature (ARD) lengthscale; RationalQuadratic and
ExpSineSquared a scalar, as in scikit-learn. `Constant` is a constant kernel (an outputscale when
multiplied). Numbers combine with kernels: ``2.0 * k`` is ``Product((Constant(2.0), k))``.

`kernel_tile` evaluates a whole expression on one tile of pairs: the squared distances are
computed once per tile and shared by every scalar-lengthscale term, which rescales them (an ARD
term sums its own weighted squares), so a composite kernel costs one pass, forward and
backward. For ``d <= DIRECT_MAX_D`` they come from the coordinate differences themselves, not
from ``|x|² + |x'|² - 2x·x'``: the expansion leaves an absolute error of about
``eps·|x|²`` in s, which ``√s`` magnifies to ~1e-3 near ``s = 0`` in float32 (Matérn-1/2 near
the diagonal).

Gradient convention at ``r = 0``: the gradient with respect to the points is 0 there for every
profile. For the smooth ones that is the derivative; for Matérn-1/2, whose one-sided derivatives
along any direction are ±1/l, it is the symmetric subgradient (their average). The
hyperparameter gradients are exact (every profile equals 1 at ``s = 0`` for any lengthscale).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from scalegp.ops._reference import half_sq_norms

#: Up to this many features, tile distances are formed from coordinate differences (exact to
#: rounding, cost d operations per pair); above it by one matrix product.
DIRECT_MAX_D = 16

#: Scaled squared distances are capped here: every decaying profile is exactly 0 beyond it in
#: float32, and the cap keeps ``inf - inf`` (NaN) out of Matérn's ``(1 + r) exp(-r)``.
SQUARED_DISTANCE_CAP = 1e30

MATERN_NUS = (0.5, 1.5, 2.5)


class Kernel:
    """Base of the kernel nodes: ``+`` and ``*`` with kernels and numbers."""

    def __add__(self, other):
        return Sum((self, as_kernel(other)))

    def __radd__(self, other):
        return Sum((as_kernel(other), self))

    def __mul__(self, other):
        return Product((self, as_kernel(other)))

    def __rmul__(self, other):
        return Product((as_kernel(other), self))

    def evaluate(self, dist: "TileDistances"):
        """The kernel on a tile of pairs: (p, q), or a scalar for a constant."""
        raise NotImplementedError

    def at_zero(self):
        """``k(x, x)``: the same for every x, the kernels being stationary."""
        raise NotImplementedError

    @property
    def decays(self) -> bool:
        """Whether ``k -> 0`` as the distance grows (false for constants and periodic terms)."""
        raise NotImplementedError


def as_kernel(value) -> Kernel:
    if isinstance(value, Kernel):
        return value
    if isinstance(value, (numbers.Real, np.ndarray, jax.Array)) and np.ndim(value) == 0:
        return Constant(value)
    raise TypeError(f"expected a scalegp.ops kernel or a number, got {type(value).__name__}")


def _dataclass_pytree(cls=None, *, meta=()):
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
        return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))

    return wrap if cls is None else wrap(cls)


def _safe_sqrt(s):
    """√s with a finite derivative at s = 0: ``√(s + tiny)``, whose derivative there (~1e19 in
    float32) meets ``∂s/∂x = ∂s/∂l = 0``, giving the gradient convention above; cheaper than a
    select, and the shift is below every representable distance."""
    return jnp.sqrt(s + jnp.finfo(s.dtype).tiny)


@_dataclass_pytree
class Constant(Kernel):
    """``k(x, x') = value``; as a factor, an outputscale."""

    value: jax.Array

    def evaluate(self, dist):
        return self.value

    def at_zero(self):
        return self.value

    @property
    def decays(self):
        return False


@_dataclass_pytree
class RBF(Kernel):
    """``exp(-s/2)``; ``lengthscale`` scalar or (d,)."""

    lengthscale: jax.Array

    def evaluate(self, dist):
        return jnp.exp(-0.5 * dist.scaled(self.lengthscale))

    def at_zero(self):
        return jnp.ones((), jnp.asarray(self.lengthscale).dtype)

    @property
    def decays(self):
        return True


@_dataclass_pytree(meta=("nu",))
class Matern(Kernel):
    """Matérn of smoothness ``nu`` in {0.5, 1.5, 2.5}; ``lengthscale`` scalar or (d,)."""

    lengthscale: jax.Array
    nu: float = 1.5

    def __post_init__(self):
        if self.nu not in MATERN_NUS:
            raise ValueError(f"Matern nu must be one of {MATERN_NUS}, got {self.nu!r}")

    def evaluate(self, dist):
        r = _safe_sqrt(dist.scaled(self.lengthscale))
        if self.nu == 0.5:
            return jnp.exp(-r)
        t = math.sqrt(2 * self.nu) * r
        poly = 1.0 + t if self.nu == 1.5 else 1.0 + t + t * t / 3.0
        return poly * jnp.exp(-t)

    def at_zero(self):
        return jnp.ones((), jnp.asarray(self.lengthscale).dtype)

    @property
    def decays(self):
        return True


@_dataclass_pytree
class RationalQuadratic(Kernel):
    """``(1 + s / (2α))^(-α)``, a scale mixture of RBFs; scalar ``lengthscale``."""

    lengthscale: jax.Array
    alpha: jax.Array

    def evaluate(self, dist):
        s = dist.scaled(self.lengthscale)
        return jnp.exp(-self.alpha * jnp.log1p(s / (2.0 * self.alpha)))

    def at_zero(self):
        return jnp.ones((), jnp.asarray(self.lengthscale).dtype)

    @property
    def decays(self):
        return True


@_dataclass_pytree
class ExpSineSquared(Kernel):
    """Periodic: ``exp(-2 sin²(π ρ / period) / l²)`` of the Euclidean distance ρ."""

    lengthscale: jax.Array
    period: jax.Array

    def evaluate(self, dist):
        rho = _safe_sqrt(dist.squared())
        sine = jnp.sin((math.pi / self.period) * rho)
        return jnp.exp(-2.0 * sine * sine / (self.lengthscale * self.lengthscale))

    def at_zero(self):
        return jnp.ones((), jnp.asarray(self.lengthscale).dtype)

    @property
    def decays(self):
        return False


@_dataclass_pytree
class Sum(Kernel):
    """``Σ_i k_i``."""

    terms: tuple

    def evaluate(self, dist):
        out = self.terms[0].evaluate(dist)
        for term in self.terms[1:]:
            out = out + term.evaluate(dist)
        return out

    def at_zero(self):
        out = self.terms[0].at_zero()
        for term in self.terms[1:]:
            out = out + term.at_zero()
        return out

    @property
    def decays(self):
        return all(term.decays for term in self.terms)


@_dataclass_pytree
class Product(Kernel):
    """``Π_i k_i``."""

    terms: tuple

    def evaluate(self, dist):
        out = self.terms[0].evaluate(dist)
        for term in self.terms[1:]:
            out = out * term.evaluate(dist)
        return out

    def at_zero(self):
        out = self.terms[0].at_zero()
        for term in self.terms[1:]:
            out = out * term.at_zero()
        return out

    @property
    def decays(self):
        return any(term.decays for term in self.terms)


PROFILES = (RBF, Matern, RationalQuadratic, ExpSineSquared)


class TileDistances:
    """Squared distances of one tile of pairs, computed once and shared by all terms.

    ``x (p, d)`` are the query rows and ``keys_t (d, q)`` the keys, feature-major, both centred
    and unscaled. Feature-major keys make each difference ``x_id - y_jd`` a broadcast over a
    contiguous row of q keys, which XLA's CPU backend vectorises (the row-major layout, a strided
    column per feature, ran several times slower). Not a pytree: it lives inside one trace of
    `kernel_tile`.
    """

    def __init__(self, x, keys_t):
        self.x, self.keys_t = x, keys_t
        self._squared = None

    def _sum_of_squares(self, x, keys_t):
        """``Σ_d (x_id - y_jd)²`` (p, q), directly or (large d) by one matrix product."""
        if x.shape[1] <= DIRECT_MAX_D:
            return jnp.sum(jnp.square(x[:, :, None] - keys_t[None, :, :]), axis=1)
        return _expanded(x, keys_t)

    def squared(self):
        """``|x_i - y_j|²`` (p, q), computed once per tile."""
        if self._squared is None:
            self._squared = self._sum_of_squares(self.x, self.keys_t)
        return self._squared

    def scaled(self, lengthscale):
        """``Σ_d ((x_id - y_jd) / l_d)²`` (p, q), capped at `SQUARED_DISTANCE_CAP`: a scalar
        lengthscale rescales the shared `squared`; an ARD one needs its own sum."""
        lengthscale = jnp.asarray(lengthscale)
        inv = 1.0 / lengthscale
        if lengthscale.ndim == 0:
            s = self.squared() * (inv * inv)
        else:
            s = self._sum_of_squares(self.x * inv, self.keys_t * inv[:, None])
        return jnp.minimum(s, SQUARED_DISTANCE_CAP)


def _expanded(x, keys_t):
    """``|x_i - y_j|²`` as ``|x|² + |y|² - 2 x·y``, clamped at 0 (large d)."""
    cross = jnp.matmul(x, keys_t, precision=jax.lax.Precision.HIGHEST)
    return jnp.maximum(-2.0 * (cross - half_sq_norms(x)[:, None]
                               - 0.5 * jnp.sum(keys_t * keys_t, axis=0)[None, :]), 0.0)


def kernel_tile(kernel: Kernel, x, keys_t, distances=TileDistances):
    """``k(x_i, y_j)`` for centred query rows x (p, d) and keys ``keys_t = yᵀ`` (d, q) ->
    (p, q). ``distances``: the `TileDistances` class, or a subclass that sums the squares
    another way (the Pallas kernels': `scalegp.ops._pallas_expression`)."""
    out = kernel.evaluate(distances(x, keys_t))
    return jnp.broadcast_to(out, (x.shape[0], keys_t.shape[1])).astype(x.dtype)


def rbf_form(kernel: Kernel):
    """``(scale, lengthscale)`` when ``kernel`` is ``scale · RBF(lengthscale)`` (a product of
    constants and one RBF), else None: such kernels take the hand-written RBF path."""
    if isinstance(kernel, RBF):
        return None, kernel.lengthscale
    if isinstance(kernel, Product):
        rbfs = [t for t in kernel.terms if isinstance(t, RBF)]
        constants = [t for t in kernel.terms if isinstance(t, Constant)]
        if len(rbfs) == 1 and len(rbfs) + len(constants) == len(kernel.terms):
            scale = None
            for c in constants:
                scale = c.value if scale is None else scale * c.value
            return scale, rbfs[0].lengthscale
    return None


def profiles_of(kernel: Kernel) -> list:
    """The profile and constant nodes of ``kernel``, depth first."""
    if isinstance(kernel, (Sum, Product)):
        return [leaf for term in kernel.terms for leaf in profiles_of(term)]
    return [kernel]


def check_kernel(kernel, d: int, dtype) -> Kernel:
    """``kernel`` with its hyperparameters cast to ``dtype`` and checked: shapes (a scalar, or
    d entries for the ARD lengthscales of RBF and Matern), and positive, finite values where
    they are concrete (not traced)."""
    from scalegp.ops._dispatch import check_scale  # the one owner of the scale check

    if isinstance(kernel, (Sum, Product)):
        if not isinstance(kernel.terms, tuple) or not kernel.terms:
            raise ValueError(f"{type(kernel).__name__} needs a non-empty tuple of kernels")
        return type(kernel)(tuple(check_kernel(term, d, dtype) for term in kernel.terms))
    if not isinstance(kernel, Kernel):
        raise TypeError(
            "kernel must be a scalegp.ops kernel (RBF, Matern, RationalQuadratic, "
            f"ExpSineSquared, Constant, or sums and products of them), got {kernel!r}"
        )
    checked = {}
    for field in dataclasses.fields(kernel):
        if field.name == "nu":
            continue
        value = jnp.asarray(getattr(kernel, field.name))
        name = f"{type(kernel).__name__}.{field.name}"
        ard = field.name == "lengthscale" and isinstance(kernel, (RBF, Matern))
        if not ard and value.ndim != 0:
            raise ValueError(f"{name} must be a scalar, got shape {value.shape}")
        checked[field.name] = check_scale(value, d, name, dtype)
    return dataclasses.replace(kernel, **checked)
