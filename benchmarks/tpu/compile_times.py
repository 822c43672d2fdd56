"""How long the estimators' programs take to compile for a TPU, and the device memory XLA's
analysis gives each: the KDE's cross-validation and scoring, the GP's BBMM objective, its
prediction solve, variance cache and prediction block, and the parts of its preconditioner.
Each program is lowered from shapes alone (no data) and compiled once, for the chip this runs
on or, with ``--compile-only``, for a v5e by libtpu's compile-only topology on a machine
without one (`mosaic_check.compile_only_device`); a program XLA refuses is recorded with its
error.

    PYTHONPATH=. python benchmarks/tpu/compile_times.py --compile-only \
        --out benchmarks/results/compile_times_tpu_v5e_compile_only.json
    PYTHONPATH=. python benchmarks/tpu/compile_times.py --sections kde --out OUT/c.json  # chip

Compilation runs on the host's CPU: figures from a 2-core machine are an upper bound for the
chip's host (13 cores), not a measurement of it. The JSON is rewritten after every program.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np


def _plans_for_a_tpu():
    """The products plan for a TPU (the Mosaic backend compiled) on a machine without one."""
    from scalegp.ops import _plan

    _plan._platform = lambda backend: backend or "tpu"


class Shapes:
    """``ShapeDtypeStruct`` s on one device."""

    def __init__(self, device):
        self.sharding = jax.sharding.SingleDeviceSharding(device)

    def __call__(self, *shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)

    def like(self, tree):
        return jax.tree.map(lambda a: self(*np.shape(a), dtype=jnp.result_type(a)), tree)


def kde_programs(shape, keys: int, d: int) -> dict:
    """The cross-validation's two programs (values; value and gradient) for the default number
    of held-out rows against ``keys`` keys, as `loo_layout` lays them out, and one scoring
    batch of the default batch size."""
    from scalegp.kde import _cv, _density, _loo
    from scalegp.ops import Engine

    engine = Engine.create("auto")
    u, s, static = _loo.loo_layout(keys, d, _cv.DEFAULT_CV_SUBSAMPLE, engine)
    args = (shape(), shape(u, d), shape(u), shape(s, dtype=jnp.int32))
    return {
        "kde cv values": lambda: _loo._loo_values_jit.lower(*args, **static),
        "kde cv value and gradient": lambda: _loo.neg_mean_loo_value_and_grad.lower(
            *args, **static),
        "kde scoring batch": lambda: _density._log_density_block.lower(
            shape(_density.DEFAULT_BATCH_SIZE, d), shape(u, d), shape(), shape(u), engine),
    }


def gp_programs(shape, n: int, d: int) -> dict:
    """The BBMM objective's two halves (the solves; the gradient without and with the control
    variate) at the estimator's defaults, the variance cache's Galerkin factor, and the
    preconditioner's parts: the pivoted Cholesky, and the eigen-form of its factor by each
    method of `LowRankPreconditioner.from_factor` ("gram" is a TPU's default)."""
    from scalegp import linalg
    from scalegp.gp import _bbmm, _predict
    from scalegp.gp._params import GPParams, Posterior

    solver = _bbmm._static_part(_bbmm.BBMMSolver())
    params = GPParams.from_constrained(np.zeros(1, np.float32), np.float32(1.0),
                                       np.ones(d, np.float32), np.float32(0.1))
    p, x, y = shape.like(params), shape(n, d), shape(n, 1)
    key = shape.like(jax.random.PRNGKey(0))
    solved = jax.eval_shape(lambda *a: _bbmm._solve(solver, *a), p, x, y, key)
    k = min(solver.preconditioner_rank, n)

    def pivoted(params, x):
        hp = params.constrained()
        diag = jnp.full((x.shape[0],), hp.kernel.at_zero(), x.dtype)
        column = lambda i: solver.engine.kernel_columns(x, x[i][None, :], hp.kernel)[:, 0]
        return linalg.pivoted_cholesky(diag, column, max_rank=k).factor

    def jit_lower(fn, *args):
        return lambda: jax.jit(fn).lower(*args)

    return {
        "gp bbmm solves": lambda: _bbmm._bbmm_solve.lower(solver, p, x, y, key),
        "gp bbmm gradient, plain": lambda: _bbmm._bbmm_gradient.lower(
            solver, p, x, *shape.like(solved), False),
        "gp bbmm gradient, control variate": lambda: _bbmm._bbmm_gradient.lower(
            solver, p, x, *shape.like(solved), True),
        "gp variance cache, Galerkin factor": lambda: _bbmm._galerkin.lower(
            solver, p, x, shape(n, min(solver.love_rank, n))),
        "gp prediction solve and variance basis": lambda: _bbmm._solve_with_variance_basis.lower(
            solver, p, x, y, shape(n, 1)),
        "gp prediction block, mean and variance": lambda: _predict._predict_block.lower(
            shape.like(params.constrained()), x,
            Posterior(alpha=shape(n, 1), love_factor=shape(n, min(solver.love_rank, n))),
            shape(_predict.TALL_PREDICT_BLOCK, d), True, solver.engine),
        "gp preconditioner": jit_lower(lambda params, x: _bbmm._preconditioner(
            params.constrained(), x, k, solver.engine), p, x),
        "gp pivoted cholesky": jit_lower(pivoted, p, x),
        **{f"eigen-form of ({n}, {k}) by {method}": jit_lower(functools.partial(
            linalg.LowRankPreconditioner.from_factor, noise=0.1, method=method), shape(n, k))
           for method in ("gram", "householder")},
        f"K v, {n}², 31 columns": jit_lower(lambda params, x, v: _bbmm._operator(
            params.constrained(), x, solver.engine)(v), p, x, shape(n, 31)),
    }


def _memory(compiled) -> dict:
    """XLA's compiled memory analysis of a program, in bytes (its temporaries, arguments and
    outputs; on a TPU the measure of a program's device memory, which the runtime's
    ``memory_stats`` undercounts), or nothing where the backend gives none."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without the analysis
        return {}
    if analysis is None:
        return {}
    return {f"{what}_bytes": int(getattr(analysis, f"{what}_size_in_bytes"))
            for what in ("temp", "argument", "output")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", nargs="+", default=["kde", "gp"], choices=["kde", "gp"])
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for a v5e without a chip (libtpu's compile-only topology)")
    parser.add_argument("--kde-keys", type=int, nargs="+", default=[1 << 20, 10_000_000])
    parser.add_argument("--kde-dims", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--gp-n", type=int, nargs="+", default=[10_000])
    parser.add_argument("--programs", nargs="+", default=None, metavar="PREFIX",
                        help="only the programs whose names start with one of these")
    args = parser.parse_args(argv)
    if args.compile_only:
        from benchmarks.tpu.mosaic_check import compile_only_device

        device = compile_only_device()
        _plans_for_a_tpu()
    else:
        device = jax.devices()[0]
    shape = Shapes(device)
    record = {"benchmark": "compile_times", "command": " ".join(["python", *sys.argv]),
              "started": datetime.datetime.now(datetime.UTC).isoformat(
                  timespec="seconds"),
              "compiled_for": f"{device.device_kind}" + (" (compile-only topology, no chip)"
                                                         if args.compile_only else ""),
              "host": {"machine": platform.machine(), "python": platform.python_version(),
                       "jax": jax.__version__},
              "results": []}
    cases = []
    if "kde" in args.sections:
        cases += [({"section": "kde", "keys": m, "dim": d}, kde_programs(shape, m, d))
                  for m in args.kde_keys for d in args.kde_dims]
    if "gp" in args.sections:
        cases += [({"section": "gp", "n": n, "dim": 4}, gp_programs(shape, n, 4))
                  for n in args.gp_n]
    for head, programs in cases:
        for name, lower in programs.items():
            if args.programs and not any(name.startswith(p) for p in args.programs):
                continue
            row = {**head, "program": name}
            start = time.perf_counter()
            try:
                compiled = lower().compile()
                row["compile_seconds"] = time.perf_counter() - start
                row.update(_memory(compiled))
            except Exception as exc:  # noqa: BLE001 - recorded, and the next program runs
                row.update(seconds_to_error=time.perf_counter() - start,
                           error=f"{type(exc).__name__}: {exc}"[:600])
            print(json.dumps(row)[:300], flush=True)
            record["results"].append(row)
            args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
