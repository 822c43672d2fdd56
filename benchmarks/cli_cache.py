"""The command line's start-up and JAX's persistent compilation cache (issue 42, point 6).

    python benchmarks/cli_cache.py                      # this checkout
    python benchmarks/cli_cache.py --tree before=/path/to/older/checkout --tree after=.

For each checkout (``--tree LABEL=PATH``, default this one), in a fresh temporary cache folder
(``SCALEGP_CACHE_DIR``), one after the other in fresh processes:

- ``scalegp --help`` (median of ``--help-runs``) and ``scalegp info``;
- ``scalegp kde examples/data/us_macro_quarterly.csv --columns unemp,infl --bandwidth cv``,
  cold (empty cache), then warm (the cache the cold run wrote);
- the README quick start's GP fit (``scalegp gp fit examples/data/co2_weekly.csv --target co2
  --test-size 0.2``), cold then warm;
- the library: the same KDE by ``ScalableKernelDensity`` after ``scalegp.enable_compilation_cache``
  in a folder of its own, cold then warm (fit and scores, imports apart).

Each row has the wall and CPU seconds (user + system) of the process, the warm/cold ratios and
the number of files in the cache. A checkout without the cache (an older one) has ratios near 1.
The targets (issue 42): ``--help`` under 1 s, warm at most 0.6x cold. On a shared machine the
ratios, measured in the same run, are what to compare; the load averages are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness  # noqa: E402

OUT = harness.ROOT / "benchmarks" / "results" / "cli_cache_cpu.json"
KDE = ["kde", "examples/data/us_macro_quarterly.csv", "--columns", "unemp,infl", "--bandwidth",
       "cv"]
QUICK_START_GP = ["gp", "fit", "examples/data/co2_weekly.csv", "--target", "co2", "--test-size",
                  "0.2", "--force", "--json"]

# Runs the command line of the checkout in argv[1] (its scalegp/ and, as scalegp.cli, its cli/,
# the mapping an editable install makes), whatever scalegp is installed.
_LAUNCHER = """
import importlib.util, sys
tree = sys.argv.pop(1)
sys.path.insert(0, tree)
spec = importlib.util.spec_from_file_location(
    "scalegp.cli", tree + "/cli/__init__.py", submodule_search_locations=[tree + "/cli"])
