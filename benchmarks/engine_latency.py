"""Latency of small batches and of repeated eager calls (issue 42 point 4): one query against
the keys should cost at most a tenth of 1,024 queries, and a second eager call should compile
nothing.

    python benchmarks/engine_latency.py --keys 100000 --d 4 --gp-n 20000 \\
        --baseline-tree /tmp/scalegp-main --out benchmarks/results/engine_latency_cpu.json

Each tree (this checkout, and with ``--baseline-tree`` another checkout, e.g. a ``git archive``
of main, for before and after in one run) is measured in its own fresh child process:

- ``rbf_kernel_mv(q, keys, v, 1.0)`` with ``keys`` (``--keys``, ``--d``) standard normal and v
  one column, for 1 and 1,024 queries: under ``jax.jit`` (median of ``--repeats`` calls after
  the compiling one), and eagerly with ``prune="auto"`` (the default) and ``prune=False`` (the
  first call, then the median of later calls and the XLA compilations they caused, counted from
  JAX's backend-compile events).
- ``ScalableGPRegressor.predict`` (the mean) of a model fitted without optimisation
  (``optimizer=None``, lengthscale 1, noise 0.1) on ``--gp-n`` points of a smooth function of
  ``--d`` features, for 1 and 1,024 rows: the first call, then the median of later ones.

The JSON gets the machine, versions, command and load averages, and per tree the timings and
the ratios ``one / 1024`` (the issue's target: at most 0.1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _timed_calls(fn, repeats):
    """(first call's seconds, median of ``repeats`` later calls, compilations in the later)."""
    import jax

    compiles = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return {"first_s": first, "median_s": statistics.median(times), "min_s": min(times),
            "repeats": repeats, "compiles_after_first": len(compiles)}


def measure(tree, settings):
    """One tree's timings (run in a fresh child: `harness.run_in_child`)."""
    source = harness.import_scalegp(tree)
    import jax
    import numpy as np

    from scalegp.estimators import ScalableGPRegressor
    from scalegp.ops import rbf_kernel_mv

    m, d, repeats = settings["keys"], settings["d"], settings["repeats"]
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((m, d)).astype(np.float32)
    v = rng.standard_normal(m).astype(np.float32)
    queries = rng.standard_normal((1024, d)).astype(np.float32)
    out = {"source": source, "kernel_mv": {}, "gp_predict": {}}
    jitted = jax.jit(lambda q, k, v: rbf_kernel_mv(q, k, v, 1.0))
    for n in (1, 1024):
        q = queries[:n]
        row = {"jit": _timed_calls(lambda: jitted(q, keys, v), repeats)}
        for prune in ("auto", False):
            row[f"eager_prune_{prune}"] = _timed_calls(
                lambda: rbf_kernel_mv(q, keys, v, 1.0, prune=prune), max(2, repeats // 4))
        out["kernel_mv"][str(n)] = row
        harness.log(f"{source['tree']}: kernel_mv n={n}: {row}")
    out["kernel_mv"]["ratio_one_to_1024"] = {
        key: out["kernel_mv"]["1"][key]["median_s"] / out["kernel_mv"]["1024"][key]["median_s"]
        for key in out["kernel_mv"]["1"]}

    n_gp = settings["gp_n"]
    x = rng.uniform(-3, 3, size=(n_gp, d))
    y = np.sin(x).sum(axis=1) + 0.1 * rng.standard_normal(n_gp)
    start = time.perf_counter()
    model = ScalableGPRegressor(lengthscale=1.0, noise=0.1, optimizer=None,
                                random_state=0).fit(x, y)
    out["gp_predict"]["fit_s"] = time.perf_counter() - start
    out["gp_predict"]["solver"] = model.solver_
    test = rng.uniform(-3, 3, size=(1024, d))
    for n in (1, 1024):
        row = _timed_calls(lambda: model.predict(test[:n]), repeats)
        out["gp_predict"][str(n)] = row
        harness.log(f"{source['tree']}: gp predict n={n}: {row}")
    out["gp_predict"]["ratio_one_to_1024"] = (out["gp_predict"]["1"]["median_s"]
                                              / out["gp_predict"]["1024"]["median_s"])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--gp-n", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--baseline-tree", default=None,
                        help="another checkout (a directory holding scalegp/) to time first")
    parser.add_argument("--baseline-label", default=None,
                        help="what the baseline tree is (e.g. its commit, for a git archive)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/engine_latency_cpu.json"))
    args = parser.parse_args(argv)
    run = harness.Run(__file__, argv)
    settings = {"keys": args.keys, "d": args.d, "gp_n": args.gp_n, "repeats": args.repeats}
    trees = {"after": str(ROOT)}
    if args.baseline_tree:
        trees = {"before": args.baseline_tree, **trees}
    results = {}
    for name, tree in trees.items():
        harness.log(f"{name}: {tree}")
        head = {"tree": tree}
        if name == "before" and args.baseline_label:
            head["label"] = args.baseline_label
        results[name] = {**head, **harness.run_in_child(measure, (tree, settings),
                                                        timeout=args.timeout, head=head)}
    elapsed = run.end()
    harness.write_json(args.out, {
        "benchmark": "engine_latency", "command": run.command, "settings": settings,
        "machine": harness.machine_info("cpu"), "loadavg_start": run.loadavg_start,
        "loadavg_end": run.loadavg_end, "elapsed_s": elapsed, "results": results})
    harness.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
