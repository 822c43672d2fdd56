"""``dtype="float64"`` with JAX's x64 mode off: the estimators compute in float64 inside their
public methods, with the results of a process with x64 on, and leave the process in float32."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from scalegp import ScalableGPRegressor, ScalableKernelDensity
from scalegp.estimators._precision import precision_scope, x64_scope

ROOT = Path(__file__).resolve().parents[2]

#: Run in this process (x64 off) and in a child with JAX_ENABLE_X64=1; prints JSON.
SCRIPT = r"""
import json, sys
import numpy as np
import jax
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel
from scalegp import ScalableGPRegressor, ScalableKernelDensity

def results():
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(60, 2))
    y = np.sin(3 * x[:, 0]) * np.cos(x[:, 1]) + 0.05 * rng.normal(size=60)
    xq = rng.uniform(-2, 2, size=(7, 2))
    out = {}
    for name, settings in [
            ("default", dict(max_iter=15)),
            ("kernel", dict(kernel=ConstantKernel() * RBF([1.0, 1.0]) + WhiteKernel(0.1),
                            max_iter=15)),
            ("bbmm", dict(solver="bbmm", subset_size=30, max_iter=5, max_iter_full=1))]:
        model = ScalableGPRegressor(dtype="float64", random_state=0, **settings).fit(x, y)
        mean, std = model.predict(xq, return_std=True)
        theta = model.theta_ if name != "kernel" else model.kernel_.theta
        lml, grad = model.log_marginal_likelihood(theta, eval_gradient=True)
        out[name] = dict(mean=mean.tolist(), std=std.tolist(), lml=[lml], grad=grad.tolist(),
                         theta=model.theta_.tolist(),
                         sample=model.sample_y(xq[:3], 2, random_state=1).ravel().tolist())
    kde = ScalableKernelDensity(bandwidth="cv", dtype="float64").fit(x)
    out["kde"] = dict(bandwidth=[float(kde.bandwidth_)], logp=kde.score_samples(xq).tolist())
    out["dtype after"] = str(jax.numpy.asarray(1.0).dtype)
    return out

if __name__ == "__main__":
    print(json.dumps(results()))
"""


def _run_script(tmp_path, x64):
    path = tmp_path / "precision_script.py"
    path.write_text(SCRIPT)
    env = dict(os.environ, JAX_ENABLE_X64="1" if x64 else "0", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow  # compiles the exact, BBMM and KDE paths twice (minutes on 2 busy cores)
def test_float64_without_x64_equals_a_process_with_x64(tmp_path):
    """fit, predict, sample_y and log_marginal_likelihood (exact and BBMM) and the KDE's fit
    and score_samples, float64 with x64 off here and on in a child process: the same to 1e-9
    relative (so far, bit for bit), and this process is in float32 afterwards."""
    namespace = {}
    exec(compile(SCRIPT, "precision_script", "exec"), namespace)  # noqa: S102 - our own text
    assert not jax.config.jax_enable_x64
    here = namespace["results"]()
    assert here.pop("dtype after") == "float32"
    assert jnp.asarray(1.0).dtype == jnp.float32
    there = _run_script(tmp_path, x64=True)
    assert there.pop("dtype after") == "float64"
    for name, values in there.items():
        for key, want in values.items():
            got, want = np.asarray(here[name][key]), np.asarray(want)
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=0, err_msg=f"{name} {key}")


def test_float64_is_float64_and_equals_an_x64_context():
    """With x64 off, a float64 model's predictions equal the closed form in numpy to 1e-10
    (float32 gets about 1e-6), and those of the same fit inside ``jax.enable_x64(True)``."""
    rng = np.random.default_rng(0)
    x, y = rng.uniform(-2, 2, size=(30, 2)), rng.normal(size=30)
    xq = rng.uniform(-2, 2, size=(5, 2))
    kernel = ConstantKernel(2.0) * RBF([0.7, 1.3]) + WhiteKernel(0.05)
    model = ScalableGPRegressor(kernel=kernel, optimizer=None, mean=0.0, alpha=0.0,
                                dtype="float64").fit(x, y)
    mean, std = model.predict(xq, return_std=True)
    assert jnp.asarray(1.0).dtype == jnp.float32 and model.alpha_.dtype == np.float64
    want = kernel.k1(xq, x) @ np.linalg.solve(kernel(x), y)
    np.testing.assert_allclose(mean, want, rtol=1e-10, atol=1e-12)
    with jax.enable_x64(True):
        same = ScalableGPRegressor(kernel=kernel, optimizer=None, mean=0.0, alpha=0.0,
                                   dtype="float64").fit(x, y)
        same_mean, same_std = same.predict(xq, return_std=True)
    np.testing.assert_array_equal(mean, same_mean)
    np.testing.assert_array_equal(std, same_std)


def test_scope_restores_after_an_error_and_nests():
    with pytest.raises(ValueError, match="contains NaN"):
        ScalableGPRegressor(dtype="float64").fit(np.zeros((3, 1)), [1.0, np.nan, 2.0])
    assert not jax.config.jax_enable_x64
    with x64_scope():
        with x64_scope():
            assert jnp.asarray(1.0).dtype == jnp.float64
        assert jax.config.jax_enable_x64
    assert not jax.config.jax_enable_x64 and jnp.asarray(1.0).dtype == jnp.float32


def test_scopes_in_threads_end_with_the_last():
    """Two threads in float64 scopes at once: neither ends the other's x64."""
    inside, release, seen = threading.Event(), threading.Event(), []

    def first():
        with x64_scope():
            inside.set()
            release.wait(10)
            seen.append(jnp.asarray(1.0).dtype)

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(10)
    with x64_scope():
        pass  # ends while the first thread's scope is still open
    release.set()
    thread.join()
    assert seen == [jnp.float64]
    assert not jax.config.jax_enable_x64


