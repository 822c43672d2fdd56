"""Forward+backward time over forward time, with the two measured interleaved.

    python benchmarks/grad_ratio.py                 # kernel_mv, n = m = 16,384, d = 8, o = 16
    python benchmarks/grad_ratio.py --family kde_density --impls xla
    python benchmarks/grad_ratio.py --sizes 4096 --dims 2 8 32 --outs 1 16 --out /tmp/ratio.json

The grid of `kernel_mv.py` times fwd and fwd_bwd in separate child processes, a minute or more
apart; on a shared machine the load moves in between, and the ratio of the two rows moves with it
(benchmarks/README.md, Results, has the measurements). Here both are built in one process from
the runner's own callables (`benchmarks.kmv.ours.JaxBench`, `benchmarks.kmv.peers`, same inputs
and gradients), and each round times one fwd call and then one fwd_bwd call. The ratio is formed
per round before the median is taken, so load that changes more slowly than a round cancels out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `scalegp` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import harness
from benchmarks.kmv import catalog
from benchmarks.kmv.child import build_bench
from benchmarks.kmv.problems import is_kde, make_inputs


def _timed(bench) -> float:
    return harness.timed(lambda: bench.sync(bench.call()))[1]


def measure(impl, family, n, d, o, rounds, threads) -> dict:
    """One row: medians of fwd and fwd_bwd (ms) and the quartiles of the per-round ratio."""
    inputs = make_inputs(family, n, n, d, o)
    fwd, fwd_bwd = (build_bench({"impl": impl, "family": family, "mode": mode}, inputs, "cpu",
                                threads) for mode in ("fwd", "fwd_bwd"))
    try:
        for bench in (fwd, fwd_bwd):
            bench.setup()
            _timed(bench)  # warm-up
        times = np.array([(_timed(fwd), _timed(fwd_bwd)) for _ in range(rounds)]) * 1e3
    finally:
        fwd.close()
        fwd_bwd.close()
    q1, med, q3 = harness.quartiles(times[:, 1] / times[:, 0])
    return {
        "family": family, "impl": impl, "n": n, "m": n, "dim": d,
        "out": 1 if is_kde(family) else o,
        "fwd_ms": float(np.median(times[:, 0])), "fwd_bwd_ms": float(np.median(times[:, 1])),
        "ratio": med, "ratio_q1": q1, "ratio_q3": q3, "rounds": rounds,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="kernel_mv", choices=["kernel_mv", "kde_density"])
    p.add_argument("--impls", nargs="+", default=["xla", "numpy_chunked", "torch_chunked"],
                   help="ours (xla, dense, auto) and CPU peers; one that does not apply to the "
                   "family or cannot be imported is skipped, with a note in config.skipped")
    p.add_argument("--sizes", nargs="+", type=int, default=[16384], help="n = m")
    p.add_argument("--dims", nargs="+", type=int, default=[8])
    p.add_argument("--outs", nargs="+", type=int, default=[16], help="columns of v (kernel_mv)")
    p.add_argument("--rounds", type=int, default=15, help="fwd, fwd_bwd pairs per configuration")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/grad_ratio_cpu.json"))
    args = p.parse_args(argv)

    run = harness.Run(__file__, argv)
    threads = harness.core_count()
    outs = [1] if args.family == "kde_density" else args.outs
    rows, skipped = [], []
    for impl in args.impls:
        if impl not in catalog.IMPLS:
            p.error(f"unknown impl {impl!r}; choose from {', '.join(catalog.IMPLS)}")
        if not all(catalog.applies(impl, args.family, m, "cpu") for m in ("fwd", "fwd_bwd")):
            skipped.append(f"{impl}: has no fwd_bwd {args.family} on the CPU")
            continue
        if missing := catalog.missing_modules(impl):
            skipped.append(f"{impl}: cannot import {', '.join(missing)}")
            continue
        for n in args.sizes:
            for d in args.dims:
                for o in outs:
                    row = measure(impl, args.family, n, d, o, args.rounds, threads)
                    rows.append(row)
                    print(f"{impl:14s} n={n} d={d} o={row['out']}: fwd {row['fwd_ms']:.1f} ms, "
                          f"fwd_bwd {row['fwd_bwd_ms']:.1f} ms, ratio {row['ratio']:.2f} "
                          f"[{row['ratio_q1']:.2f}, {row['ratio_q3']:.2f}]", flush=True)
    run.end()
    report = {
        "device": harness.machine_info("cpu"),
        "config": {
            "runner": "benchmarks/grad_ratio.py",
            "command": run.command,
            "loadavg_start": run.loadavg_start,
            "loadavg_end": run.loadavg_end,
            "skipped": skipped,
            "note": "per round: one fwd call, then one fwd_bwd call (value and gradient of "
                    "sum(out * G) with respect to every input), each waited for; ratio = "
                    "median over rounds of fwd_bwd / fwd, with its quartiles",
        },
        "results": rows,
    }
    harness.write_json(args.out, report)
    for note in skipped:
        print(f"skipped {note}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
