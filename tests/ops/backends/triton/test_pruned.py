"""Pruned Pallas kernels (`scalegp.ops.backends.triton._pruned`: groups of query tiles and their plans,
the public ``impl="pallas", prune=True``), in interpret mode on CPU: groups do not change the
result, far queries, memory, the public functions; the products' numerics are in
tests/ops/backends/triton/test_pruned_mv.py and tests/ops/backends/triton/test_pruned_lse.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import rbf_kde_density, rbf_kernel_mv
from scalegp.ops.backends.triton import _pruned as triton_pruned
from tests.ops.oracle import kde_log_density_f64
from tests.ops.backends.triton.pruned_problems import (
    BLOCK,
    in_caller_order,
    log_norm,
    normalised,
    pallas_lse,
    pallas_mv,
    tiled,
)
from tests.ops.pruning.problems import clustered, rel_err
from tests.ops.test_memory import temp_bytes


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
    assert triton_pruned.group_size(1000, 1 << 20) == 4
    assert triton_pruned.group_size(3, 10) == 3 and triton_pruned.group_size(9, 10, 2) == 2


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
    monkeypatch.setattr(triton_pruned, "LIST_ENTRIES", 1 << 12)
    # The public products are module-level jits, which keep the trace of a shape with the cap
    # it was made under: without this, the large shape reused the default cap's trace (issue
    # 58 point 9: "32-54x the memory for 4x the points").
    jax.clear_caches()
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
