"""The xla pruned KDE log-sum-exp (`scalegp.ops.backends.xla._pruned_lse`, through
`scalegp.ops.pruning._rules.kernel_logsumexp`): against float64, within the stated relative bound, far
queries among near ones; gradients."""

import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops.pruning import _rules as rules
from tests.ops.oracle import grads, kde_log_density_f64
from tests.ops.pruning.problems import (
    BLOCK,
    clustered,
    datasets,
    pruned_log_density,
    rel_err,
)


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
    out = pruned_log_density(q, x, h, w, rules.default_tolerance(jnp.float32))
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
