"""Two or more trees of scalegp timed on the same products in one run, alternating, each call in
a fresh process: the ratio of a change's effect that a shared, noisy machine allows. Each tree
is a folder holding a ``scalegp`` package (``git archive COMMIT scalegp | tar -x -C DIR``), put
first on the worker's ``PYTHONPATH`` (whatever else is there, jax on a TPU machine, stays).

Cases (``--n`` rows and keys, the same points in every tree):

- ``kv_d8``, ``kv_d2``: ``rbf_kernel_mv(x, x, v, 1.0)``, 16 columns, at d = 8 (the expansion
  or the differences, chosen at run time) and d = 2 (the differences): the forward, and the
  forward with the gradients of points, values and lengthscale;
- ``kv_wide``: ``rbf_kernel_mv(q, x, r, 1.0)`` at d = 4 with 1,024 columns (a GP variance
  cache's product), ``--n`` / 4 query rows: the forward;
- ``expr_d8``: ``kernel_mv`` of issue 60's ``RBF(1) + ExpSineSquared(1, 2) * RBF(2)`` on
  ``kv_d8``'s points and values: the forward, its ratio to the RBF's forward timed in the same
  process, and the forward with the gradients of points, values and the hyperparameters.

Per call: the first call (compilation included) and the median of ``--repeats`` after it; the
forward's relative error over its first 64 rows against numpy in float64; and the outputs,
saved, so that the parent reports how far each tree's outputs lie from the first tree's
(norm-wise). The JSON is rewritten after every call.

    python benchmarks/tpu/paired_trees.py --trees before=tmpcall/before after=. \
        --cases kv_d8 kv_d2 kv_wide --rounds 2 --out OUT/paired.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CASES = ("kv_d8", "kv_d2", "kv_wide", "expr_d8")


def _inputs(case: str, n: int):
    rng = np.random.default_rng(0)
    if case == "kv_wide":
        keys = rng.standard_normal((n, 4)).astype(np.float32)
        rows = rng.standard_normal((max(n // 4, 1), 4)).astype(np.float32)
        return rows, keys, rng.standard_normal((n, 1024)).astype(np.float32)
    d = 2 if case == "kv_d2" else 8
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x, x, rng.standard_normal((n, 16)).astype(np.float32)


def _expression():
    from scalegp.ops import RBF, ExpSineSquared

    return RBF(1.0) + ExpSineSquared(1.0, 2.0) * RBF(2.0)


def _reference_rows(case, rows, keys, values, count: int = 64):
    """The first ``count`` rows of ``K(rows, keys) @ values`` in float64: the RBF of
    lengthscale 1, or `_expression`."""
    a, b = rows[:count].astype(np.float64), keys.astype(np.float64)
    sq = np.maximum((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T, 0.0)
    k = np.exp(-0.5 * sq)
    if case == "expr_d8":
        k = k + np.exp(-2.0 * np.sin(np.pi * np.sqrt(sq) / 2.0) ** 2 - sq / 8.0)
    return k @ values.astype(np.float64)


def _timed(fn, args, repeats: int):
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, first, statistics.median(times)


def worker(case: str, n: int, impl: str, repeats: int, save: Path) -> dict:
    """Times ``case`` in this process (the tree on ``PYTHONPATH``); saves its outputs."""
    import jax
    import jax.numpy as jnp

    from scalegp.ops import kernel_mv, rbf_kernel_mv

    rows, keys, values = _inputs(case, n)
    args = [jnp.asarray(t) for t in (rows, keys, values)]
    expression = case == "expr_d8"

    def rbf(q, x, v, lengthscale=1.0):
        return rbf_kernel_mv(q, x, v, lengthscale, impl=impl, prune=False)

    def product(q, x, v, kernel):
        return kernel_mv(kernel, q, x, v, impl=impl, prune=False)

    forward = (lambda q, x, v: product(q, x, v, _expression())) if expression else rbf
    out, fwd_first, fwd = _timed(jax.jit(forward), args, repeats)
    ref = _reference_rows(case, rows, keys, values)
    got = np.asarray(out[:64], np.float64)
    row = {"case": case, "n": n, "impl": impl, "fwd_first_s": fwd_first, "fwd_s": fwd,
           "fwd_rel_err_64_rows": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
           "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if expression:
        _, _, rbf_fwd = _timed(jax.jit(rbf), args, repeats)
        row.update(rbf_fwd_s=rbf_fwd, ratio_to_rbf=fwd / rbf_fwd)
    saved = {"out": np.asarray(out)}
    if case != "kv_wide":
        weights = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)
        op, third = (product, _expression()) if expression else (rbf, jnp.float32(1.0))

        def value_and_grads(x, v, parameters):
            return jax.grad(lambda *a: jnp.sum(weights * op(a[0], a[0], a[1], a[2])),
                            (0, 1, 2))(x, v, parameters)

        grads, first, both = _timed(jax.jit(value_and_grads), [args[0], args[2], third],
                                    repeats)
        row.update(fwd_bwd_first_s=first, fwd_bwd_s=both, ratio=both / fwd)
        grad_x, grad_v, grad_parameters = grads
        saved.update(grad_x=np.asarray(grad_x), grad_v=np.asarray(grad_v),
                     grad_parameters=np.concatenate([np.ravel(g) for g in
                                                     jax.tree_util.tree_leaves(grad_parameters)]))
    np.savez(save, **saved)
    return row


def _run_worker(tree: Path, case: str, args, save: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree.resolve())] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", case, "--n",
               str(args.n), "--impl", args.impl, "--repeats", str(args.repeats), "--save",
               str(save)]
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if done.returncode:
        return {"case": case, "error": (done.stderr or done.stdout)[-1500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _agreement(first: Path, other: Path) -> dict:
    """Norm-wise relative distance of each saved output from the first tree's."""
    with np.load(first) as a, np.load(other) as b:
        return {name: float(np.linalg.norm(b[name] - a[name]) / max(np.linalg.norm(a[name]),
                                                                     1e-30))
                for name in a.files if name in b.files}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", metavar="NAME=DIR",
                        help="the trees, the first the reference of the agreement")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--impl", default="pallas")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=300.0, help="per call, in seconds")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.n, args.impl, args.repeats, args.save)))
        return
    if not args.trees or args.out is None:
        parser.error("--trees and --out are required")
    trees = [(name, Path(folder)) for name, folder in (t.split("=", 1) for t in args.trees)]
    report = {"benchmark": "paired_trees", "command": " ".join(["python", *sys.argv]),
              "host": {"machine": platform.machine(), "python": platform.python_version()},
              "trees": {name: str(folder) for name, folder in trees}, "rows": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            order = trees if round_ % 2 == 0 else trees[::-1]
            for case in args.cases:
                for name, folder in order:
                    save = Path(scratch) / f"{name}_{case}.npz"
                    row = {"round": round_, "tree": name, **_run_worker(folder, case, args,
                                                                          save)}
                    first = Path(scratch) / f"{trees[0][0]}_{case}.npz"
                    if name != trees[0][0] and first.exists() and save.exists():
                        row["distance_from_" + trees[0][0]] = _agreement(first, save)
                    report["rows"].append(row)
                    print(json.dumps(row)[:400], flush=True)
                    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
