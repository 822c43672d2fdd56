"""How far the xla distance expansion ``|a|² + |b|² - 2 a·b`` is from float64, against the keys'
mean scaled squared norm: the measurements behind `scalegp.ops._xla.RBF_EXPANSION_MEAN_LIMIT`
and `MATERN_EXPANSION_MEAN_LIMIT`.

For the RBF and the Matérn-3/2 and -5/2 profiles, d = 1 to 16, uniform points on the unit cube
and standard normal ones, lengthscales 1 to 0.01: the float32 ``K(x, x) v`` of the expansion
alone (`_xla.kernel_mv`, `_xla.matern_mv` on prepared points) and of the public call (which
takes the coordinate differences above the limit), norm-wise relative errors against the float64
dense product, and ``ratio`` = the expansion's error over ``u · mean_j |b_j|²`` (u = 2^-24),
whose largest value where that mean is at least 50 sets the limits (below, the float32 floor of
a few u, about 1e-6 here, dominates the error and the ratio says nothing about the expansion).

    python benchmarks/expansion_accuracy.py --out benchmarks/results/expansion_accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness  # noqa: E402

UNIT_ROUNDOFF = 2.0**-24
PROFILES = ("rbf", "matern32", "matern52")
MEAN_SQ_FLOOR = 50.0


def measure(profile: str, d: int, data: str, lengthscale: float, n: int, seed: int) -> dict:
    import jax.numpy as jnp

    from scalegp.ops import RBF, Matern, _xla, kernel_mv
    from scalegp.ops._dispatch import xla_block_sizes

    rng = np.random.default_rng(seed)
    x = rng.random((n, d)) if data == "uniform" else rng.standard_normal((n, d))
    v = rng.standard_normal((n, 1))
    nu = {"rbf": None, "matern32": 1.5, "matern52": 2.5}[profile]
    kernel = RBF(lengthscale) if nu is None else Matern(lengthscale, nu=nu)
    want = np.asarray(kernel_mv(kernel, x, x, v, impl="dense", prune=False))
    b = (x - x.mean(axis=0)) * (1.0 if nu is None else np.sqrt(2 * nu)) / lengthscale
    b32, v32 = jnp.asarray(b, jnp.float32), jnp.asarray(v, jnp.float32)
    block_sizes = xla_block_sizes(n)
    expansion = (_xla.kernel_mv(b32, b32, v32, block_sizes) if nu is None
                 else _xla.matern_mv(b32, b32, v32, nu, block_sizes))
    x32 = jnp.asarray(x, jnp.float32)
    public = kernel_mv(kernel, x32, x32, v32, impl="xla", prune=False)
    mean_sq = float(np.mean(np.sum(b * b, axis=1)))

    def err(out):
        return float(np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want))

    row = {"profile": profile, "d": d, "data": data, "lengthscale": lengthscale, "n": n,
           "mean_sq": mean_sq, "expansion_error": err(expansion), "public_error": err(public)}
    row["ratio"] = row["expansion_error"] / (UNIT_ROUNDOFF * mean_sq)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1500)
    parser.add_argument("--d", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--lengthscales", type=float, nargs="+",
                        default=[1.0, 0.3, 0.1, 0.03, 0.01])
    parser.add_argument("--profiles", nargs="+", choices=PROFILES, default=list(PROFILES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", True)  # the float64 reference; the rest is float32
    run = harness.Run(__file__)
    rows, seed = [], 0
    for profile in args.profiles:
        for d in args.d:
            for data in ("uniform", "normal"):
                for lengthscale in args.lengthscales:
                    row = measure(profile, d, data, lengthscale, args.n, seed)
                    seed += 1
                    print(row, flush=True)
                    rows.append(row)
    run.end()
    summary = {}
    for profile in args.profiles:
        above = [r for r in rows if r["profile"] == profile and r["mean_sq"] >= MEAN_SQ_FLOOR]
        summary[profile] = {
            "ratio_range_mean_sq_ge_50": [min(r["ratio"] for r in above),
                                          max(r["ratio"] for r in above)] if above else None,
            "largest_public_error": max(r["public_error"] for r in rows
                                        if r["profile"] == profile)}
    print(summary)
    report = {"machine": harness.host(),
              "versions": harness.versions(("numpy", "jax", "jaxlib")),
              "scalegp_commit": harness.scalegp_commit(), "command": run.command,
              "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end,
              "summary": summary, "rows": rows}
    if args.out:
        harness.write_json(args.out, report, indent=2)


if __name__ == "__main__":
    main()
