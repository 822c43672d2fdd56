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
