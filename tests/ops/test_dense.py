"""`scalegp.ops.dense_products`: the kernels' wrapping (gradients against XLA's, XLA's dot for
operands the kernels do not take), on the Mosaic kernels interpreted, and which products it
hands out where."""

import jax
import jax.numpy as jnp
import numpy as np

from scalegp.ops import _dense, _plan, dense_products
from scalegp.ops.backends import mosaic
from scalegp.ops.backends.mosaic import _dense as mosaic_dense


def _rel(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


def _interpreted():
    """`dense_products`' wrapping (fallbacks, gradients) of the kernels, interpreted."""
    return _dense._with_fallback(_dense.DenseProducts(
        matmul=lambda a, s: mosaic_dense.matmul(a, s, interpret=True),
        matmul_tn=lambda a, b: mosaic_dense.matmul_tn(a, b, interpret=True)))


def test_gradients_match_xla():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(300, 20)).astype(np.float32)
    b = rng.normal(size=(300, 7)).astype(np.float32)
    s = rng.normal(size=(20, 7)).astype(np.float32)
    weights = rng.normal(size=(300, 7)).astype(np.float32)
    kernels, xla = _interpreted(), _dense.XLA_PRODUCTS

    def loss(products, a, b, s):
        c = products.matmul_tn(a, b)  # (20, 7)
        return jnp.sum(weights * products.matmul(a, s * c))

    got = jax.grad(loss, argnums=(1, 2, 3))(kernels, a, b, s)
    want = jax.grad(loss, argnums=(1, 2, 3))(xla, a, b, s)
    for g, w in zip(got, want):
        assert _rel(g, np.asarray(w, np.float64)) < 1e-5


def test_other_operands_take_xla():
    """Batched operands go to XLA's dot (the kernels take 2-D float32)."""
    kernels = _interpreted()
    rng = np.random.default_rng(2)
    batched = rng.normal(size=(2, 50, 6)).astype(np.float32)
    got = kernels.matmul_tn(batched, batched)
    assert got.shape == (2, 6, 6)
    np.testing.assert_allclose(got, np.swapaxes(batched, 1, 2) @ batched, rtol=1e-5)


def test_dense_products_where(monkeypatch):
    assert dense_products() is _dense.XLA_PRODUCTS  # a CPU: XLA's dot
    assert _plan.dense_backend("tpu") is mosaic.BACKEND
    assert _plan.dense_backend("cpu") is None  # interpreted kernels are never taken
    monkeypatch.setattr(_plan, "_platform", lambda backend: backend or "tpu")
    chosen = dense_products()
    assert chosen is _dense._with_fallback(mosaic.BACKEND.dense)
    assert chosen is not _dense.XLA_PRODUCTS
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("rows",))
    assert dense_products(mesh) is _dense.XLA_PRODUCTS  # over a mesh, XLA partitions its dot
