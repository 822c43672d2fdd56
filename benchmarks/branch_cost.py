"""What the xla RBF path's choice between the distance expansion and the coordinate differences
(a ``lax.cond`` on the keys, `scalegp.ops._dispatch.rbf_expansion_ok`) costs where it takes the
expansion: the public calls (``prune="auto"`` and its gate included) against the same
expansion composed without the branch, as the RBF path was before it (the engine's centre,
`scalegp.ops._xla.kernel_mv` and `kernel_logsumexp` called directly), in one process,
alternating call by call, so that the machine's load moves both alike. Cases as in
engine_latency.py (Gaussian points, lengthscale 1, bandwidth 0.3: all take the expansion).

    python benchmarks/branch_cost.py --out benchmarks/results/branch_cost_cpu.json

``ratio``: the median over pairs of (public call / unbranched call), with its quartiles.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness  # noqa: E402


def cases():
    import jax
    import jax.numpy as jnp

    from scalegp.ops import _xla, rbf_kde_density, rbf_kernel_mv
    from scalegp.ops._dispatch import centre_of, masked_rows, prepared_rows, xla_block_sizes

    def unbranched_prepare(x1, x2, scale):
        centre = centre_of(x2)
        (a, far_a), (b, far_b) = prepared_rows(x1, centre, scale), prepared_rows(x2, centre, scale)
        return a, b, far_a, far_b

    def unbranched_mv(x1, x2, v, lengthscale):
        a, b, far_a, far_b = unbranched_prepare(x1, x2, lengthscale)
        return masked_rows(_xla.kernel_mv(a, b, masked_rows(v, far_b),
                                          xla_block_sizes(x2.shape[0])), far_a)

    def unbranched_kde(q, x, bandwidth):
        a, b, far_a, far_b = unbranched_prepare(q, x, bandwidth)
        m, d = x.shape
        w = jnp.where(far_b, 0.0, jnp.full((m,), 1.0 / m, x.dtype))
        lse = _xla.kernel_logsumexp(a, b, w, xla_block_sizes(m))
        return (jnp.where(far_a, -jnp.inf, lse) - 0.5 * d * math.log(2 * math.pi)
                - d * jnp.log(bandwidth))

    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    x1, x2, v = arr(16384, 8), arr(16384, 8), arr(16384, 16)
    x4, v1 = arr(16384, 4), arr(16384, 1)
    q2, k2 = arr(16384, 2), arr(16384, 2)
    keys, values, one = arr(100_000, 4), arr(100_000, 1), arr(1, 4)
    one_l, bandwidth = jnp.float32(1.0), jnp.float32(0.3)

    def squared_sum(mv):
        return jax.jit(jax.grad(lambda a, b, c, l: jnp.sum(mv(a, b, c, l) ** 2),
                                argnums=(0, 1, 2, 3)))

    public_mv, plain_mv = jax.jit(rbf_kernel_mv), jax.jit(unbranched_mv)
    return {
        "mv_fwd_n16384_d8_o16": (public_mv, plain_mv, (x1, x2, v, one_l), 15),
        "mv_fwd_n16384_d4_o1": (public_mv, plain_mv, (x4, x4, v1, one_l), 15),
        "mv_fwd_bwd_n16384_d8_o16": (squared_sum(rbf_kernel_mv), squared_sum(unbranched_mv),
                                     (x1, x2, v, one_l), 15),
        "kde_fwd_n16384_d2": (jax.jit(lambda a, b, h: rbf_kde_density(a, b, h, log=True)),
                              jax.jit(unbranched_kde), (q2, k2, bandwidth), 15),
        "mv_1_query_100000_keys_d4": (public_mv, plain_mv, (one, keys, values, one_l), 61),
    }


def compare(public, plain, args, pairs: int) -> dict:
    import jax

    for f in (public, plain):
        jax.block_until_ready(f(*args))
    times = {"public": [], "plain": []}
    for i in range(pairs):
        order = ("public", "plain") if i % 2 == 0 else ("plain", "public")
        for name in order:
            f = public if name == "public" else plain
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - start)
    ratios = np.array(times["public"]) / np.array(times["plain"])
    return {"public_ms": 1e3 * float(np.median(times["public"])),
            "unbranched_ms": 1e3 * float(np.median(times["plain"])),
            "ratio": float(np.median(ratios)),
            "ratio_quartiles": [float(np.percentile(ratios, 25)),
                                float(np.percentile(ratios, 75))],
            "pairs": pairs}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    run = harness.Run(__file__)
    rows = {}
    for name, (public, plain, call_args, pairs) in cases().items():
        rows[name] = compare(public, plain, call_args, pairs)
        print(name, rows[name], flush=True)
    run.end()
    report = {"machine": harness.host(),
              "versions": harness.versions(("numpy", "jax", "jaxlib")),
              "scalegp_commit": harness.scalegp_commit(), "command": run.command,
              "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end, "cases": rows}
    if args.out:
        harness.write_json(args.out, report, indent=2)


if __name__ == "__main__":
    main()
