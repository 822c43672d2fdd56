"""pallas_memory.py: the GPU program's buffers estimated on the CPU, kernels as opaque calls."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu import pallas_memory
from scalegp.ops import rbf_kernel_mv


def test_dispatch_takes_the_compiled_pallas_path_with_opaque_kernels():
    x = np.zeros((40, 3), np.float32)
    v = np.zeros((40, 2), np.float32)
    with pallas_memory.gpu_program_on_cpu():
        f = jax.jit(jax.grad(lambda x: jnp.sum(rbf_kernel_mv(x, x, v, 1.0, impl="pallas"))))
        text = f.lower(x).compile().as_text()
    assert text.count("python_cpu_callback") >= 2  # the two backward kernels at least
    assert jax.default_backend() == "cpu"  # nothing leaks out of the context


def test_estimates_add_up_and_grow_with_n(tmp_path):
    out = tmp_path / "mem.json"
    argv = ["--sizes", "256", "1024", "--dims", "3", "--outs", "5", "--out", str(out)]
    assert pallas_memory.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["n"]) for r in rows] == [
        ("fwd", 256), ("fwd", 1024), ("fwd_bwd", 256), ("fwd_bwd", 1024)]
    for r in rows:
        assert r["impl"] == "pallas" and r["xla_temp_mb"] > 0
        assert abs(r["total_mb"] - (r["xla_arg_mb"] + r["xla_out_mb"] + r["xla_temp_mb"])) < 0.02
    fwd_bwd = rows[2:]
    # 1024 rows of 4-byte floats: x1, x2 (3 columns), v, G (5 columns) -> 16 numbers a point
    assert fwd_bwd[1]["xla_arg_mb"] == round(1024 * 16 * 4 / 2**20, 2)
    assert fwd_bwd[1]["xla_temp_mb"] > fwd_bwd[0]["xla_temp_mb"]
