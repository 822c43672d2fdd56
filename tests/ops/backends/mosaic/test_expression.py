"""The Mosaic expression kernels in interpret mode against float64: forward and the gradient of
every hyperparameter, point and value, for Matérn (scalar and ARD lengthscales), the rational
quadratic, the periodic kernel in a sum of products, constants and ARD RBFs, on offset data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    RBF,
    Constant,
    ExpSineSquared,
    Matern,
    RationalQuadratic,
    kernel_mv,
)
from tests.conftest import rel_err
from tests.ops.oracle import grads

pytestmark = pytest.mark.x64
ARD = np.array([0.5, 1.0, 2.0], np.float32)
KERNELS = {
    "matern32": lambda: Constant(1.3) * Matern(0.7, 1.5),
    "rbf+periodic*rbf": lambda: RBF(1.0) + ExpSineSquared(1.2, 2.0) * RBF(3.0),
    "matern52-ard": lambda: Matern(jnp.asarray(ARD), 2.5),
    "rational-quadratic+constant": lambda: Constant(0.5) * RationalQuadratic(0.8, 1.5)
    + Constant(0.1),
    "rbf-ard+periodic": lambda: RBF(jnp.asarray(ARD)) + ExpSineSquared(1.0, 3.0),
    # a Matérn that owns its distance inside an expression (a lone one takes the RBF's
    # kernels: test_rbf)
    "matern32+rbf": lambda: Matern(0.7, 1.5) + Constant(0.5) * RBF(2.0),
}
IN_CI = ("matern32", "matern32+rbf")


@pytest.mark.parametrize("name, columns", [
    *[(n, 4) if n in IN_CI else pytest.param(n, 4, marks=pytest.mark.slow) for n in KERNELS],
    ("matern32+rbf", 256),  # wide values: split row-major, three passes (`_blocks.wide`)
])
def test_expression_and_every_gradient_against_float64(name, columns):
    rng = np.random.default_rng(len(name))
    x1 = (rng.standard_normal((100, 3)) + 5).astype(np.float32)
    x2 = (rng.standard_normal((300, 3)) + 5).astype(np.float32)
    v = rng.standard_normal((300, columns)).astype(np.float32)
    kernel = KERNELS[name]()

    def mosaic(k, a, b, v):
        return kernel_mv(k, a, b, v, impl="mosaic", block_q=128, block_k=128)

    def dense(k, a, b, v):
        return kernel_mv(k, a, b, v, impl="dense")

    with jax.default_device(jax.devices("cpu")[0]):  # float64 on the host: a TPU has none
        kernel64 = jax.tree_util.tree_map(lambda t: jnp.asarray(t, jnp.float64), kernel)
        args64 = [kernel64] + [t.astype(np.float64) for t in (x1, x2, v)]
        ref = dense(*args64)
        want = jax.tree_util.tree_leaves(grads(dense, args64))
    assert rel_err(mosaic(kernel, x1, x2, v), ref) < 1e-5
    got = jax.tree_util.tree_leaves(grads(mosaic, [kernel] + [jnp.asarray(t)
                                                              for t in (x1, x2, v)]))
    for g, w in zip(got, want):
        assert rel_err(g, w) < 2e-5


def test_row_chunks_change_no_value_or_gradient(monkeypatch):
    """More rows than `_blocks.ROW_CHUNK` run chunk by chunk, in both backward passes: the
    same values and point gradients, bit for bit; the hyperparameters' gradients (sums over
    all rows, outside the kernels, whose order XLA on a TPU changed) to rounding."""
    from scalegp.ops.backends.mosaic import _blocks

    rng = np.random.default_rng(8)
    x1, x2 = (jnp.asarray(rng.standard_normal((n, 3)) + 5, jnp.float32) for n in (300, 270))
    v = jnp.asarray(rng.standard_normal((270, 2)), jnp.float32)
    kernel = Constant(1.3) * Matern(jnp.asarray(ARD), 1.5)

    def run():
        f = jax.jit(lambda k, a, b, v: kernel_mv(k, a, b, v, impl="mosaic", block_q=128,
                                                 block_k=128))
        out = f(kernel, x1, x2, v)
        dkernel, *g = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2, 3)))(
            kernel, x1, x2, v)
        return ([np.asarray(t) for t in (out, *g)],
                [np.asarray(t) for t in jax.tree_util.tree_leaves(dkernel)])

    whole, whole_kernel = run()
    monkeypatch.setattr(_blocks, "ROW_CHUNK", 128)
    jax.clear_caches()
    chunked, chunked_kernel = run()
    for got, want in zip(chunked, whole, strict=True):
        np.testing.assert_array_equal(got, want)
    # sums over all rows: 9e-7 apart on the chip (the ARD lengthscale's, by the chain rule)
    for got, want in zip(chunked_kernel, whole_kernel, strict=True):
        np.testing.assert_allclose(got, want, rtol=3e-6)


def test_column_chunks_change_no_value_and_add_the_gradients(monkeypatch):
    """Values wider than `_blocks.COLUMN_CHUNK` (the forward's `FORWARD_COLUMN_CHUNK`) run a
    chunk of columns at a time, forward and in both backward passes: the same product; the
    gradients of points and hyperparameters the chunks' sums, to rounding."""
    from scalegp.ops.backends.mosaic import _blocks

    rng = np.random.default_rng(10)
    x1, x2 = (jnp.asarray(rng.standard_normal((n, 3)) + 5, jnp.float32) for n in (150, 140))
    v = jnp.asarray(rng.standard_normal((140, 19)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((150, 19)), jnp.float32)
    kernel = KERNELS["matern32+rbf"]()

    def run():
        f = jax.jit(lambda k, a, b, v: kernel_mv(k, a, b, v, impl="mosaic", block_q=128,
                                                 block_k=128))
        out = f(kernel, x1, x2, v)
        grads_ = jax.jit(jax.grad(lambda *a: jnp.sum(weights * f(*a)), (0, 1, 2, 3)))(
            kernel, x1, x2, v)
        return [np.asarray(t) for t in (out, *jax.tree_util.tree_leaves(grads_))]

    whole = run()
    monkeypatch.setattr(_blocks, "COLUMN_CHUNK", 8)
    monkeypatch.setattr(_blocks, "FORWARD_COLUMN_CHUNK", 16)
    jax.clear_caches()
    for got, want in zip(run(), whole, strict=True):
        assert rel_err(got, want) < 1e-6
