"""The pruned ``K v`` Pallas kernels (`scalegp.ops.backends.triton._pruned_mv`), in interpret mode on
CPU: the same tiles as the xla pruned path, against float64 within the stated bound on
clustered, uniform and offset data; gradients."""

import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops._interface import PrunedCore
from scalegp.ops.backends.xla import _pruned_mv as xla_pruned_mv
from scalegp.ops.pruning import _rules as rules
from tests.ops.backends.triton.pruned_problems import (
    BLOCK,
    in_caller_order,
    pallas_mv,
    tiled,
)
from tests.ops.oracle import grads, kernel_mv_f64
from tests.ops.pruning.problems import clustered, datasets, rel_err


@pytest.mark.x64
@pytest.mark.parametrize("lengthscale", [0.003, [0.01, 0.04]])
@pytest.mark.parametrize("data", ["clustered", "uniform", "offset"])
@pytest.mark.slow
def test_kernel_mv_matches_the_xla_path_and_float64(data, lengthscale):
    rng = np.random.default_rng(0)
    x, q = datasets(rng, 300, 2)[data], datasets(rng, 120, 2)[data]
    v = rng.standard_normal((300, 3)).astype(np.float32)
    ls = np.asarray(lengthscale, np.float32)
    tol = rules.default_tolerance(jnp.float32)
    xt, yt, vt, inv, perm = tiled(q, x, v, ls)
    out = pallas_mv(tol)(xt, yt, vt, inv)
    assert out.dtype == jnp.float32
    # the same tiles in the same order, each pair from the same differences
    np.testing.assert_allclose(out, xla_pruned_mv.pruned_kernel_mv(xt, yt, vt, inv, tol),
                               rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(out))))
    # within the bound on what is skipped, plus float32 rounding
    got = in_caller_order(out, perm, 120).astype(np.float64)
    ref = np.asarray(kernel_mv_f64(q, x, v, ls))
    bound = tol * np.sum(np.abs(v), axis=0) + 1e-6 * np.abs(ref).max()
    assert np.all(np.abs(got - ref) <= bound)
    if not np.isscalar(lengthscale):  # wide enough that the values dwarf the bound
        assert rel_err(got, ref) <= 1e-6


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
def test_kernel_mv_gradients_match_the_xla_path_and_autodiff_of_the_oracle():
    rng = np.random.default_rng(6)
    x, q = clustered(rng, 200, 2, spread=0.05), clustered(rng, 70, 2, spread=0.05)
    v = rng.standard_normal((200, 2))
    ls = np.array([0.05, 0.08])
    args = (jnp.asarray(q, jnp.float64), jnp.asarray(x, jnp.float64), jnp.asarray(v),
            jnp.asarray(ls))

    def via(core):
        def f(q, x, v, ls):
            keys = rules.ordered_keys(x, ls, BLOCK)
            return rules.kernel_mv(q, keys, v, ls, 1e-12, PrunedCore(BLOCK, core, core))
        return f

    got = grads(via(pallas_mv(1e-12)), args)
    for g, w in zip(got, grads(kernel_mv_f64, args)):
        assert rel_err(g, np.asarray(w)) < 1e-9
    # float32, default tolerance: the xla path's gradients (the same tiles visited)
    args32 = tuple(a.astype(jnp.float32) for a in args)
    tol = rules.default_tolerance(jnp.float32)
    xla = grads(via(lambda *a: xla_pruned_mv.pruned_kernel_mv(*a[:4], tol)), args32)
    got = grads(via(lambda *a: pallas_mv(tol)(*a[:4])), args32)
    for g, w in zip(got, xla):
        assert rel_err(g, np.asarray(w, np.float64)) < 1e-5
