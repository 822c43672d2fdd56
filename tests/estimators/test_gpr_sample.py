"""`ScalableGPRegressor.sample_y`: pathwise draws (Matheron's rule) against `predict`, their
shapes and random_state semantics, and the switch from the exact draw."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import (
    RBF,
    ConstantKernel,
    ExpSineSquared,
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
