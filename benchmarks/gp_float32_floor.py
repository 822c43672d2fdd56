"""How far a float32 kernel product is from float64 at GP scale, against the noise variance.

For BBMM, ``K + σ²I`` must stay positive definite in the arithmetic of its products: the error
of a float32 ``K v`` must stay well below ``σ² |v|``. It grows with the row sums of ``K`` (about
n times the fraction of points within a lengthscale), and it is largest for smooth ``v`` (the
directions CG's iterates and ``α`` are made of), where the sum does not cancel. This runner
measures it on ``gp_scale.py``'s data (d = 4) at the 32k fit's hyperparameters: the engine's
float32 ``K v`` against a float64 numpy product on 300 random rows, for a random and a smooth
``v``.

    python benchmarks/gp_float32_floor.py --n 32768 100000 --out RESULT.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness  # noqa: E402
from benchmarks.gp_scale import make_data  # noqa: E402

OUTPUTSCALE, LENGTHSCALE, NOISE = 1.78**2, np.array([1.07, 2.13, 1.72, 0.956]), 0.0161


def measure(n: int, rows: int = 300) -> dict:
    import jax
    import jax.numpy as jnp

    from scalegp import gp
    from scalegp.ops import Engine

    x, _, _, _ = make_data(n, len(LENGTHSCALE), 10)
    x = x - x.mean(axis=0)
    kernel = gp.GPParams.from_constrained(0.0, OUTPUTSCALE, LENGTHSCALE, NOISE,
                                          dtype=jnp.float32).constrained().kernel
    x32 = jnp.asarray(x, jnp.float32)
    product = jax.jit(lambda v: Engine().kernel_mv(x32, x32, v, kernel))
    picked = np.random.default_rng(2).choice(n, rows, replace=False)
    k = OUTPUTSCALE * np.exp(-0.5 * (((x[picked, None, :] - x[None, :, :]) / LENGTHSCALE) ** 2)
                             .sum(-1))
    out = {"n": n, "row_sum_mean": float(k.sum(axis=1).mean()), "noise": NOISE}
    for name, v in (("random", np.random.default_rng(1).normal(size=(n, 1))),
                    ("smooth", np.sin(x[:, :1]) + 0.5)):
        err = np.asarray(product(jnp.asarray(v, jnp.float32)))[picked] - k @ v
        out[name] = {"rms_error": float(np.sqrt(np.mean(err**2))),
                     "max_error": float(np.abs(err).max()),
                     "rms_v": float(np.sqrt(np.mean(v**2)))}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[32768, 100000])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = harness.Run(__file__)
    rows = []
    for n in args.n:
        row = measure(n)
        print(row, flush=True)
        rows.append(row)
    run.end()
    report = {"machine": harness.host(), "versions": harness.versions(("numpy", "jax", "jaxlib")),
              "command": run.command, "loadavg_start": run.loadavg_start,
              "loadavg_end": run.loadavg_end, "rows": rows}
    if args.out:
        harness.write_json(args.out, report, indent=2)


if __name__ == "__main__":
    main()
