"""The examples run and check themselves (each exits non-zero when its numbers are off)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_sharded_products_agree_with_float64_on_four_cpu_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sharded_products.py"), "--n", "256",
         "--m", "200", "--tol", "2e-5"],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "P('data',)" in proc.stdout, "the queries were not sharded over the mesh"
    assert proc.stdout.count("ring") == 4, proc.stdout


@pytest.mark.slow
def test_bayes_opt_finds_the_branin_minimum_within_30_evaluations(tmp_path):
    """examples/bayes_opt.py: expected improvement maximised by gradient through predict_fn
    reaches f* + 1e-2 on Branin in under 30 evaluations (it exits non-zero otherwise), with
    JAX's x64 mode off in the process (the GP is float64 by its dtype alone)."""
    plot = tmp_path / "bo.png"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64="0")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "bayes_opt.py"), "--plot", str(plot)],
        env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "within 0.01 of f* at evaluation" in proc.stdout, proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.stat().st_size > 0


def test_gp_classification_matches_sklearn_on_iris_and_plots(tmp_path):
    """examples/gp_classification.py (about 20 s): ScalableGPClassifier's held-out accuracy and
    log-loss on iris within 0.1 of GaussianProcessClassifier's (it exits non-zero otherwise),
    its saved model predicting the same probabilities, and the plot where matplotlib is."""
    plot = tmp_path / "gpc.png"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gp_classification.py"), "--plot", str(plot)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "scalegp ScalableGPClassifier" in proc.stdout and "the same probabilities" in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.read_bytes().startswith(b"\x89PNG")
