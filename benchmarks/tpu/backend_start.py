"""Where a fresh process's time goes before and after its first JAX program on this machine:
``import jax``, the backend's start (``jax.devices()``), one tiny program, and the process's
exit, each variant of the environment in its own fresh process. On a TPU host the client's
start and shutdown bound every command line's time (issue 61's 10 s command).

    PYTHONPATH=. python benchmarks/tpu/backend_start.py --out OUT/backend_start.json
    PYTHONPATH=. python benchmarks/tpu/backend_start.py --variants default skip_mds

Variants (``--variants``): ``default`` (the machine's environment), ``skip_mds`` (libtpu told
not to ask the cloud metadata server for the topology, which is given instead: one chip on one
host), ``premapped_256m`` and ``premapped_64m`` (libtpu's pinned host pool for transfers at
that size instead of 4 GiB: its start maps the whole pool), ``cpu`` (JAX_PLATFORMS=cpu, the
floor), ``read_then_start`` and ``start_beside_read`` (the 256 MiB pool; the command line's
reader reads ``--read-csv`` before ``jax.devices()`` or while a thread starts the client:
whether the client's start overlaps the host's work). Each process also sends an array to the
device and back twice (``--transfer-mib``), so that a smaller pool's cost to large transfers
shows. ``--log-dir`` keeps each variant's stderr with
libtpu's own log at its most verbose, for the timestamps of its start.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# the child: each phase's seconds, as one JSON line
_CHILD = r"""
import json, os, threading, time
t0 = time.perf_counter()
import jax, jax.numpy as jnp
t1 = time.perf_counter()
read = os.environ.get("PROBE_READ")  # read the CSV at PROBE_CSV "before" the start or "beside"
if read:
    from cli.io import read_table
    reader = threading.Thread(target=jax.devices) if read == "beside" else None
    if reader:
        reader.start()
    t_read = time.perf_counter()
    read_table(os.environ["PROBE_CSV"])
    read_s = time.perf_counter() - t_read
    if reader:
        reader.join()
devices = jax.devices()
t2 = time.perf_counter()
jax.jit(lambda a: a * 2 + 1)(jnp.ones(8)).block_until_ready()
t3 = time.perf_counter()
row = {"import_s": t1 - t0, "devices_s": t2 - t1, "first_program_s": t3 - t2,
       "platform": devices[0].platform, "device_kind": devices[0].device_kind,
       "devices": len(devices)}
if read:  # devices_s holds the read too
    row["read_seconds"] = read_s
import numpy as np
host = np.ones(TRANSFER_FLOATS, np.float32)
for attempt in ("first", "second"):  # to the device and back
    t4 = time.perf_counter()
    on_device = jax.device_put(host).block_until_ready()
    t5 = time.perf_counter()
    np.asarray(on_device)
    row[f"put_{attempt}_s"], row[f"get_{attempt}_s"] = t5 - t4, time.perf_counter() - t5
    del on_device
row["transfer_mb"] = host.nbytes / 2**20
print(json.dumps(row), flush=True)
"""

# one chip on one host, as libtpu would otherwise learn from the metadata server
_ONE_CHIP = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-1",
             "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost",
             "TPU_HOST_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1"}



def _premapped(mib: int) -> dict:
    """libtpu's pinned host pool for transfers (``TPU_PREMAPPED_BUFFER_SIZE``, 4 GiB unless
    set) at ``mib`` MiB, transfers up to its size through it."""
    size = str(mib << 20)
    return {"TPU_PREMAPPED_BUFFER_SIZE": size,
            "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES": size}


VARIANTS = {"default": {}, "skip_mds": _ONE_CHIP, "premapped_256m": _premapped(256),
            "premapped_64m": _premapped(64), "cpu": {"JAX_PLATFORMS": "cpu"},
            "read_then_start": {**_premapped(256), "PROBE_READ": "before"},
            "start_beside_read": {**_premapped(256), "PROBE_READ": "beside"}}
_VERBOSE = {"TPU_STDERR_LOG_LEVEL": "0", "TPU_MIN_LOG_LEVEL": "0", "TF_CPP_MIN_LOG_LEVEL": "0"}


def run_variant(name: str, log_dir: Path | None, timeout: float,
                transfer_floats: int = 1 << 26) -> dict:
    """One fresh process under variant ``name``: its phases, ``transfer_floats`` float32 to the
    device and back twice, and its wall time to exit."""
    env = {**os.environ, **VARIANTS[name], **(_VERBOSE if log_dir else {})}
    if "PROBE_READ" in env and "PROBE_CSV" not in env:
        return {"variant": name, "error": "needs --read-csv"}
    start = time.perf_counter()
    try:
        child = _CHILD.replace("TRANSFER_FLOATS", str(transfer_floats))
        proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"timeout after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    if log_dir:
        (log_dir / f"backend_start_{name}.log").write_text(proc.stderr)
    row = {"variant": name, "env": VARIANTS[name], "wall_s": wall, "exit_code": proc.returncode}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if lines:
        phases = json.loads(lines[-1])
        row.update(phases)
        # what the process spent outside the phases timed: the interpreter's and the client's
        # shutdown, and the interpreter's own start (the cpu variant shows the floor)
        row["outside_s"] = wall - sum(v for k, v in phases.items() if k.endswith("_s"))
    else:
        row["error"] = proc.stderr[-2000:]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", nargs="+",
                        default=["default", "premapped_256m", "premapped_64m", "cpu"],
                        choices=sorted(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the variants")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep each variant's verbose stderr here (first round only)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--transfer-mib", type=int, default=256,
                        help="the array sent to the device and back, twice")
    parser.add_argument("--read-csv", type=Path, default=None,
                        help="the CSV that read_then_start and start_beside_read read with the "
                             "command line's reader (cli.io.read_table; the repository root on "
                             "PYTHONPATH)")
    args = parser.parse_args(argv)
    if args.read_csv:
        os.environ["PROBE_CSV"] = str(args.read_csv)
    doc = {"benchmark": "backend_start", "command": " ".join(sys.argv),
           "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": {"machine": platform.machine(), "python": platform.python_version(),
                    "cpus": os.cpu_count()}, "results": []}
    try:
        doc["host"]["transparent_hugepages"] = Path(
            "/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for round_ in range(args.repeats):
        for name in args.variants:
            row = {"round": round_, **run_variant(name, args.log_dir if round_ == 0 else None,
                                                   args.timeout, args.transfer_mib << 18)}
            print(json.dumps(row), flush=True)
            doc["results"].append(row)
            args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
