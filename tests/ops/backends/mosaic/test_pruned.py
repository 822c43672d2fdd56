"""The pruned Mosaic kernels (`scalegp.ops.backends.mosaic._pruned`) in interpret mode on CPU
(compiled where a TPU runs this file): ``K v`` and the KDE, forward and every gradient, against
the xla pruned path (the same rows add the same key tiles) and float64 within the stated bound;
their plans (visit lists, the index maps that read them: only listed tiles are fetched); the
public functions with ``impl="mosaic", prune=True``; and their lowering to Mosaic for a TPU
(what runs without one: the Mosaic compiler itself runs only on a TPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import Matern, rbf_kde_density, rbf_kernel_mv
from scalegp.ops._interface import PrunedCore
from scalegp.ops._plan import BACKENDS, plan
from scalegp.ops._tiling import BlockSizes
from scalegp.ops.backends.mosaic import _pruned
from scalegp.ops.backends.xla import _pruned_lse as xla_pruned_lse
from scalegp.ops.backends.xla import _pruned_mv as xla_pruned_mv
from scalegp.ops.pruning import _bounds as bounds
from scalegp.ops.pruning import _rules as rules
from tests.ops.backends.triton.pruned_problems import (
    in_caller_order,
    log_norm,
    normalised,
)
from tests.ops.backends.triton.pruned_problems import tiled as eager_tiled
from tests.ops.oracle import grads, kde_log_density_f64, kernel_mv_f64
from tests.ops.pruning.problems import clustered, datasets, rel_err
from tests.ops.test_memory import temp_bytes

BLOCK = 128  # the smallest tile a TPU takes: small problems have several tiles to skip
BS = BlockSizes(block_q=BLOCK, block_k=BLOCK)
NAME = "mosaic"
#: Interpret mode, except on a TPU, where this file checks the compiled kernels.
INTERPRET = jax.default_backend() not in BACKENDS["mosaic"].compiles_on
#: Log-densities: the xla pruned path's error (on a TPU its log is 1e-4 off: the Mosaic
#: kernels correct theirs, `_tile_math.accurate_log`) and the kernels' against float64 (the
#: chip's exp: up to 6e-6 compiled on a TPU v5e).
XLA_LOG_ATOL, LOG_ATOL = (2e-6, 2e-6) if INTERPRET else (2e-4, 2e-5)


#: (query tiles, key tiles, value tiles, 1/scale, the query order) in k-d order, as the pruned
#: cores take them, in one compiled program (the k-d sort run eagerly took seconds).
tiled = jax.jit(eager_tiled, static_argnums=4)


def mosaic_mv(tol, group=None):
    """The Mosaic core at ``tol`` (a tol passed after inv, as `rules.kernel_mv` does, is
    ignored), jitted: interpret mode run eagerly compiles every operation apart."""
    return _jitted(lambda x, y, v, inv: _pruned.pruned_kernel_mv(x, y, v, inv, tol, BS, INTERPRET,
                                                                  group))


def mosaic_lse(tol, group=None):
    return _jitted(lambda x, y, w, inv: _pruned.pruned_kernel_logsumexp(x, y, w, inv, tol, BS,
                                                                         INTERPRET, group))


def _jitted(core):
    fn = jax.jit(core)
    return lambda x, y, v, inv, *_: fn(x, y, v, inv)


def jit_grads(f, args):
    """`grads` (a fixed random cotangent) in one compiled program."""
    return jax.jit(lambda *a: grads(f, a))(*args)


def xla_mv(tol):
    return _jitted(lambda *a: xla_pruned_mv.pruned_kernel_mv(*a, tol))


def xla_lse(tol):
    return _jitted(lambda *a: xla_pruned_lse.pruned_kernel_logsumexp(*a, tol))


def _lse_forward(tol):
    """(M, L, levels) of the Mosaic KDE's forward passes."""
    return jax.jit(lambda *a: _pruned._lse_forward(*a, tol, BS, INTERPRET, None))


