"""Where the seconds of a BBMM fit go: the components of one GP regression, timed one by one.

One configuration (default n = 32,768, d = 4, the data of ``gp_scale.py``'s ``make_data``,
float32, inputs centred and targets standardised as the estimator does) at fixed hyperparameters
near the fitted ones (``--outputscale 2.6 --lengthscale 1.04 2.03 1.67 0.94 --noise 0.016``).
Each section runs in its own child process (so no section reuses another's compiled code, and a
crash or a timeout becomes an error entry); within it every component is called once (``first_s``:
compilation included), then again up to ``--repeats`` times, until ``--budget-s`` seconds of
steady calls are spent (at least one): ``steady_s`` is their median, ``samples_s`` all of them.
``cpu_utilisation`` is process CPU time / wall time over the steady calls (``first_cpu_util``: the
first call), which says how many of the cores the component keeps busy.

Sections (``--sections``, default all) and their components:

- ``kernel_mv``: one kernel product ``K(X, X) V`` through ``scalegp.ops.Engine().kernel_mv``,
  jitted, for V with 1, 11 and 31 columns (31 = y and 30 probes, the mBCG block).
- ``preconditioner``: the pivoted-Cholesky preconditioner, ``scalegp.gp._bbmm._preconditioner``
  at rank ``--rank`` (768) on ``scalegp.ops.Engine()``, jitted.
- ``objective``: one BBMM objective value and gradient,
  ``scalegp.gp._bbmm._bbmm_value_and_grad(BBMMSolver(), params, x, y, key)`` (``key``: the
  solver's probe key, `_bbmm._probe_key`), with the CG iterations
  of its right-hand side and of its probes.
- ``alpha``: the prediction solve ``scalegp.gp._bbmm._bbmm_alpha`` (tolerance ``predict_tol``)
  with its CG iterations.
- ``love``: the variance cache of ``BBMMSolver.love`` (rank ``love_rank``).
- ``exact``: the exact objective and gradient ``scalegp.gp.CholeskySolver().value_and_grad`` on
  the first m points for m in ``--exact-sizes`` (2048, 4096: the subset phase's size and the
  largest exact n), and a plain jitted ``jnp.linalg.cholesky`` of the same ``K + σ²I``.
- ``fit``: ``ScalableGPRegressor(normalize_y=True, random_state=0, max_iter_full=3,
  subset_size=2048, verbose=1)`` fit and predict (mean, then std, for ``--num-test`` points) by
  ``gp_scale.run_scalegp``: wall and CPU time per phase and the objective evaluations per phase.

The names above are internals of scalegp and may change: a component that fails (AttributeError,
a changed signature, ...) becomes an entry with an ``error`` and the others go on. ``--tree DIR``
imports scalegp from another checkout (e.g. a worktree of an older commit), to profile it.

    python benchmarks/gp_profile.py --out benchmarks/results/gp_profile_cpu.json
    python benchmarks/gp_profile.py --tree ../wt-base --out /tmp/gp_profile_base.json
"""

from __future__ import annotations

import argparse
import functools
import math
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness  # noqa: E402
from benchmarks.gp_scale import make_data, run_scalegp  # noqa: E402

SECTIONS = ("kernel_mv", "preconditioner", "objective", "alpha", "love", "exact", "fit")
VERSIONS = ("numpy", "scipy", "jax", "jaxlib", "sklearn")


# ----------------------------------------------------------------------------------------------
# in the child


def timed_component(fn, repeats, budget_s):
    """``(fields, output of the first call)``: ``fn()`` once (first_s), then steady calls."""
    import jax

    def call():
        wall, cpu = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(fn())
        return out, time.perf_counter() - wall, time.process_time() - cpu

    out, first_s, first_cpu = call()
    samples, cpu = [], 0.0
    while len(samples) < max(1, repeats) and (not samples or sum(samples) < budget_s):
        _, wall_s, cpu_s = call()
        samples.append(wall_s)
        cpu += cpu_s
    fields = {"first_s": first_s, "steady_s": statistics.median(samples),
              "samples_s": samples, "cpu_utilisation": cpu / sum(samples),
              "first_cpu_util": first_cpu / first_s if first_s > 0 else None}
    return fields, out


