"""What each kernel says about its own values (`scalegp.ops._kernels.Kernel.bound_at_gap`,
``decays``) and what the RBF and Matérn profiles say (`scalegp.ops._profiles`: values, gradient
weights, log bounds, reach), checked against the values themselves: a float64 numpy oracle of
each formula, and the engine's float32 tiles on the same coordinates (the rounding margin)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    RBF,
    Constant,
    ExpSineSquared,
    Matern,
    Product,
    RationalQuadratic,
    Sum,
)
from scalegp.ops._kernels import MATERN_NUS, kernel_tile
from scalegp.ops._profiles import MaternProfile

pytestmark = pytest.mark.x64
EPS32 = float(np.finfo(np.float32).eps)


def values_f64(kernel, x, y):
    """``k(x_i, y_j)`` (n, m) in float64 numpy, from the formulas of `scalegp.ops._kernels`."""
    if isinstance(kernel, (Sum, Product)):
        parts = [values_f64(term, x, y) for term in kernel.terms]
        return sum(parts) if isinstance(kernel, Sum) else math.prod(parts)
    if isinstance(kernel, Constant):
        return np.full((len(x), len(y)), float(kernel.value))
    diff = x[:, None, :] - y[None, :, :]
    if isinstance(kernel, ExpSineSquared):
        rho = np.sqrt(np.sum(diff ** 2, axis=-1))
        sine = np.sin(np.pi * rho / float(kernel.period))
        return np.exp(-2.0 * sine ** 2 / float(kernel.lengthscale) ** 2)
    s = np.sum((diff / np.asarray(kernel.lengthscale, np.float64)) ** 2, axis=-1)
    if isinstance(kernel, RBF):
        return np.exp(-s / 2)
    if isinstance(kernel, RationalQuadratic):
        alpha = float(kernel.alpha)
        return (1 + s / (2 * alpha)) ** -alpha
    t = np.sqrt(2 * kernel.nu * s)
    poly = {0.5: 1.0, 1.5: 1 + t, 2.5: 1 + t + t * t / 3}[kernel.nu]
    return poly * np.exp(-t)


def kernels(lengthscale, dtype):
    """Every node type, scalar and ARD lengthscales, a negative constant, sums and products."""
    f = lambda v: jnp.asarray(v, dtype)  # noqa: E731
    ard = f([lengthscale, 2.5 * lengthscale])
    out = {
        "rbf": RBF(f(lengthscale)),
        "rbf_ard": RBF(ard),
        "rq": RationalQuadratic(f(lengthscale), f(1.5)),
        "periodic": ExpSineSquared(f(lengthscale), f(3.0 * lengthscale)),
        "constant": Constant(f(-2.0)),
        "sum": f(0.7) * RBF(ard) + Matern(f(lengthscale), nu=0.5),
        "product": f(-1.5) * RBF(f(lengthscale)) * ExpSineSquared(f(1.0), f(0.5)),
        "composite": (f(1.2) * RBF(f(lengthscale)) + Matern(ard, nu=2.5)
                      * RationalQuadratic(f(2.0 * lengthscale), f(3.0))),
    }
    for nu in MATERN_NUS:
        out[f"matern{nu}"] = Matern(f(lengthscale), nu=nu)
        out[f"matern{nu}_ard"] = Matern(ard, nu=nu)
    return out


def box_pairs(rng, offset, lengthscale, count=24, per_box=40, d=2):
    """``count`` pairs of boxes (corners included among their points) a few lengthscales apart,
    some overlapping in a feature: [(points in the first, points in the second, gap (d,))]."""
    out = []
    for _ in range(count):
        boxes = []
        for _ in range(2):
            lo = offset + rng.uniform(-4, 4, d) * lengthscale
            hi = lo + rng.uniform(0, 1.5, d) * lengthscale
            points = rng.uniform(lo, hi, (per_box, d))
            points[:2] = lo, hi
            boxes.append((lo, hi, points))
        (lo_a, hi_a, a), (lo_b, hi_b, b) = boxes
        out.append((a, b, np.maximum(np.maximum(lo_b - hi_a, lo_a - hi_b), 0.0)))
    return out


@pytest.mark.parametrize("lengthscale", [0.05, 0.3, 2.0])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_each_kernel_bounds_every_value_of_its_box_pairs(offset, lengthscale):
    """max |k| over every pair of two boxes <= the bound at their gap, in float64."""
    rng = np.random.default_rng(0)
    pairs = box_pairs(rng, offset, lengthscale)
    gaps = jnp.asarray(np.stack([gap for _, _, gap in pairs]))
    for name, kernel in kernels(lengthscale, jnp.float64).items():
        bounds = np.asarray(kernel.bound_at_gap(gaps))
        assert bounds.shape == (len(pairs),)
        for (a, b, _), bound in zip(pairs, bounds):
            largest = np.abs(values_f64(kernel, a, b)).max()
            assert largest <= bound * (1 + 1e-12), name


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_bounds_hold_for_float32_tiles_on_the_same_coordinates(offset):
    """The float32 bound of float32 gaps bounds the engine's float32 tile values of the same
    float32 points, centred as the engine centres them (the offset off, exactly): the
    `scalegp.ops._profiles.bound_safety` margin covers the rounding of the distances; the
    profile's own evaluation (a few ulps, which it does not claim) remains."""
    rng = np.random.default_rng(1)
    centre = np.float32(offset)
    for lengthscale in (0.01, 0.3):
        pairs = [(a.astype(np.float32) - centre, b.astype(np.float32) - centre)
                 for a, b, _ in box_pairs(rng, offset, lengthscale)]
        for name, kernel in kernels(lengthscale, jnp.float32).items():
            for a, b in pairs:
                gap = np.maximum(np.maximum(b.min(0) - a.max(0), a.min(0) - b.max(0)), 0)
                bound = float(kernel.bound_at_gap(jnp.asarray(gap)))
                tile = kernel_tile(kernel, jnp.asarray(a), jnp.asarray(b).T)
                assert float(jnp.max(jnp.abs(tile))) <= bound * (1 + 4 * EPS32), name


