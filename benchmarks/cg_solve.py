"""Benchmark of one mBCG solve (scalegp.linalg) on an RBF kernel, in kernel_mv.py's JSON schema.

    python benchmarks/cg_solve.py                      # n = 16,384, d = 4, 1 + 10 right-hand sides
    python benchmarks/cg_solve.py --n 4096 --out /tmp/cg.json

Solves ``(K + σ²I) X = [y, z₁ … z₁₀]`` with ``scalegp.linalg.cg`` (Lanczos coefficients on, as
for a log-determinant) without and with a rank-k pivoted-Cholesky preconditioner. The kernel
product is the engine's memory-linear ``rbf_kernel_mv(..., impl="xla")``. Per solve it reports iterations, seconds, the seconds
of one kernel product on 11 columns, and the per-iteration overhead beyond the product, measured
two ways:

- ``overhead_direct``: the same ``cg`` call, same iteration count (``tol = 0``,
  ``max_iter = iterations``), with the kernel product replaced by a diagonal scaling; what is
  left is CG's own work plus the preconditioner solve.
- ``overhead_residual``: ``(solve seconds - iterations × product seconds) / iterations``, which
  also absorbs timing noise and CPU contention during the long solve.

Both are also given as fractions of the product time (target: under 10%).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `scalegp` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from scalegp.linalg import LowRankPreconditioner, cg, pivoted_cholesky
from scalegp.ops import rbf_kernel_mv

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cg_solve_cpu.json"
MATVEC_NAME = 'rbf_kernel_mv(impl="xla")'
NOTE = (
    "solve_s is one call of the compiled cg (Lanczos coefficients on); matvec_s is the fastest of "
    "`repeats` calls of the compiled kernel product on all columns; overhead_direct replaces the "
    "kernel product by a diagonal scaling at the same iteration count (median of 3). "
    "overhead_residual = s_per_iteration - matvec_s also carries any CPU contention during the "
    "long solve (see load averages), so overhead_direct is the figure to read."
)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=16_384)
    p.add_argument("--d", type=int, default=4)
    p.add_argument("--probes", type=int, default=10, help="right-hand sides besides y")
    p.add_argument("--lengthscale", type=float, default=1.0)
    p.add_argument("--noise", type=float, default=0.1, help="σ² (outputscale 1)")
    p.add_argument("--tol", type=float, default=1e-4, help="relative residual per column")
    p.add_argument("--rank", type=int, default=100, help="pivoted-Cholesky rank")
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5, help="timings of the kernel product")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def compiled_seconds(fn, *args, repeats: int = 1):
    """Seconds of each of ``repeats`` calls of ``jax.jit(fn)``, compiled ahead of time so that no
    call (not even the first) pays compilation; returns (seconds, last output)."""
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = []
    for _ in range(repeats):
        out, s = harness.timed(lambda: jax.block_until_ready(compiled(*args)))
        seconds.append(s)
    return seconds, out


def timed(fn, *args, repeats: int = 1):
    """Median seconds of ``repeats`` compiled calls (see compiled_seconds) and the last output."""
    seconds, out = compiled_seconds(fn, *args, repeats=repeats)
    return harness.quartiles(seconds)[1], out


def solve_row(args, a_mv, rhs, name, pre, matvec_s, rng) -> dict:
    """One preconditioner's solve: iterations, seconds and CG's overhead per iteration."""
    dtype = rhs.dtype

    def solve(b, pre):
        return cg(a_mv, b, preconditioner=pre, tol=args.tol, max_iter=args.max_iters,
                  return_lanczos=True)

    solve_s, result = timed(solve, rhs, pre)
    iterations = int(np.max(np.asarray(result.iterations)))
    per_iteration = max(iterations, 1)
    # Same loop length with a trivial product: CG's own work per iteration. A diagonal with
    # distinct entries: CG cannot finish early, so tol = 0 runs exactly `iterations` steps.
    diagonal = jnp.asarray(args.noise + rng.random(args.n), dtype)[:, None]

    def direct(b, pre):
        return cg(lambda v: diagonal * v, b, preconditioner=pre, tol=0.0,
                  max_iter=iterations, return_lanczos=True)

    direct_s, direct_result = timed(direct, rhs, pre, repeats=3)
    assert int(np.min(np.asarray(direct_result.iterations))) == iterations
    return {
        "family": "cg_solve",
        "preconditioner": name,
        "n": args.n,
        "dim": args.d,
        "rhs": int(rhs.shape[1]),
        "dtype": args.dtype,
        "tol": args.tol,
        "iterations": iterations,
        "iterations_per_column": np.asarray(result.iterations).tolist(),
        "converged": bool(np.all(np.asarray(result.converged))),
        "max_relative_residual": float(np.max(np.asarray(result.relative_residual))),
        "solve_s": solve_s,
        "matvec_s": matvec_s,
        "s_per_iteration": solve_s / per_iteration,
        "overhead_direct_s_per_iteration": direct_s / per_iteration,
        "overhead_direct_fraction": direct_s / per_iteration / matvec_s,
        "overhead_residual_s_per_iteration": (solve_s - iterations * matvec_s) / per_iteration,
        "overhead_residual_fraction": (solve_s / per_iteration - matvec_s) / matvec_s,
    }


def main(argv=None) -> int:
    args = parse(argv)
    run = harness.Run(__file__, argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((args.n, args.d)), dtype)
    noise = args.noise
    a_mv = lambda v: rbf_kernel_mv(x, x, v, args.lengthscale, impl="xla") + noise * v  # noqa: E731
    rhs = jnp.asarray(rng.standard_normal((args.n, 1 + args.probes)), dtype)

    product_s, _ = compiled_seconds(a_mv, rhs, repeats=args.repeats)
    # The fastest call: the CPU is often shared, and contention only ever adds time.
    matvec_s = min(product_s)
    print(f"kernel product ({MATVEC_NAME}) on {rhs.shape[1]} columns: {matvec_s:.4f} s",
          flush=True)

    def column(i):
        return jnp.exp(-0.5 * jnp.sum(((x - x[i]) / args.lengthscale) ** 2, axis=-1))

    def build():
        chol = pivoted_cholesky(jnp.ones(args.n, dtype), column, max_rank=args.rank)
        return LowRankPreconditioner.from_factor(chol.factor, noise)

    build_s, preconditioner = timed(build)
    results = []
    for name, pre in (("none", None), (f"pivoted_cholesky_rank{args.rank}", preconditioner)):
        row = solve_row(args, a_mv, rhs, name, pre, matvec_s, rng)
        row["matvec_median_s"] = harness.quartiles(product_s)[1]
        row["matvec_repeats_s"] = product_s
        if pre is not None:
            row["preconditioner_build_s"] = build_s
        results.append(row)
        long_fields = ("iterations_per_column", "matvec_repeats_s")
        print(json.dumps({k: v for k, v in row.items() if k not in long_fields}), flush=True)

    run.end()
    report = {
        "device": harness.machine_info("cpu"),
        "config": {
            "runner": "benchmarks/cg_solve.py",
            "command": run.command,
            "argv": sys.argv[1:] if argv is None else list(argv),
            "kernel": "rbf",
            "lengthscale": args.lengthscale,
            "outputscale": 1.0,
            "noise": noise,
            "matvec": MATVEC_NAME,
            "max_iters": args.max_iters,
            "lanczos": True,
            "load_average_before": run.loadavg_start,
            "load_average_after": run.loadavg_end,
            "note": NOTE,
        },
        "results": results,
    }
    harness.write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