def _problem(args):
    """x (n, d) centred float32, y (n, 1) standardised, and the GPParams at the given
    hyperparameters."""
    import jax.numpy as jnp
    import numpy as np

    from scalegp import gp

    x, y, _, _ = make_data(args.n, args.d, 0)
    x = jnp.asarray((x - x.mean(axis=0)).astype(np.float32))
    y = jnp.asarray(((y - y.mean()) / y.std()).astype(np.float32)[:, None])
    lengthscale = (list(args.lengthscale) * args.d)[:args.d]
    params = gp.GPParams.from_constrained(0.0, args.outputscale, lengthscale, args.noise,
                                          dtype=jnp.float32)
    return x, y, params


def _cg_fields(cg, num_rhs=1):
    """CG iterations of a `CGResult`: of the right-hand side(s) and, after them, of the probes."""
    import numpy as np

    iters = np.asarray(cg.iterations).ravel()
    out = {"cg_iterations_rhs": int(iters[:num_rhs].max())}
    if iters.size > num_rhs:
        out["cg_iterations_probes_max"] = int(iters[num_rhs:].max())
        out["cg_iterations_probes_mean"] = float(iters[num_rhs:].mean())
    converged = getattr(cg, "converged", None)
    if converged is not None:
        out["converged"] = bool(np.all(np.asarray(converged)))
    return out


def _kernel_mv(args, x, y, params):
    import jax
    import numpy as np

    from scalegp import ops

    engine = ops.Engine()
    mv = jax.jit(lambda x, v, kernel: engine.kernel_mv(x, x, v, kernel))
    kernel = params.constrained().kernel
    rng = np.random.default_rng(1)
    for t in args.columns:
        v = jax.numpy.asarray(rng.normal(size=(args.n, t)).astype(np.float32))
        yield f"kernel_mv t={t}", lambda v=v: mv(x, v, kernel), lambda out, t=t: {
            "columns": t, "impl": getattr(engine, "impl", None)}


def _preconditioner(args, x, y, params):
    import jax

    from scalegp import ops
    from scalegp.gp import _bbmm

    build = jax.jit(lambda hp, x: _bbmm._preconditioner(hp, x, args.rank, ops.Engine()))
    hp = params.constrained()

    def info(out):
        basis = getattr(out, "basis", None)
        return {"rank": args.rank, "basis_columns": None if basis is None else basis.shape[-1]}

    yield f"preconditioner rank={args.rank}", lambda: build(hp, x), info


def _objective(args, x, y, params):
    from scalegp.gp import _bbmm

    solver = _bbmm.BBMMSolver()
    key = _bbmm._probe_key(solver)
    yield ("bbmm objective+grad", lambda: _bbmm._bbmm_value_and_grad(solver, params, x, y, key),
           lambda res: {"value": float(res.value), **_cg_fields(res.cg, y.shape[1]),
                        "num_probes": solver.num_probes, "cg_tol": solver.cg_tol,
                        "preconditioner_rank": solver.preconditioner_rank})


def _alpha(args, x, y, params):
    from scalegp.gp import _bbmm

    solver = _bbmm.BBMMSolver()
    yield ("bbmm alpha solve", lambda: _bbmm._bbmm_alpha(solver, params, x, y),
           lambda res: {**_cg_fields(res, y.shape[1]), "predict_tol": solver.predict_tol})


def _love(args, x, y, params):
    from scalegp.gp import _bbmm

    solver = _bbmm.BBMMSolver()
    static = _bbmm._static_part(solver)
    # the two programs of `BBMMSolver.love`: the pivoted-Cholesky basis, its Galerkin factor
    yield ("love factor", lambda: _bbmm._galerkin(static, params, x,
                                                  _bbmm._basis(static, params, x)),
           lambda out: {"love_rank": solver.love_rank, "shape": list(out.shape)})


