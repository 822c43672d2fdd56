"""The pruned KDE Pallas kernels (`scalegp.ops.backends.triton._pruned_lse`), in interpret mode on CPU:
the same plan as the xla pruned path, row for row, against float64 within the stated relative
bound; gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops._interface import PrunedCore
from scalegp.ops.backends.triton import _pruned_lse as triton_pruned_lse
from scalegp.ops.backends.xla import _pruned_lse as xla_pruned_lse
from scalegp.ops.pruning import _bounds as bounds
from scalegp.ops.pruning import _rules as rules
from tests.ops.backends.triton.pruned_problems import (
    BLOCK,
    BS,
    GROUP,
    in_caller_order,
    log_norm,
    normalised,
    pallas_lse,
    tiled,
)
from tests.ops.oracle import grads, kde_log_density_f64
from tests.ops.pruning.problems import clustered, datasets, rel_err


@pytest.mark.x64
@pytest.mark.parametrize("bandwidth", [0.004, [0.01, 0.02]])
@pytest.mark.parametrize("data", ["clustered", "uniform", "offset"])
@pytest.mark.slow
def test_kde_matches_the_xla_path_and_float64(data, bandwidth):
    rng = np.random.default_rng(3)
    x, q = datasets(rng, 300, 2)[data], datasets(rng, 120, 2)[data]
    w = normalised(rng.uniform(0.5, 1.5, 300))
    h = np.asarray(bandwidth, np.float32)
    tol = rules.default_tolerance(jnp.float32)
    xt, yt, wt, inv, perm = tiled(q, x, w, h)
    levels = triton_pruned_lse._lse_forward(xt, yt, wt, inv, tol, BS, True, GROUP)[2]
    xla_max, xla_log_sum, xla_levels = xla_pruned_lse.lse_forward(xt, yt, wt, inv, tol)
    np.testing.assert_array_equal(levels, xla_levels)  # the same plan, row for row
    out = pallas_lse(tol)(xt, yt, wt, inv)
    np.testing.assert_allclose(out, xla_max + xla_log_sum, rtol=1e-6, atol=1e-6)
    got = in_caller_order(out, perm, 120) + log_norm(h, 2)
    ref = np.asarray(kde_log_density_f64(q, x, h, w))
    assert rel_err(np.exp(got), np.exp(ref)) <= 1e-6
    assert np.max(np.abs(got - ref)) <= 2e-6 * max(1, np.abs(ref).max())


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
    setup, _ = bounds.lse_setup(yt, wt)
    levels = triton_pruned_lse._lse_forward(xt, yt, wt, inv, tol, BS, True, GROUP)[2]
    added = jax.vmap(
        lambda x_t, level: bounds.lse_added(x_t, setup, inv, np.log(tol), level))(
        xt, levels)
    assert np.mean(np.any(np.asarray(added), axis=1)) < 0.5  # most tile pairs skipped
    out = in_caller_order(pallas_lse(tol)(xt, yt, wt, inv), perm, 60).astype(np.float64)
    ref = np.asarray(kde_log_density_f64(q, x, np.float32(0.02), w)) - log_norm(0.02, 3)
    rounding = 2e-6 + 4e-7 * np.abs(ref)
    assert np.all(ref - out <= np.log1p(tol) + rounding)
    assert np.all(out - ref <= rounding)


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
            keys = rules.ordered_keys(x, h, BLOCK)
            out = rules.kernel_logsumexp(q, keys, w / jnp.sum(w), h, 1e-14,
                                         PrunedCore(BLOCK, core, core))
            return out + log_norm_traced(h, x.shape[1])
        return f

    got = grads(via(pallas_lse(1e-14)), args)
    for g, w_ in zip(got, grads(kde_log_density_f64, args)):
        assert rel_err(g, np.asarray(w_)) < 1e-9
    args32 = tuple(a.astype(jnp.float32) for a in args)
    tol = rules.default_tolerance(jnp.float32)
    xla = grads(via(lambda *a: xla_pruned_lse.pruned_kernel_logsumexp(*a[:4], tol)), args32)
    got = grads(via(lambda *a: pallas_lse(tol)(*a[:4])), args32)
    for g, w_ in zip(got, xla):
        assert rel_err(g, np.asarray(w_, np.float64)) < 1e-5


def log_norm_traced(h, d):
    return -0.5 * d * jnp.log(2 * jnp.pi) - jnp.sum(jnp.log(jnp.broadcast_to(h, (d,))))
