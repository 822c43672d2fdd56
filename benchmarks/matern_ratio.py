"""The ARD Matérn-3/2 kernel product against the RBF's, timed in one process with the two
interleaved, as ratios (issue #17: the Matérn forward within 1.5x the RBF's on the CPU).

    python benchmarks/matern_ratio.py --out benchmarks/results/matern_ratio_cpu.json

Each round times one sample of each (calls back to back for about ``--target-s``, waited for
once) in turn, in an order that alternates from round to round, so that both see the same
load; a round's ratio is Matérn / RBF, and the report is the median over rounds of those ratios
(with quartiles), and the medians of the times. Other work on the machine moves the ratios too
(with fewer cores free the two slow down unequally): compare runs made at similar load
averages, which the results record. Shapes as the kernels section of kernel_mv.py: n = m,
d = 4, o = 1 and 16, the lengthscale ``√d`` per feature (an ARD vector for both), impl "auto"
(xla on the CPU). ``--modes fwd_bwd`` adds the gradient in x1, x2, v and the lengthscale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import scalegp  # the installed one, before this checkout joins the path (for `benchmarks`)

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import harness


def functions(mode):
    """``{"rbf": f, "matern32": f}``, each ``f(x1, x2, v, lengthscale)``, jitted."""
    import jax
    import jax.numpy as jnp

    from scalegp.ops import Matern, kernel_mv, rbf_kernel_mv

    products = {"rbf": lambda a, b, c, l: rbf_kernel_mv(a, b, c, l),
                "matern32": lambda a, b, c, l: kernel_mv(Matern(l, nu=1.5), a, b, c)}
    if mode == "fwd":
        return {k: jax.jit(f) for k, f in products.items()}
    return {k: jax.jit(jax.grad(lambda a, b, c, l, f=f: jnp.sum(f(a, b, c, l) ** 2),
                                argnums=(0, 1, 2, 3))) for k, f in products.items()}


def run_case(n, d, o, mode, rounds, inner):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x1, x2 = (jnp.asarray(rng.normal(size=(n, d)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(n, o)), jnp.float32)
    lengthscale = jnp.full((d,), np.sqrt(d), jnp.float32)
    fns = functions(mode)
    for f in fns.values():  # compile, then one warm call
        for _ in range(2):
            jax.block_until_ready(f(x1, x2, v, lengthscale))
    samples = {k: [] for k in fns}
    for i in range(rounds):
        for name in sorted(fns, reverse=i % 2 == 1):  # ABBA: drift in the load cancels
            f = fns[name]
            def sample():
                out = None
                for _ in range(inner):
                    out = f(x1, x2, v, lengthscale)
                jax.block_until_ready(out)
            samples[name].append(harness.timed(sample)[1] / inner)
    ratios = np.asarray(samples["matern32"]) / np.asarray(samples["rbf"])
    q1, median, q3 = harness.quartiles(ratios)
    row = {"n": n, "d": d, "o": o, "mode": mode, "rounds": rounds, "inner": inner,
           "ratio_median": median, "ratio_q1": q1, "ratio_q3": q3}
    for name, s in samples.items():
        row[f"{name}_median_ms"] = 1e3 * float(np.median(s))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results file (overwritten)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--outs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dims", type=int, nargs="+", default=[4])
    parser.add_argument("--modes", nargs="+", default=["fwd"], choices=["fwd", "fwd_bwd"])
    parser.add_argument("--label", default="this checkout", help="name of the code timed")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--target-s", type=float, default=0.05,
                        help="calls per sample: enough for this many seconds (at least one)")
    args = parser.parse_args(argv)
    results = {"command": harness.command_line(__file__, argv), "label": args.label,
               "device": harness.machine_info("cpu"),
               "scalegp": str(Path(scalegp.__file__).parents[1]),
               "commit": harness.scalegp_commit(Path(scalegp.__file__).parents[1]),
               "loadavg_start": harness.loadavg(), "rows": []}
    for mode in args.modes:
        for n in args.sizes:
            for d in args.dims:
                for o in args.outs:
                    # calls per sample from a rough cost: ~0.3 ns a pair forward, 4x with grads
                    seconds = 3e-10 * n * n * (1 if mode == "fwd" else 4)
                    inner = max(1, int(round(args.target_s / seconds)))
                    row = run_case(n, d, o, mode, args.rounds, inner)
                    results["rows"].append(row)
                    harness.log(json.dumps(row))
    results["loadavg_end"] = harness.loadavg()
    harness.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
