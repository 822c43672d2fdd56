"""Correctness of impl="pallas" on the device: forward and every gradient, against a float64
reference and against impl="dense", on shapes with odd sizes, odd d and o, ARD lengthscales, a
vector v, explicit tiles, and the KDE (density and log-density, weights; at narrow bandwidths
unpruned, its differences branch, `scalegp.ops.backends.triton._rbf` direct kernels); and the pruned
kernels (``prune=True``, `scalegp.ops.backends.triton._pruned`) at narrow lengthscales, where they skip
tiles (the dense comparison is unpruned).

    PYTHONPATH=. python benchmarks/gpu/pallas_check.py --device gpu --out OUT/pallas_check.json
    PYTHONPATH=. python benchmarks/gpu/pallas_check.py --device cpu --quick   # interpret mode

On a GPU the Pallas kernels run compiled (Triton), which the unit tests (interpret mode on CPU)
never exercise: this is the check to run first on a GPU machine. A quantity passes when its
norm-wise relative error against float64 is at most max(1e-4, 4 x the dense float32 path's error)
(the design expects about 1e-6 to 1e-5; TF32 products would show as 1e-4 to 1e-3).
Exit status 1 if anything fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from benchmarks import harness
from benchmarks.kmv.problems import relative_error

ABS_TOL = 1e-4
DENSE_FACTOR = 4.0

# name, n, m, d, o (0: vector v), ard, tiles[, prune]
KMV_CASES = [
    ("square", 1024, 1024, 8, 16, False, None),
    ("odd-sizes-ard-d32", 1000, 777, 32, 5, True, None),
    ("odd-d-o-ard", 257, 129, 17, 33, True, None),
    ("one-query-vector-v", 1, 300, 2, 0, False, None),
    ("tiles-32-64-16", 2048, 1536, 8, 16, False, (32, 64, 16)),
    ("n65536-d8-o16", 65536, 65536, 8, 16, False, None),
    ("pruned-odd-ard-d2", 3000, 4001, 2, 5, True, None, True),
    ("pruned-n65536-d3-o16-tiles-32", 65536, 65536, 3, 16, False, (32, 32, 16), True),
]
KMV_QUICK = [
    ("square", 128, 128, 8, 16, False, None),
    ("odd-sizes-ard", 100, 77, 3, 5, True, None),
    ("odd-d-o-ard", 33, 65, 17, 3, True, None),
    ("one-query-vector-v", 1, 50, 2, 0, False, None),
    ("tiles-32-64-16", 96, 80, 8, 16, False, (32, 64, 16)),
    ("pruned-odd-ard-d2", 150, 201, 2, 5, True, (16, 16, 16), True),
]
# name, n, m, d, ard, weights, log[, prune[, narrow]]; narrow (default: prune) takes the
# bandwidth times PRUNED_SCALE: unpruned, that is the KDE's differences branch (data spread
# over hundreds of bandwidths), whose bandwidth gradient lost 10% before decisions #35
KDE_CASES = [
    ("kde-odd-weights-log", 1000, 777, 3, False, True, True),
    ("kde-d8-ard-density", 513, 1025, 8, True, False, False),
    ("kde-differences-weights-log-d2", 1000, 4096, 2, False, True, True, False, True),
    ("kde-differences-d8-ard-log", 513, 2048, 8, True, False, True, False, True),
    ("kde-pruned-weights-log-d2", 3000, 4001, 2, False, True, True, True),
    ("kde-pruned-n65536-d3-ard-density", 65536, 65536, 3, True, False, False, True),
]
KDE_QUICK = [
    ("kde-odd-weights-log", 100, 77, 3, False, True, True),
    ("kde-d8-ard-density", 64, 90, 8, True, False, False),
    ("kde-differences-d8-ard-log", 64, 300, 8, True, False, True, False, True),
    ("kde-pruned-weights-log-d2", 150, 201, 2, False, True, True, True),
]
# Lengthscale (times sqrt(d)) and bandwidth (times the default's) of the pruned cases: narrow
# enough, on standard normal points, that most tile pairs are skipped.
PRUNED_SCALE = 0.03


def _scale(rng, d, ard, base):
    if ard:
        return (base * rng.uniform(0.5, 1.5, d)).astype(np.float32)
    return np.float32(base)


def kmv_case(name, n, m, d, o, ard, tiles, prune=False, seed=0):
    import jax
    import jax.numpy as jnp

    from benchmarks.kmv.problems import _kmv64, _row_chunk
    from scalegp.ops import rbf_kernel_mv

    rng = np.random.default_rng([seed, n, m, d, o])
    f32 = np.float32
    x1 = rng.standard_normal((n, d)).astype(f32)
    x2 = rng.standard_normal((m, d)).astype(f32)
    v = rng.standard_normal((m, o) if o else (m,)).astype(f32)
    G = rng.standard_normal((n, o) if o else (n,)).astype(f32)
    ls = _scale(rng, d, ard, math.sqrt(d) * (PRUNED_SCALE if prune else 1.0))
    blocks = dict(zip(("block_q", "block_k", "block_o"), tiles or ()))

    def ours(impl):
        options = {**blocks, "prune": prune} if impl == "pallas" else {"prune": False}

        def f(x1, x2, v, ls):
            return rbf_kernel_mv(x1, x2, v, ls, impl=impl, **options)

        fwd = jax.jit(f)(x1, x2, v, ls)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * G), argnums=(0, 1, 2, 3)))(
            x1, x2, v, ls)
        return np.asarray(fwd), [np.asarray(g) for g in grads]

    def ref():
        a = [jnp.asarray(np.asarray(t, np.float64)) for t in (x1, x2, v, ls, G)]
        chunk = _row_chunk(n, m, 1 << 22)

        def f(x1, x2, v, ls):
            out = _kmv64(x1, x2, v if o else v[:, None], ls, chunk)
            return out if o else out[:, 0]

        fwd = jax.jit(f)(*a[:4])
        grads = jax.jit(jax.grad(lambda *b: jnp.sum(f(*b) * a[4]), argnums=(0, 1, 2, 3)))(*a[:4])
        return np.asarray(fwd), [np.asarray(g) for g in grads]

    return (name, dict(n=n, m=m, d=d, o=o, ard=ard, tiles=tiles, prune=prune), ours, ref,
            ("fwd", "dx1", "dx2", "dv", "dlengthscale"))


def kde_case(name, n, m, d, ard, weighted, log, prune=False, narrow=None, seed=0):
    import jax
    import jax.numpy as jnp

    from benchmarks.kmv.problems import _kde_log64, _row_chunk
    from scalegp.ops import rbf_kde_density

    rng = np.random.default_rng([seed, n, m, d, 7])
    f32 = np.float32
    q = rng.standard_normal((n, d)).astype(f32)
    x = rng.standard_normal((m, d)).astype(f32)
    w = rng.uniform(0.0, 2.0, m).astype(f32) if weighted else np.ones(m, f32)
    G = rng.standard_normal(n).astype(f32)
    narrow = prune if narrow is None else narrow
    h = _scale(rng, d, ard, m ** (-1.0 / (d + 4)) * (PRUNED_SCALE if narrow else 1.0))

    def ours(impl):
        def f(q, x, h, w):
            return rbf_kde_density(q, x, h, w, log=log, impl=impl,
                                   prune=prune if impl == "pallas" else False)

        fwd = jax.jit(f)(q, x, h, w)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * G), argnums=(0, 1, 2, 3)))(q, x, h, w)
        return np.asarray(fwd), [np.asarray(g) for g in grads]

    def ref():
        a = [jnp.asarray(np.asarray(t, np.float64)) for t in (q, x, h, w, G)]
        chunk = _row_chunk(n, m, 1 << 22)

        def f(q, x, h, w):
            lp = _kde_log64(q, x, h, chunk, weights=w)
            return lp if log else jnp.exp(lp)

        fwd = jax.jit(f)(*a[:4])
        grads = jax.jit(jax.grad(lambda *b: jnp.sum(f(*b) * a[4]), argnums=(0, 1, 2, 3)))(*a[:4])
        return np.asarray(fwd), [np.asarray(g) for g in grads]

    return (name, dict(n=n, m=m, d=d, ard=ard, weights=weighted, log=log, prune=prune,
                       narrow=narrow), ours,
            ref,
            ("fwd", "dq", "dk", "dbandwidth", "dweights"))


DENSE_MAX_ENTRIES = 1 << 26  # above this the dense comparison is skipped (time, not memory)


def run_ours(case):
    """float32 results of pallas and dense (x64 still off, as in any user's process)."""
    name, shape, ours, _, _ = case
    t0 = time.perf_counter()
    impls = ("pallas", "dense") if shape["n"] * shape["m"] <= DENSE_MAX_ENTRIES else ("pallas",)
    try:
        return {impl: ours(impl) for impl in impls}, None, time.perf_counter() - t0
    except Exception as exc:  # a compile failure is a failed case, not the end of the check
        return None, f"{type(exc).__name__}: {exc}"[:400], time.perf_counter() - t0


def compare(case, results, error, seconds):
    name, shape, _, ref, names = case
    row = {"case": name, **shape}
    if error is not None:
        row.update(ok=False, error=error)
        return row
    t0 = time.perf_counter()
    r_fwd, r_grads = ref()
    refs = [r_fwd] + r_grads
    ok = True
    for i, key in enumerate(names):
        errs = {impl: relative_error(([fwd] + grads)[i], refs[i])
                for impl, (fwd, grads) in results.items()}
        limit = max(ABS_TOL, DENSE_FACTOR * errs.get("dense", 0.0))
        passed = errs["pallas"] <= limit  # also False for nan
        ok &= passed
        row[key] = {**errs, "ok": passed}
    row["ok"] = ok
    row["seconds"] = round(seconds + time.perf_counter() - t0, 2)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    p.add_argument("--quick", action="store_true", help="small shapes only (for interpret mode)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    import jax

    from scalegp.ops import available_implementations

    backend = jax.default_backend()
    mode = available_implementations()["pallas"]
    print(f"backend {backend}, {jax.devices()[0].device_kind}; pallas: {mode}", flush=True)
    if args.device == "gpu" and (backend != "gpu" or not mode.startswith("compiled")):
        print("error: --device gpu needs JAX's GPU backend (pallas compiled, not interpreted)",
              file=sys.stderr)
        return 2
    quick = args.quick or args.device == "cpu"
    cases = [kmv_case(*c) for c in (KMV_QUICK if quick else KMV_CASES)]
    cases += [kde_case(*c) for c in (KDE_QUICK if quick else KDE_CASES)]
    ours = []
    for case in cases:
        ours.append(run_ours(case))
        status = "compiled and ran" if ours[-1][1] is None else f"FAILED: {ours[-1][1]}"
        print(f"  {case[0]}: {status} [{ours[-1][2]:.1f} s]", flush=True)
    jax.config.update("jax_enable_x64", True)  # only now: the float64 references
    rows = []
    for case, (results, error, seconds) in zip(cases, ours):
        rows.append(compare(case, results, error, seconds))
        _print(rows[-1])
    ok = all(r["ok"] for r in rows)
    summary = {"backend": backend, "device_kind": jax.devices()[0].device_kind,
               "jax": jax.__version__, "pallas": mode, "abs_tol": ABS_TOL,
               "dense_factor": DENSE_FACTOR, "ok": ok, "cases": rows}
    if args.out:
        harness.write_json(args.out, summary)
    print("pallas check: " + ("all passed" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


def _print(row):
    if "error" in row:
        print(f"FAIL {row['case']}: {row['error']}", flush=True)
        return
    parts = [f"{k} {v['pallas']:.1e}" + (f" (dense {v['dense']:.1e})" if "dense" in v else "")
             for k, v in row.items() if isinstance(v, dict)]
    print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['case']} [{row['seconds']} s]: "
          + ", ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(main())
