"""scalegp.estimators._gpr_predict: `ScalableGPRegressor.sample_y`, pathwise draws (Matheron's
rule) against `predict`, their shapes and random_state semantics, and the switch from the exact
draw; and `ScalableGPRegressor.predict_fn`, a pure JAX function of X whose values are
`predict`'s and through which jit, grad and vmap work."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.exceptions import NotFittedError
from sklearn.gaussian_process.kernels import (
    RBF,
    ConstantKernel,
    ExpSineSquared,
    Matern,
    RationalQuadratic,
    WhiteKernel,
)

from scalegp import gp
from scalegp.estimators import ScalableGPRegressor

ROOT = Path(__file__).resolve().parents[2]

# 200 points, 40 test points, 4,000 draws in float64 (x64 on in a subprocess: the exact
# solver's host callback needs the process-wide switch), pathwise; prints the largest
# |sample mean - predict| in standard errors and the sample covariance's relative Frobenius
# distance to predict(return_cov=True).
_FLOAT64_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from scalegp.estimators import ScalableGPRegressor
    rng = np.random.RandomState(0)
    x = rng.uniform(-3, 3, (200, 2))
    y = np.sin(x[:, 0]) * np.cos(0.5 * x[:, 1]) + 0.1 * rng.standard_normal(200)
    xt = rng.uniform(-3, 3, (40, 2))
    model = ScalableGPRegressor(normalize_y=True, random_state=0, dtype="float64").fit(x, y)
    mean, cov = model.predict(xt, return_cov=True)
    draws = 4000
    s = model.sample_y(xt, draws, random_state=1, method="pathwise",
                       n_features=int(sys.argv[1]))
    again = model.sample_y(xt, 3, random_state=1, method="pathwise", n_features=int(sys.argv[1]))
    print(json.dumps({
        "dtype": str(s.dtype), "shape": list(s.shape),
        "z": float(np.max(np.abs(s.mean(1) - mean) / np.sqrt(np.diag(cov) / draws))),
        "frobenius": float(np.linalg.norm(np.cov(s) - cov) / np.linalg.norm(cov)),
        "repeatable": bool(np.array_equal(again, model.sample_y(
            xt, 3, random_state=1, method="pathwise", n_features=int(sys.argv[1]))))}))
""")


def _float64_statistics(n_features):
    env = dict(os.environ, JAX_ENABLE_X64="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _FLOAT64_SCRIPT, str(n_features)], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_float64(result):
    assert result["dtype"] == "float64" and result["shape"] == [40, 4000]
    assert result["z"] < 4.5
    assert result["frobenius"] < 0.15
    assert result["repeatable"]


def test_pathwise_draws_match_predict_in_float64():
    # The draws' covariance is exact on average whatever the number of features (fresh
    # frequencies per draw), so few of them keep this test fast; the default is the slow one.
    _check_float64(_float64_statistics(64))


@pytest.mark.slow
def test_pathwise_draws_match_predict_in_float64_default_features():
    _check_float64(_float64_statistics(gp.PRIOR_FEATURES))


def _data(n=120, d=2, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.uniform(-2, 2, (n, d))
    y = np.sin(2 * x[:, 0]) + 0.1 * rng.standard_normal(n)
    return x, y, rng.uniform(-2, 2, (30, d))


def _standardised(model, xt, draws):
    mean, std = model.predict(xt, return_std=True)
    return (draws - mean[:, None]) / std[:, None]


@pytest.mark.parametrize("solver", ["exact", "bbmm"])
def test_standardised_draws_are_standard_normal(solver):
    x, y, xt = _data(300)
    model = ScalableGPRegressor(lengthscale=0.7, noise=0.01, optimizer=None, solver=solver,
                                random_state=0).fit(x, y)
    z = _standardised(model, xt, model.sample_y(xt, 400, random_state=0, method="pathwise",
                                                n_features=64))
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1) < 0.05


def test_a_periodic_kernel_on_one_feature():
    rng = np.random.RandomState(2)
    x = rng.uniform(0, 6, (150, 1))
    y = np.sin(2 * np.pi * x[:, 0]) + 0.05 * x[:, 0] + 0.1 * rng.standard_normal(150)
    kernel = (ConstantKernel(1.0) * RBF(5.0) * ExpSineSquared(1.0, 1.0)
              + ConstantKernel(0.1) * RationalQuadratic(1.0, 1.0) + WhiteKernel(0.01))
    model = ScalableGPRegressor(kernel=kernel, optimizer=None, mean=0.0).fit(x, y)
    xt = np.linspace(-1, 7, 25)[:, None]  # beyond the data too, where the prior shows
    z = _standardised(model, xt, model.sample_y(xt, 1000, random_state=3, method="pathwise",
                                                n_features=64))
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1) < 0.05