def test_a_float64_scope_leaves_other_threads_in_float32():
    """While a float64 estimator's scope is open in one thread, a float32 one in another
    computes and returns float32 (dtype=None on float64 data: float32 with x64 off), and a
    float64 fit in the first thread is float64 throughout, the BBMM's Lanczos quadrature (a
    host callback on XLA's threads) included."""
    inside, release, fitted = threading.Event(), threading.Event(), {}
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(60, 2))
    y = np.sin(3 * x[:, 0]) + 0.05 * rng.normal(size=60)

    def float64_fit():
        with x64_scope():
            inside.set()
            release.wait(60)
        model = ScalableGPRegressor(dtype="float64", solver="bbmm", subset_size=30, max_iter=3,
                                    max_iter_full=1, random_state=0).fit(x, y)
        fitted["dtypes"] = {model.alpha_.dtype, np.asarray(model.predict(x[:3])).dtype}

    thread = threading.Thread(target=float64_fit)
    thread.start()
    try:
        assert inside.wait(60)
        kde = ScalableKernelDensity(bandwidth=0.5).fit(x)
        assert kde.data_.dtype == np.float32 and kde.score_samples(x).dtype == np.float32
        assert jnp.asarray(1.0).dtype == jnp.float32
    finally:
        release.set()
        thread.join()
    assert fitted["dtypes"] == {np.dtype(np.float64)}


@pytest.mark.x64
def test_nothing_changes_with_x64_on_or_for_float32():
    """With x64 on the scope is a no-op; float32 estimators compute in float32 either way."""
    for dtype in (None, "float32", "float64", "nonsense"):
        with precision_scope(dtype):
            assert jax.config.jax_enable_x64
    x = np.random.default_rng(0).normal(size=(30, 2))
    kde = ScalableKernelDensity(bandwidth=0.5, dtype="float32").fit(x)
    assert kde.data_.dtype == np.float32 and kde.score_samples(x).dtype == np.float32
    assert jax.config.jax_enable_x64


def test_kde_dtype_is_checked():
    with pytest.raises(ValueError, match="dtype must be None, float32 or float64"):
        ScalableKernelDensity(dtype="float16").fit(np.zeros((3, 1)))