def _exact(args, x, y, params):
    import jax
    import jax.numpy as jnp

    from scalegp import gp

    solver = gp.CholeskySolver()
    for m in args.exact_sizes:
        m = min(m, args.n)
        xm, ym = x[:m], y[:m]
        yield (f"exact objective+grad m={m}", lambda xm=xm, ym=ym: solver.value_and_grad(
            params, xm, ym), lambda res, m=m: {"m": m, "value": float(res.value)})

        try:  # K + σ²I outside the timing; a failure is the Cholesky's error entry
            from scalegp.gp import _exact

            a = jax.block_until_ready(jax.jit(_exact.covariance)(params.constrained(), xm))
        except Exception as exc:
            a, fn = None, _raiser(exc)
        else:
            fn = functools.partial(jax.jit(jnp.linalg.cholesky), a)
        yield (f"jnp.linalg.cholesky m={m}", fn,
               lambda out, m=m: {"m": m, "finite": bool(jnp.all(jnp.isfinite(out)))})
        del a


def _raiser(exc):
    def fn():
        raise exc

    return fn


COMPONENTS = {"kernel_mv": _kernel_mv, "preconditioner": _preconditioner,
              "objective": _objective, "alpha": _alpha, "love": _love, "exact": _exact}


def _error(section, component, exc):
    return {"section": section, "component": component,
            "error": f"{type(exc).__name__}: {exc}"[:500]}


def run_section(section, args, tree=None):
    """One section in this (child) process: ``{"source", "components": [...]}``."""
    source = harness.import_scalegp(tree)
    if section == "fit":
        row = run_scalegp(args.n, _fit_args(args), tree)
        return {"source": source, "components": [{"section": "fit", "component": "fit",
                                                  **row}]}
    import jax

    jax.block_until_ready(jax.numpy.zeros(1) + 1)  # the backend starts outside every timing
    components = []
    try:
        problem = _problem(args)
    except Exception as exc:
        return {"source": source, "components": [_error(section, "data", exc)]}
    generator = COMPONENTS[section](args, *problem)
    while True:
        name = section
        try:
            name, fn, info = next(generator)
        except StopIteration:
            break
        except Exception as exc:  # the component could not even be set up
            components.append(_error(section, name, exc))
            break
        try:
            fields, out = timed_component(fn, args.repeats, args.budget_s)
            try:
                fields.update(info(out))
            except Exception as exc:
                fields["info_error"] = f"{type(exc).__name__}: {exc}"[:300]
            del out
            components.append({"section": section, "component": name, **fields})
        except Exception as exc:
            components.append(_error(section, name, exc))
        print(f"  {components[-1]}", flush=True)
    return {"source": source, "components": components}


def _fit_args(args):
    """The settings of ``gp_scale.run_scalegp`` for the fit section."""
    return argparse.Namespace(d=args.d, num_test=args.num_test, subset_size=args.subset_size,
                              full_steps=args.full_steps, rank=None, love_rank=None,
                              probes=None, float64=False, kernel="rbf", exact_max_n=None)


# ----------------------------------------------------------------------------------------------
# the parent


def _fmt(v, digits=2):
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


NOTE_KEYS = ("columns", "m", "love_rank", "shape", "finite", "cg_iterations_rhs", "cg_iterations_probes_max", "cg_iterations_probes_mean",
             "converged", "basis_columns", "value")


