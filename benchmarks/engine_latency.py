"""Engine timings through the public API (impl="auto"): large products, and small calls whose
cost is dominated by the fixed query tile.

    python benchmarks/engine_latency.py --out benchmarks/results/engine_latency_cpu.json

Times whichever `scalegp` is installed (its path and commit go into the results), so two
checkouts can be compared by running this file with each one's interpreter, alternately: the
rounds in one results file are appended with ``--label``. Cases: K v at n = m = 16,384, d = 8,
o = 16 (forward, and forward+backward in x1, x2, v and the lengthscale); the KDE log-density at
n = m = 16,384, d = 2; one query against 100,000 keys; 100 queries against 100 keys.
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


def cases():
    import jax
    import jax.numpy as jnp

    from scalegp.ops import rbf_kde_density, rbf_kernel_mv

    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    x1, x2, v = arr(16384, 8), arr(16384, 8), arr(16384, 16)
    mv = jax.jit(lambda a, b, c, l: rbf_kernel_mv(a, b, c, l))
    grad = jax.jit(jax.grad(lambda a, b, c, l: jnp.sum(rbf_kernel_mv(a, b, c, l) ** 2),
                            argnums=(0, 1, 2, 3)))
    q2, k2 = arr(16384, 2), arr(16384, 2)
    kde = jax.jit(lambda a, b: rbf_kde_density(a, b, 0.3, log=True))
    keys, values, one, small = arr(100_000, 4), arr(100_000, 1), arr(1, 4), arr(100, 4)
    one_l = jnp.float32(1.0)
    return {
        "mv_fwd_n16384_d8_o16": (mv, (x1, x2, v, one_l)),
        "mv_fwd_bwd_n16384_d8_o16": (grad, (x1, x2, v, one_l)),
        "kde_fwd_n16384_d2": (kde, (q2, k2)),
        "mv_1_query_100000_keys_d4": (mv, (one, keys, values, one_l)),
        "mv_100_queries_100_keys_d4": (mv, (small, small, small[:, :1], one_l)),
    }


def time_case(fn, args, repeats):
    import jax

    jax.block_until_ready(fn(*args))
    samples = [harness.timed(lambda: jax.block_until_ready(fn(*args)))[1] for _ in range(repeats)]
    q1, median, q3 = harness.quartiles(samples)
    return {"median_ms": 1e3 * median, "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results file (appended to)")
    parser.add_argument("--label", default="this checkout", help="name of this round's code")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    results = json.loads(args.out.read_text()) if args.out.exists() else {
        "command": harness.command_line(__file__, argv), "device": harness.machine_info("cpu"),
        "rounds": []}
    row = {"label": args.label, "scalegp": str(Path(scalegp.__file__).parents[1]),
           "loadavg": harness.loadavg()}
    row.update({name: time_case(fn, a, args.repeats) for name, (fn, a) in cases().items()})
    results["rounds"].append(row)
    harness.write_json(args.out, results)
    print(json.dumps({k: v["median_ms"] for k, v in row.items() if isinstance(v, dict)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
