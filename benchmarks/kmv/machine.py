"""The "device" block of a result file: what ran, where, with which library versions."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from pathlib import Path

from benchmarks.kmv.catalog import core_count

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("numpy", "scipy", "sklearn", "torch", "pykeops", "threadpoolctl")


def command_line(script: str, argv=None) -> str:
    """How a result file was made: ``python benchmarks/<script> <arguments>``, for its metadata."""
    import sys

    return " ".join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _run(cmd) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _gpu() -> dict:
    q = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
              "--format=csv,noheader,nounits"])
    if not q:
        return {}
    name, driver, mem = [s.strip() for s in q.splitlines()[0].split(",")]
    return {"gpu": name, "driver": driver, "gpu_memory_gb": round(float(mem) / 1024, 1)}


def machine_info(device: str) -> dict:
    import jax

    devices = jax.devices()
    info = {
        "jax": jax.__version__,
        "jaxlib": importlib.import_module("jaxlib").__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "python": platform.python_version(),
        "device_kind": devices[0].device_kind,
        "cpu": _cpu_model(),
        "cpu_count": core_count(),
        "memory_gb": _memory_gb(),
        "platform": platform.platform(),
    }
    if device == "gpu":
        info.update(_gpu())
    for lib in LIBRARIES:
        try:
            info[lib] = importlib.import_module(lib).__version__
        except Exception:  # missing or broken: the runner notes skipped peers separately
            info[lib] = None
    if info.get("torch"):
        import torch

        info["torch_threads"] = torch.get_num_threads() if device == "cpu" else None
        info["torch_cuda"] = torch.version.cuda
        info["torch_cuda_available"] = bool(torch.cuda.is_available())
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [
            {k: p.get(k) for k in ("internal_api", "num_threads", "version")}
            for p in threadpool_info()
            if p.get("user_api") == "blas"
        ]
    except Exception:
        pass
    commit = _run(["git", "rev-parse", "--short", "HEAD"])
    if commit:
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        info["scalegp_commit"] = commit + ("+dirty" if dirty else "")
    return info


def auto_choices(shapes) -> list[dict]:
    """What impl="auto" picks for each (n, m, d, o) on this backend."""
    from scalegp.ops import auto_config

    rows = []
    for n, m, d, o in shapes:
        impl, bs = auto_config(m, d)
        row = {"n": n, "m": m, "dim": d, "out": o, "impl": impl}
        if bs is not None:
            row.update(block_q=bs.block_q, block_k=bs.block_k, block_o=bs.block_o)
        rows.append(row)
    return rows