def _via_rules_mv(core, tol):
    """``K(q, x) v`` on unordered points through `rules.kernel_mv` with ``core``: the gradient
    reaches the lengthscale through 1/l."""
    def f(q, x, v, ls):
        keys = rules.ordered_keys(x, ls, BLOCK)
        return rules.kernel_mv(q, keys, v, ls, tol, PrunedCore(BLOCK, core, core))
    return f


def _via_rules_kde(core, tol):
    """The log-density through `rules.kernel_logsumexp` with ``core``."""
    def f(q, x, h, w):
        keys = rules.ordered_keys(x, h, BLOCK)
        out = rules.kernel_logsumexp(q, keys, w / jnp.sum(w), h, tol,
                                     PrunedCore(BLOCK, core, core))
        d = x.shape[1]
        return out - 0.5 * d * jnp.log(2 * jnp.pi) - jnp.sum(jnp.log(jnp.broadcast_to(h, (d,))))
    return f


# ----------------------------------------------------------------------------------------------
# K v


@pytest.mark.x64
@pytest.mark.parametrize("data, lengthscale", [
    ("clustered", 0.02),
    pytest.param("uniform", [0.01, 0.04], marks=pytest.mark.slow),
    pytest.param("offset", 0.003, marks=pytest.mark.slow),
])
def test_kernel_mv_matches_the_xla_path_and_float64(data, lengthscale):
    rng = np.random.default_rng(0)
    x, q = datasets(rng, 600, 2)[data], datasets(rng, 200, 2)[data]
    v = rng.standard_normal((600, 3)).astype(np.float32)
    ls = np.asarray(lengthscale, np.float32)
    tol = rules.default_tolerance(jnp.float32)
    xt, yt, vt, inv, perm = tiled(q, x, v, ls, BLOCK)
    out = mosaic_mv(tol)(xt, yt, vt, inv)
    assert out.dtype == jnp.float32
    # the same tiles, each row the same pairs; K v by two bfloat16 passes (2^-16 per element)
    ref = xla_mv(tol)(xt, yt, vt, inv)
    assert rel_err(out, np.asarray(ref, np.float64)) < 1e-5
    got = in_caller_order(out, perm, 200).astype(np.float64)
    exact = np.asarray(kernel_mv_f64(q, x, v, ls))
    bound = tol * np.sum(np.abs(v), axis=0) + 2e-5 * np.abs(exact).max()
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.x64
@pytest.mark.parametrize("tol", [1e-2, pytest.param(0.0, marks=pytest.mark.slow)])
def test_kernel_mv_error_stays_within_the_bound(tol):
    """prune_tol 1e-2 skips at most 1e-2 ‖v‖₁ per row and column; 0 only what underflows."""
    rng = np.random.default_rng(1)
    x, q = clustered(rng, 600, 2), clustered(rng, 200, 2)
    v = rng.standard_normal((600, 3)).astype(np.float32)
    xt, yt, vt, inv, perm = tiled(q, x, v, np.float32(0.02), BLOCK)
    out = in_caller_order(mosaic_mv(tol)(xt, yt, vt, inv), perm, 200).astype(np.float64)
    ref = np.asarray(kernel_mv_f64(q, x, v, np.float32(0.02)))
    bound = tol * np.sum(np.abs(v), axis=0) + 2e-5 * np.abs(ref).max()  # plus rounding
    assert np.all(np.abs(out - ref) <= bound)


