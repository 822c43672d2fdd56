"""The backend conformance suite: every backend this platform offers (`scalegp.ops._plan.BACKENDS`,
the fused ones interpreted on a CPU) and a toy backend registered here run the same cases, each
where the backend declares the capability it needs: forward products against float64, every
gradient, rows independent of their batch, memory linear in the points, pruning within its
bound, the host-planned KDE, and the products over a mesh.

The toy backend is the dense oracle under another name, added through the one line a new backend
needs (`register`); nothing else in the library names it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    Constant,
    Engine,
    Matern,
    RationalQuadratic,
    data_mesh,
    kernel_mv,
    rbf_kde_density,
    rbf_kernel_mv,
    sharded_kde_density,
    sharded_kernel_mv,
)
from scalegp.ops._plan import BACKENDS, register, unregister
from tests.conftest import engine_impls, needs, rel_err
from tests.ops.oracle import grads, kde_log_density_f64, kernel_mv_f64
from tests.ops.pruning.problems import clustered
from tests.ops.test_memory import temp_bytes

#: The dense oracle under another name: what a new backend declares, in one object.
TOY = dataclasses.replace(BACKENDS["dense"], name="toy")

# the toy in CI; xla in CI; the others (dense, the interpreted fused kernels) under -m slow
NAMES = engine_impls() + ["toy"]
OFFSET = 30.0  # uncentred data: the keys' centre matters


@pytest.fixture(scope="module", autouse=True)
def _the_toy_backend():
    """The toy is in the table while this module's tests run, and only then: registered at
    collection, it would join every other module's `engine_impls`."""
    register(TOY)  # the one line a new backend needs (in the library: an entry of `BACKENDS`)
    yield
    unregister("toy")


def _points(rng, n, d, offset=OFFSET):
    return (rng.standard_normal((n, d)) + offset).astype(np.float32)


@pytest.mark.x64
@pytest.mark.parametrize("impl", NAMES)
def test_rbf_product_and_every_gradient(impl):
    rng = np.random.default_rng(0)
    x1, x2 = _points(rng, 37, 3), _points(rng, 45, 3)
    v = rng.standard_normal((45, 2)).astype(np.float32)
    ls = np.array([0.7, 1.3, 2.1], np.float32)
    out = rbf_kernel_mv(x1, x2, v, ls, impl=impl, prune=False)
    assert out.dtype == jnp.float32
    assert rel_err(out, kernel_mv_f64(x1, x2, v, ls)) < 1e-5
    got = grads(lambda *a: rbf_kernel_mv(*a, impl=impl, prune=False), (x1, x2, v, ls))
    want = grads(kernel_mv_f64, tuple(np.float64(a) for a in (x1, x2, v, ls)))
    for name, g, w in zip(("x1", "x2", "v", "lengthscale"), got, want):
        assert rel_err(g, w) < 5e-5, name


@pytest.mark.x64
@pytest.mark.parametrize("impl", NAMES)
def test_kde_and_every_gradient(impl):
    rng = np.random.default_rng(1)
    q, x = _points(rng, 29, 2), _points(rng, 41, 2)
    w = rng.uniform(0.5, 2.0, 41).astype(np.float32)
    h = np.float32(0.6)
    out = rbf_kde_density(q, x, h, w, log=True, impl=impl, prune=False)
    np.testing.assert_allclose(out, kde_log_density_f64(q, x, h, w), rtol=0, atol=2e-5)
    got = grads(lambda *a: rbf_kde_density(*a, log=True, impl=impl, prune=False), (q, x, h, w))
    want = grads(kde_log_density_f64, tuple(np.float64(a) for a in (q, x, h, w)))
    for name, g, ref in zip(("queries", "data", "bandwidth", "weights"), got, want):
        assert rel_err(g, ref) < 5e-5, name


def _expression():
    return Constant(np.float32(1.5)) * Matern(np.array([0.8, 1.6], np.float32), nu=1.5) \
        + RationalQuadratic(np.float32(1.1), np.float32(0.7))


@pytest.mark.x64
@pytest.mark.parametrize("impl", NAMES)
def test_expression_and_every_gradient(impl):
    """Against the dense oracle in float64 (float64 points and hyperparameters)."""
    needs(impl, "expression")
    rng = np.random.default_rng(2)
    x1, x2 = _points(rng, 23, 2), _points(rng, 31, 2)
    v = rng.standard_normal((31, 1)).astype(np.float32)
    kernel = _expression()
    kernel64 = jax.tree.map(lambda t: jnp.asarray(t, jnp.float64), kernel)
    f64 = (np.float64(x1), np.float64(x2), np.float64(v))
    want = kernel_mv(kernel64, *f64, impl="dense", prune=False)
    assert rel_err(kernel_mv(kernel, x1, x2, v, impl=impl, prune=False), want) < 1e-5
    got = grads(lambda k, *a: kernel_mv(k, *a, impl=impl, prune=False), (kernel, x1, x2, v))
    ref = grads(lambda k, *a: kernel_mv(k, *a, impl="dense", prune=False), (kernel64, *f64))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert rel_err(g, r) < 5e-5


