"""The pruned products' entry points and switches (`scalegp.ops.pruning._rules`): far rows, the
public ``prune=`` switch, ``prune="auto"``'s estimate and gate, keys in spatial order, memory,
the models' default; the per-product numerics are in tests/ops/backends/xla/test_pruned_mv.py and
tests/ops/backends/xla/test_pruned_lse.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    Constant,
    Engine,
    ExpSineSquared,
    Matern,
    kernel_mv,
    rbf_kde_density,
    rbf_kernel_mv,
    spatial_order,
)
from scalegp.ops._kernels import MATERN_NUS
from scalegp.ops._profiles import MaternProfile
from scalegp.ops.pruning import _rules as rules
from tests.ops.pruning.problems import (
    BLOCK,
    clustered,
    pruned_log_density,
    pruned_mv,
    rel_err,
)
from tests.ops.test_memory import temp_bytes


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
    tol = rules.default_tolerance(jnp.float32)
    keys = rules.ordered_keys(jnp.asarray(local), jnp.float32(0.002), BLOCK)
    assert bool(rules.pruning_pays(keys, jnp.float32(0.002), tol))
    keys = rules.ordered_keys(jnp.asarray(spread), jnp.float32(1.0), BLOCK)
    assert not bool(rules.pruning_pays(keys, jnp.float32(1.0), tol))
    assert not rules.considered_by_auto(100_000, 32, batched=False)
    assert not rules.considered_by_auto(1000, 2, batched=False)


@pytest.mark.parametrize("layout", ["clustered", "uniform", "with_far_rows"])
def test_the_sampled_test_on_keys_in_order_agrees_with_the_full_one(layout):
    """`pays_in_order` (a sample of the tiles against each other) decides as `pruning_pays`
    (sampled tiles against every tile) from the narrowest to the widest bandwidth, far rows
    (moved to the centre, as the pruned path moves them) included."""
    rng = np.random.default_rng(12)
    x = (clustered(rng, 2**14, 2, clusters=40, spread=0.01) if layout != "uniform"
         else rng.uniform(size=(2**14, 2)).astype(np.float32))
    if layout == "with_far_rows":
        x[::997] = np.inf
    tol = rules.default_tolerance(jnp.float32)
    decisions = []
    for h in np.float32([0.001, 0.01, 0.03, 0.1, 1.0]):
        keys = jnp.asarray(x[spatial_order(np.where(np.isfinite(x), x, 0.0), h)])
        full = bool(rules.pruning_pays(rules.ordered_keys(keys, h, in_order=True), h,
                                          tol))
        sampled = bool(rules.pays_in_order(keys, h, tol))
        assert sampled == full, h
        decisions.append(full)
    assert decisions[0] and not decisions[-1]


def test_the_kde_prunes_a_larger_share_in_one_feature():
    """The in-program KDE's "auto" prunes up to `KDE_LOW_D_MAX_VISITED` of the tile pairs at
    d = 1, where `kernel_mv` stops at `AUTO_MAX_VISITED`: uniform keys at 0.75 of Scott's
    bandwidth sit between the two, and "auto" gives the pruned rows, bitwise."""
    rng = np.random.default_rng(15)
    m = rules.AUTO_MIN_KEYS
    x = rng.uniform(size=(m, 1)).astype(np.float32)
    h = np.float32(0.75 * m ** (-1 / 5) * x.std())
    keys = jnp.asarray(x[spatial_order(x, h)])
    tol = rules.default_tolerance(jnp.float32)
    lo, hi = rules.sampled_boxes(keys, h)
    share = float(rules._visited_share(lo, hi, lo, hi, h, tol, rules.RBF.profile))
    assert rules.AUTO_MAX_VISITED < share <= rules.kde_max_visited(1), share
    assert not bool(rules.pays_in_order(keys, h, tol))
    q = jnp.asarray(rng.uniform(size=(37, 1)).astype(np.float32))
    pruned, auto, unpruned = (np.asarray(rbf_kde_density(q, keys, h, log=True, prune=p,
                                                         keys_in_order=True))
                              for p in (True, "auto", False))
    np.testing.assert_array_equal(auto, pruned)
    assert not np.array_equal(unpruned, pruned)  # so that the rows tell the paths apart
    assert rules.kde_max_visited(2) == rules.AUTO_MAX_VISITED


def test_kde_without_weights_equals_equal_weights():
    """No weights reach the program as None (each branch builds its own, `sum_to_one`): the
    densities equal those with equal weights given, pruned, unpruned and under "auto", also
    for a number of keys whose reciprocal rounds."""
    rng = np.random.default_rng(16)
    x = clustered(rng, 3001, 2)
    q = x[:50] + np.float32(0.003)
    for prune in (True, False, "auto"):
        none = rbf_kde_density(q, x, 0.01, log=True, prune=prune)
        ones = rbf_kde_density(q, x, 0.01, np.ones(3001, np.float32), log=True, prune=prune)
        np.testing.assert_allclose(np.asarray(none), np.asarray(ones), rtol=2e-7, atol=2e-6)
    batched = rbf_kde_density(np.stack([q, q[::-1]]), np.stack([x, x[::-1]]), 0.01, log=True)
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(none)[::-1], rtol=2e-7,
                               atol=2e-6)


@pytest.mark.parametrize("far_value", [1e30, np.inf, -np.inf, np.nan, None])
def test_the_in_order_test_leaves_far_rows_out_of_the_boxes(far_value):
    """`sampled_boxes` (the in-order "auto" test's) tests rows one by one only where a box's
    corner overflows: with a far row (its squares overflow, infinite, NaN) in the first
    sampled tile, and without one, the boxes are those of the finite rows alone, and a tile of
    far rows alone has an empty box."""
    rng = np.random.default_rng(3)
    h = np.float32(0.01)
    x = rng.uniform(size=(2**14, 2)).astype(np.float32)
    x = x[spatial_order(x, h)]
    if far_value is not None:
        x[5] = far_value
        x[rules.PRUNE_BLOCK * 2: rules.PRUNE_BLOCK * 3] = far_value  # a whole sampled tile
    block = rules.PRUNE_BLOCK
    full = x.shape[0] // block
    tiles = x[: full * block].reshape(full, block, 2)[:: max(1, full // rules.AUTO_IN_ORDER_SAMPLE)]
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.isfinite(np.sum(np.square(tiles / h), axis=2))[..., None]
    want_lo = np.where(finite, tiles, np.inf).min(axis=1)
    want_hi = np.where(finite, tiles, -np.inf).max(axis=1)
    lo, hi = jax.jit(lambda k: rules.sampled_boxes(k, h))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(lo), want_lo)
    np.testing.assert_array_equal(np.asarray(hi), want_hi)
    if far_value is not None:
        assert np.all(np.asarray(lo)[1] == np.inf) and np.all(np.asarray(hi)[1] == -np.inf)


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


def test_keys_are_ordered_only_where_the_engine_may_prune_them():
    """`Engine.orders_keys`: a model sorts its keys once only where its products may prune
    them; the Mosaic products do not prune under "auto" (docs/decisions.md #48), so sorting
    there would cost a fit its time (and a TPU a compilation) for nothing."""
    m = rules.AUTO_MIN_KEYS
    assert Engine.create("xla", prune="auto").orders_keys(m, 2, np.float32)
    assert not Engine.create("xla", prune="auto").orders_keys(m - 1, 2, np.float32)
    assert not Engine.create("xla", prune=False).orders_keys(m, 2, np.float32)
    assert not Engine.create("mosaic", prune="auto").orders_keys(m, 2, np.float32)
    assert Engine.create("mosaic", prune=True).orders_keys(m, 2, np.float32)


def test_spatial_order_is_the_host_k_d_order_of_the_real_rows():
    rng = np.random.default_rng(5)
    x = clustered(rng, 5000, 3)  # not a multiple of the tile height
    perm = spatial_order(x, np.array([0.1, 0.2, 0.3]))
    np.testing.assert_array_equal(np.sort(perm), np.arange(5000))

    def extent(rows):  # the tiles' boxes, summed
        tiles = x[rows][:4864].reshape(19, 256, 3)
        return float(np.sum(tiles.max(axis=1) - tiles.min(axis=1)))

    assert extent(perm) < 0.3 * extent(rng.permutation(5000))


def test_models_do_not_prune_unless_asked_and_periodic_kernels_refuse():
    assert Engine().prune is False
    x = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="fall to 0 with distance"):
        kernel_mv(ExpSineSquared(jnp.float32(1.0), jnp.float32(1.0)), x, x,
                  np.ones(4, np.float32), prune=True)
    with pytest.raises(ValueError, match="fall to 0 with distance"):
        kernel_mv(Matern(jnp.float32(1.0)) + Constant(jnp.float32(2.0)), x, x,
                  np.ones(4, np.float32), prune=True)


@pytest.mark.parametrize("nu", MATERN_NUS)
def test_auto_finds_that_pruning_a_narrow_matern_pays(nu):
    rng = np.random.default_rng(14)
    keys = rules.ordered_keys(jnp.asarray(clustered(rng, 4096, 2, clusters=40, spread=0.003)),
                                 jnp.float32(0.001), BLOCK)
    tol = rules.default_tolerance(jnp.float32)
    assert rules.pruning_pays(keys, jnp.float32(0.001), tol, MaternProfile(nu))
    assert not rules.pruning_pays(keys, jnp.float32(0.3), tol, MaternProfile(nu))


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


@pytest.mark.slow
def test_auto_decides_at_run_time_and_differentiates():
    """At AUTO_MIN_KEYS keys "auto" compiles both paths under one lax.cond; local keys take the
    pruned one (the same numbers as prune=True), gradients flow through the choice."""
    rng = np.random.default_rng(13)
    x = clustered(rng, rules.AUTO_MIN_KEYS, 2, clusters=64, spread=0.001)
    q = x[:64] + np.float32(1e-4)
    v = rng.standard_normal(len(x)).astype(np.float32)
    auto = jax.jit(lambda q, x, v, ls: rbf_kernel_mv(q, x, v, ls, prune="auto"))
    np.testing.assert_array_equal(auto(q, x, v, 0.001), rbf_kernel_mv(q, x, v, 0.001, prune=True))
    g = jax.grad(lambda ls: jnp.sum(auto(q, x, v, ls) ** 2))(jnp.float32(0.001))
    assert np.isfinite(g) and g != 0


@pytest.mark.slow
def test_auto_does_not_sort_keys_whose_extent_the_kernel_spans():
    rng = np.random.default_rng(14)
    tol = rules.default_tolerance(jnp.float32)
    spread = jnp.asarray(rng.standard_normal((5000, 8)), jnp.float32)
    assert not bool(rules.reach_allows_pruning(spread, jnp.float32(1.0), tol))
    local = jnp.asarray(clustered(rng, 5000, 2, spread=0.001))
    assert bool(rules.reach_allows_pruning(local, jnp.float32(0.001), tol))


def test_sparse_queries_take_tiles_of_the_key_tiles_width():
    """`query_block`: a batch of queries sparser than the keys is tiled in short tiles (about
    the key tiles' width), which visit far fewer tile pairs than tiles of the keys' height,
    and every row's log-density is bitwise the same at each height it may take."""
    from scalegp.ops.backends.xla._pruned_lse import lse_forward
    from scalegp.ops.pruning._bounds import (
        lse_candidates,
        lse_log_tol,
        lse_rest_visits,
        lse_setup,
    )

    assert [rules.query_block(n, 2**17, 256) for n in (1, 1024, 8192, 10**6)] == [16, 16, 16, 64]
    rng = np.random.default_rng(5)
    keys = clustered(rng, 2**14, 2, clusters=40)
    queries = jnp.asarray(clustered(rng, 256, 2, clusters=40))
    h, tol = jnp.float32(0.01), rules.default_tolerance(jnp.float32)
    ordered = rules.ordered_keys(jnp.asarray(keys), h, 256)
    w = rules.tile_values(jnp.full(2**14, 2.0**-14, jnp.float32), ordered.perm, 256)
    inv, log_tol = jnp.full((2,), 1 / h), lse_log_tol(tol, jnp.float32)
    setup = lse_setup(ordered.tiles, w)[0]

    def pairs_and_values(height):
        x, perm, _ = rules.ordered_queries(queries, ordered, h, False, height)
        run_max, log_sum, level = lse_forward(x, ordered.tiles, w, inv, tol)
        visits = jax.vmap(lambda x_t, lv: lse_candidates(x_t, setup, inv, log_tol).sum()
                          + lse_rest_visits(x_t, setup, inv, lv).sum())(x, level)
        values = rules.unordered((run_max + log_sum).reshape(-1), perm, 256)
        return int(visits.sum()) * height * 256, np.asarray(values)

    assert rules.query_block(256, 2**14, 256) == 16
    tall, tall_values = pairs_and_values(256)
    for height in (16, 32, 64):
        pairs, values = pairs_and_values(height)
        np.testing.assert_array_equal(values, tall_values, err_msg=f"height {height}")
        if height == 16:
            assert pairs < tall / 4, (pairs, tall)


@pytest.mark.parametrize("tiles", [1, 7, 512, 3907])
@pytest.mark.parametrize("share", [0.0, 0.03, 0.5, 1.0])
def test_a_visit_list_is_the_stable_partition_of_the_tiles(tiles, share):
    """`visit_list` (a scatter, not a sort): the visited tiles, then the others, each in tile
    order, as a stable argsort of the flags gives them."""
    from scalegp.ops.pruning._bounds import visit_list

    visit = np.random.default_rng(tiles).random(tiles) < share
    idx, count = visit_list(jnp.asarray(visit))
    np.testing.assert_array_equal(idx, np.argsort(~visit, kind="stable"))
    assert int(count) == visit.sum()
