"""Compare the engine's implementations on one kernel product: time, XLA temporary memory, error.

    python examples/engine_demo.py                 # n = m = 16,384, d = 8, o = 16: dense, xla, auto
    python examples/engine_demo.py --n 65536 --impls xla auto

The error is the norm-wise relative error against a float64 reference computed with numpy on a
random subset of query rows (all keys), so the demo stays quick at large n. Peak resident memory
is that of this whole process (it includes JAX itself, about 300 MB).
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from scalegp.ops import auto_config, rbf_kernel_mv


def reference_rows(x1, x2, v, lengthscale, rows):
    """float64 ``K(x1[rows], x2) @ v`` by direct differences, chunked to ~64 MB at a time."""
    x1, x2, v = (np.asarray(a, np.float64) for a in (x1, x2, v))
    chunk = max(1, 2**23 // (x2.shape[0] * x2.shape[1]))
    out = []
    for start in range(0, len(rows), chunk):
        diff = (x1[rows[start : start + chunk], None, :] - x2[None, :, :]) / lengthscale
        out.append(np.exp(-0.5 * np.einsum("ijk,ijk->ij", diff, diff)) @ v)
    return np.concatenate(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384, help="points in each set (n = m)")
    parser.add_argument("--d", type=int, default=8, help="dimensions")
    parser.add_argument("--o", type=int, default=16, help="value columns")
    parser.add_argument("--lengthscale", type=float, default=1.0)
    parser.add_argument("--impls", nargs="+", default=["dense", "xla", "auto"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-rows", type=int, default=512, help="query rows checked in float64")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    n, d, o = args.n, args.d, args.o
    x1 = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    x2 = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, o)), jnp.float32)
    rows = np.sort(rng.choice(n, size=min(n, args.check_rows), replace=False))
    expected = reference_rows(x1, x2, v, args.lengthscale, rows)

    auto_impl, auto_tiles = auto_config(n, d)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; n = m = {n}, d = {d}, o = {o}")
    print(f"auto picks: {auto_impl}" + (f" with {auto_tiles}" if auto_tiles else ""))
    print(f"{'impl':>8} {'median ms':>10} {'xla temp MB':>12} {'rel err':>10}")
    for impl in args.impls:
        f = jax.jit(lambda x1, x2, v, impl=impl: rbf_kernel_mv(x1, x2, v, args.lengthscale, impl=impl))
        compiled = f.lower(x1, x2, v).compile()
        temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2**20
        out = compiled(x1, x2, v).block_until_ready()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            compiled(x1, x2, v).block_until_ready()
            times.append(time.perf_counter() - start)
        got = np.asarray(out, np.float64)[rows]
        err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        print(f"{impl:>8} {1e3 * np.median(times):10.1f} {temp_mb:12.1f} {err:10.2e}", flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory of this process: {peak_mb:.0f} MB")


if __name__ == "__main__":
    main()
