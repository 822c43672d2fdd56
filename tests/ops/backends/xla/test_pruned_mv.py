"""The xla pruned ``K v`` (`scalegp.ops.backends.xla._pruned_mv`, through `scalegp.ops.pruning._rules.kernel_mv`)
for the RBF and the Matérn profiles: against float64 oracles, within the stated bound on
clustered, uniform, offset and adversarial data; gradients; row independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import RBF
from scalegp.ops._kernels import MATERN_NUS
from scalegp.ops._profiles import MaternProfile
from scalegp.ops.pruning import _bounds as bounds
from scalegp.ops.pruning import _order as order
from scalegp.ops.pruning import _rules as rules
from tests.ops.oracle import grads, kernel_mv_f64
from tests.ops.pruning.problems import (
    BLOCK,
    clustered,
    datasets,
    matern_mv_f64,
    pruned_mv,
    rel_err,
)


@pytest.mark.x64
@pytest.mark.parametrize("lengthscale", [0.003, 0.02, [0.01, 0.04]])
@pytest.mark.parametrize("data", ["clustered", "uniform", "offset"])
def test_kernel_mv_matches_float64_at_the_default_tolerance(data, lengthscale):
    rng = np.random.default_rng(0)
    x = datasets(rng, 600, 2)[data]
    q = datasets(rng, 300, 2)[data]
    v = rng.standard_normal((600, 3)).astype(np.float32)
    ls = np.asarray(lengthscale, np.float32)
    out = pruned_mv(q, x, v, ls, rules.default_tolerance(jnp.float32))
    assert out.dtype == jnp.float32
    assert rel_err(out, kernel_mv_f64(q, x, v, ls)) <= 1e-6


@pytest.mark.x64
@pytest.mark.parametrize("tol", [0.0, 1e-4, 1e-2])
def test_kernel_mv_error_stays_within_the_bound(tol):
    rng = np.random.default_rng(1)
    x, q = clustered(rng, 800, 2), clustered(rng, 200, 2)
    v = rng.standard_normal((800, 2)).astype(np.float32)
    out = np.asarray(pruned_mv(q, x, v, np.float32(0.02), tol), np.float64)
    ref = np.asarray(kernel_mv_f64(q, x, v, np.float32(0.02)))
    bound = tol * np.sum(np.abs(v), axis=0) + 1e-5 * np.abs(ref).max()  # plus rounding
    assert np.all(np.abs(out - ref) <= bound)


@pytest.mark.x64
def test_kernel_mv_bound_holds_on_adversarial_keys():
    """Every key sits just inside the distance where one key's kernel value drops under tol:
    each skipped tile is worth little, but there are many of them."""
    rng = np.random.default_rng(2)
    tol, m = 1e-3, 2048
    radius = np.sqrt(-2 * np.log(tol)) * 1.02
    angles = rng.uniform(0, 2 * np.pi, m)
    keys = (radius * np.stack([np.cos(angles), np.sin(angles)], 1)).astype(np.float32)
    q = np.zeros((1, 2), np.float32)
    v = np.ones((m, 1), np.float32)
    out = float(pruned_mv(q, keys, v, np.float32(1.0), tol)[0, 0])
    ref = float(kernel_mv_f64(q, keys, v, np.float32(1.0))[0, 0])
    assert abs(out - ref) <= tol * m * (1 + 1e-5)
    assert abs(out - ref) / ref < 1  # not everything was dropped


@pytest.mark.x64
@pytest.mark.parametrize("profile", [pytest.param(RBF.profile, marks=pytest.mark.slow)]
                         + [MaternProfile(nu) for nu in MATERN_NUS])
def test_kernel_mv_gradients_match_autodiff_of_the_oracle(profile):
    rng = np.random.default_rng(6)
    x, q = clustered(rng, 300, 2, spread=0.05), clustered(rng, 100, 2, spread=0.05)
    v = rng.standard_normal((300, 2))
    ls = np.array([0.05, 0.08])
    args = (jnp.asarray(q, jnp.float64), jnp.asarray(x, jnp.float64), jnp.asarray(v),
            jnp.asarray(ls))
    oracle = kernel_mv_f64 if profile == RBF.profile else (
        lambda a, b, c, l: matern_mv_f64(a, b, c, l, profile.nu))
    got = grads(lambda a, b, c, l: pruned_mv(a, b, c, l, 1e-12, profile=profile), args)
    want = grads(oracle, args)
    for g, w in zip(got, want):
        assert rel_err(g, np.asarray(w)) < 1e-9


@pytest.mark.slow
def test_exact_pruning_keeps_rows_bitwise_independent():
    rng = np.random.default_rng(8)
    x = clustered(rng, 500, 2)
    q = clustered(rng, 200, 2)
    v = rng.standard_normal((500, 2)).astype(np.float32)
    together = np.asarray(pruned_mv(q, x, v, np.float32(0.01), 0.0))
    for i in (0, 57, 199):
        alone = np.asarray(pruned_mv(q[i:i + 1], x, v, np.float32(0.01), 0.0))
        np.testing.assert_array_equal(alone[0], together[i])


@pytest.mark.x64
@pytest.mark.parametrize("nu", MATERN_NUS)
@pytest.mark.parametrize("lengthscale", [0.003, [0.01, 0.04]])
@pytest.mark.parametrize("data", ["clustered", "offset"])
@pytest.mark.slow
def test_matern_kernel_mv_matches_float64_at_the_default_tolerance(data, lengthscale, nu):
    rng = np.random.default_rng(10)
    x = datasets(rng, 600, 2)[data]
    q = datasets(rng, 300, 2)[data]
    v = rng.standard_normal((600, 2)).astype(np.float32)
    ls = np.asarray(lengthscale, np.float32)
    out = pruned_mv(q, x, v, ls, rules.default_tolerance(jnp.float32),
                    profile=MaternProfile(nu))
    assert out.dtype == jnp.float32
    assert rel_err(out, matern_mv_f64(q, x, v, ls, nu)) <= 1e-6


@pytest.mark.x64
@pytest.mark.parametrize("nu", MATERN_NUS)
@pytest.mark.parametrize("tol", [1e-4, 1e-2])
def test_matern_kernel_mv_error_stays_within_the_bound(tol, nu):
    rng = np.random.default_rng(11)
    x, q = clustered(rng, 800, 2), clustered(rng, 200, 2)
    v = rng.standard_normal((800, 2)).astype(np.float32)
    out = np.asarray(pruned_mv(q, x, v, np.float32(0.01), tol, profile=MaternProfile(nu)),
                     np.float64)
    ref = np.asarray(matern_mv_f64(q, x, v, np.float32(0.01), nu))
    bound = tol * np.sum(np.abs(v), axis=0) + 1e-5 * np.abs(ref).max()  # plus rounding
    assert np.all(np.abs(out - ref) <= bound)
    # and the bound did let tiles be skipped
    keys = rules.ordered_keys(jnp.asarray(x), jnp.float32(0.01), BLOCK)
    setup = bounds.mv_setup(
        keys.tiles, order.tile_values(jnp.asarray(v), keys.perm, BLOCK), tol)
    visits = jax.vmap(lambda t: jnp.any(bounds.mv_include(
        t, *setup, jnp.float32(100.0), MaternProfile(nu)), axis=0))(keys.tiles)
    assert 0 < np.mean(visits) < 0.5