@pytest.mark.x64
@pytest.mark.parametrize("against_xla", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kernel_mv_every_gradient(against_xla):
    """x1, x2, v and the lengthscale: against autodiff of the float64 oracle, and (slow) the
    xla pruned path's gradients (float32, the default tolerance: the same pairs)."""
    rng = np.random.default_rng(6)
    x, q = clustered(rng, 300, 2, spread=0.05), clustered(rng, 150, 2, spread=0.05)
    v = rng.standard_normal((300, 2))
    ls = np.array([0.05, 0.08])
    args = tuple(jnp.asarray(a, jnp.float32) for a in (q, x, v, ls))
    tol = rules.default_tolerance(jnp.float32)
    got = jit_grads(_via_rules_mv(mosaic_mv(tol), tol), args)
    if against_xla:
        want, bound = jit_grads(_via_rules_mv(xla_mv(tol), tol), args), 2e-5
    else:
        want, bound = jit_grads(kernel_mv_f64, tuple(np.float64(a) for a in args)), 3e-5
    for name, g, w in zip(("x1", "x2", "v", "lengthscale"), got, want):
        assert rel_err(g, np.asarray(w, np.float64)) < bound, name


# ----------------------------------------------------------------------------------------------
# KDE


@pytest.mark.x64
@pytest.mark.parametrize("data, bandwidth", [
    ("clustered", 0.02),
    pytest.param("uniform", [0.01, 0.02], marks=pytest.mark.slow),
    pytest.param("offset", 0.004, marks=pytest.mark.slow),
])
def test_kde_matches_the_xla_path_and_float64(data, bandwidth):
    rng = np.random.default_rng(3)
    x, q = datasets(rng, 600, 2)[data], datasets(rng, 200, 2)[data]
    w = normalised(rng.uniform(0.5, 1.5, 600))
    h = np.asarray(bandwidth, np.float32)
    tol = rules.default_tolerance(jnp.float32)
    xt, yt, wt, inv, perm = tiled(q, x, w, h, BLOCK)
    f_max, f_log_sum, levels = _lse_forward(tol)(xt, yt, wt, inv)
    xla_max, xla_log_sum, xla_levels = jax.jit(xla_pruned_lse.lse_forward, static_argnums=4)(
        xt, yt, wt, inv, tol)
    # the same plan row for row (the levels from the near tiles' sums, to rounding)
    np.testing.assert_allclose(levels, xla_levels, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f_max + f_log_sum, xla_max + xla_log_sum, rtol=1e-6,
                               atol=XLA_LOG_ATOL)
    got = in_caller_order(f_max + f_log_sum, perm, 200) + log_norm(h, 2)
    ref = np.asarray(kde_log_density_f64(q, x, h, w))
    assert rel_err(np.exp(got), np.exp(ref)) <= LOG_ATOL
    assert np.max(np.abs(got - ref)) <= LOG_ATOL * max(1, np.abs(ref).max())


@pytest.mark.x64
def test_kde_relative_error_stays_within_the_bound_and_tiles_are_skipped():
    """A few queries far from the clusters in tiles with near ones; most pairs skipped."""
    rng = np.random.default_rng(4)
    tol, m, n = 1e-2, 2000, 512
    x = clustered(rng, m, 2)
    q = (x[:n] + 0.01 * rng.standard_normal((n, 2))).astype(np.float32)
    q[:3] += 0.3
    w = normalised(np.ones(m))
    xt, yt, wt, inv, perm = tiled(q, x, w, np.float32(0.01), BLOCK)
    setup, _ = bounds.lse_setup(yt, wt)
    f_max, f_log_sum, levels = _lse_forward(tol)(xt, yt, wt, inv)
    added = jax.jit(jax.vmap(lambda x_t, level: bounds.lse_added(x_t, setup, inv, np.log(tol),
                                                                  level)))(xt, levels)
    assert np.mean(np.any(np.asarray(added), axis=1)) < 0.5  # most tile pairs skipped
    out = in_caller_order(f_max + f_log_sum, perm, n).astype(np.float64)
    ref = np.asarray(kde_log_density_f64(q, x, np.float32(0.01), w)) - log_norm(0.01, 2)
    rounding = 2e-6 + 4e-7 * np.abs(ref)
    assert np.all(ref - out <= np.log1p(tol) + rounding)
    assert np.all(out - ref <= rounding)


@pytest.mark.x64
@pytest.mark.parametrize("against_xla", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kde_every_gradient(against_xla):
    """Queries, data, bandwidth and weights: against autodiff of the float64 oracle, and
    (slow) the xla pruned path's gradients."""
    rng = np.random.default_rng(7)
    x, q = clustered(rng, 300, 2, spread=0.05), clustered(rng, 150, 2, spread=0.05)
    w = rng.uniform(0.5, 1.5, 300)
    args = tuple(jnp.asarray(a, jnp.float32) for a in (q, x, 0.04, w))
    tol = rules.default_tolerance(jnp.float32)
    got = jit_grads(_via_rules_kde(mosaic_lse(tol), tol), args)
    if against_xla:
        want, bound = jit_grads(_via_rules_kde(xla_lse(tol), tol), args), 2e-5
    else:
        want, bound = jit_grads(kde_log_density_f64, tuple(np.float64(a) for a in args)), 3e-5
    for name, g, w_ in zip(("queries", "data", "bandwidth", "weights"), got, want):
        assert rel_err(g, np.asarray(w_, np.float64)) < bound, name


# ----------------------------------------------------------------------------------------------
# plans: only listed tiles are visited


def _at_every_step(index_map, rows, steps, prefetch):
    """``index_map(r, k, *prefetch)`` at every grid step (rows, steps)."""
    fn = jax.vmap(jax.vmap(index_map, (None, 0) + (None,) * len(prefetch)),
                  (0, None) + (None,) * len(prefetch))
    return fn(jnp.arange(rows), jnp.arange(steps), *prefetch)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _plans_and_blocks(xt, yt, vt, inv, steps, key_steps):
    """The plans of one group of all query tiles, and the blocks each grid step of the query
    and the key passes asks for (``steps``, ``key_steps``: at least the grids' extents)."""
    tq, tk = xt.shape[0], yt.shape[0]
    include = _pruned._mv_include(xt, jnp.ones(tq, bool), bounds.mv_setup(yt, vt, 1e-7), inv)
    qp, kp = _pruned.query_plan(include), _pruned.key_plan(include)
    q_grid, k_grid = _pruned.QueryGrid(tk, BLOCK), _pruned.KeyGrid(tq, BLOCK)
    q_prefetch, k_prefetch = (qp.lists, qp.counts), (kp.keys, kp.lists, kp.counts)
    return include, qp, kp, {
        "keys": _at_every_step(q_grid.key_cols(2).index_map, tq, steps, q_prefetch)[1],
        "flags": _at_every_step(q_grid.flags().index_map, tq, steps, q_prefetch)[2],
        "key_tiles": _at_every_step(k_grid.rows(2).index_map, tk, key_steps, k_prefetch)[0],
        "queries": _at_every_step(k_grid.query_cols(2).index_map, tk, key_steps,
                                  k_prefetch)[1]}


def test_only_listed_key_tiles_are_fetched():
    """On clustered keys most tile pairs are skipped; at every grid step the BlockSpecs ask
    for a tile on the row's list (past its count, the last one again: no new DMA), and the
    grids' extents are the largest counts, not the numbers of tiles."""
    rng = np.random.default_rng(2)
    x, q = clustered(rng, 2000, 2, spread=0.005), clustered(rng, 600, 2, spread=0.005)
    v = rng.standard_normal((2000, 1)).astype(np.float32)
    xt, yt, vt, inv, _ = tiled(q, x, v, np.float32(0.005), BLOCK)
    tq, tk = xt.shape[0], yt.shape[0]
    include, qp, kp, blocks = _plans_and_blocks(xt, yt, vt, inv, tk, tq)
    visits = np.any(np.asarray(include), axis=1)  # (tq, tk)
    counts, steps = np.asarray(qp.counts), int(qp.steps)
    assert counts.sum() < 0.3 * tq * tk and steps == counts.max() < tk
    keys = np.asarray(blocks["keys"])[:, :steps]
    for i in range(tq):
        assert list(keys[i, :counts[i]]) == list(np.flatnonzero(visits[i]))  # in key order
        assert set(keys[i, counts[i]:]) <= {keys[i, max(counts[i] - 1, 0)]}
    assert np.all(np.asarray(blocks["flags"]) == 0)  # under 128 steps: one block of flags
    # the key passes: the key tiles the group visits, each with the query tiles visiting it
    num_keys, key_steps = int(kp.num_keys), int(kp.steps)
    assert num_keys == np.sum(np.any(visits, axis=0)) and key_steps == visits.sum(0).max()
    key_tiles = np.asarray(blocks["key_tiles"])[:num_keys, 0]
    queries = np.asarray(blocks["queries"])[:num_keys, :key_steps]
    assert sorted(key_tiles) == list(np.flatnonzero(np.any(visits, axis=0)))
    for c, t in enumerate(key_tiles):
        visitors = list(np.flatnonzero(visits[:, t]))
        assert list(queries[c, :len(visitors)]) == visitors
        assert set(queries[c, len(visitors):]) <= {visitors[-1]}


@pytest.mark.slow
def test_long_lists_and_many_visitors():
    """Query tiles that visit more than 128 key tiles (their flags in a second (block, 128)
    block) and key tiles visited by more than 8 query tiles (a second (8, block) block of the
    key passes' flags): a wide kernel, every pair added; value and gradients against the xla
    pruned path."""
    rng = np.random.default_rng(13)
    x, q = rng.uniform(size=(129 * BLOCK, 2)), rng.uniform(size=(9 * BLOCK, 2))
    v = rng.standard_normal((129 * BLOCK, 1))
    xt, yt, vt, inv, _ = tiled(q.astype(np.float32), x.astype(np.float32),
                               v.astype(np.float32), np.float32(3.0), BLOCK)
    tol = rules.default_tolerance(jnp.float32)
    mosaic, xla = jax.jit(mosaic_mv(tol)), jax.jit(xla_mv(tol))
    out, ref = mosaic(xt, yt, vt, inv), xla(xt, yt, vt, inv)
    assert rel_err(out, np.asarray(ref, np.float64)) < 1e-5
    got, want = (jit_grads(f, (xt, yt, vt, inv)) for f in (mosaic, xla))
    for name, g, w in zip(("x", "y", "v", "1/l"), got, want):
        assert rel_err(g, np.asarray(w, np.float64)) < 2e-5, name


@pytest.mark.slow
def test_groups_do_not_change_the_result():
    """One group of all query tiles or groups of one: the same numbers forward (each query
    tile's kernel does the same arithmetic), and the gradients to rounding (the key passes'
    sums over groups are reassociated)."""
    rng = np.random.default_rng(8)
    x, q = clustered(rng, 600, 2), clustered(rng, 300, 2)
    v = rng.standard_normal((600, 2)).astype(np.float32)
    xt, yt, vt, inv, _ = tiled(q, x, v, np.float32(0.02), BLOCK)
    whole = mosaic_mv(1e-7)(xt, yt, vt, inv)
    np.testing.assert_array_equal(mosaic_mv(1e-7, group=1)(xt, yt, vt, inv), whole)
    wt = vt[..., 0] ** 2
    whole = mosaic_lse(1e-7)(xt, yt, wt, inv)
    np.testing.assert_array_equal(mosaic_lse(1e-7, group=1)(xt, yt, wt, inv), whole)
    assert _pruned.group_size(1000, 1 << 10, 256, per_row=3) == 5
    assert _pruned.group_size(3, 10, 128) == 3 and _pruned.group_size(9, 10, 128, group=2) == 2


# ----------------------------------------------------------------------------------------------
# the public functions, through a backend with the pruned core


@pytest.mark.x64
@pytest.mark.slow
def test_public_functions_take_the_pruned_kernels():
    """``impl=<the backend>, prune=True``: K v and the log-density within the bound against
    float64, and a query row the same alone as in its batch."""
    rng = np.random.default_rng(10)
    x, q = clustered(rng, 500, 2), clustered(rng, 200, 2)
    v = rng.standard_normal(500).astype(np.float32)
    h = np.float32(0.01)
    mv = jax.jit(lambda a: rbf_kernel_mv(a, x, v, h, impl=NAME, prune=True, block_q=BLOCK,
                                         block_k=BLOCK))
    kde = jax.jit(lambda a: rbf_kde_density(a, x, h, log=True, impl=NAME, prune=True,
                                            block_k=BLOCK))
    full = np.asarray(mv(q), np.float64)
    tol = rules.default_tolerance(jnp.float32)
    exact = np.asarray(kernel_mv_f64(q, x, v, h))
    assert np.max(np.abs(full - exact)) <= tol * np.sum(np.abs(v)) + 2e-5 * np.abs(exact).max()
    np.testing.assert_array_equal(np.asarray(mv(q[137:138])), full[137:138])
    log_p = np.asarray(kde(q))
    ref = np.asarray(kde_log_density_f64(q, x, h))
    assert np.max(np.abs(log_p - ref)) <= 2e-6 * max(1, np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(kde(q[:1])), log_p[:1])


def test_tiles_and_profiles_are_checked():
    rng = np.random.default_rng(11)
    x = rng.uniform(size=(300, 2)).astype(np.float32)
    v = np.ones(300, np.float32)
    with pytest.raises(ValueError, match="block_q must equal block_k"):
        rbf_kernel_mv(x, x, v, 0.1, impl=NAME, prune=True, block_q=128, block_k=256)
    with pytest.raises(ValueError, match="multiple of 128"):
        rbf_kde_density(x, x, 0.1, impl=NAME, prune=True, block_k=192)
    core = plan(NAME, 300, 2, jnp.float32, family="pruned").pruned()
    assert core.block == _pruned.BLOCK and not core.query_block
    xt, yt, vt, inv, _ = tiled(x, x, v[:, None], np.float32(0.1), core.block)
    with pytest.raises(ValueError, match="RBF only"):
        core.mv(xt, yt, vt, inv, 1e-7, Matern(np.float32(0.1), nu=1.5).profile)


@pytest.mark.slow
def test_far_queries_batches_and_exact_pruning_through_the_public_functions():
    """A query at infinity (0 in a product, -inf as a log-density), exact pruning (tol = 0),
    and batch dimensions (vmap over the pallas_calls)."""
    xs = np.array([[0.0, 0.0], [0.1, 0.0], [0.0, 3.0]], np.float32)
    qs = np.array([[0.0, 0.0], [np.inf, 1.0]], np.float32)
    out = rbf_kernel_mv(qs, xs, np.ones(3, np.float32), 0.1, impl=NAME, prune=True,
                        prune_tol=0.0, block_k=BLOCK)
    np.testing.assert_allclose(out, [1 + np.exp(-0.5), 0.0], rtol=2e-5)
    log_p = rbf_kde_density(qs, xs, 0.1, log=True, impl=NAME, prune=True, block_k=BLOCK)
    assert np.isfinite(log_p[0]) and log_p[1] == -np.inf
    rng = np.random.default_rng(12)
    x, q = clustered(rng, 400, 2), clustered(rng, 160, 2)
    xb, qb = np.stack([x[:200], x[200:]]), np.stack([q[:80], q[80:]])
    out = rbf_kde_density(qb, xb, 0.05, log=True, impl=NAME, prune=True, block_k=BLOCK)
    np.testing.assert_allclose(out, rbf_kde_density(qb, xb, 0.05, log=True, impl="xla",
                                                    prune=True), rtol=1e-5, atol=1e-5)


def _public(f, impl):
    if f == "kernel_mv":
        def fn(x1, x2, v, ls):
            return jnp.sum(rbf_kernel_mv(x1, x2, v, ls, impl=impl, prune=True,
                                         block_k=BLOCK) ** 2)
    else:
        def fn(x1, x2, v, ls):
            return jnp.sum(rbf_kde_density(x1, x2, ls, v, log=True, impl=impl, prune=True,
                                           block_k=BLOCK))
    return jax.value_and_grad(fn, argnums=(0, 1, 2, 3))


@pytest.mark.parametrize("f", ["kernel_mv", "kde"])
@pytest.mark.slow
def test_pruned_path_is_memory_linear(f, monkeypatch):
    """XLA's compiled memory analysis of value and gradient through the public functions
    (interpret mode): 4x the points, under 6x the temporary memory, with the plans capped at
    2^16 entries per group."""
    value = (lambda k: (k, 4)) if f == "kernel_mv" else (lambda k: (k,))

    def shapes(k):
        return (k, 2), (k, 2), value(k), ()

    monkeypatch.setattr(_pruned, "LIST_ENTRIES", 1 << 16)
    jax.clear_caches()  # the public products' jits keep traces made under the default cap
    small, large = (temp_bytes(_public(f, NAME), *shapes(n)) for n in (1 << 12, 1 << 14))
    assert large < 6 * small


# ----------------------------------------------------------------------------------------------
# lowering for a TPU


def test_every_kernel_lowers_to_mosaic():
    """Value and gradient of both products lowered for a TPU (``interpret=False``): Pallas's
    lowering to Mosaic runs here; Mosaic's own compiler runs only on a TPU."""
    bs = BlockSizes(block_q=256, block_k=256)
    x, y = jnp.zeros((3, 256, 2)), jnp.zeros((5, 256, 2))
    v, w, inv = jnp.zeros((5, 256, 3)), jnp.zeros((5, 256)), jnp.ones((2,))

    def mv(x, y, v, inv):
        return jnp.sum(_pruned.pruned_kernel_mv(x, y, v, inv, 1e-7, bs, False, 2) ** 2)

    def lse(x, y, w, inv):
        return jnp.sum(_pruned.pruned_kernel_logsumexp(x, y, w, inv, 1e-7, bs, False, 2))

    for f, args, calls in ((mv, (x, y, v, inv), 3), (lse, (x, y, w, inv), 4)):
        lowered = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3))).trace(*args).lower(
            lowering_platforms=("tpu",))
        assert lowered.as_text().count("tpu_custom_call") == calls