def table(components) -> str:
    """The human-readable summary: one line per component (the fit: one per phase)."""
    lines = ["| component | first s | steady s | samples | CPU util | notes |",
             "|---|---|---|---|---|---|"]
    for c in components:
        if "error" in c:
            lines.append(f"| {c['component']} | error | | | | {c['error'][:120]} |")
            continue
        if c["section"] == "fit":
            evals = c.get("objective_evaluations", {})
            util = c.get("phase_cpu_utilisation", {})
            for phase, seconds in c["phases"].items():
                e = evals.get(phase[:-2]) if isinstance(evals, dict) else None
                note = ""
                if isinstance(e, dict):
                    note = (f"{e['evaluations']} objective evaluations ({e['calls']} calls), "
                            f"{e['seconds']:.1f} s in them")
                    if e.get("cg_iterations"):
                        note += f", CG iterations {e['cg_iterations']}"
                if phase == "full_s" and c.get("full_cg_iterations"):
                    note = note or f"CG iterations {c['full_cg_iterations']}"
                lines.append(f"| fit: {phase[:-2]} | {_fmt(seconds, 1)} | | | "
                             f"{_fmt(util.get(phase))} | {note} |")
            lines.append(f"| fit: total (fit {_fmt(c['fit_s'], 1)} s) | "
                         f"{_fmt(c['total_s'], 1)} | | | {_fmt(c.get('cpu_utilisation'))} | "
                         f"RMSE {c['rmse']:.4f}, NLL {c['nll']:.3f} |")
            continue
        notes = ", ".join(f"{k.replace('cg_iterations_', 'CG ')} {_fmt(c[k], 4)}"
                          for k in NOTE_KEYS if k in c)
        if "info_error" in c:
            notes += f" (info: {c['info_error'][:60]})"
        lines.append(f"| {c['component']} | {_fmt(c['first_s'], 3)} | {_fmt(c['steady_s'], 3)} "
                     f"| {len(c['samples_s'])} | {_fmt(c['cpu_utilisation'])} | {notes} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--tree", default=None, metavar="DIR",
                        help="import scalegp from this checkout (default: the one holding this "
                             "script)")
    parser.add_argument("--outputscale", type=float, default=2.6)
    parser.add_argument("--lengthscale", type=float, nargs="+", default=[1.04, 2.03, 1.67, 0.94],
                        help="d values (repeated cyclically to d)")
    parser.add_argument("--noise", type=float, default=0.016,
                        help="noise variance on the standardised targets")
    parser.add_argument("--columns", type=int, nargs="+", default=[1, 11, 31],
                        help="columns of V in the kernel_mv section")
    parser.add_argument("--rank", type=int, default=768, help="preconditioner rank")
    parser.add_argument("--exact-sizes", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--subset-size", type=int, default=2048, help="fit section")
    parser.add_argument("--full-steps", type=int, default=3, help="fit section: max_iter_full")
    parser.add_argument("--num-test", type=int, default=1000, help="fit section")
    parser.add_argument("--repeats", type=int, default=3,
                        help="steady calls per component (after the first) ...")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="... unless they have taken this many seconds (at least one)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per section")
    parser.add_argument("--mem-limit-gb", type=float, default=None,
                        help="address-space cap of each section's process")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tree is not None:
        if not (Path(args.tree) / "scalegp" / "__init__.py").is_file():
            parser.error(f"--tree: {args.tree} has no scalegp/__init__.py")
        args.tree = str(Path(args.tree).resolve())

    run = harness.Run(__file__, argv)
    report = {
        "machine": {**harness.host(), "processor": platform.processor()},
        "versions": {"python": platform.python_version(), **harness.versions(VERSIONS)},
        "command": run.command,
        "args": vars(args),
        "loadavg_start": run.loadavg_start,
        "hyperparameters": {"outputscale": args.outputscale, "noise": args.noise,
                            "lengthscale": (list(args.lengthscale) * args.d)[:args.d],
                            "targets": "standardised", "dtype": "float32"},
        "sections": {},
        "components": [],
    }
    for section in args.sections:
        harness.log(f"section {section} (n={args.n})")
        result = harness.run_in_child(run_section, (section, args, args.tree), args.timeout,
                                      args.mem_limit_gb, head={"section": section})
        if "error" in result:
            report["sections"][section] = {"error": result["error"], "wall_s": result["wall_s"],
                                           "loadavg": harness.loadavg()}
            report["components"].append({"section": section, "component": section,
                                         "error": result["error"]})
            continue
        report.setdefault("scalegp", result["source"])
        report["sections"][section] = {"wall_s": result["wall_s"], "loadavg": harness.loadavg()}
        report["components"].extend(result["components"])
        if args.out:  # a partial file after each section
            harness.write_json(args.out, report, indent=2)
    run.end()
    report["loadavg_end"] = run.loadavg_end
    if args.out:
        harness.write_json(args.out, report, indent=2)
    source = report.get("scalegp", {})
    print(f"\nscalegp {source.get('scalegp_commit')} from {source.get('tree')}, n={args.n}, "
          f"d={args.d}, load {run.loadavg_start} -> {run.loadavg_end}")
    print(table(report["components"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
