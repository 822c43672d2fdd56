"""What a user meets at the chip's limits (issue 61 point 5, issue 62 point 6), each as a user
meets it, through the ``scalegp`` command on PATH (a staged copy on a TPU host:
``benchmarks/tpu/tpu_check.sh``'s ``stage_cli``):

- ``busy``: another process holds the chip (a Python process that has started JAX's TPU client
  and sleeps); then ``scalegp kde`` on a small file, and a bare ``import jax`` program: each
  one's exit status, time and every line it printed.
- ``interrupt``: ``scalegp kde big.csv --bandwidth cv --out logp.npy`` on 10⁶ points of
  `kde_million.overlapping_mixture`, sent SIGINT after each of ``--interrupt-after`` seconds:
  its exit status, the seconds from the signal to its exit, and what it left in its folder.
- ``memory``: the device's ``memory_stats()``, then one array larger than the device: the
  exception's type and text.
- ``gp_memory``: ``ScalableGPRegressor().fit`` on ``--gp-n`` points in 4 dimensions, more than
  its arrays fit in the device's memory at the default ranks: the seconds to its refusal and
  the message.

    PATH=STAGE/bin:$PATH PYTHONPATH=STAGE:. python benchmarks/tpu/chip_limits.py --out OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kde_million import overlapping_mixture, write_csv  # noqa: E402

_HOLDER = ("import jax, time; jax.devices(); print('held', jax.default_backend(), flush=True); "
           "time.sleep(HOLD)")
_BARE = "import jax; print(jax.default_backend())"
_MEMORY = r"""
import json, jax, jax.numpy as jnp
row = {"backend": jax.default_backend()}
try:
    row["memory_stats"] = jax.devices()[0].memory_stats()
except Exception as error:
    row["memory_stats_error"] = repr(error)
try:
    jnp.zeros((BYTES // 4,), jnp.float32).block_until_ready()
    row["allocated"] = True
except Exception as error:
    row["error_type"] = f"{type(error).__module__}.{type(error).__name__}"
    row["error_text"] = str(error)[:1500]
print(json.dumps(row))
"""

_GP_MEMORY = r"""
import json, time
import numpy as np
from scalegp import ScalableGPRegressor
rng = np.random.default_rng(0)
x = rng.standard_normal((N, 4), dtype=np.float32)
y = np.sin(x[:, 0]) + 0.1 * rng.standard_normal(N, dtype=np.float32)
start = time.perf_counter()
row = {}
try:
    ScalableGPRegressor(random_state=0).fit(x, y)
    row["fitted"] = True
except MemoryError as error:
    row["error_type"] = type(error).__name__
    row["error_text"] = str(error)
row["seconds_to_outcome"] = time.perf_counter() - start
print(json.dumps(row))
"""


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _run(cmd: list[str], cwd: Path, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd), "error": f"timeout after {timeout:.0f} s"}
    return {"command": " ".join(cmd), "returncode": proc.returncode,
            "wall_s": time.perf_counter() - start, "stdout": _lines(proc.stdout)[-20:],
            "stderr": _lines(proc.stderr)[-40:], "stderr_lines": len(_lines(proc.stderr))}


def section_busy(workdir: Path, timeout: float) -> list[dict]:
    small = workdir / "small.npy"
    np.save(small, np.random.default_rng(0).standard_normal((2000, 2)))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.replace("HOLD", str(timeout * 3))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = holder.stdout.readline().strip()
        rows = [{"section": "busy", "holder": first}]
        for cmd in (["scalegp", "kde", str(small), "--bandwidth", "scott", "--json"],
                    [sys.executable, "-c", _BARE]):
            rows.append({"section": "busy", "holder": first, **_run(cmd, workdir, timeout)})
            print(json.dumps(rows[-1])[:600], flush=True)
        return rows
    finally:
        holder.kill()
        holder.wait()


def section_interrupt(workdir: Path, delays: list[float], timeout: float) -> list[dict]:
    data = workdir / "big.csv"
    write_csv(data, overlapping_mixture(1_000_000))
    rows = []
    for delay in delays:
        folder = Path(tempfile.mkdtemp(dir=workdir))
        before = set(os.listdir(folder))
        cmd = ["scalegp", "kde", str(data), "--bandwidth", "cv", "--out", "logp.npy"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        signalled = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        ended = time.perf_counter()
        rows.append({"section": "interrupt", "after_s": delay, "returncode": proc.returncode,
                     "signal_to_exit_s": ended - signalled, "wall_s": ended - start,
                     "left_behind": sorted(set(os.listdir(folder)) - before),
                     "stdout": _lines(out)[-5:], "stderr": _lines(err)[-10:]})
        print(json.dumps(rows[-1])[:600], flush=True)
    return rows


def _child_row(head: dict, code: str, workdir: Path, timeout: float) -> list[dict]:
    """``code`` run in a fresh Python, its last JSON line merged into ``head`` with its exit
    status, time and stderr."""
    got = _run([sys.executable, "-c", code], workdir, timeout)
    got.pop("command", None)
    row = {**head, **got}
    lines = [line for line in got.get("stdout", []) if line.startswith("{")]
    if lines:
        row.update(json.loads(lines[-1]))
        row.pop("stdout")
    print(json.dumps(row)[:600], flush=True)
    return [row]


def section_memory(workdir: Path, nbytes: int, timeout: float) -> list[dict]:
    return _child_row({"section": "memory", "requested_bytes": nbytes},
                      _MEMORY.replace("BYTES", str(nbytes)), workdir, timeout)


def section_gp_memory(workdir: Path, n: int, timeout: float) -> list[dict]:
    return _child_row({"section": "gp_memory", "n": n, "dim": 4},
                      _GP_MEMORY.replace("N", str(n)), workdir, timeout)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", nargs="+",
                        default=["busy", "interrupt", "memory", "gp_memory"],
                        choices=["busy", "interrupt", "memory", "gp_memory"])
    parser.add_argument("--interrupt-after", nargs="+", type=float, default=[2.0, 5.0, 9.0])
    parser.add_argument("--memory-gib", type=float, default=24.0,
                        help="the memory section's array, larger than the device")
    parser.add_argument("--gp-n", type=int, default=2_500_000,
                        help="the gp_memory section's points")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per command")
    args = parser.parse_args(argv)
    doc = {"benchmark": "chip_limits", "command": " ".join(sys.argv),
           "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "results": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections:
            if name == "busy":
                rows = section_busy(Path(tmp), args.timeout)
            elif name == "interrupt":
                rows = section_interrupt(Path(tmp), args.interrupt_after, args.timeout)
            elif name == "gp_memory":
                rows = section_gp_memory(Path(tmp), args.gp_n, args.timeout)
            else:
                rows = section_memory(Path(tmp), int(args.memory_gib * 2**30), args.timeout)
            doc["results"] += rows
            args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