@pytest.mark.x64
def test_wide_values_go_a_chunk_of_columns_at_a_time(monkeypatch):
    """Values wider than `_blocks.COLUMN_CHUNK` run a chunk of columns at a time, each chunk's
    visits planned from its own columns: every column within its bound against float64, and
    the gradient of the values the same as unchunked."""
    from scalegp.ops.backends.mosaic import _blocks

    rng = np.random.default_rng(12)
    x, q = clustered(rng, 400, 2), clustered(rng, 150, 2)
    v = (rng.standard_normal((400, 19)) * np.geomspace(1, 1e3, 19)).astype(np.float32)
    h = np.float32(0.01)

    def run():
        f = jax.jit(lambda v: rbf_kernel_mv(q, x, v, h, impl=NAME, prune=True, block_q=BLOCK,
                                            block_k=BLOCK))
        weights = jnp.asarray(rng.standard_normal((150, 19)), jnp.float32)
        return np.asarray(f(v), np.float64), np.asarray(jax.grad(
            lambda v: jnp.sum(weights * f(v)))(jnp.asarray(v)))

    rng_state = rng.bit_generator.state
    whole, whole_grad = run()
    monkeypatch.setattr(_blocks, "COLUMN_CHUNK", 8)
    jax.clear_caches()
    rng.bit_generator.state = rng_state
    chunked, chunked_grad = run()
    exact = np.asarray(kernel_mv_f64(q, x, v, h))
    tol = rules.default_tolerance(jnp.float32)
    bound = tol * np.sum(np.abs(v), axis=0) + 2e-5 * np.abs(exact).max(axis=0)
    assert np.all(np.abs(chunked - exact) <= bound)
    assert np.all(np.abs(whole - exact) <= bound)
    assert rel_err(chunked_grad, whole_grad) < 1e-5