@pytest.mark.parametrize("impl", NAMES)
def test_rows_are_independent_of_their_batch(impl):
    needs(impl, "row_independent")
    rng = np.random.default_rng(3)
    x2, q = _points(rng, 700, 3), _points(rng, 70, 3)
    v = rng.standard_normal(700).astype(np.float32)
    for f in (lambda a: rbf_kernel_mv(a, x2, v, 0.8, impl=impl, prune=False),
              lambda a: rbf_kde_density(a, x2, 0.8, log=True, impl=impl, prune=False)):
        full = np.asarray(f(q))
        for rows in ([0], [69], list(range(7, 40))):
            np.testing.assert_array_equal(np.asarray(f(q[rows])), full[rows])


@pytest.mark.parametrize("impl", NAMES)
def test_memory_is_linear_in_the_points(impl):
    """XLA's compiled memory analysis of value and gradient: 4x the points, under 6x the
    temporary memory (quadratic growth would be 16x)."""
    needs(impl, "memory_linear")

    def value_and_grads(x1, x2, v):
        return jax.value_and_grad(lambda *a: jnp.sum(
            rbf_kernel_mv(*a, 0.5, impl=impl, prune=False) ** 2), argnums=(0, 1, 2))(x1, x2, v)

    small = temp_bytes(value_and_grads, (2048, 2), (2048, 2), (2048, 1))
    large = temp_bytes(value_and_grads, (8192, 2), (8192, 2), (8192, 1))
    assert large < 6 * small


@pytest.mark.x64
@pytest.mark.parametrize("impl", NAMES)
def test_pruning_stays_within_its_bound(impl):
    """``K v`` skips at most ``prune_tol · ‖v‖₁`` per row and column; the KDE's log-density
    errs by at most ``prune_tol`` relative."""
    needs(impl, "pruned")
    rng = np.random.default_rng(4)
    x, q = clustered(rng, 600, 2, spread=0.01), clustered(rng, 90, 2, spread=0.01)
    v = rng.standard_normal(600).astype(np.float32)
    tol, h = 1e-4, np.float32(0.01)
    pruned = rbf_kernel_mv(q, x, v, h, impl=impl, prune=True, prune_tol=tol, block_k=128)
    exact = np.asarray(kernel_mv_f64(q, x, v, h))
    assert np.max(np.abs(np.asarray(pruned, np.float64) - exact)) <= tol * np.sum(np.abs(v)) + 1e-5
    log_p = rbf_kde_density(q, x, h, log=True, impl=impl, prune=True, prune_tol=tol, block_k=128)
    ref = np.asarray(kde_log_density_f64(q, x, h))
    assert np.max(np.abs(np.asarray(log_p, np.float64) - ref)) <= 2 * tol + 1e-5


@pytest.mark.x64
@pytest.mark.parametrize("impl", NAMES)
def test_the_planned_kde_stays_within_its_bound(impl):
    needs(impl, "planned_kde")
    rng = np.random.default_rng(5)
    x, q = clustered(rng, 3000, 2, spread=0.01), clustered(rng, 200, 2, spread=0.01)
    h = np.float32(0.01)
    engine = Engine.create(impl, prune=True, prune_tol=1e-4)
    planned = engine.planned_kde(x, h)
    out = engine.kde_planned_log_density(planned, q, h)
    ref = np.asarray(kde_log_density_f64(q, x, h))
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 2e-4 + 1e-5


@pytest.mark.parametrize("scheme", ["allgather", "ring"])
@pytest.mark.parametrize("impl", NAMES)
def test_mesh_products_equal_one_device(impl, scheme):
    needs(impl, "mesh")
    rng = np.random.default_rng(6)
    x1, x2 = _points(rng, 37, 2), _points(rng, 45, 2)
    v = rng.standard_normal((45, 2)).astype(np.float32)
    mesh = data_mesh()
    one = rbf_kernel_mv(x1, x2, v, 0.9, impl=impl, prune=False)
    many = sharded_kernel_mv(x1, x2, v, 0.9, mesh=mesh, scheme=scheme, impl=impl)
    assert rel_err(many, one) < 2e-6
    one = rbf_kde_density(x1, x2, 0.9, log=True, impl=impl, prune=False)
    many = sharded_kde_density(x1, x2, 0.9, mesh=mesh, scheme=scheme, log=True, impl=impl)
    assert rel_err(many, one) < 2e-6
    grad_one = jax.grad(lambda a: jnp.sum(rbf_kernel_mv(a, x2, v, 0.9, impl=impl,
                                                        prune=False)))(x1)
    grad_many = jax.grad(lambda a: jnp.sum(sharded_kernel_mv(a, x2, v, 0.9, mesh=mesh,
                                                             scheme=scheme, impl=impl)))(x1)
    assert rel_err(grad_many, grad_one) < 2e-6
