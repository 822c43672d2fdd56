"""The README quick start's GP fit on an idle machine and beside one CPU-bound process (issue 42,
point 5: host BLAS threads against XLA's).

    python benchmarks/busy_machine.py                   # this checkout
    python benchmarks/busy_machine.py --tree before=/path/to/older/checkout --tree after=.

For each checkout (``--tree LABEL=PATH``, default this one), ``scalegp gp fit
examples/data/co2_weekly.csv --target co2 --test-size 0.2`` runs twice in fresh processes: alone
("idle"), then while ``python -c 'while True: pass'`` runs ("busy"). The compilation cache is off
(``SCALEGP_CACHE_DIR=off``), so both runs compile the same programs. Each row has the wall and
CPU seconds, the fit's own seconds and results (iterations, log marginal likelihood, held-out
RMSE) and ``busy_over_idle``; the target is at most 2. "Idle" means no process of this runner's
besides the fit: the load averages say what else ran.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness  # noqa: E402
from benchmarks.cli_cache import QUICK_START_GP, parse_trees, run_cli, tree_info  # noqa: E402

OUT = harness.ROOT / "benchmarks" / "results" / "busy_machine_cpu.json"
BUSY = [sys.executable, "-c", "while True: pass"]
_RESULTS = ("fit_seconds", "seconds", "optimizer_iterations", "log_marginal_likelihood",
            "lengthscale", "noise", "test_rmse", "test_nll")


def fit_once(tree: Path, model: Path, busy: bool) -> dict:
    env = {"SCALEGP_CACHE_DIR": "off", "JAX_COMPILATION_CACHE_DIR": None}
    other = subprocess.Popen(BUSY) if busy else None
    try:
        row = {"loadavg_start": harness.loadavg(),
               **run_cli(tree, [*QUICK_START_GP, "--model", str(model)], env)}
        row["loadavg_end"] = harness.loadavg()
    finally:
        if other is not None:
            other.kill()
            other.wait()
    output = row.pop("output")
    if isinstance(output, dict):
        row["fit"] = {key: output.get(key) for key in _RESULTS if key in output}
    else:
        row["stdout"] = output
    return row


def measure_tree(tree: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="scalegp-busy-") as folder:
        model = Path(folder) / "co2_gp.npz"
        idle = fit_once(tree, model, busy=False)
        harness.log(f"{tree}: idle {idle['wall_s']} s wall, {idle['cpu_s']} s CPU")
        busy = fit_once(tree, model, busy=True)
        harness.log(f"{tree}: busy {busy['wall_s']} s wall, {busy['cpu_s']} s CPU")
    return {**tree_info(tree), "idle": idle, "busy": busy,
            "busy_over_idle_wall": round(busy["wall_s"] / idle["wall_s"], 3),
            "busy_over_idle_cpu": round(busy["cpu_s"] / idle["cpu_s"], 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", help="LABEL=PATH of a checkout to measure "
                        "(repeat to compare; default: this checkout)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    run = harness.Run(__file__, argv)
    rows = {label: measure_tree(tree) for label, tree in parse_trees(args.tree).items()}
    seconds = run.end()
    harness.write_json(args.out, {
        "benchmark": "busy_machine", "command": run.command, "device": harness.host(),
        "versions": harness.versions(("jax", "jaxlib", "numpy", "scipy", "sklearn",
                                      "threadpoolctl")),
        "busy_process": " ".join(BUSY[1:]),
        "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end,
        "seconds": round(seconds, 1), "trees": rows})
    harness.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