@pytest.mark.parametrize("name", ["rbf", "rbf_ard"] + [f"matern{nu}" for nu in MATERN_NUS])
def test_profile_bounds_are_attained_by_the_nearest_pair(name):
    """For boxes apart in every feature, the nearest corners are exactly the gap apart: the
    bound is their value, up to the rounding margin."""
    kernel = kernels(0.1, jnp.float64)[name]
    for gap in ([0.05, 0.02], [0.2, 0.1], [0.3, 0.4]):
        a, b = np.zeros((1, 2)), np.asarray([gap])
        value = values_f64(kernel, a, b)[0, 0]
        bound = float(kernel.bound_at_gap(jnp.asarray(gap)))
        assert value <= bound <= value * (1 + 1e-12)


def test_the_bound_is_the_expression_of_its_terms_at_the_gap():
    f = lambda v: jnp.asarray(v, jnp.float64)  # noqa: E731
    gap = jnp.array([[0.0, 0.0], [0.3, 0.4]], jnp.float64)
    s = 0.25 / 0.01  # |gap|² / l²
    bound = (f(2.0) * RBF(f(0.1)) * ExpSineSquared(f(1.0), f(1.0))
             + RationalQuadratic(f(0.1), f(2.0))).bound_at_gap(gap)
    np.testing.assert_allclose(bound, [3.0, 2.0 * np.exp(-s / 2) + (1 + s / 4) ** -2.0],
                               rtol=1e-12)


def test_decays_sum_needs_every_term_product_any_factor():
    f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    decaying = (RBF(f(1.0)), Matern(f(1.0)), RationalQuadratic(f(1.0), f(1.0)))
    lasting = (ExpSineSquared(f(1.0), f(1.0)), Constant(f(2.0)))
    assert all(k.decays for k in decaying) and not any(k.decays for k in lasting)
    assert (decaying[0] + decaying[1]).decays and not (decaying[0] + lasting[0]).decays
    assert (lasting[1] * lasting[0] * decaying[2]).decays and not (lasting[1] * lasting[0]).decays


def profiles():
    return [RBF.profile] + [Matern(1.0, nu=nu).profile for nu in MATERN_NUS]


@pytest.mark.parametrize("profile", profiles())
def test_profile_values_weights_and_log_bounds_agree(profile):
    """``w = -2 ∂k/∂s`` (autodiff of k) and ``log_at_half_sq(h) = log k(2h)``, in float64."""
    s = jnp.asarray([1e-6, 0.3, 2.0, 17.0, 90.0], jnp.float64)
    k, w = profile.values(s)
    np.testing.assert_array_equal(k, profile.value(s))
    np.testing.assert_allclose(w, -2.0 * jax.vmap(jax.grad(profile.value))(s), rtol=1e-12)
    np.testing.assert_allclose(profile.log_at_half_sq(s / 2), np.log(k), rtol=1e-12, atol=1e-14)
    assert bool(jnp.all(jnp.diff(k) < 0))  # decreasing: a bound at a gap bounds beyond it


@pytest.mark.parametrize("profile", profiles())
@pytest.mark.parametrize("level", [1e-3, 6e-8, 1e-300])
def test_reach_is_where_the_profile_falls_to_the_level(profile, level):
    """At the reach the value is at most the level, and just inside it above: tight."""
    half_sq = profile.reach_half_sq(math.log(level))
    assert isinstance(half_sq, float)
    at = float(profile.value(jnp.asarray(2.0 * half_sq, jnp.float64)))
    inside = float(profile.value(jnp.asarray(2.0 * half_sq * (1 - 1e-9), jnp.float64)))
    assert at <= level * (1 + 1e-12) and inside > level * (1 - 1e-12)
    assert half_sq > profile.reach_half_sq(math.log(level) + 1)


def test_rbf_reach_is_closed_form_and_profiles_are_static():
    assert RBF.profile.reach_half_sq(-5.0) == 5.0
    assert RBF(jnp.float32(0.2)).profile == RBF.profile
    assert Matern(jnp.float32(0.2), nu=1.5).profile == MaternProfile(1.5)
    assert len({RBF.profile, *profiles()}) == 1 + len(MATERN_NUS)  # hashable, distinct
