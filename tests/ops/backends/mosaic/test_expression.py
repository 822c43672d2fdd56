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


@pytest.mark.parametrize("make, by_expansion", [
    # C = 1/2 + 2π²/4 + 1/8 (`shared_distance_slope`): Gaussian keys at d = 8 measure about
    # 8 · 2C = 89 in its units, under the limit of 140
    (lambda: RBF(1.0) + ExpSineSquared(1.0, 2.0) * RBF(2.0), True),
    (lambda: Constant(0.5) * RationalQuadratic(0.8, 1.5) + Matern(1.0, 2.5), True),
    # about 8 · 2C = 135: the expansion at the edge of its limit
    (lambda: RBF(0.35) + 0.5 * RBF(1.5), True),
    # a period short against the spread: the differences
    (lambda: RBF(1.0) + ExpSineSquared(0.5, 0.7) * RBF(2.0), False),
    # a periodic term that does not decay, whose far points would carry the expansion's error
    # in full: the differences
    (lambda: 0.5 * RBF(3.0) + (ExpSineSquared(3.0, 20.0) + Constant(0.2)), False),
    # no shared distance at all (a Matérn and an ARD RBF own theirs): the differences
    (lambda: Matern(1.0, 1.5) + RBF(jnp.linspace(0.8, 1.5, 8)), False),
])
def test_forward_at_d8_takes_the_expansion_where_the_spread_allows(monkeypatch, make,
                                                                   by_expansion):
    """Past d = 4 the forward's shared distance comes from the expansion while the keys'
    spread in units of the kernel's steepest slope allows (`_shared_distance`), on offset
    points, within 1e-5 of float64 either way; with the limit taken away the forward takes the
    differences, whose values then differ from the expansion's."""
    from scalegp.ops.backends.mosaic import _expression

    rng = np.random.default_rng(9)
    x1 = (rng.standard_normal((100, 8)) + 5).astype(np.float32)
    x2 = (rng.standard_normal((300, 8)) + 5).astype(np.float32)
    v = rng.standard_normal((300, 4)).astype(np.float32)
    kernel = make()

    def mosaic():
        return np.asarray(kernel_mv(kernel, x1, x2, v, impl="mosaic", block_q=128,
                                    block_k=128))

    with jax.default_device(jax.devices("cpu")[0]):
        kernel64 = jax.tree_util.tree_map(lambda t: jnp.asarray(t, jnp.float64), kernel)
        ref = kernel_mv(kernel64, *(t.astype(np.float64) for t in (x1, x2, v)), impl="dense")
    centred = jnp.asarray(x2 - x2.mean(axis=0))
    chosen = _expression._shared_distance(kernel, centred, _expression.BlockSizes(
        block_q=128, block_k=128))
    assert bool(chosen) is not by_expansion
    out = mosaic()
    assert rel_err(out, ref) < 1e-5
    monkeypatch.setattr(_expression, "RBF_EXPANSION_MEAN_LIMIT", -1.0)
    jax.clear_caches()  # the limit is read when the product is traced
    by_differences = mosaic()
    assert rel_err(by_differences, ref) < 1e-5
    assert np.array_equal(out, by_differences) is not by_expansion
