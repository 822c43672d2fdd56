"""Pruned kernel products and KDE (`scalegp.ops._pruning`): against float64 oracles, within the
stated bounds on clustered, uniform, offset and adversarial data; gradients; row independence;
the k-d order; memory; the public ``prune=`` switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    Constant,
    Engine,
    ExpSineSquared,
    Matern,
    _pruning,
    _pruning_bounds,
    _pruning_order,
    kernel_mv,
    rbf_kde_density,
    rbf_kernel_mv,
    spatial_order,
)
from scalegp.ops._kernels import MATERN_NUS
from tests.ops.oracle import grads, kde_log_density_f64, kernel_mv_f64
from tests.ops.test_memory import temp_bytes

BLOCK = 32  # small tiles, so that small problems have many tiles to skip


def clustered(rng, n, d, clusters=12, spread=0.01, offset=0.0):
    centres = rng.uniform(size=(clusters, d))
    x = centres[rng.integers(clusters, size=n)] + spread * rng.standard_normal((n, d))
    return (x + offset).astype(np.float32)


def datasets(rng, n, d):
    return {
        "clustered": clustered(rng, n, d),
        "uniform": rng.uniform(size=(n, d)).astype(np.float32),
        "offset": clustered(rng, n, d, offset=1e3),
    }


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def pruned_mv(x1, x2, v, lengthscale, tol, block=BLOCK, profile=_pruning_bounds.RBF_PROFILE):
    keys = _pruning.ordered_keys(jnp.asarray(x2), jnp.asarray(lengthscale), block)
    return _pruning.kernel_mv(jnp.asarray(x1), keys, jnp.asarray(v), jnp.asarray(lengthscale), tol,
                              profile=profile)


def pruned_log_density(q, x, h, w, tol, block=BLOCK):
    keys = _pruning.ordered_keys(jnp.asarray(x), jnp.asarray(h), block)
    w = jnp.asarray(w, x.dtype)
    w = w / jnp.sum(w)
    d = x.shape[1]
    log_norm = -0.5 * d * np.log(2 * np.pi) - jnp.sum(jnp.log(jnp.broadcast_to(h, (d,))))
    return _pruning.kernel_logsumexp(jnp.asarray(q), keys, w, jnp.asarray(h), tol) + log_norm


@pytest.mark.x64
@pytest.mark.parametrize("lengthscale", [0.003, 0.02, [0.01, 0.04]])
@pytest.mark.parametrize("data", ["clustered", "uniform", "offset"])
def test_kernel_mv_matches_float64_at_the_default_tolerance(data, lengthscale):
    rng = np.random.default_rng(0)
    x = datasets(rng, 600, 2)[data]
    q = datasets(rng, 300, 2)[data]
    v = rng.standard_normal((600, 3)).astype(np.float32)
    ls = np.asarray(lengthscale, np.float32)
    out = pruned_mv(q, x, v, ls, _pruning.default_tolerance(jnp.float32))
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
@pytest.mark.parametrize("bandwidth", [0.004, 0.03, [0.01, 0.02]])
@pytest.mark.parametrize("data", ["clustered", "uniform", "offset"])
@pytest.mark.slow
def test_kde_matches_float64_at_the_default_tolerance(data, bandwidth):
    rng = np.random.default_rng(3)
    x = datasets(rng, 700, 2)[data]
    q = datasets(rng, 250, 2)[data]
    w = rng.uniform(0.5, 1.5, 700).astype(np.float32)
    h = np.asarray(bandwidth, np.float32)
    out = pruned_log_density(q, x, h, w, _pruning.default_tolerance(jnp.float32))
    ref = np.asarray(kde_log_density_f64(q, x, h, w))
    assert rel_err(jnp.exp(out), np.exp(ref)) <= 1e-6
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 2e-6 * max(1, np.abs(ref).max())


@pytest.mark.x64
@pytest.mark.parametrize("tol", [1e-4, 1e-2])
@pytest.mark.slow
def test_kde_relative_error_stays_within_the_bound(tol):
    rng = np.random.default_rng(4)
    x, q = clustered(rng, 2500, 3, spread=0.03), clustered(rng, 200, 3, spread=0.05)
    q[:5] += 0.3  # a few queries far from the clusters, in tiles with near ones
    w = np.ones(2500, np.float32)
    out = np.asarray(pruned_log_density(q, x, np.float32(0.02), w, tol, block=16), np.float64)
    ref = np.asarray(kde_log_density_f64(q, x, np.float32(0.02), w))
    rounding = 2e-6 + 4e-7 * np.abs(ref)  # float32 logs of far queries are large
    # skipped mass <= tol · computed density: log(p) - log(p_computed) <= log1p(tol)
    assert np.all(ref - out <= np.log1p(tol) + rounding)
    assert np.all(out - ref <= rounding)


@pytest.mark.x64
def test_kde_far_query_in_a_tile_of_near_ones_keeps_its_digits():
    rng = np.random.default_rng(5)
    x = clustered(rng, 400, 2, clusters=3, spread=0.005)
    q = np.concatenate([x[:BLOCK - 1], [[5.0, 5.0]]]).astype(np.float32)
    out = np.asarray(pruned_log_density(q, x, np.float32(0.01), np.ones(400), 1e-7), np.float64)
    ref = np.asarray(kde_log_density_f64(q, x, np.float32(0.01), np.ones(400)))
    assert np.isfinite(out[-1]) and ref[-1] < -1e4
    assert abs(out[-1] - ref[-1]) <= 1e-6 * abs(ref[-1])


@pytest.mark.x64
@pytest.mark.parametrize("profile", [pytest.param(_pruning_bounds.RBF_PROFILE,
                                                   marks=pytest.mark.slow)]
                         + [("matern", nu) for nu in MATERN_NUS])
def test_kernel_mv_gradients_match_autodiff_of_the_oracle(profile):
    rng = np.random.default_rng(6)
    x, q = clustered(rng, 300, 2, spread=0.05), clustered(rng, 100, 2, spread=0.05)
    v = rng.standard_normal((300, 2))
    ls = np.array([0.05, 0.08])
    args = (jnp.asarray(q, jnp.float64), jnp.asarray(x, jnp.float64), jnp.asarray(v),
            jnp.asarray(ls))
    oracle = kernel_mv_f64 if profile == _pruning_bounds.RBF_PROFILE else (
        lambda a, b, c, l: matern_mv_f64(a, b, c, l, profile[1]))
    got = grads(lambda a, b, c, l: pruned_mv(a, b, c, l, 1e-12, profile=profile), args)
    want = grads(oracle, args)
    for g, w in zip(got, want):
        assert rel_err(g, np.asarray(w)) < 1e-9


@pytest.mark.x64
def test_kde_gradients_match_autodiff_of_the_oracle():
    rng = np.random.default_rng(7)
    x, q = clustered(rng, 300, 2, spread=0.05), clustered(rng, 100, 2, spread=0.05)
    w = rng.uniform(0.5, 1.5, 300)
    args = (jnp.asarray(q, jnp.float64), jnp.asarray(x, jnp.float64), jnp.asarray(0.04),
            jnp.asarray(w))
    got = grads(lambda a, b, h, c: pruned_log_density(a, b, h, c, 1e-14), args)
    want = grads(kde_log_density_f64, args)
    for g, w_ in zip(got, want):
        assert rel_err(g, np.asarray(w_)) < 1e-9


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


def test_kd_order_is_a_permutation_with_compact_tiles():
    rng = np.random.default_rng(9)
    x = rng.uniform(size=(1000, 2)).astype(np.float32)
    perm = np.asarray(_pruning_order.kd_order(jnp.asarray(x), 1.0, 64))
    assert perm.shape == (1024,)
    np.testing.assert_array_equal(np.sort(perm), np.arange(1024))
    assert np.all(perm[1000:] >= 1000)  # padding last
    lo, hi = _pruning_bounds.boxes(
        _pruning_order.ordered_tiles(jnp.asarray(x), jnp.asarray(perm), 64))
    area = float(jnp.sum(jnp.prod(hi - lo, axis=1)))
    assert area < 2.0  # 16 leaves tile the unit square; random tiles would each cover most of it


def test_far_queries_give_the_limits():
    x = np.array([[0.0, 0.0], [0.1, 0.0], [0.0, 3.0]], np.float32)
    q = np.array([[0.0, 0.0], [np.inf, 1.0]], np.float32)
    v = np.ones((3, 1), np.float32)
    out = np.asarray(pruned_mv(q, x, v, np.float32(0.1), 0.0))
    np.testing.assert_allclose(out[:, 0], [1 + np.exp(-0.5), 0.0], rtol=1e-6)
    log_p = np.asarray(pruned_log_density(q, x, np.float32(0.1), np.ones(3, np.float32), 1e-7))
    assert np.isfinite(log_p[0]) and log_p[1] == -np.inf


@pytest.mark.slow
def test_public_prune_switch():
    rng = np.random.default_rng(10)
    x = clustered(rng, 3000, 2)
    v = rng.standard_normal(3000).astype(np.float32)
    off = rbf_kernel_mv(x, x, v, 0.01, prune=False)
    on = rbf_kernel_mv(x, x, v, 0.01, prune=True)
    assert rel_err(on, np.asarray(off, np.float64)) < 1e-4
    # auto leaves small key sets alone: the very same numbers as prune=False
    np.testing.assert_array_equal(rbf_kernel_mv(x, x, v, 0.01, prune="auto"), off)
    dens = rbf_kde_density(x[:50], x, 0.01, prune=True)
    np.testing.assert_allclose(dens, rbf_kde_density(x[:50], x, 0.01, prune=False), rtol=1e-4)
    with pytest.raises(ValueError, match="prune must be"):
        rbf_kernel_mv(x, x, v, 0.01, prune="yes")
    with pytest.raises(ValueError, match="prune_tol"):
        rbf_kde_density(x, x, 0.01, prune=True, prune_tol=-1)
    with pytest.raises(ValueError, match="impl='xla'"):
        rbf_kernel_mv(x, x, v, 0.01, prune=True, impl="dense")


@pytest.mark.slow
def test_auto_estimate_depends_on_locality():
    rng = np.random.default_rng(11)
    local = clustered(rng, 4096, 2, clusters=40, spread=0.002)
    spread = rng.standard_normal((4096, 8)).astype(np.float32)
    tol = _pruning.default_tolerance(jnp.float32)
    keys = _pruning.ordered_keys(jnp.asarray(local), jnp.float32(0.002), BLOCK)
    assert bool(_pruning.pruning_pays(keys, jnp.float32(0.002), tol))
    keys = _pruning.ordered_keys(jnp.asarray(spread), jnp.float32(1.0), BLOCK)
    assert not bool(_pruning.pruning_pays(keys, jnp.float32(1.0), tol))
    assert not _pruning.considered_by_auto(100_000, 32, batched=False)
    assert not _pruning.considered_by_auto(1000, 2, batched=False)


def _pruned_mv_value_and_grad(x1, x2, v, ls):
    return jax.value_and_grad(
        lambda *a: jnp.sum(rbf_kernel_mv(*a, impl="xla", prune=True) ** 2), argnums=(0, 1, 2, 3)
    )(x1, x2, v, ls)


def _pruned_kde_value_and_grad(q, x, h, w):
    return jax.value_and_grad(
        lambda *a: jnp.sum(rbf_kde_density(*a, log=True, impl="xla", prune=True)),
        argnums=(0, 1, 2, 3))(q, x, h, w)


@pytest.mark.parametrize("f, shapes", [
    (_pruned_mv_value_and_grad, lambda n: ((n, 2), (n, 2), (n, 4), ())),
    (_pruned_kde_value_and_grad, lambda n: ((n, 2), (n, 2), (), (n,))),
], ids=["kernel_mv", "kde"])
def test_pruned_paths_are_memory_linear(f, shapes):
    n = 1 << 14
    small, large = temp_bytes(f, *shapes(n // 4)), temp_bytes(f, *shapes(n))
    assert large < 6 * small  # 4x the points; quadratic growth would be 16x
    assert large < 64 * 2**20


@pytest.mark.slow
def test_keys_in_spatial_order_skip_the_sort_and_give_the_same_result():
    rng = np.random.default_rng(12)
    x = clustered(rng, 2000, 2)
    q = clustered(rng, 300, 2)
    perm = spatial_order(x, 0.01)
    np.testing.assert_array_equal(np.sort(perm), np.arange(2000))
    v = rng.standard_normal(2000).astype(np.float32)
    plain = rbf_kernel_mv(q, x, v, 0.01, prune=True)
    ordered = rbf_kernel_mv(q, x[perm], v[perm], 0.01, prune=True, keys_in_order=True)
    np.testing.assert_allclose(ordered, plain, rtol=1e-5, atol=1e-6)
    dens = rbf_kde_density(q, x[perm], 0.01, log=True, prune=True, keys_in_order=True)
    np.testing.assert_allclose(dens, rbf_kde_density(q, x, 0.01, log=True, prune=True), rtol=1e-6)


def test_models_do_not_prune_unless_asked_and_periodic_kernels_refuse():
    assert Engine().prune is False
    x = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="fall to 0 with distance"):
        kernel_mv(ExpSineSquared(jnp.float32(1.0), jnp.float32(1.0)), x, x,
                  np.ones(4, np.float32), prune=True)
    with pytest.raises(ValueError, match="fall to 0 with distance"):
        kernel_mv(Matern(jnp.float32(1.0)) + Constant(jnp.float32(2.0)), x, x,
                  np.ones(4, np.float32), prune=True)


# ----------------------------------------------------------------------------------------------
# Matérn profiles


def matern_mv_f64(x1, x2, v, lengthscale, nu):
    x1, x2, v, lengthscale = (jnp.asarray(t, jnp.float64) for t in (x1, x2, v, lengthscale))
    diff = (x1[:, None, :] - x2[None, :, :]) / lengthscale
    # sqrt of a clamped sum: the oracle's own gradient at r = 0 is not exercised here
    t = jnp.sqrt(2 * nu * jnp.maximum(jnp.sum(diff**2, axis=-1), 1e-300))
    poly = {0.5: 1.0, 1.5: 1.0 + t, 2.5: 1.0 + t + t**2 / 3}[nu]
    return (poly * jnp.exp(-t)) @ v


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
    out = pruned_mv(q, x, v, ls, _pruning.default_tolerance(jnp.float32),
                    profile=("matern", nu))
    assert out.dtype == jnp.float32
    assert rel_err(out, matern_mv_f64(q, x, v, ls, nu)) <= 1e-6


@pytest.mark.x64
@pytest.mark.parametrize("nu", MATERN_NUS)
@pytest.mark.parametrize("tol", [1e-4, 1e-2])
def test_matern_kernel_mv_error_stays_within_the_bound(tol, nu):
    rng = np.random.default_rng(11)
    x, q = clustered(rng, 800, 2), clustered(rng, 200, 2)
    v = rng.standard_normal((800, 2)).astype(np.float32)
    out = np.asarray(pruned_mv(q, x, v, np.float32(0.01), tol, profile=("matern", nu)),
                     np.float64)
    ref = np.asarray(matern_mv_f64(q, x, v, np.float32(0.01), nu))
    bound = tol * np.sum(np.abs(v), axis=0) + 1e-5 * np.abs(ref).max()  # plus rounding
    assert np.all(np.abs(out - ref) <= bound)
    # and the bound did let tiles be skipped
    keys = _pruning.ordered_keys(jnp.asarray(x), jnp.float32(0.01), BLOCK)
    setup = _pruning_bounds.mv_setup(
        keys.tiles, _pruning_order.tile_values(jnp.asarray(v), keys.perm, BLOCK), tol)
    visits = jax.vmap(lambda t: jnp.any(_pruning_bounds.mv_include(
        t, *setup, jnp.float32(100.0), ("matern", nu)), axis=0))(keys.tiles)
    assert 0 < np.mean(visits) < 0.5


@pytest.mark.parametrize("nu", MATERN_NUS)
def test_auto_finds_that_pruning_a_narrow_matern_pays(nu):
    rng = np.random.default_rng(14)
    keys = _pruning.ordered_keys(jnp.asarray(clustered(rng, 4096, 2, clusters=40, spread=0.003)),
                                 jnp.float32(0.001), BLOCK)
    tol = _pruning.default_tolerance(jnp.float32)
    assert _pruning.pruning_pays(keys, jnp.float32(0.001), tol, ("matern", nu))
    assert not _pruning.pruning_pays(keys, jnp.float32(0.3), tol, ("matern", nu))


@pytest.mark.x64
@pytest.mark.slow
def test_public_matern_product_prunes_with_its_outputscale_and_coincident_points():
    """``c · Matern`` through `kernel_mv`: the outputscale multiplies, and coincident points
    (queries = keys) have the finite gradient convention (0 point gradient at r = 0)."""
    rng = np.random.default_rng(13)
    x = clustered(rng, 400, 2).astype(np.float64)
    v = rng.standard_normal(400)
    for nu in MATERN_NUS:
        kernel = Constant(jnp.asarray(2.5)) * Matern(jnp.asarray([0.01, 0.02]), nu=nu)
        out = kernel_mv(kernel, x, x, v, prune=True)
        plain = kernel_mv(kernel, x, x, v, prune=False)
        assert rel_err(out, np.asarray(plain)) < 1e-12

        def loss(a, prune):
            return jnp.sum(kernel_mv(kernel, a, x, v, prune=prune) ** 2)

        got, want = (jax.grad(loss)(jnp.asarray(x), p) for p in (True, False))
        assert np.all(np.isfinite(got))
        assert rel_err(got, np.asarray(want)) < 1e-9


def test_matern_reach_is_where_the_profile_falls_to_the_level():
    for nu in MATERN_NUS:
        for level in (1e-3, 6e-8):
            half_sq = _pruning_bounds.reach_half_sq(("matern", nu), np.log(level))
            at = float(_pruning_bounds.log_bound(("matern", nu), jnp.asarray(half_sq, jnp.float32)))
            assert abs(at - np.log(level)) < 1e-3
            assert half_sq > _pruning_bounds.reach_half_sq(("matern", nu), np.log(level) + 1)
    assert _pruning_bounds.reach_half_sq(_pruning_bounds.RBF_PROFILE, -5.0) == 5.0


@pytest.mark.slow
def test_auto_decides_at_run_time_and_differentiates():
    """At AUTO_MIN_KEYS keys "auto" compiles both paths under one lax.cond; local keys take the
    pruned one (the same numbers as prune=True), gradients flow through the choice."""
    rng = np.random.default_rng(13)
    x = clustered(rng, _pruning.AUTO_MIN_KEYS, 2, clusters=64, spread=0.001)
    q = x[:64] + np.float32(1e-4)
    v = rng.standard_normal(len(x)).astype(np.float32)
    auto = jax.jit(lambda q, x, v, ls: rbf_kernel_mv(q, x, v, ls, prune="auto"))
    np.testing.assert_array_equal(auto(q, x, v, 0.001), rbf_kernel_mv(q, x, v, 0.001, prune=True))
    g = jax.grad(lambda ls: jnp.sum(auto(q, x, v, ls) ** 2))(jnp.float32(0.001))
    assert np.isfinite(g) and g != 0


@pytest.mark.slow
def test_auto_does_not_sort_keys_whose_extent_the_kernel_spans():
    rng = np.random.default_rng(14)
    tol = _pruning.default_tolerance(jnp.float32)
    spread = jnp.asarray(rng.standard_normal((5000, 8)), jnp.float32)
    assert not bool(_pruning.reach_allows_pruning(spread, jnp.float32(1.0), tol))
    local = jnp.asarray(clustered(rng, 5000, 2, spread=0.001))
    assert bool(_pruning.reach_allows_pruning(local, jnp.float32(0.001), tol))