def test_the_prior_before_fit():
    _, _, xt = _data()
    kernel = ConstantKernel(2.0) * RBF([0.5, 1.0]) + WhiteKernel(0.1)
    model = ScalableGPRegressor(kernel=kernel, mean=1.5, n_targets=2)
    draws = model.sample_y(xt, 2000, random_state=0, method="pathwise", n_features=64)
    assert draws.shape == (30, 2, 2000)
    np.testing.assert_allclose(draws.mean(axis=2), 1.5, atol=5 * np.sqrt(2.1 / 2000))
    np.testing.assert_allclose(draws.std(axis=2), np.sqrt(2.1), rtol=0.1)
    single = ScalableGPRegressor().sample_y(xt, 3, method="pathwise")
    assert single.shape == (30, 3)


def test_shapes_and_random_state():
    x, y, xt = _data()
    fixed = dict(optimizer=None, random_state=0)
    single = ScalableGPRegressor(**fixed).fit(x, y)
    double = ScalableGPRegressor(**fixed).fit(x, np.stack([y, 2 * y], 1))
    column = ScalableGPRegressor(**fixed).fit(x, y[:, None])
    for model, shape in ((single, (30, 5)), (double, (30, 2, 5)), (column, (30, 5))):
        for method in ("exact", "pathwise"):
            assert model.sample_y(xt, 5, method=method, n_features=32).shape == shape

    def draw(random_state):
        return single.sample_y(xt, 4, random_state=random_state, method="pathwise",
                               n_features=32)

    a = draw(7)
    np.testing.assert_array_equal(a, draw(7))
    assert not np.allclose(a, draw(8))
    # a RandomState instance is advanced: two calls with it give different draws
    state = np.random.RandomState(7)
    first = draw(state)
    np.testing.assert_array_equal(first, a)
    assert not np.allclose(first, draw(state))


def test_auto_is_exact_up_to_the_documented_rows(monkeypatch):
    x, y, xt = _data()
    model = ScalableGPRegressor(optimizer=None, random_state=0).fit(x, y)
    exact = model.sample_y(xt, 3, random_state=0, method="exact")
    np.testing.assert_array_equal(model.sample_y(xt, 3, random_state=0), exact)
    monkeypatch.setattr(gp, "SAMPLE_EXACT_MAX_ROWS", 29)
    np.testing.assert_array_equal(model.sample_y(xt, 3, random_state=0, n_features=32),
                                  model.sample_y(xt, 3, random_state=0, method="pathwise",
                                                 n_features=32))


def test_bad_settings_are_refused():
    x, y, xt = _data()
    model = ScalableGPRegressor(optimizer=None, random_state=0).fit(x, y)
    with pytest.raises(ValueError, match='method must be "auto", "exact" or "pathwise"'):
        model.sample_y(xt, method="svd")
    with pytest.raises(ValueError, match="n_samples must be >= 1"):
        model.sample_y(xt, 0)
    # a period much longer than the data: positive definite enough to fit on two features
    periodic = ScalableGPRegressor(kernel=ExpSineSquared(2.0, 20.0) + WhiteKernel(0.1),
                                   optimizer=None).fit(x, y)
    with pytest.raises(ValueError, match="method='exact'"):
        periodic.sample_y(xt, 2, method="pathwise")
    assert periodic.sample_y(xt, 2).shape == (30, 2)  # auto: the exact draw


