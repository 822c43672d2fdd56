"""`ScalableGPRegressor.predict_fn`: a pure JAX function of X whose values are `predict`'s and
through which jit, grad and vmap work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.exceptions import NotFittedError
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, Matern, WhiteKernel

from scalegp import ScalableGPRegressor


def _data(n=50, seed=0, offset=0.0, targets=None):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, size=(n, 2)) + offset
    f = np.sin(2 * (x[:, 0] - offset)) + 0.5 * np.cos(x[:, 1] - offset)
    y = 20.0 * f + 3.0 + 0.1 * rng.normal(size=n)
    if targets:
        y = np.column_stack([y * (j + 1) for j in range(targets)])
    return x, y


def _queries(m=9, offset=0.0, seed=1):
    return np.random.default_rng(seed).uniform(-2, 2, size=(m, 2)) + offset


MODELS = {
    # the default model; its inputs far from the origin (the centring inside f)
    "default": (dict(optimizer=None, lengthscale=[1.0, 1.5], outputscale=400.0, noise=0.01),
                dict(offset=100.0)),
    # a kernel, normalize_y, its WhiteKernel the noise at new points
    "kernel": (dict(kernel=ConstantKernel(1.0) * RBF([1.0, 1.5]) + WhiteKernel(0.01),
                    normalize_y=True, optimizer=None), {}),
    "matern-two-targets": (dict(kernel=ConstantKernel(1.0) * Matern(1.0, nu=2.5)
                                + WhiteKernel(0.01), normalize_y=True, optimizer=None),
                           dict(targets=2)),
    # the iterative solver: the variance from its LOVE cache, built by predict_fn
    "bbmm": (dict(solver="bbmm", optimizer=None, lengthscale=1.0, outputscale=400.0,
                  noise=0.01), {}),
}


@pytest.mark.x64  # the check: within 1e-6 of predict, in float64
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name == "bbmm" else name for name in MODELS])
def test_values_equal_predict(name):
    settings, data = MODELS[name]
    x, y = _data(**data)
    model = ScalableGPRegressor(random_state=0, **settings).fit(x, y)
    xq = _queries(offset=data.get("offset", 0.0))
    mean, std = model.predict(xq, return_std=True)
    f_mean, f_std = model.predict_fn(return_std=True)(jnp.asarray(xq))
    assert f_mean.shape == mean.shape and f_std.shape == std.shape
    assert f_mean.dtype == jnp.float64
    np.testing.assert_allclose(f_mean, mean, rtol=1e-6, atol=1e-6 * np.abs(mean).max())
    np.testing.assert_allclose(f_std, std, rtol=1e-6, atol=1e-6 * np.abs(mean).max())
    np.testing.assert_allclose(model.predict_fn()(xq), mean, rtol=1e-6,
                               atol=1e-6 * np.abs(mean).max())


@pytest.mark.x64
@pytest.mark.parametrize("name", ["default", "kernel",
                                  pytest.param("bbmm", marks=pytest.mark.slow)])
def test_gradients_match_central_differences(name):
    """jax.grad of the mean and of the std within 1e-4 (relative to the largest component) of
    central differences of `predict` (float64; h = 1e-4, truncation error ~h²)."""
    settings, data = MODELS[name]
    x, y = _data(**data)
    model = ScalableGPRegressor(random_state=0, **settings).fit(x, y)
    xq = _queries(5, offset=data.get("offset", 0.0))
    f = model.predict_fn(return_std=True)
    h = 1e-4
    for which in (0, 1):
        grad = np.asarray(jax.grad(lambda z, w=which: f(z)[w].sum())(jnp.asarray(xq)))
        numeric = np.zeros_like(xq)
        for k in range(xq.shape[1]):
            step = np.zeros_like(xq)
            step[:, k] = h
            up = model.predict(xq + step, return_std=True)[which]
            down = model.predict(xq - step, return_std=True)[which]
            numeric[:, k] = (up - down) / (2 * h)
        np.testing.assert_allclose(grad, numeric, rtol=0,
                                   atol=1e-4 * np.abs(numeric).max(), err_msg=f"output {which}")


def test_jit_and_vmap_in_float32():
    """The default float32 (x64 off): jit and vmap give the eager values, which equal
    predict's to float32 rounding; rows are independent (a row alone, or in a batch). A noise
    well above float32's rounding: with a nearly singular kernel matrix (a large alpha_) a
    prediction moves with the last bit of its query (jit fuses the centring otherwise), and
    the variance ``k(0) - k*ᵀA⁻¹k*`` cancels to the rounding of k(0)."""
    x, y = _data()
    model = ScalableGPRegressor(optimizer=None, lengthscale=[1.0, 1.5], outputscale=400.0,
                                noise=4.0).fit(x, y)
    xq = _queries(6)
    f = model.predict_fn(return_std=True)
    mean, std = f(xq)
    assert mean.dtype == jnp.float32 and isinstance(mean, jax.Array)
    want_mean, want_std = model.predict(xq, return_std=True)
    scale = np.abs(want_mean).max()
    np.testing.assert_allclose(mean, want_mean, atol=1e-5 * scale)
    prior_variance = model.outputscale_ + model.noise_
    np.testing.assert_allclose(np.asarray(std, np.float64)**2, want_std**2,
                               atol=1e-5 * prior_variance)
    jitted = jax.jit(f)(xq)
    np.testing.assert_allclose(jitted[0], mean, atol=1e-6 * scale)
    batched = jax.vmap(f)(jnp.stack([xq[:3], xq[3:]]))
    np.testing.assert_allclose(np.concatenate(batched[0]), mean, atol=1e-6 * scale)
    np.testing.assert_allclose(np.concatenate(batched[1]), std, atol=1e-6 * scale)
    one = f(xq[2:3])
    np.testing.assert_allclose(one[0], mean[2:3], atol=1e-6 * scale)
    grad = jax.jit(jax.grad(lambda z: model.predict_fn()(z).sum()))(jnp.asarray(xq))
    assert grad.shape == xq.shape and np.all(np.isfinite(grad))


def test_shapes_follow_predict_for_several_targets():
    x, y = _data(targets=3)
    model = ScalableGPRegressor(kernel=RBF(1.0) + WhiteKernel(0.1), normalize_y=True,
                                optimizer=None).fit(x, y)
    mean, std = model.predict_fn(return_std=True)(_queries(4))
    assert mean.shape == std.shape == (4, 3)
    assert model.predict_fn()(_queries(4)).shape == (4, 3)


def test_refusals():
    with pytest.raises(NotFittedError):
        ScalableGPRegressor().predict_fn()
    x, y = _data()
    model = ScalableGPRegressor(optimizer=None).fit(x, y)
    with pytest.raises(ValueError, match=r"X must have shape \(n_queries, 2\)"):
        model.predict_fn()(jnp.zeros(2))
    with pytest.raises(ValueError, match=r"X must have shape \(n_queries, 2\)"):
        model.predict_fn()(jnp.zeros((3, 3)))


def test_float64_model_computes_inside_an_x64_context():
    """dtype="float64" with x64 off: predict_fn builds its state in float64; the function
    computes inside `jax.enable_x64(True)` (equal to predict) and refuses outside it (it
    would compute in float32)."""
    x, y = _data()
    model = ScalableGPRegressor(optimizer=None, dtype="float64").fit(x, y)
    f = model.predict_fn(return_std=True)
    assert jnp.asarray(1.0).dtype == jnp.float32
    with pytest.raises(RuntimeError, match=r"jax.enable_x64\(True\)"):
        f(_queries())
    with jax.enable_x64(True):
        mean, std = f(_queries())
        grad = jax.grad(lambda z: f(z)[1].sum())(jnp.asarray(_queries()))
    assert mean.dtype == jnp.float64 and grad.dtype == jnp.float64
    want_mean, want_std = model.predict(_queries(), return_std=True)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(std, want_std, rtol=1e-12)
