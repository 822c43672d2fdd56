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

Each node bounds its own values for the pruned products (`backends.xla._pruned_expression`):
`Kernel.bound_at_gap` bounds ``|k|`` over the pairs at least a box gap apart in every feature
(a decreasing profile by its value at the gap's scaled distance, made rigorous under rounding
by `scalegp.ops._profiles.bound_safety`; the periodic by 1; ``c`` by ``|c|``; sums and products
by those of their terms' bounds), and `Kernel.decays` says whether they fall to 0 with distance.
RBF and Matern hand out their profile (``profile``, `scalegp.ops._profiles`: values, gradient
weights, log bounds, reach), which the hand-written pruned paths (`pruning._rules`) take.

`kernel_tile` evaluates a whole expression on one tile of pairs: the unscaled squared distances
are computed once per tile and shared by the RBF and rational-quadratic terms with a scalar
lengthscale (each rescales them) and the periodic terms; Matérn and ARD terms sum their own
scaled squares (`owns_distance`). A composite kernel costs one pass, forward and backward.
For ``d <= DIRECT_MAX_D`` they come from the coordinate differences themselves, not from
``|x|² + |x'|² - 2x·x'``: the expansion leaves an absolute error of about
``eps·|x|²`` in s, which ``√s`` magnifies near ``s = 0`` (Matérn-1/2 near the diagonal; a
measured case is in docs/architecture.md). A lone ``c · Matern(l, ν)`` with ν = 3/2 or 5/2
takes the expansion on the xla path all the same (`matern_form`,
`backends.xla._matern.matern_mv`) where the keys' scaled norms allow: those profiles are
smooth in s, so its error in k is at most a fixed fraction of its error in s, which grows with
those norms (`scalegp.ops._matmul.MATERN_EXPANSION_MEAN_LIMIT`); otherwise it takes the
differences.

Gradient convention at ``r = 0``: the gradient with respect to the points is 0 there for every
profile. For the smooth ones that is the derivative; for Matérn-1/2, whose one-sided derivatives
along any direction are ±1/l, it is the symmetric subgradient (their average). The
hyperparameter gradients are exact (every profile equals 1 at ``s = 0`` for any lengthscale).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scalegp.ops._checks import check_scale
from scalegp.ops._matmul import half_sq_norms
from scalegp.ops._profiles import MaternProfile, RBFProfile, bound_safety

#: Up to this many features, tile distances are formed from coordinate differences (exact to
#: rounding, cost d operations per pair); above it by one matrix product.
DIRECT_MAX_D = 16

#: The Matérn smoothness values ``nu`` the engine has closed forms for.
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

    def exponent(self, dist: "TileDistances"):
        """``e`` with ``k = exp(e)`` on the tile, for the profiles that are one exponential
        (RBF, ExpSineSquared); None for the others, which then read nothing from ``dist``. A
        product adds its factors' exponents and takes one exponential
        (`Product.evaluate`)."""
        return None

    def at_zero(self):
        """``k(x, x)``: the same for every x, the kernels being stationary."""
        raise NotImplementedError

    #: Whether the values provably fall to 0 with distance (what pruning needs).
    decays = False

    def bound_at_gap(self, gap):
        """An upper bound on ``|k(x, y)|`` over all pairs with ``|x_d - y_d| >= gap_d`` in every
        feature, rounding of the computed distances included: gap (..., d) >= 0 -> (...,).
        A profile decreasing in its scaled distance is bounded by its value at the gap; a
        periodic one by 1; a constant c by ``|c|``; a sum by the sum of its terms' bounds, a
        product by the product of its factors'."""
        raise NotImplementedError


class _Profile(Kernel):
    """A stationary profile of a distance: 1 at distance 0, whatever its hyperparameters."""

    def at_zero(self):
        return jnp.ones((), jnp.asarray(self.lengthscale).dtype)


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
    """√s whose derivative is 0 (not inf) below the smallest normal number: the gradient
    convention above (periodic terms). The blocked backward passes form point gradients from
    ``∂k/∂s`` times coordinates, where an infinite ``∂k/∂s`` at a duplicated point would not
    cancel."""
    return jnp.sqrt(jnp.maximum(s, jnp.finfo(s.dtype).tiny))


@_dataclass_pytree
class Constant(Kernel):
    """``k(x, x') = value``; as a factor, an outputscale."""

    value: jax.Array

    def evaluate(self, dist):
        return self.value

    def at_zero(self):
        return self.value

    def bound_at_gap(self, gap):
        return jnp.broadcast_to(jnp.abs(self.value), gap.shape[:-1]).astype(gap.dtype)


class _DecreasingProfile(_Profile):
    """A profile of the scaled squared distance ``s = Σ_d ((x_d - y_d) / l_d)²``, decreasing in
    s (`of_scaled_sq`): bounded at a gap by its value at the gap's s."""

    decays = True

    def of_scaled_sq(self, s):
        """The kernel at s (any shape): its ``profile``'s value (RBF, Matern)."""
        return self.profile.value(s)

    def evaluate(self, dist):
        return self.of_scaled_sq(dist.scaled(self.lengthscale, owns_distance(self)))

    def bound_at_gap(self, gap):
        """``k(s_min)``, ``s_min = Σ_d (g_d / l_d)²`` shrunk by `bound_safety`, so that it
        bounds the computed values too."""
        scaled = gap / self.lengthscale
        s = bound_safety(gap.dtype, gap.shape[-1]) * jnp.sum(scaled * scaled, axis=-1)
        return self.of_scaled_sq(s)


@_dataclass_pytree
class RBF(_DecreasingProfile):
    """``exp(-s/2)``; ``lengthscale`` scalar or (d,)."""

    lengthscale: jax.Array
    profile = RBFProfile()

    def exponent(self, dist):
        return -0.5 * dist.scaled(self.lengthscale, owns_distance(self))


@_dataclass_pytree(meta=("nu",))
class Matern(_DecreasingProfile):
    """Matérn of smoothness ``nu`` in {0.5, 1.5, 2.5}; ``lengthscale`` scalar or (d,)."""

    lengthscale: jax.Array
    nu: float = 1.5

    def __post_init__(self):
        if self.nu not in MATERN_NUS:
            raise ValueError(f"Matern nu must be one of {MATERN_NUS}, got {self.nu!r}")

    @property
    def profile(self) -> MaternProfile:
        return MaternProfile(float(self.nu))


@_dataclass_pytree
class RationalQuadratic(_DecreasingProfile):
    """``(1 + s / (2α))^(-α)``, a scale mixture of RBFs; scalar ``lengthscale``."""

    lengthscale: jax.Array
    alpha: jax.Array

    def of_scaled_sq(self, s):
        return jnp.exp(-self.alpha * jnp.log1p(s / (2.0 * self.alpha)))


#: sin(π f) = f P(f²) on |f| <= 1/2: P fitted for least relative error (Lawson's iteration on
#: 200,001 points; at most 5.4e-9 relative in float64). In float32 its square is within 3.8e-7
#: relative of float64's sin², as numpy's float32 sine squared is within 3.3e-7.
_SIN_PI_COEFFICIENTS = (3.1415926367515885, -5.167709679076584, 2.550069670386001,
                        -0.598241957672935, 0.0775603012459605)


def _sin_of_pi_times(f):
    """``sin(π f)`` for |f| <= 1/2: `_SIN_PI_COEFFICIENTS`' polynomial, or in float64 jnp.sin."""
    if jnp.dtype(f.dtype) == jnp.float64:
        return jnp.sin(math.pi * f)
    g = f * f
    poly = _SIN_PI_COEFFICIENTS[-1]
    for c in _SIN_PI_COEFFICIENTS[-2::-1]:
        poly = poly * g + c
    return f * poly


def _reduced(t):
    """``t - ⌊t + ½⌋`` in [-½, ½], exact: an integer within ½ of t is subtracted."""
    return t - jnp.floor(t + 0.5)


@jax.custom_jvp
def sin_squared_of_pi_times(t):
    """``sin²(π t)`` for t >= 0 (any shape): ``t`` reduced exactly to ``f = t - ⌊t + ½⌋`` in
    [-½, ½] (`_reduced`), then ``sin(π f)`` by `_sin_of_pi_times`, squared.

    ``jnp.sin`` of ``π t`` reduces its argument by multiples of π that are themselves rounded
    numbers, for any magnitude; on a TPU that general reduction is vector-unit work on every
    pair of a tile. The period is exact here and both forms round the argument ``t`` once, so
    the error is that of ``jnp.sin`` (tests/ops/test_kernel_expressions.py).

    The derivative, ``2π sin(π f) cos(π f)``, is written out (custom JVP) with ``cos(π f) =
    sin(π (½ - |f|))``: the polynomial's own derivative cancels to nothing at ``|f| = ½`` and
    erred there by up to 2.4e-3 relative in float32, this form by 3.3e-7."""
    return _sin_of_pi_times(_reduced(t)) ** 2


@sin_squared_of_pi_times.defjvp
def _sin_squared_jvp(primals, tangents):
    (t,), (dt,) = primals, tangents
    f = _reduced(t)
    sine, cosine = _sin_of_pi_times(f), _sin_of_pi_times(0.5 - jnp.abs(f))
    return sine * sine, (2.0 * math.pi) * sine * cosine * dt


@_dataclass_pytree
class ExpSineSquared(_Profile):
    """Periodic: ``exp(-2 sin²(π ρ / period) / l²)`` of the Euclidean distance ρ."""

    lengthscale: jax.Array
    period: jax.Array

    def exponent(self, dist):
        rho = _safe_sqrt(dist.squared())
        return (-2.0 / (self.lengthscale * self.lengthscale)) * sin_squared_of_pi_times(
            rho * (1.0 / self.period))

    def evaluate(self, dist):
        return jnp.exp(self.exponent(dist))

    def bound_at_gap(self, gap):
        return jnp.ones(gap.shape[:-1], gap.dtype)  # its values lie in (0, 1] at any distance


@_dataclass_pytree
class Sum(Kernel):
    """``Σ_i k_i``; decays when every term does."""

    terms: tuple

    def evaluate(self, dist):
        out = self.terms[0].evaluate(dist)
        for term in self.terms[1:]:
            out = out + term.evaluate(dist)
        return out

    def summands(self) -> list:
        """The terms, with nested sums' own terms in their place, depth first."""
        return [summand for term in self.terms
                for summand in (term.summands() if isinstance(term, Sum) else [term])]

    def at_zero(self):
        out = self.terms[0].at_zero()
        for term in self.terms[1:]:
            out = out + term.at_zero()
        return out

    @property
    def decays(self) -> bool:
        return all(term.decays for term in self.terms)

    def bound_at_gap(self, gap):
        return functools.reduce(jnp.add, [term.bound_at_gap(gap) for term in self.terms])


@_dataclass_pytree
class Product(Kernel):
    """``Π_i k_i``; decays when a factor does."""

    terms: tuple

    def evaluate(self, dist):
        # exp(a) exp(b) as exp(a + b): one exponential per product of exponential profiles
        # (the expression kernels' tiles are bound by their transcendental functions), nested
        # products (``a * b * c``) flattened, in order (`TileDistances` hands out owned
        # distances in the order the terms read them)
        out = exponent = None
        for term in self.factors():
            e = term.exponent(dist)
            if e is None:
                value = term.evaluate(dist)
                out = value if out is None else out * value
            else:
                exponent = e if exponent is None else exponent + e
        if exponent is not None:
            out = jnp.exp(exponent) if out is None else out * jnp.exp(exponent)
        return out

    def factors(self) -> list:
        """The terms, with nested products' own terms in their place, depth first."""
        return [factor for term in self.terms
                for factor in (term.factors() if isinstance(term, Product) else [term])]

    def at_zero(self):
        out = self.terms[0].at_zero()
        for term in self.terms[1:]:
            out = out * term.at_zero()
        return out

    @property
    def decays(self) -> bool:
        return any(term.decays for term in self.terms)

    def bound_at_gap(self, gap):
        return functools.reduce(jnp.multiply, [term.bound_at_gap(gap) for term in self.terms])


class TileDistances:
    """The squared distances of one tile of pairs, as the kernel's terms ask for them.

    ``squared`` (p, q) is ``|x_i - y_j|²``, shared by the scalar-lengthscale RBF and
    rational-quadratic terms (which rescale it) and the periodic ones; ``own`` holds one
    ``Σ_d ((x_id - y_jd) / l_d)²`` for each term that has its own (`owns_distance`), in
    `own_lengthscales` order, handed out as the terms evaluate (depth first, the same order).
    Not a pytree: it lives inside one trace of `profile_tile`.
    """

    def __init__(self, squared, own):
        self._squared, self._own, self._next = squared, own, 0

    def squared(self):
        return self._squared

    def scaled(self, lengthscale, owned: bool = False):
        """``Σ_d ((x_id - y_jd) / l_d)²`` (p, q): the term's own array, or the shared one
        rescaled (which may overflow to inf, the limit RBF and RQ map to 0)."""
        if owned:
            s, self._next = self._own[self._next], self._next + 1
            return s
        inv = 1.0 / lengthscale
        return self._squared * (inv * inv)


def owns_distance(node) -> bool:
    """Terms with their own scaled distance array: ARD lengthscales, and every Matérn (its
    profile needs a finite distance, which scaled and bounded coordinates guarantee)."""
    return isinstance(node, Matern) or (isinstance(node, RBF) and jnp.ndim(node.lengthscale) == 1)


def own_lengthscales(kernel: Kernel) -> list:
    """The lengthscales (scalar or (d,)) of the terms that own a distance, depth first."""
    return [node.lengthscale for node in profiles_of(kernel) if owns_distance(node)]


def shared_distance_slope(kernel: Kernel):
    """A bound on ``|∂ log k / ∂s|`` over the terms that read the shared squared distance s
    (`uses_squared`), at any s: the sum over them of ``1/(2l²)`` (RBF, rational quadratic)
    and ``2π²/(p l)²`` (periodic: ``sin²(π√s/p)`` grows at most as ``(π/p)² s``). The sum
    bounds any product of those terms, and a sum of terms errs relatively by at most its
    worst term's. 0 where no term reads s. None where a summand that reads s does not decay (a
    periodic term alone): its values stay whole at every distance, so an error in s that
    grows with a point's distance from the centre (the expansion's) would count in full."""
    summands = kernel.summands() if isinstance(kernel, Sum) else [kernel]
    if any(uses_squared(term) and not term.decays for term in summands):
        return None
    slope = 0.0
    for node in profiles_of(kernel):
        if isinstance(node, _Profile) and not owns_distance(node):
            if isinstance(node, ExpSineSquared):
                slope = slope + 2.0 * (math.pi / (node.period * node.lengthscale)) ** 2
            else:
                slope = slope + 0.5 / node.lengthscale ** 2
    return slope


def uses_squared(kernel: Kernel) -> bool:
    """Whether some term reads the shared unscaled squared distance."""
    return any(isinstance(node, _Profile) and not owns_distance(node)
               for node in profiles_of(kernel))


#: Coordinates (centred, and scaled for a term's own distance) are clipped to this size per
#: tile, O((p + q) d) work: squared distances then stay finite in float32 for d <= 16
#: (4 d · 1e36 < 3.4e38), without a guard on each of the p·q pairs. Points this far apart have
#: kernel values of exactly 0 either way (periodic terms aside, which have no meaning there).
COORDINATE_LIMIT = 1e18


def broadcast_squares(x, keys_t):
    """``Σ_d (x_id - y_jd)²`` from the differences, as one (p, d, q) broadcast: with the keys
    feature-major, a broadcast over a contiguous row of q keys, which XLA's CPU backend
    vectorises (a strided column per feature ran several times slower)."""
    return jnp.sum(jnp.square(x[:, :, None] - keys_t[None, :, :]), axis=1)


class TileArithmetic(NamedTuple):
    """How a backend forms a tile's squared distances (`sum_of_squares`): ``direct(x,
    keys_t)`` from the coordinate differences for d <= `DIRECT_MAX_D`; past it one matrix
    product at ``precision`` (the backend's policy) with the rows' ``half_norms`` (|x|²/2; the
    written-out sum, but `jnp.sum` inside a Triton kernel, which cannot slice)."""

    direct: Callable = broadcast_squares
    half_norms: Callable = half_sq_norms
    precision: Any = jax.lax.Precision.HIGHEST


#: The arithmetic of a dense matrix at full float32 (`scalegp.ops.kernel_matrix`).
FULL_PRECISION = TileArithmetic()


def sum_of_squares(x, keys_t, arithmetic: TileArithmetic = FULL_PRECISION):
    """``Σ_d (x_id - y_jd)²`` (p, q) for x (p, d) and ``keys_t = yᵀ`` (d, q), of coordinates
    bounded by `COORDINATE_LIMIT`, by the backend's ``arithmetic``: for ``d <=``
    `DIRECT_MAX_D` from the differences themselves; above, by one matrix product (see
    `DIRECT_MAX_D` for the accuracy this gives up)."""
    x = jnp.clip(x, -COORDINATE_LIMIT, COORDINATE_LIMIT)
    keys_t = jnp.clip(keys_t, -COORDINATE_LIMIT, COORDINATE_LIMIT)
    if x.shape[1] <= DIRECT_MAX_D:
        return arithmetic.direct(x, keys_t)
    cross = jnp.matmul(x, keys_t, precision=arithmetic.precision)
    return jnp.maximum(-2.0 * (cross - arithmetic.half_norms(x)[:, None]
                               - 0.5 * jnp.sum(keys_t * keys_t, axis=0)[None, :]), 0.0)


def _scaled_coordinates(x, keys_t, lengthscale):
    inv = 1.0 / lengthscale
    return x * inv, keys_t * jnp.reshape(inv, (-1, 1))


def tile_distances(kernel: Kernel, x, keys_t, arithmetic: TileArithmetic = FULL_PRECISION):
    """``(squared or None, own tuple)``: what `TileDistances` holds for x (p, d), keys_t (d, q);
    ``arithmetic`` as in `sum_of_squares`."""
    own = tuple(sum_of_squares(*_scaled_coordinates(x, keys_t, l), arithmetic)
                for l in own_lengthscales(kernel))
    # a kernel of constants alone reads no distance, but its tile needs a shape
    squared = (sum_of_squares(x, keys_t, arithmetic)
               if uses_squared(kernel) or not own else None)
    return squared, own


def profile_tile(kernel: Kernel, squared, own):
    """The kernel on a tile from its distances (`tile_distances`) -> (p, q). Differentiable in
    the hyperparameters and the distances; the lengthscale of a term with its own distance
    enters only through that array, so its gradient is the caller's
    (`backends.xla._expression`)."""
    shape = (squared if squared is not None else own[0]).shape
    out = kernel.evaluate(TileDistances(squared, own))
    return jnp.broadcast_to(out, shape)


def kernel_tile(kernel: Kernel, x, keys_t, arithmetic: TileArithmetic = FULL_PRECISION):
    """``k(x_i, y_j)`` for centred query rows x (p, d) and keys ``keys_t = yᵀ`` (d, q) ->
    (p, q); differentiable in everything. ``arithmetic``: the backend's (`TileArithmetic`)."""
    return profile_tile(kernel, *tile_distances(kernel, x, keys_t, arithmetic)).astype(x.dtype)


def with_own_gradients(grads: Kernel, own_grads) -> Kernel:
    """``grads`` (a kernel-shaped pytree of gradients) with ``own_grads`` added to the
    lengthscale leaves of the terms that own a distance, in `own_lengthscales` order."""
    remaining = list(own_grads)

    def visit(node):
        if isinstance(node, (Sum, Product)):
            return type(node)(tuple(visit(term) for term in node.terms))
        if owns_distance(node):
            return dataclasses.replace(node, lengthscale=node.lengthscale + remaining.pop(0))
        return node

    return visit(grads)


def _scaled_profile(kernel: Kernel, cls):
    """``(scale or None, profile)`` when ``kernel`` is one ``cls`` profile, alone or times
    constants (products nested in products too: ``2 * k * 3``), else None."""
    if isinstance(kernel, cls):
        return None, kernel
    if isinstance(kernel, Product):
        factors = profiles_of(kernel) if _products_only(kernel) else kernel.terms
        profiles = [t for t in factors if isinstance(t, cls)]
        constants = [t for t in factors if isinstance(t, Constant)]
        if len(profiles) == 1 and len(profiles) + len(constants) == len(factors):
            scale = None
            for c in constants:
                scale = c.value if scale is None else scale * c.value
            return scale, profiles[0]
    return None


def _products_only(kernel: Kernel) -> bool:
    return not isinstance(kernel, Sum) and (
        not isinstance(kernel, Product) or all(map(_products_only, kernel.terms)))


def rbf_form(kernel: Kernel):
    """``(scale, lengthscale)`` when ``kernel`` is ``scale · RBF(lengthscale)`` (a product of
    constants and one RBF), else None: such kernels take the hand-written RBF path."""
    form = _scaled_profile(kernel, RBF)
    return None if form is None else (form[0], form[1].lengthscale)


#: The Matérn smoothnesses with a hand-written xla path (`matern_form`): their profiles are
#: smooth in s, so the distance expansion's rounding stays small (not so for ν = 1/2, whose
#: √s magnifies it near s = 0; see the module docstring).
SMOOTH_MATERN_NUS = (1.5, 2.5)


def matern_form(kernel: Kernel):
    """``(scale, lengthscale, nu)`` when ``kernel`` is ``scale · Matern(lengthscale, nu)`` with
    ν in `SMOOTH_MATERN_NUS` (a product of constants and one such Matérn), else None: such
    kernels take the hand-written Matérn path on the xla implementation
    (`backends.xla._matern.matern_mv`)."""
    form = _scaled_profile(kernel, Matern)
    if form is None or form[1].nu not in SMOOTH_MATERN_NUS:
        return None
    return form[0], form[1].lengthscale, form[1].nu


def scaled_matern(kernel: Kernel):
    """``(scale, matern)`` when ``kernel`` is ``scale · matern`` (a product of constants and one
    `Matern` of any supported ν), else None: such kernels take the hand-written pruned path
    (`pruning._rules`, with ``matern.profile``)."""
    return _scaled_profile(kernel, Matern)


def profiles_of(kernel: Kernel) -> list:
    """The profile and constant nodes of ``kernel``, depth first."""
    if isinstance(kernel, (Sum, Product)):
        return [leaf for term in kernel.terms for leaf in profiles_of(term)]
    return [kernel]


def check_kernel(kernel, d: int, dtype) -> Kernel:
    """``kernel`` with its hyperparameters cast to ``dtype`` and checked: shapes (a scalar, or
    d entries for the ARD lengthscales of RBF and Matern), and positive, finite values where
    they are concrete (not traced)."""
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