@pytest.mark.parametrize("method", ["exact", "pathwise"])
def test_draws_beyond_memory_are_refused_before_any_work(method):
    # numpy's MemoryError part-way once ("Unable to allocate 7.28 PiB for an array with shape
    # (1000000000000, 1024, 2)"), naming neither the request nor the limit
    x, y, xt = _data()
    for model in (ScalableGPRegressor(), ScalableGPRegressor(optimizer=None).fit(x, y)):
        with pytest.raises(MemoryError, match=(
                rf"^1,000,000,000,000 draws at 30 query rows \(1 target\(s\), {method}\) need "
                r"about [\d,]+ bytes, more than the [\d,]+ bytes this process can hold .*: "
                r"draw fewer samples at a time")):
            model.sample_y(xt, n_samples=10**12, method=method)


# ------------------------------------------------------------------------------------------
# predict_fn


def _fn_data(n=50, seed=0, offset=0.0, targets=None):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, size=(n, 2)) + offset
    f = np.sin(2 * (x[:, 0] - offset)) + 0.5 * np.cos(x[:, 1] - offset)
    y = 20.0 * f + 3.0 + 0.1 * rng.normal(size=n)
    if targets:
        y = np.column_stack([y * (j + 1) for j in range(targets)])
    return x, y


def _fn_queries(m=9, offset=0.0, seed=1):
    return np.random.default_rng(seed).uniform(-2, 2, size=(m, 2)) + offset


FN_MODELS = {
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
    pytest.param(name, marks=pytest.mark.slow) if name == "bbmm" else name for name in FN_MODELS])
def test_values_equal_predict(name):
    settings, data = FN_MODELS[name]
    x, y = _fn_data(**data)
    model = ScalableGPRegressor(random_state=0, **settings).fit(x, y)
    xq = _fn_queries(offset=data.get("offset", 0.0))
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
    settings, data = FN_MODELS[name]
    x, y = _fn_data(**data)
    model = ScalableGPRegressor(random_state=0, **settings).fit(x, y)
    xq = _fn_queries(5, offset=data.get("offset", 0.0))
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
    x, y = _fn_data()
    model = ScalableGPRegressor(optimizer=None, lengthscale=[1.0, 1.5], outputscale=400.0,
                                noise=4.0).fit(x, y)
    xq = _fn_queries(6)
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
    x, y = _fn_data(targets=3)
    model = ScalableGPRegressor(kernel=RBF(1.0) + WhiteKernel(0.1), normalize_y=True,
                                optimizer=None).fit(x, y)
    mean, std = model.predict_fn(return_std=True)(_fn_queries(4))
    assert mean.shape == std.shape == (4, 3)
    assert model.predict_fn()(_fn_queries(4)).shape == (4, 3)


def test_refusals():
    with pytest.raises(NotFittedError):
        ScalableGPRegressor().predict_fn()
    x, y = _fn_data()
    model = ScalableGPRegressor(optimizer=None).fit(x, y)
    with pytest.raises(ValueError, match=r"X must have shape \(n_queries, 2\)"):
        model.predict_fn()(jnp.zeros(2))
    with pytest.raises(ValueError, match=r"X must have shape \(n_queries, 2\)"):
        model.predict_fn()(jnp.zeros((3, 3)))


def test_float64_model_computes_inside_an_x64_context():
    """dtype="float64" with x64 off: predict_fn builds its state in float64; the function
    computes inside `jax.enable_x64(True)` (equal to predict) and refuses outside it (it
    would compute in float32)."""
    x, y = _fn_data()
    model = ScalableGPRegressor(optimizer=None, dtype="float64").fit(x, y)
    f = model.predict_fn(return_std=True)
    assert jnp.asarray(1.0).dtype == jnp.float32
    with pytest.raises(RuntimeError, match=r"jax.enable_x64\(True\)"):
        f(_fn_queries())
    with jax.enable_x64(True):
        mean, std = f(_fn_queries())
        grad = jax.grad(lambda z: f(z)[1].sum())(jnp.asarray(_fn_queries()))
    assert mean.dtype == jnp.float64 and grad.dtype == jnp.float64
    want_mean, want_std = model.predict(_fn_queries(), return_std=True)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(std, want_std, rtol=1e-12)
