"""Pruned Pallas kernels (`scalegp.ops._pallas_pruning`, `_pallas_pruning_mv`,
`_pallas_pruning_lse`), in interpret mode on CPU: the same tiles as the xla pruned path
(`scalegp.ops._pruning`), against float64 oracles within the stated bounds on clustered, uniform
and offset data; gradients; groups of query tiles; memory; the public ``impl="pallas",
prune=True``. Small tiles (16 rows) and small problems: interpret mode is slow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    _pallas_pruning,
    _pallas_pruning_lse,
    _pallas_pruning_mv,
    _pruning,
    _pruning_bounds,
    _pruning_lse,
    _pruning_order,
    rbf_kde_density,
    rbf_kernel_mv,
)
from scalegp.ops._tiling import BlockSizes
from tests.ops.oracle import grads, kde_log_density_f64, kernel_mv_f64
from tests.ops.pruning_problems import clustered, datasets, rel_err
from tests.ops.test_memory import temp_bytes

BLOCK = 16
BS = BlockSizes(block_q=BLOCK, block_k=BLOCK)
GROUP = 3  # query tiles per pallas_call: several groups, the last one padded


def tiled(q, x, values, scale, block=BLOCK):
    """(query tiles, key tiles, value tiles, 1/scale) in k-d order, as the pruned cores take
    them, and the query permutation."""
    scale = jnp.asarray(scale, x.dtype)
    keys = _pruning.ordered_keys(jnp.asarray(x), scale, block)
    xt, perm, _ = _pruning.ordered_queries(jnp.asarray(q), keys, scale, False)
    vt = _pruning_order.tile_values(jnp.asarray(values, x.dtype), keys.perm, block)
    return xt, keys.tiles, vt, jnp.broadcast_to(1 / scale, (x.shape[1],)), perm


def pallas_mv(tol, group=GROUP, bs=BS):
    """The Pallas core at ``tol`` (a tol passed after inv, as `_pruning.kernel_mv` does, is
    ignored)."""
    return lambda x, y, v, inv, *_: _pallas_pruning_mv.pruned_kernel_mv(
        x, y, v, inv, tol, bs, True, group)


def pallas_lse(tol, group=GROUP, bs=BS):
    return lambda x, y, w, inv, *_: _pallas_pruning_lse.pruned_kernel_logsumexp(
        x, y, w, inv, tol, bs, True, group)


def in_caller_order(out, perm, n):
    return np.asarray(_pruning_order.unordered(out.reshape((-1,) + out.shape[2:]), perm, n))


def normalised(w):
    return (np.asarray(w, np.float64) / np.sum(w)).astype(np.float32)


def log_norm(h, d):
    return -0.5 * d * np.log(2 * np.pi) - np.sum(np.log(np.broadcast_to(h, (d,))))


@pytest.mark.x64
@pytest.mark.parametrize("lengthscale", [0.003, [0.01, 0.04]])
@pytest.mark.parametrize("data", ["clustered", "uniform", "offset"])
@pytest.mark.slow
def test_kernel_mv_matches_the_xla_path_and_float64(data, lengthscale):
    rng = np.random.default_rng(0)
    x, q = datasets(rng, 300, 2)[data], datasets(rng, 120, 2)[data]
    v = rng.standard_normal((300, 3)).astype(np.float32)
    ls = np.asarray(lengthscale, np.float32)
    tol = _pruning.default_tolerance(jnp.float32)
    xt, yt, vt, inv, perm = tiled(q, x, v, ls)
    out = pallas_mv(tol)(xt, yt, vt, inv)
    assert out.dtype == jnp.float32
    # the same tiles in the same order, each pair from the same differences
    np.testing.assert_allclose(out, _pallas_pruning_mv.mv_reference(xt, yt, vt, inv, tol),
                               rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(out))))
    # within the bound on what is skipped, plus float32 rounding
    got = in_caller_order(out, perm, 120).astype(np.float64)
    ref = np.asarray(kernel_mv_f64(q, x, v, ls))
    bound = tol * np.sum(np.abs(v), axis=0) + 1e-6 * np.abs(ref).max()
    assert np.all(np.abs(got - ref) <= bound)
    if not np.isscalar(lengthscale):  # wide enough that the values dwarf the bound
        assert rel_err(got, ref) <= 1e-6


@pytest.mark.x64
@pytest.mark.parametrize("bandwidth", [0.004, [0.01, 0.02]])
@pytest.mark.parametrize("data", ["clustered", "uniform", "offset"])
@pytest.mark.slow
def test_kde_matches_the_xla_path_and_float64(data, bandwidth):
    rng = np.random.default_rng(3)
    x, q = datasets(rng, 300, 2)[data], datasets(rng, 120, 2)[data]
    w = normalised(rng.uniform(0.5, 1.5, 300))
    h = np.asarray(bandwidth, np.float32)
    tol = _pruning.default_tolerance(jnp.float32)
    xt, yt, wt, inv, perm = tiled(q, x, w, h)
    levels = _pallas_pruning_lse._lse_forward(xt, yt, wt, inv, tol, BS, True, GROUP)[2]
    xla_max, xla_log_sum, xla_levels = _pruning_lse.lse_forward(xt, yt, wt, inv, tol)
    np.testing.assert_array_equal(levels, xla_levels)  # the same plan, row for row
    out = pallas_lse(tol)(xt, yt, wt, inv)
    np.testing.assert_allclose(out, xla_max + xla_log_sum, rtol=1e-6, atol=1e-6)
    got = in_caller_order(out, perm, 120) + log_norm(h, 2)
    ref = np.asarray(kde_log_density_f64(q, x, h, w))
    assert rel_err(np.exp(got), np.exp(ref)) <= 1e-6
    assert np.max(np.abs(got - ref)) <= 2e-6 * max(1, np.abs(ref).max())


@pytest.mark.x64
@pytest.mark.parametrize("tol", [0.0, 1e-2])
def test_kernel_mv_error_stays_within_the_bound(tol):
    rng = np.random.default_rng(1)
    x, q = clustered(rng, 400, 2), clustered(rng, 100, 2)
    v = rng.standard_normal((400, 2)).astype(np.float32)
    xt, yt, vt, inv, perm = tiled(q, x, v, np.float32(0.02))
    out = in_caller_order(pallas_mv(tol)(xt, yt, vt, inv), perm, 100).astype(np.float64)
    ref = np.asarray(kernel_mv_f64(q, x, v, np.float32(0.02)))
    bound = tol * np.sum(np.abs(v), axis=0) + 1e-5 * np.abs(ref).max()  # plus rounding
    assert np.all(np.abs(out - ref) <= bound)


@pytest.mark.x64
@pytest.mark.slow
def test_kde_relative_error_stays_within_the_bound():
    """A few queries far from the clusters in tiles with near ones; most pairs skipped."""
    rng = np.random.default_rng(4)
    tol, m = 1e-2, 1200
    x, q = clustered(rng, m, 3, spread=0.03), clustered(rng, 60, 3, spread=0.05)
    q[:3] += 0.3
    w = normalised(np.ones(m))
    xt, yt, wt, inv, perm = tiled(q, x, w, np.float32(0.02))
    setup, _ = _pruning_bounds.lse_setup(yt, wt)
    levels = _pallas_pruning_lse._lse_forward(xt, yt, wt, inv, tol, BS, True, GROUP)[2]
    added = jax.vmap(
        lambda x_t, level: _pruning_bounds.lse_added(x_t, setup, inv, np.log(tol), level))(
        xt, levels)
    assert np.mean(np.any(np.asarray(added), axis=1)) < 0.5  # most tile pairs skipped
    out = in_caller_order(pallas_lse(tol)(xt, yt, wt, inv), perm, 60).astype(np.float64)
    ref = np.asarray(kde_log_density_f64(q, x, np.float32(0.02), w)) - log_norm(0.02, 3)
    rounding = 2e-6 + 4e-7 * np.abs(ref)
    assert np.all(ref - out <= np.log1p(tol) + rounding)
    assert np.all(out - ref <= rounding)


@pytest.mark.x64
@pytest.mark.slow
def test_kernel_mv_gradients_match_the_xla_path_and_autodiff_of_the_oracle():
    rng = np.random.default_rng(6)
    x, q = clustered(rng, 200, 2, spread=0.05), clustered(rng, 70, 2, spread=0.05)
    v = rng.standard_normal((200, 2))
    ls = np.array([0.05, 0.08])
    args = (jnp.asarray(q, jnp.float64), jnp.asarray(x, jnp.float64), jnp.asarray(v),
            jnp.asarray(ls))

    def via(core):
        def f(q, x, v, ls):
            keys = _pruning.ordered_keys(x, ls, BLOCK)
            return _pruning.kernel_mv(q, keys, v, ls, 1e-12, core=core)
        return f

    got = grads(via(pallas_mv(1e-12)), args)
    for g, w in zip(got, grads(kernel_mv_f64, args)):
        assert rel_err(g, np.asarray(w)) < 1e-9
    # float32, default tolerance: the xla path's gradients (the same tiles visited)
    args32 = tuple(a.astype(jnp.float32) for a in args)
    tol = _pruning.default_tolerance(jnp.float32)
    xla = grads(via(lambda *a: _pallas_pruning_mv.mv_reference(*a[:4], tol)), args32)
    got = grads(via(lambda *a: pallas_mv(tol)(*a[:4])), args32)
    for g, w in zip(got, xla):
        assert rel_err(g, np.asarray(w, np.float64)) < 1e-5


@pytest.mark.x64
@pytest.mark.slow
def test_kde_gradients_match_the_xla_path_and_autodiff_of_the_oracle():
    rng = np.random.default_rng(7)
    x, q = clustered(rng, 200, 2, spread=0.05), clustered(rng, 70, 2, spread=0.05)
    w = rng.uniform(0.5, 1.5, 200)
    args = (jnp.asarray(q, jnp.float64), jnp.asarray(x, jnp.float64), jnp.asarray(0.04),
            jnp.asarray(w))

    def via(core):
        def f(q, x, h, w):
            keys = _pruning.ordered_keys(x, h, BLOCK)
            out = _pruning.kernel_logsumexp(q, keys, w / jnp.sum(w), h, 1e-14, core=core)
            return out + log_norm_traced(h, x.shape[1])
        return f

    got = grads(via(pallas_lse(1e-14)), args)
    for g, w_ in zip(got, grads(kde_log_density_f64, args)):
        assert rel_err(g, np.asarray(w_)) < 1e-9
    args32 = tuple(a.astype(jnp.float32) for a in args)
    tol = _pruning.default_tolerance(jnp.float32)
    xla = grads(via(lambda *a: _pallas_pruning_lse.logsumexp_reference(*a[:4], tol)), args32)
    got = grads(via(lambda *a: pallas_lse(tol)(*a[:4])), args32)
    for g, w_ in zip(got, xla):
        assert rel_err(g, np.asarray(w_, np.float64)) < 1e-5


def log_norm_traced(h, d):
    return -0.5 * d * jnp.log(2 * jnp.pi) - jnp.sum(jnp.log(jnp.broadcast_to(h, (d,))))


@pytest.mark.slow
def test_groups_do_not_change_the_result():
    """One group of all query tiles or groups of one: the same numbers (each query tile's
    kernel does the same arithmetic; only the key pass's sums over groups are reassociated)."""
    rng = np.random.default_rng(8)
    x, q = clustered(rng, 200, 2), clustered(rng, 90, 2)
    v = rng.standard_normal((200, 2)).astype(np.float32)
    xt, yt, vt, inv, _ = tiled(q, x, v, np.float32(0.02))
    whole = pallas_mv(1e-7, group=None)(xt, yt, vt, inv)
    np.testing.assert_array_equal(pallas_mv(1e-7, group=1)(xt, yt, vt, inv), whole)
    assert _pallas_pruning.group_size(1000, 1 << 20) == 4
    assert _pallas_pruning.group_size(3, 10) == 3 and _pallas_pruning.group_size(9, 10, 2) == 2


@pytest.mark.x64
@pytest.mark.slow
def test_far_queries_keep_their_digits_and_give_the_limits():
    """A query far from every key in a tile of near ones (the KDE stops only once its own
    remainder is small against its own tiny sum), exact pruning (tol = 0), and a query at
    infinity (0 in a product, -inf as a log-density), through the public functions."""
    rng = np.random.default_rng(5)
    x = clustered(rng, 200, 2, clusters=3, spread=0.005)
    q = np.concatenate([x[:BLOCK - 1], [[5.0, 5.0]]]).astype(np.float32)
    xt, yt, wt, inv, perm = tiled(q, x, normalised(np.ones(200)), np.float32(0.01))
    out = in_caller_order(pallas_lse(0.0)(xt, yt, wt, inv), perm, BLOCK).astype(np.float64)
    ref = np.asarray(kde_log_density_f64(q, x, np.float32(0.01), np.ones(200)))
    ref = ref - log_norm(0.01, 2)
    assert np.isfinite(out[-1]) and ref[-1] < -1e4
    assert abs(out[-1] - ref[-1]) <= 1e-6 * abs(ref[-1])
    xs = np.array([[0.0, 0.0], [0.1, 0.0], [0.0, 3.0]], np.float32)
    qs = np.array([[0.0, 0.0], [np.inf, 1.0]], np.float32)
    out = rbf_kernel_mv(qs, xs, np.ones(3, np.float32), 0.1, impl="pallas", prune=True,
                        prune_tol=0.0, block_k=16)
    np.testing.assert_allclose(out, [1 + np.exp(-0.5), 0.0], rtol=1e-6)
    log_p = rbf_kde_density(qs, xs, 0.1, log=True, impl="pallas", prune=True, block_k=16)
    assert np.isfinite(log_p[0]) and log_p[1] == -np.inf


def _public(f, impl):
    if f == "kernel_mv":
        def fn(x1, x2, v, ls):
            return jnp.sum(rbf_kernel_mv(x1, x2, v, ls, impl=impl, prune=True) ** 2)
    else:
        def fn(x1, x2, v, ls):
            return jnp.sum(rbf_kde_density(x1, x2, ls, v, log=True, impl=impl, prune=True))
    return jax.value_and_grad(fn, argnums=(0, 1, 2, 3))


@pytest.mark.parametrize("f", ["kernel_mv", "kde"])
@pytest.mark.slow
def test_pallas_pruned_path_is_memory_linear(f, monkeypatch):
    """XLA's compiled memory analysis of value and gradient through the public functions: 4x
    the points, under 6x the temporary memory (quadratic growth would be 16x), with the visit
    lists capped at 2^12 entries per group; and under 64 MiB at the default cap (16 MiB a
    list) with 2^14 points."""
    n = 1 << 14
    value = (lambda k: (k, 4)) if f == "kernel_mv" else (lambda k: (k,))

    def shapes(k):
        return (k, 2), (k, 2), value(k), ()

    large_default = temp_bytes(_public(f, "pallas"), *shapes(n))
    monkeypatch.setattr(_pallas_pruning, "LIST_ENTRIES", 1 << 12)
    small, large = temp_bytes(_public(f, "pallas"), *shapes(n // 4)), temp_bytes(
        _public(f, "pallas"), *shapes(n))
    assert large < 6 * small
    assert large_default < 64 * 2**20


@pytest.mark.slow
def test_public_functions_take_the_pruned_kernels():
    rng = np.random.default_rng(10)
    x, q = clustered(rng, 400, 2), clustered(rng, 100, 2)
    v = rng.standard_normal(400).astype(np.float32)
    ref = np.asarray(rbf_kernel_mv(q, x, v, 0.01, impl="xla", prune=True), np.float64)
    out = rbf_kernel_mv(q, x, v, 0.01, impl="pallas", prune=True, block_k=32)
    assert rel_err(out, ref) < 1e-5
    out = rbf_kernel_mv(x, x, v, 0.01, impl="pallas", prune=True, block_q=32, block_k=32)
    assert rel_err(out, np.asarray(rbf_kernel_mv(x, x, v, 0.01, impl="xla", prune=True))) < 1e-5
    dens = rbf_kde_density(q, x, 0.01, log=True, impl="pallas", prune=True, block_k=32)
    np.testing.assert_allclose(dens, rbf_kde_density(q, x, 0.01, log=True, impl="xla",
                                                     prune=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_q must equal block_k"):
        rbf_kernel_mv(q, x, v, 0.01, impl="pallas", prune=True, block_q=16, block_k=32)
    with pytest.raises(ValueError, match="power of two"):
        rbf_kde_density(q, x, 0.01, impl="pallas", prune=True, block_k=24)
    # batch dimensions (vmap over the pallas_calls)
    xb, qb = np.stack([x[:100], x[100:200]]), np.stack([q[:40], q[40:80]])
    out = rbf_kde_density(qb, xb, 0.05, log=True, impl="pallas", prune=True, block_k=16)
    np.testing.assert_allclose(out, rbf_kde_density(qb, xb, 0.05, log=True, impl="xla",
                                                    prune=True), rtol=1e-5, atol=1e-5)
    # "auto" does not prune on the pallas path: the unpruned kernels' numbers
    np.testing.assert_array_equal(rbf_kernel_mv(q, x, v, 0.01, impl="pallas", prune="auto"),
                                  rbf_kernel_mv(q, x, v, 0.01, impl="pallas", prune=False))
