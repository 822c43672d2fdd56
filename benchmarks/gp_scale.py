"""End-to-end GP regression at scale on CPU: ScalableGPRegressor against scikit-learn's GPR and
GPyTorch's CG-based ExactGP, on the same synthetic data (d = 4 by default).

What is timed, each configuration in a child process with a timeout (a run that runs out of time
or memory becomes an error row, not a crash):

- scalegp (``ScalableGPRegressor``, float32, default settings unless overridden): fit (random
  subset of ``--subset-size`` points by exact L-BFGS-B, then at most ``--full-steps`` scoring
  steps of the BBMM objective per stage (``max_iter_full``: nested subsets growing fourfold,
  then all data), then the ``alpha`` solve), then mean and std for
  ``--num-test`` points (the std builds the variance cache). ``phases`` splits the time using the
  estimator's per-iteration log records: ``subset_s`` (to the last subset iteration),
  ``full_s`` (to the last full-data iteration), ``solve_s`` (rest of fit: the alpha solve),
  ``predict_mean_s``, ``predict_std_s`` (variance cache + std).
- scikit-learn's GaussianProcessRegressor, ``ConstantKernel * RBF(ARD) + WhiteKernel``, same
  start, float64: n = 1024, 2048, ... until a run exceeds ``--budget`` seconds (recorded as a
  timeout row: where it stops) or n reaches ``--n``.
- GPyTorch (if torch and gpytorch import): ``ExactGP`` with ``ConstantMean`` and
  ``ScaleKernel(RBFKernel(ard_num_dims=d))``, ``GaussianLikelihood``, float32, trained by
  GPyTorch's standard recipe (Adam, lr 0.1, ``--gpytorch-iters`` iterations on all data, exact
  marginal log likelihood), always by CG/Lanczos (``max_cholesky_size(0)``) with our settings:
  ``cg_tolerance`` = our ``cg_tol`` (1e-3), ``num_trace_samples`` = our ``num_probes`` (30),
  ``max_preconditioner_size`` = our ``preconditioner_rank``, ``max_cg_iterations`` 1000,
  prediction solves at ``eval_cg_tolerance`` 1e-4, variances by LOVE (``fast_pred_var``) with
  ``max_root_decomposition_size`` = our ``love_rank``. Same ladder of n as scikit-learn, up to
  ``--n``; its memory is capped at ``--peer-mem-gb`` (GPyTorch on CPU forms the n × n kernel
  matrix: that is its own cost). scalegp is also run at the largest n GPyTorch finished, for a
  comparison at equal n.

``--data short`` swaps the data for a GP draw with a short lengthscale (``--data-lengthscale``,
default 1% of the extent) on the unit cube, the case tile pruning is for; ``--prune`` and
``--lengthscale`` set the estimator's ``prune`` and initial lengthscale:

    python benchmarks/gp_scale.py --n 200000 --d 2 --data short --lengthscale 0.02 \
        --prune auto --skip-peers --budget 3600 --out benchmarks/results/gp_scale_200k_short_cpu.json

Both targets are standardised (``normalize_y``) and metrics are on the raw test targets: RMSE and
the mean Gaussian negative log predictive density (NLL, noise included).

Each scalegp row also records where its scalegp came from (``tree``, ``scalegp_file``,
``scalegp_commit``, "+dirty" and ``scalegp_diff_sha1`` when scalegp/ has uncommitted changes),
``objective_evaluations`` per phase (calls of the estimator's ``Objective``, counted in the child
by wrapping ``scalegp.estimators._gpr_fit.Objective.__call__``; "subset" are the exact fits, on
all data too when n <= exact_max_n, "full" the BBMM fits; split by the number of points, e.g.
"subset n=2048" and "subset n=4096", where a phase runs on several), ``full_cg_iterations`` (parsed
from the progress messages), and CPU time (``cpu_s``, ``cpu_utilisation`` = CPU / wall seconds,
per phase in ``phase_cpu_utilisation``: about 2 when both cores work), and the resident set
size's peak per phase, sampled every 0.1 s (``phase_max_rss_mb``; ``max_rss_mb`` is the
process's whole peak, data generation included).

``--baseline-tree DIR`` runs scalegp a second time, with the same settings, importing it from
``DIR`` (another checkout, e.g. ``git worktree add ../wt-base <commit>``; the benchmark code is
this one): row ``baseline``, ``speedup_vs_baseline`` (baseline total_s / scalegp total_s) and
``baseline_comparison`` (speedups of the total, the fit and each phase; RMSE and NLL ratios,
current / baseline, and the NLL difference; objective evaluations and commits of both). The
baseline runs first; ``--repeats k`` runs each k times, interleaved B C, C B, B C ..., and keeps
the run of median total time (all runs under ``repeats``). ``--tree DIR`` takes the current
scalegp from another checkout too. ``--skip-peers`` runs scalegp only.

    python benchmarks/gp_scale.py --n 32768 --out benchmarks/results/gp_scale_cpu.json
    # after a change to scalegp only: rerun it, keep the peers' rows
    python benchmarks/gp_scale.py --n 32768 --reuse-peers benchmarks/results/gp_scale_cpu.json \
        --out benchmarks/results/gp_scale_cpu.json
    # this checkout against an older one, scalegp only, twice each
    python benchmarks/gp_scale.py --n 32768 --skip-peers --baseline-tree ../wt-base --repeats 2 \
        --out /tmp/gp_scale_vs_base.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import logging
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness  # noqa: E402

PEER_VERSIONS = ("numpy", "scipy", "jax", "jaxlib", "sklearn", "torch", "gpytorch",
                 "linear_operator")


def make_data(n, d, num_test, seed=0):
    """``--data smooth``: a smooth function of points uniform in [-2, 2]^d, noise sd 0.1. The
    test points come from their own stream, so that they are the same for every n (fits at
    different n are compared on one test set)."""
    def draw(count, rng):
        x = rng.uniform(-2, 2, size=(count, d))
        f = np.sin(x @ np.linspace(0.6, 1.4, d)) + 0.5 * np.cos(1.5 * x[:, 0] * x[:, -1])
        return x, f + 0.1 * rng.normal(size=count)

    x, y = draw(n, np.random.default_rng(seed))
    x_test, y_test = draw(num_test, np.random.default_rng([seed, 1]))
    return x, y, x_test, y_test


def make_short_data(n, d, num_test, lengthscale, seed=0, features=2000):
    """``--data short``: points uniform in the unit cube and a draw (random Fourier features,
    ``features`` of them) of a GP with an RBF kernel of ``lengthscale`` (a fraction of the
    extent), unit variance, noise sd 0.1: the case pruning is for."""
    rng = np.random.default_rng(seed)
    omega = rng.standard_normal((features, d)) / lengthscale
    phase = rng.uniform(0, 2 * np.pi, features)
    amplitude = rng.standard_normal(features) * np.sqrt(2.0 / features)
    x = rng.uniform(size=(n + num_test, d))
    f = np.concatenate([np.cos(chunk @ omega.T + phase) @ amplitude
                        for chunk in np.array_split(x, max(1, (n + num_test) // 20000))])
    y = f + 0.1 * rng.normal(size=n + num_test)
    return x[:n], y[:n], x[n:], y[n:]


def data_for(n, args):
    if args.data == "short":
        return make_short_data(n, args.d, args.num_test, args.data_lengthscale)
    return make_data(n, args.d, args.num_test)


def metrics(mean, std, y):
    rmse = float(np.sqrt(np.mean((mean - y) ** 2)))
    nll = float(np.mean(0.5 * np.log(2 * np.pi * std**2) + 0.5 * ((y - mean) / std) ** 2))
    return rmse, nll


def _matern32(d):
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

    return ConstantKernel(1.0) * Matern(np.ones(d), nu=1.5) + WhiteKernel(0.1)


#: ``--kernel``: scalegp's model (the peers always fit ConstantKernel * RBF + WhiteKernel)
KERNELS = {"rbf": lambda d: None, "matern32": _matern32}


#: ``--prune``: the estimator's ``prune`` (not passed when the option is not given)
PRUNE_CHOICES = {"auto": "auto", "on": True, "off": False}


#: ``Objective`` calls are counted per phase by the solver they use: the exact fits (the subset
#: phase; on all data too when n <= exact_max_n) use the Cholesky solver, the BBMM stages BBMM.
SOLVER_PHASES = {"CholeskySolver": "subset", "BBMMSolver": "full"}


class ObjectiveCounter:
    """Counts the estimator's objective calls (``scalegp.estimators._gpr_fit.Objective``, what
    scipy calls) per phase, by wrapping ``Objective.__call__`` in this process. Where that class
    or method does not exist (another version of scalegp), nothing is counted and ``summary()``
    says why.

    An ``Objective`` that remembers its recent points and counts the evaluations it actually
    made (attribute ``evaluations``) may answer a call from memory: then ``evaluations`` (the
    solver's work) is below ``calls``; without that attribute every call is an evaluation."""

    def __init__(self):
        self.calls = []  # (phase, n, seconds, CG iterations or None)
        self.objectives = {}  # id -> (objective, phase)
        self.note = None
        try:
            try:
                from scalegp.estimators import _gpr_fit as module
            except ImportError:  # a tree before issue 59
                from scalegp.estimators import _gpr_optimise as module

            cls = module.Objective
            original = cls.__call__
        except (ImportError, AttributeError) as exc:
            self.note = f"not counted: {type(exc).__name__}: {exc}"
            return
        calls, objectives = self.calls, self.objectives

        @functools.wraps(original)
        def counted(objective, *a, **kw):
            start = time.perf_counter()
            try:
                return original(objective, *a, **kw)
            finally:
                solver = type(getattr(objective, "solver", None)).__name__
                phase = SOLVER_PHASES.get(solver, solver)
                x = getattr(objective, "x", None)
                cg = getattr(objective, "cg_iterations", None)
                calls.append((phase, None if x is None else int(x.shape[0]),
                              time.perf_counter() - start, None if cg is None else int(cg)))
                objectives[id(objective)] = (objective, phase)

        cls.__call__ = counted

    def summary(self) -> dict:
        """``{phase: {calls, evaluations, n, seconds (inside the objective), first_s (the first
        call, which compiles), seconds_each and cg_iterations (per call; BBMM phases only)}}``,
        or ``{"note": ...}``. A phase whose calls ran on several numbers of points (an exact
        fit on a subset and then on all data; BBMM stages on growing subsets) has one entry per
        number, keyed ``"{phase} n={n}"``."""
        if self.note:
            return {"note": self.note}
        sizes = {}
        for phase, n, *_ in self.calls:
            sizes.setdefault(phase, set()).add(n)

        def key_of(phase, n):
            return phase if len(sizes.get(phase, ())) <= 1 else f"{phase} n={n}"

        out = {}
        for phase, n, seconds, cg in self.calls:
            key = key_of(phase, n)
            entry = out.setdefault(key, {"calls": 0, "evaluations": 0, "n": n, "seconds": 0.0,
                                         "first_s": seconds, "seconds_each": [],
                                         "cg_iterations": []})
            entry["calls"] += 1
            entry["seconds"] += seconds
            entry["seconds_each"].append(round(seconds, 3))
            entry["cg_iterations"].append(cg)
        made = {}  # key -> evaluations each objective says it made (None: it does not say)
        for objective, phase in self.objectives.values():
            count = getattr(objective, "evaluations", None)
            x = getattr(objective, "x", None)
            key = key_of(phase, None if x is None else int(x.shape[0]))
            made.setdefault(key, []).append(count if isinstance(count, int) else None)
        for key, entry in out.items():
            counts = made.get(key, [])
            entry["evaluations"] = sum(counts) if counts and None not in counts else entry["calls"]
            if not any(entry["cg_iterations"]):  # Cholesky: no CG, and many calls
                del entry["cg_iterations"], entry["seconds_each"]
        return out


def phase_split(records, start, fit_end):
    """``(subset_end, full_end)`` from the (time, ...) log records of a fit, each a record (or
    ``start``): the last "exact fit ..." and the last "BBMM fit ..." record (the message is the
    record's last item; text after its start, such as an elapsed time, is ignored)."""
    subset_end = max([r for r in records if r[-1].startswith("exact fit")], default=start)
    full_end = max([r for r in records if r[-1].startswith("BBMM fit")], default=subset_end)
    return subset_end, min(full_end, fit_end)


def cg_iterations(messages):
    """The ``CG iterations N`` of each progress message (None where a message has none)."""
    out = []
    for m in messages:
        match = re.search(r"CG iterations (\d+)", m)
        out.append(int(match.group(1)) if match else None)
    return out


def run_scalegp(n, args, tree=None):
    """One scalegp row; ``tree``: import scalegp from that checkout (default: this one's)."""
    source = harness.import_scalegp(tree)
    import jax

    if args.float64:
        jax.config.update("jax_enable_x64", True)
    from scalegp import ScalableGPRegressor

    counter = ObjectiveCounter()
    x, y, x_test, y_test = data_for(n, args)
    records = []

    class Recorder(logging.Handler):
        def emit(self, record):
            records.append((time.perf_counter(), time.process_time(), record.getMessage()))

    logger = logging.getLogger("scalegp.gp")
    logger.addHandler(Recorder())
    logger.setLevel(logging.INFO)
    settings = {"preconditioner_rank": args.rank, "num_probes": args.probes,
                "love_rank": args.love_rank, "exact_max_n": getattr(args, "exact_max_n", None),
                "lengthscale": getattr(args, "lengthscale", None),
                "prune": PRUNE_CHOICES.get(getattr(args, "prune", None)),
                "full_data_tol": getattr(args, "full_data_tol", None)}
    model = ScalableGPRegressor(
        kernel=KERNELS[args.kernel](args.d),
        normalize_y=True, random_state=0, subset_size=args.subset_size,
        max_iter_full=args.full_steps, verbose=1,
        **{k: v for k, v in settings.items() if v is not None},
    )
    def now():
        return time.perf_counter(), time.process_time()

    sampler = harness.RssSampler()
    start = now()
    model.fit(x, y)
    fit_end = now()
    mean = model.predict(x_test)
    mean_end = now()
    mean, std = model.predict(x_test, return_std=True)
    total = now()
    sampler.stop()
    rmse, nll = metrics(mean, std, y_test)
    # A BBMM fit without steps on all data leaves its log marginal likelihood to its first
    # reading (one more evaluation on all data, after the timed run and its peak memory):
    # read only with --evaluate-nlml.
    max_rss_mb = harness.rss_peak_mb()
    device = jax.devices()[0]
    device_peak = (None if device.platform == "cpu"
                   else (device.memory_stats() or {}).get("peak_bytes_in_use"))
    lml_known = "log_marginal_likelihood_value_" in vars(model)
    lml_start = time.perf_counter()
    lml = (model.log_marginal_likelihood_value_ if lml_known or args.evaluate_nlml else None)
    lml_s = None if lml_known or lml is None else time.perf_counter() - lml_start
    subset_end, full_end = phase_split(records, start, fit_end)
    bounds = {"subset_s": (start, subset_end), "full_s": (subset_end, full_end),
              "solve_s": (full_end, fit_end), "predict_mean_s": (fit_end, mean_end),
              "predict_std_s": (mean_end, total)}
    full_iters = [m for *_, m in records if m.startswith("BBMM fit")]
    params = model.get_params()
    # The same fit again in this process, on the programs the first one compiled: the first
    # fit's time less this one's is about its compilation (an accelerator's main cost there).
    refit_s = None
    if getattr(args, "refit", False):
        from sklearn.base import clone

        again = time.perf_counter()
        clone(model).fit(x, y)
        refit_s = time.perf_counter() - again
    return {
        "n": n, "fit_s": fit_end[0] - start[0], "total_s": total[0] - start[0], "rmse": rmse,
        "refit_s": refit_s, "device": device.device_kind, "device_peak_bytes": device_peak,
        "nll": nll,
        "phases": {k: b[0] - a[0] for k, (a, b) in bounds.items()},
        "full_data_iterations": full_iters,
        "full_cg_iterations": cg_iterations(full_iters),
        "objective_evaluations": counter.summary(),
        "cpu_s": total[1] - start[1],
        "cpu_utilisation": (total[1] - start[1]) / (total[0] - start[0]),
        "phase_cpu_utilisation": {k: (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else None
                                  for k, (a, b) in bounds.items()},
        "solver": model.solver_, "kernel": str(model.kernel_), "noise": model.noise_,
        "log_marginal_likelihood": lml,
        "log_marginal_likelihood_evaluated_after_fit_s": lml_s,
        "settings": {k: params[k] for k in (
            "subset_size", "max_iter_full", "full_data_tol", "num_probes",
            "preconditioner_rank", "cg_tol", "love_rank", "optimizer", "exact_max_n",
            "lengthscale", "prune") if k in params},
        "lengthscale_": np.atleast_1d(getattr(model, "lengthscale_", np.nan)).tolist(),
        "dtype": "float64" if args.float64 else "float32",
        "max_rss_mb": max_rss_mb,
        "phase_max_rss_mb": {k: sampler.peak_between(a[0], b[0]) for k, (a, b) in bounds.items()},
        **source,
    }


def run_sklearn(n, args):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    x, y, x_test, y_test = data_for(n, args)
    model = GaussianProcessRegressor(
        ConstantKernel() * RBF(np.ones(args.d)) + WhiteKernel(0.1), normalize_y=True,
        random_state=0)
    start = time.perf_counter()
    model.fit(x, y)
    mean, std = model.predict(x_test, return_std=True)
    elapsed = time.perf_counter() - start
    rmse, nll = metrics(mean, std, y_test)
    return {"n": n, "total_s": elapsed, "rmse": rmse, "nll": nll, "kernel": str(model.kernel_),
            "max_rss_mb": harness.rss_peak_mb()}


def run_gpytorch(n, args):
    import gpytorch
    import torch

    torch.manual_seed(0)
    x, y, x_test, y_test = data_for(n, args)
    y_mean, y_std = y.mean(), y.std()
    train_x = torch.tensor(x, dtype=torch.float32)
    train_y = torch.tensor((y - y_mean) / y_std, dtype=torch.float32)
    test_x = torch.tensor(x_test, dtype=torch.float32)

    class ExactGPModel(gpytorch.models.ExactGP):
        def __init__(self, train_x, train_y, likelihood):
            super().__init__(train_x, train_y, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(ard_num_dims=train_x.shape[1]))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x),
                                                             self.covar_module(x))

    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(train_x, train_y, likelihood)
    rank = args.rank if args.rank is not None else 768
    love_rank = args.love_rank if args.love_rank is not None else 1024
    settings = [
        gpytorch.settings.max_cholesky_size(0),
        gpytorch.settings.cg_tolerance(1e-3),
        gpytorch.settings.eval_cg_tolerance(1e-4),
        gpytorch.settings.max_cg_iterations(1000),
        gpytorch.settings.num_trace_samples(args.probes or 30),
        gpytorch.settings.max_preconditioner_size(rank),
        gpytorch.settings.max_root_decomposition_size(love_rank),
    ]
    for s in settings:
        s.__enter__()
    start = time.perf_counter()
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    for i in range(args.gpytorch_iters):
        optimizer.zero_grad()
        loss = -mll(model(train_x), train_y)
        loss.backward()
        optimizer.step()
        print(f"gpytorch n={n} iter {i + 1}: loss {loss.item():.5f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    fit_end = time.perf_counter()
    model.eval()
    likelihood.eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var():
        pred = likelihood(model(test_x))
        mean = pred.mean.numpy() * y_std + y_mean
        std = pred.stddev.numpy() * y_std
    total = time.perf_counter()
    rmse, nll = metrics(mean, std, y_test)
    return {
        "n": n, "fit_s": fit_end - start, "total_s": total - start, "rmse": rmse, "nll": nll,
        "lengthscale": model.covar_module.base_kernel.lengthscale.detach().numpy().ravel()
        .tolist(),
        "outputscale": float(model.covar_module.outputscale),
        "noise": float(likelihood.noise), "iterations": args.gpytorch_iters,
        "max_rss_mb": harness.rss_peak_mb(),
    }


def in_child(fn, n, args, timeout, mem_limit_gb=None, tree=None):
    """``fn(n, args)`` in a fresh process (``fn(n, args, tree)`` with a ``tree``); a timeout or
    a crash becomes an error row."""
    call_args, head = (n, args), {"n": n}
    if tree is not None:
        call_args, head = (n, args, tree), {"n": n, "tree": str(Path(tree).resolve())}
    result = harness.run_in_child(fn, call_args, timeout, mem_limit_gb, head=head)
    print(f"{fn.__name__} n={n}: {json.dumps(result)}", flush=True)
    return result


def _median_row(rows):
    """The row of median ``total_s`` (the lower median for an even count) with every run's times
    under ``repeats``; an error row if any run failed."""
    failed = [r for r in rows if "error" in r]
    if failed:
        return {**failed[0], "repeats": [_brief(r) for r in rows]}
    ranked = sorted(rows, key=lambda r: r["total_s"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["repeats"] = [_brief(r) for r in rows]
    row["median_total_s"] = statistics.median(r["total_s"] for r in rows)
    row["median_fit_s"] = statistics.median(r["fit_s"] for r in rows)
    return row


def _brief(row):
    keys = ("order", "total_s", "fit_s", "phases", "rmse", "nll", "cpu_utilisation", "wall_s",
            "loadavg", "error")
    return {k: row[k] for k in keys if k in row}


def _ratio(a, b):
    try:
        return a / b
    except (TypeError, ZeroDivisionError):
        return None


def _difference(a, b):
    return None if a is None or b is None else a - b


def compare(current, baseline) -> dict:
    """Current against baseline: speedups (baseline time / current time: > 1 is faster now) of
    the total, the fit and each phase; accuracy as ratios current / baseline (RMSE: < 1 is better;
    NLL is negative, so the difference is given too: < 0 is better)."""
    if "error" in current or "error" in baseline:
        return {"error": current.get("error") or baseline.get("error")}

    def time_of(row, key):
        return row.get(f"median_{key}", row[key])

    out = {
        "total_speedup": _ratio(time_of(baseline, "total_s"), time_of(current, "total_s")),
        "fit_speedup": _ratio(time_of(baseline, "fit_s"), time_of(current, "fit_s")),
        "fit_s": {"scalegp": time_of(current, "fit_s"), "baseline": time_of(baseline, "fit_s")},
        "total_s": {"scalegp": time_of(current, "total_s"),
                    "baseline": time_of(baseline, "total_s")},
        "phase_speedup": {k: _ratio(baseline["phases"].get(k), v)
                          for k, v in current["phases"].items()},
        "rmse_ratio": _ratio(current["rmse"], baseline["rmse"]),
        "nll_ratio": _ratio(current["nll"], baseline["nll"]),
        "nll_diff": current["nll"] - baseline["nll"],
        "log_marginal_likelihood_diff": _difference(current["log_marginal_likelihood"],
                                                    baseline["log_marginal_likelihood"]),
        "objective_evaluations": {
            who: {phase: e.get("evaluations") for phase, e in row["objective_evaluations"]
                  .items() if isinstance(e, dict)}
            for who, row in (("scalegp", current), ("baseline", baseline))},
        "commits": {"scalegp": current.get("scalegp_commit"),
                    "baseline": baseline.get("scalegp_commit")},
    }
    return out


def scalegp_rows(args):
    """``(current row, baseline row or None)``: scalegp at ``args.n``, from this checkout (or
    ``--tree``) and, with ``--baseline-tree``, from that checkout, interleaved: the baseline
    first, then ABBA order over ``--repeats`` (B C, C B, B C, ...), so slow drift of the machine's
    load falls on both alike. With repeats, each row is the run of median total time."""
    trees = {"scalegp": args.tree}
    if args.baseline_tree:
        trees["baseline"] = args.baseline_tree
    runs = {who: [] for who in trees}
    order = list(trees)[::-1]  # baseline first
    for i in range(args.repeats):
        for who in order if i % 2 == 0 else order[::-1]:
            row = in_child(run_scalegp, args.n, args, 2 * args.budget, tree=trees[who])
            row["order"] = len(runs["scalegp"]) + len(runs.get("baseline", []))
            row["loadavg"] = harness.loadavg()
            runs[who].append(row)
    rows = {who: (r[0] if args.repeats == 1 else _median_row(r)) for who, r in runs.items()}
    return rows["scalegp"], rows.get("baseline")


def ladder(fn, args, mem_limit_gb=None):
    """n = 1024, 2048, ... up to args.n; stops after the first run that fails or exceeds the
    budget (that row says where the peer stops)."""
    rows = []
    n = args.ladder_start
    while n <= args.n:
        row = in_child(fn, n, args, args.budget, mem_limit_gb)
        rows.append(row)
        if "error" in row or row["total_s"] > args.budget:
            break
        n *= 2
    return rows


#: import name -> distribution name, for the versions of peers that are skipped (not imported)
DISTRIBUTIONS = {"sklearn": "scikit-learn", "linear_operator": "linear-operator"}


def peer_versions(args) -> dict:
    """``{module: version}``: imported (None if it does not import), except the modules of
    skipped peers, read from the installed metadata without importing them."""
    skipped = set()
    if args.skip_gpytorch:
        skipped |= {"torch", "gpytorch", "linear_operator"}
    if args.skip_sklearn:
        skipped.add("sklearn")
    out = harness.versions([m for m in PEER_VERSIONS if m not in skipped])
    for name in skipped:
        try:
            out[name] = importlib.metadata.version(DISTRIBUTIONS.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return {m: out[m] for m in PEER_VERSIONS}


def summary(report) -> str:
    """A few lines: the scalegp rows (and the baseline's) with their phases, and the speedup."""
    lines = []
    for key in ("baseline", "scalegp", "scalegp_at_gpytorch_n"):
        row = report.get(key)
        if row is None:
            continue
        head = f"{key:9s} n={row['n']} {row.get('scalegp_commit') or ''}"
        if "error" in row:
            lines.append(f"{head}: {row['error']}")
            continue
        phases = " ".join(f"{k[:-2]} {v:.1f}" for k, v in row["phases"].items())
        evals = " ".join(f"{k} {e['evaluations']}" for k, e in row.get(
            "objective_evaluations", {}).items() if isinstance(e, dict))
        lines.append(f"{head}: total {row['total_s']:.1f} s, fit {row['fit_s']:.1f} s "
                     f"[{phases}], RMSE {row['rmse']:.4f}, NLL {row['nll']:.3f}, "
                     f"objective evaluations [{evals}], CPU x{row.get('cpu_utilisation', 0):.2f}")
    if "baseline_comparison" in report:
        c = report["baseline_comparison"]
        if "error" in c:
            lines.append(f"comparison: {c['error']}")
        else:
            lines.append(f"speedup vs baseline: total x{c['total_speedup']:.2f}, fit "
                         f"x{c['fit_speedup']:.2f}; RMSE ratio {c['rmse_ratio']:.4f}, NLL "
                         f"{c['nll_diff']:+.4f}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--num-test", type=int, default=1000)
    parser.add_argument("--subset-size", type=int, default=2048)
    parser.add_argument("--full-steps", type=int, default=3,
                        help="max_iter_full: scoring steps per BBMM stage (subsets, all data)")
    parser.add_argument("--rank", type=int, default=None, help="preconditioner rank (default: "
                        "the estimator's)")
    parser.add_argument("--love-rank", type=int, default=None)
    parser.add_argument("--exact-max-n", type=int, default=None,
                        help="largest n fitted by exact Cholesky (default: the estimator's, "
                             "4096); lower it to time the BBMM path at a small n")
    parser.add_argument("--probes", type=int, default=None)
    parser.add_argument("--full-data-tol", type=float, default=None,
                        help="scalegp's full_data_tol (default: the estimator's; a baseline "
                             "tree without the parameter needs it left out)")
    parser.add_argument("--evaluate-nlml", action="store_true",
                        help="read the log marginal likelihood of a fit that left it "
                             "unevaluated (one more BBMM evaluation on all data, timed apart "
                             "from the run)")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="rbf",
                        help="scalegp's kernel: the default ARD RBF model, or "
                             "ConstantKernel * Matern(nu=1.5, ARD) + WhiteKernel")
    parser.add_argument("--data", choices=("smooth", "short"), default="smooth",
                        help="smooth: a smooth function on [-2, 2]^d; short: a GP draw with a "
                             "short lengthscale (--data-lengthscale) on the unit cube")
    parser.add_argument("--data-lengthscale", type=float, default=0.01,
                        help="--data short: the generating RBF lengthscale (fraction of the "
                             "extent)")
    parser.add_argument("--lengthscale", type=float, default=None,
                        help="scalegp's initial lengthscale (default: the estimator's)")
    parser.add_argument("--prune", choices=sorted(PRUNE_CHOICES), default=None,
                        help="scalegp's prune (default: the estimator's, 'auto')")
    parser.add_argument("--budget", type=float, default=600.0,
                        help="seconds per run (the 10-minute target); longer runs are stopped")
    parser.add_argument("--ladder-start", type=int, default=1024)
    parser.add_argument("--gpytorch-iters", type=int, default=50)
    parser.add_argument("--peer-mem-gb", type=float, default=12.0,
                        help="address-space cap of each peer process")
    parser.add_argument("--skip-sklearn", action="store_true")
    parser.add_argument("--skip-gpytorch", action="store_true")
    parser.add_argument("--skip-peers", action="store_true",
                        help="scalegp only: --skip-sklearn and --skip-gpytorch (their modules "
                             "are not even imported)")
    parser.add_argument("--tree", default=None, metavar="DIR",
                        help="import scalegp from this checkout (default: the one holding this "
                             "script)")
    parser.add_argument("--baseline-tree", default=None, metavar="DIR",
                        help="also run scalegp, same settings, from this checkout (e.g. a git "
                             "worktree of an older commit): row 'baseline', plus "
                             "speedup_vs_baseline and baseline_comparison")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each scalegp row (interleaved with the baseline's); the "
                             "row kept is the run of median total time, all runs under repeats")
    parser.add_argument("--reuse-peers", default=None, metavar="RESULT.json",
                        help="take the scikit-learn and GPyTorch rows from an earlier result "
                             "of the same --n/--d/--num-test instead of running them again "
                             "(they do not depend on scalegp); recorded under peers_from")
    parser.add_argument("--refit", action="store_true",
                        help="fit scalegp again in the same process (refit_s: the programs "
                             "compiled; fit_s - refit_s is about the compilation)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.skip_peers:
        args.skip_sklearn = args.skip_gpytorch = True
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    for key in ("tree", "baseline_tree"):
        tree = getattr(args, key)
        if tree is not None:
            if not (Path(tree) / "scalegp" / "__init__.py").is_file():
                parser.error(f"--{key.replace('_', '-')}: {tree} has no scalegp/__init__.py")
            setattr(args, key, str(Path(tree).resolve()))

    run = harness.Run(__file__)
    report = {
        "machine": {**harness.host(), "processor": platform.processor()},
        "versions": {"python": platform.python_version(), **peer_versions(args)},
        "command": run.command,
        "args": vars(args),
        "loadavg_start": run.loadavg_start,
    }
    if args.reuse_peers:
        with open(args.reuse_peers) as f:
            old = json.load(f)
        for key in ("n", "d", "num_test"):
            if old["args"][key] != getattr(args, key):
                parser.error(f"--reuse-peers: {key} was {old['args'][key]} there")
    report["scalegp"], baseline = scalegp_rows(args)
    if baseline is not None:
        report["baseline"] = baseline
        comparison = compare(report["scalegp"], baseline)
        report["speedup_vs_baseline"] = comparison.get("total_speedup")
        report["baseline_comparison"] = comparison
    if args.reuse_peers:
        report["peers_from"] = {k: old.get(k) for k in (
            "command", "versions", "loadavg_start", "loadavg_end")}
        report.update({k: old[k] for k in ("sklearn", "gpytorch") if k in old})
    else:
        if not args.skip_sklearn:
            report["sklearn"] = ladder(run_sklearn, args, args.peer_mem_gb)
        if not args.skip_gpytorch and report["versions"]["gpytorch"]:
            report["gpytorch"] = ladder(run_gpytorch, args, args.peer_mem_gb)
    if "gpytorch" in report:
        done = [r["n"] for r in report["gpytorch"] if "error" not in r]
        if done and max(done) < args.n:
            report["scalegp_at_gpytorch_n"] = in_child(run_scalegp, max(done), args,
                                                       2 * args.budget, tree=args.tree)
    run.end()
    report["loadavg_end"] = run.loadavg_end
    if args.out:
        harness.write_json(args.out, report, indent=2)
    print(summary(report))


if __name__ == "__main__":
    main()