@pytest.mark.slow
def test_mauna_loa_kernel_fits_in_float64_without_x64():
    """scikit-learn's Mauna Loa kernel (examples/co2_forecast.py) on the bundled weekly CO2
    record, dtype="float64" with x64 off (beyond a float32 Cholesky: outputscale 50² against
    noise 0.01): it fits, reproduces the record to a fraction of a ppm, and the process is in
    float32 afterwards."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from co2_forecast import DATA, mauna_loa_kernel
    finally:
        sys.path.pop(0)
    table = np.loadtxt(DATA, delimiter=",", skiprows=1)
    x, y = table[:, :1], table[:, 1] - table[:, 1].mean()
    model = ScalableGPRegressor(kernel=mauna_loa_kernel(), mean=0.0, dtype="float64")
    model.fit(x, y)
    assert not jax.config.jax_enable_x64 and jnp.asarray(1.0).dtype == jnp.float32
    assert np.isfinite(model.log_marginal_likelihood_value_)
    assert model.alpha_.dtype == np.float64
    residual = model.predict(x) - y
    assert np.sqrt(np.mean(residual**2)) < 0.5, model.kernel_
    # the seasonal term's period was fixed at one year; its amplitude was found (ppm²)
    assert 1.0 < model.kernel_.k1.k1.k2.k1.k1.constant_value < 100.0, model.kernel_


def _defaults_seen(monkeypatch, module, name):
    """Records JAX's default device at each call of ``module.name``."""
    seen, original = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(jax.config.jax_default_device)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("solver, dtype, on_host", [
    ("exact", None, True),       # the exact solver: the host
    ("bbmm", None, False),       # float32 BBMM: the chip's kernels
    ("bbmm", "float64", True),   # "float64": the chip has none
])
def test_on_a_tpu_the_exact_solver_and_float64_run_on_the_host(monkeypatch, solver, dtype,
                                                               on_host):
    """Where JAX's default backend is a TPU (faked here: `_precision.dense_work_on_host`), a fit
    and its predictions run with the host CPU as JAX's default device for the exact solver and
    for float64, and with the chip's for float32 BBMM; on a CPU nothing changes."""
    from scalegp.estimators import _gpr, _precision

    monkeypatch.setattr(_precision, "dense_work_on_host", lambda: True)
    fitting = _defaults_seen(monkeypatch, _gpr, "optimise")
    predicting = _defaults_seen(monkeypatch, _gpr, "fitted_state")
    rng = np.random.default_rng(0)
    X = rng.uniform(0, 1, (80, 2))
    y = np.sin(3 * X[:, 0]) + 0.1 * rng.standard_normal(80)
    model = ScalableGPRegressor(solver=solver, dtype=dtype, max_iter=3).fit(X, y)
    model.predict(X[:5])
    want = jax.devices("cpu")[0] if on_host else None
    assert fitting == [want]
    assert predicting and all(seen == want for seen in predicting)
    assert jax.config.jax_default_device is None  # the caller's setting back


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_on_a_tpu_a_bbmm_fit_s_exact_subset_start_runs_on_the_host(monkeypatch):
    """A BBMM fit starts by exact fits on subsets: on a TPU (faked) their evaluations, and the
    Fisher information of the scoring steps, run with the host CPU as the default device, the
    BBMM evaluations on all data with the chip's."""
    from scalegp import gp
    from scalegp.estimators import _precision

    monkeypatch.setattr(_precision, "dense_work_on_host", lambda: True)
    exact = _defaults_seen(monkeypatch, gp.CholeskySolver, "value_and_grad")
    information = _defaults_seen(monkeypatch, gp, "fisher_information")
    bbmm = _defaults_seen(monkeypatch, gp.BBMMSolver, "value_and_grad")
    rng = np.random.default_rng(2)
    X = rng.uniform(0, 1, (120, 2))
    y = np.sin(3 * X[:, 0]) + 0.1 * rng.standard_normal(120)
    ScalableGPRegressor(solver="bbmm", subset_size=40, max_iter=3, max_iter_full=1,
                        preconditioner_rank=10, random_state=0).fit(X, y)
    host = jax.devices("cpu")[0]
    assert exact and all(device == host for device in exact)
    assert all(device == host for device in information)
    assert bbmm and all(device is None for device in bbmm)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_on_a_tpu_the_classifier_s_exact_solver_runs_on_the_host(monkeypatch):
    from scalegp import ScalableGPClassifier
    from scalegp.estimators import _gpc, _precision

    monkeypatch.setattr(_precision, "dense_work_on_host", lambda: True)
    seen = _defaults_seen(monkeypatch, _gpc, "centred")  # in fit and in every prediction
    rng = np.random.default_rng(1)
    X = rng.uniform(0, 1, (60, 2))
    model = ScalableGPClassifier(solver="exact", max_iter=3).fit(X, X[:, 0] > 0.5)
    model.predict_proba(X[:5])
    assert len(seen) >= 3 and all(device == jax.devices("cpu")[0] for device in seen)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_on_a_tpu_an_exact_model_predicts_with_products_planned_for_the_host(monkeypatch):
    """With JAX's default backend faked as a TPU, the products plan for the chip (the Mosaic
    kernels, compiled: they refuse to run on a CPU) except inside `host_scope`: a fitted exact
    model's predictions, mean, std and samples, run there. On a v5e they failed with "Only
    interpret mode is supported on CPU backend" before the plan followed the default device."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    rng = np.random.default_rng(3)
    X = rng.uniform(0, 1, (70, 2))
    y = np.sin(3 * X[:, 0]) + 0.1 * rng.standard_normal(70)
    model = ScalableGPRegressor(solver="exact", max_iter=3).fit(X, y)
    mean, std = model.predict(X[:5], return_std=True)
    assert np.all(np.isfinite(mean)) and np.all(std > 0)
    assert model.sample_y(X[:5], n_samples=2).shape == (5, 2)


def test_host_scope_changes_nothing_off_a_tpu():
    from scalegp.estimators._precision import host_scope

    with host_scope(True):
        assert jax.config.jax_default_device is None


class _Accelerator:
    """A device as JAX shows a TPU: its platform and its runtime's memory statistics."""

    platform = "tpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_an_accelerators_memory_is_its_runtimes_bytes_limit(monkeypatch):
    from scalegp.estimators._precision import accelerator_memory

    assert accelerator_memory() is None  # JAX's CPU reports none: the process's limit holds
    for stats, want in (({"bytes_limit": 16_909_336_064, "bytes_in_use": 26_624},  # a v5e's
                         ("tpu", 16_909_336_064)),
                        (None, None), (NotImplementedError("memory_stats"), None)):
        monkeypatch.setattr(jax, "devices", lambda *args, stats=stats: [_Accelerator(stats)])
        assert accelerator_memory() == want