module = importlib.util.module_from_spec(spec)
sys.modules["scalegp.cli"] = module
spec.loader.exec_module(module)
from scalegp.cli.app import main
sys.argv[0] = "scalegp"
main()
"""


def run_cli(tree: Path, args: list[str], env: dict | None = None, timeout: float = 3600) -> dict:
    """``scalegp ARGS`` from the checkout ``tree`` in a fresh process, in the checkout's folder,
    with ``env`` over this process's environment (None removes a variable): its wall and CPU
    seconds (user + system, from the child's resource usage), exit code, and stdout (parsed
    when it is JSON)."""
    environ = {**os.environ, **(env or {})}
    environ = {name: value for name, value in environ.items() if value is not None}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _LAUNCHER, str(tree), *args], cwd=tree,
                          env=environ, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "returncode": done.returncode}
    try:
        row["output"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        row["output"] = done.stdout[-2000:]
    if done.returncode or done.stderr.strip():
        row["stderr"] = done.stderr[-2000:]
    return row


def parse_trees(values: list[str] | None) -> dict[str, Path]:
    """``["before=/a", "after=."]`` -> ``{"before": Path("/a"), "after": Path(".")}`` (resolved);
    none: this checkout, as "this"."""
    trees = {}
    for value in values or [f"this={harness.ROOT}"]:
        label, sep, path = value.partition("=")
        if not sep or not label:
            raise SystemExit(f"--tree wants LABEL=PATH, got {value!r}")
        tree = Path(path).resolve()
        if not (tree / "scalegp" / "__init__.py").is_file() or not (tree / "cli").is_dir():
            raise SystemExit(f"--tree {value!r}: {tree} has no scalegp/ and cli/")
        trees[label] = tree
    return trees


def tree_info(tree: Path) -> dict:
    return {"path": str(tree), "commit": harness.scalegp_commit(tree, ("scalegp", "cli"))}


def _cold_then_warm(tree: Path, args: list[str], env: dict, cache: Path) -> dict:
    cold = run_cli(tree, args, env)
    entries = len(list(cache.iterdir())) if cache.is_dir() else 0
    warm = run_cli(tree, args, env)
    return {"cold": cold, "warm": warm, "cache_entries_after_cold": entries,
            "warm_over_cold_wall": round(warm["wall_s"] / cold["wall_s"], 3),
            "warm_over_cold_cpu": round(warm["cpu_s"] / cold["cpu_s"], 3)}


def library_kde_fit(tree: str, cache: str) -> dict:
    """In a fresh process: scalegp from ``tree``, ``scalegp.enable_compilation_cache(cache)``
    (the library's opt-in; a checkout without it runs uncached), then the KDE of the command
    above (``ScalableKernelDensity(bandwidth="cv", scale="standardize")``) and its scores: the
    seconds of each."""
    source = harness.import_scalegp(tree)
    import scalegp

    start = time.perf_counter()
    enabled = (scalegp.enable_compilation_cache(cache)
               if hasattr(scalegp, "enable_compilation_cache") else None)
    import numpy as np

    x = np.loadtxt(Path(tree) / KDE[1], delimiter=",", skiprows=1, usecols=(3, 4))
    kde = scalegp.ScalableKernelDensity(bandwidth="cv", scale="standardize")
    imported = time.perf_counter()
    kde.fit(x)
    fitted = time.perf_counter()
    kde.score_samples(x)
    done = time.perf_counter()
    return {"scalegp_commit": source["scalegp_commit"], "cache": str(enabled),
            "import_s": round(imported - start, 3), "fit_s": round(fitted - imported, 3),
            "score_s": round(done - fitted, 3)}


def _library_cold_then_warm(tree: Path, cache: Path) -> dict:
    cold = harness.run_in_child(library_kde_fit, (str(tree), str(cache)), timeout=1800)
    warm = harness.run_in_child(library_kde_fit, (str(tree), str(cache)), timeout=1800)
    out = {"cold": cold, "warm": warm}
    if "error" not in cold and "error" not in warm:
        out["warm_over_cold_fit_and_score"] = round(
            (warm["fit_s"] + warm["score_s"]) / (cold["fit_s"] + cold["score_s"]), 3)
    return out


def measure_tree(tree: Path, help_runs: int, gp: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="scalegp-cache-") as folder:
        cache = Path(folder) / "cache"
        model = Path(folder) / "co2_gp.npz"
        env = {"SCALEGP_CACHE_DIR": str(cache), "JAX_COMPILATION_CACHE_DIR": None}
        helps = [run_cli(tree, ["--help"], env) for _ in range(help_runs)]
        row = {**tree_info(tree),
               "help_wall_s": statistics.median(h["wall_s"] for h in helps),
               "help_cpu_s": statistics.median(h["cpu_s"] for h in helps),
               "help_runs": [{k: h[k] for k in ("wall_s", "cpu_s", "returncode")} for h in helps]}
        info = run_cli(tree, ["info"], env)
        row["info"] = {k: info[k] for k in ("wall_s", "cpu_s", "returncode")}
        harness.log(f"{tree}: --help {row['help_wall_s']} s, info {info['wall_s']} s")
        row["kde"] = _cold_then_warm(tree, KDE, env, cache)
        harness.log(f"{tree}: kde cold {row['kde']['cold']['wall_s']} s, "
                    f"warm {row['kde']['warm']['wall_s']} s")
        row["library_kde"] = _library_cold_then_warm(tree, Path(folder) / "library-cache")
        harness.log(f"{tree}: library kde {row['library_kde'].get('warm_over_cold_fit_and_score')}"
                    " warm/cold")
        if gp:
            row["quick_start_gp"] = _cold_then_warm(
                tree, [*QUICK_START_GP, "--model", str(model)], env, cache)
            harness.log(f"{tree}: gp fit cold {row['quick_start_gp']['cold']['wall_s']} s, "
                        f"warm {row['quick_start_gp']['warm']['wall_s']} s")
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", help="LABEL=PATH of a checkout to measure "
                        "(repeat to compare; default: this checkout)")
    parser.add_argument("--help-runs", type=int, default=5)
    parser.add_argument("--gp-tree", action="append", help="LABEL of a checkout whose quick "
                        "start GP fit to time (repeat; default: every checkout)")
    parser.add_argument("--no-gp", action="store_true", help="Skip the quick start's GP fit.")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    run = harness.Run(__file__, argv)
    trees = parse_trees(args.tree)
    python_alone = [_python_alone() for _ in range(3)]
    rows = {label: measure_tree(tree, args.help_runs,
                                not args.no_gp and (not args.gp_tree or label in args.gp_tree))
            for label, tree in trees.items()}
    seconds = run.end()
    harness.write_json(args.out, {
        "benchmark": "cli_cache", "command": run.command, "device": harness.host(),
        "versions": harness.versions(("jax", "jaxlib", "numpy", "scipy", "sklearn", "typer")),
        "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end,
        "seconds": round(seconds, 1),
        "python_startup_wall_s": statistics.median(python_alone),
        "trees": rows})
    harness.log(f"wrote {args.out}")


def _python_alone() -> float:
    """Wall seconds of ``python -c pass``: the floor under ``scalegp --help`` on this machine."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return round(time.perf_counter() - start, 3)


if __name__ == "__main__":
    main()
