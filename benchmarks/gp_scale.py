"""End-to-end GP regression at scale on CPU: ScalableGPRegressor against scikit-learn's GPR and
GPyTorch's CG-based ExactGP, on the same synthetic data (d = 4 by default).

What is timed, each configuration in a child process with a timeout (a run that runs out of time
or memory becomes an error row, not a crash):

- scalegp (``ScalableGPRegressor``, float32, default settings unless overridden): fit (random
  subset of ``--subset-size`` points by exact L-BFGS-B, then ``--full-steps`` L-BFGS-B iterations
  of the BBMM objective on all data, then the ``alpha`` solve), then mean and std for
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

Both targets are standardised (``normalize_y``) and metrics are on the raw test targets: RMSE and
the mean Gaussian negative log predictive density (NLL, noise included).

    python benchmarks/gp_scale.py --n 32768 --out benchmarks/results/gp_scale_cpu.json
    # after a change to scalegp only: rerun it, keep the peers' rows
    python benchmarks/gp_scale.py --n 32768 --reuse-peers benchmarks/results/gp_scale_cpu.json \
        --out benchmarks/results/gp_scale_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
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
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, size=(n + num_test, d))
    f = np.sin(x @ np.linspace(0.6, 1.4, d)) + 0.5 * np.cos(1.5 * x[:, 0] * x[:, -1])
    y = f + 0.1 * rng.normal(size=n + num_test)
    return x[:n], y[:n], x[n:], y[n:]


def metrics(mean, std, y):
    rmse = float(np.sqrt(np.mean((mean - y) ** 2)))
    nll = float(np.mean(0.5 * np.log(2 * np.pi * std**2) + 0.5 * ((y - mean) / std) ** 2))
    return rmse, nll


def _matern32(d):
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

    return ConstantKernel(1.0) * Matern(np.ones(d), nu=1.5) + WhiteKernel(0.1)


#: ``--kernel``: scalegp's model (the peers always fit ConstantKernel * RBF + WhiteKernel)
KERNELS = {"rbf": lambda d: None, "matern32": _matern32}


def run_scalegp(n, args):
    import jax

    if args.float64:
        jax.config.update("jax_enable_x64", True)
    from scalegp import ScalableGPRegressor

    x, y, x_test, y_test = make_data(n, args.d, args.num_test)
    records = []

    class Recorder(logging.Handler):
        def emit(self, record):
            records.append((time.perf_counter(), record.getMessage()))

    logger = logging.getLogger("scalegp.gp")
    logger.addHandler(Recorder())
    logger.setLevel(logging.INFO)
    settings = {"preconditioner_rank": args.rank, "num_probes": args.probes,
                "love_rank": args.love_rank}
    model = ScalableGPRegressor(
        kernel=KERNELS[args.kernel](args.d),
        normalize_y=True, random_state=0, subset_size=args.subset_size,
        max_iter_full=args.full_steps, verbose=1,
        **{k: v for k, v in settings.items() if v is not None},
    )
    start = time.perf_counter()
    model.fit(x, y)
    fit_end = time.perf_counter()
    mean = model.predict(x_test)
    mean_end = time.perf_counter()
    mean, std = model.predict(x_test, return_std=True)
    total = time.perf_counter()
    rmse, nll = metrics(mean, std, y_test)
    subset_end = max([t for t, m in records if m.startswith("exact fit")], default=start)
    full_end = max([t for t, m in records if m.startswith("BBMM fit")], default=subset_end)
    full_iters = [m for _, m in records if m.startswith("BBMM fit")]
    params = model.get_params()
    return {
        "n": n, "fit_s": fit_end - start, "total_s": total - start, "rmse": rmse, "nll": nll,
        "phases": {
            "subset_s": subset_end - start, "full_s": full_end - subset_end,
            "solve_s": fit_end - full_end, "predict_mean_s": mean_end - fit_end,
            "predict_std_s": total - mean_end,
        },
        "full_data_iterations": full_iters,
        "solver": model.solver_, "kernel": str(model.kernel_), "noise": model.noise_,
        "log_marginal_likelihood": model.log_marginal_likelihood_value_,
        "settings": {k: params[k] for k in (
            "subset_size", "max_iter_full", "num_probes", "preconditioner_rank", "cg_tol",
            "love_rank", "optimizer")},
        "dtype": "float64" if args.float64 else "float32",
        "max_rss_mb": harness.rss_peak_mb(),
    }


def run_sklearn(n, args):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    x, y, x_test, y_test = make_data(n, args.d, args.num_test)
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
    x, y, x_test, y_test = make_data(n, args.d, args.num_test)
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


def in_child(fn, n, args, timeout, mem_limit_gb=None):
    """``fn(n, args)`` in a fresh process; a timeout or a crash becomes an error row."""
    result = harness.run_in_child(fn, (n, args), timeout, mem_limit_gb, head={"n": n})
    print(f"{fn.__name__} n={n}: {json.dumps(result)}", flush=True)
    return result


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


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--num-test", type=int, default=1000)
    parser.add_argument("--subset-size", type=int, default=2048)
    parser.add_argument("--full-steps", type=int, default=3,
                        help="L-BFGS-B iterations of the BBMM objective on all data")
    parser.add_argument("--rank", type=int, default=None, help="preconditioner rank (default: "
                        "the estimator's)")
    parser.add_argument("--love-rank", type=int, default=None)
    parser.add_argument("--probes", type=int, default=None)
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="rbf",
                        help="scalegp's kernel: the default ARD RBF model, or "
                             "ConstantKernel * Matern(nu=1.5, ARD) + WhiteKernel")
    parser.add_argument("--budget", type=float, default=600.0,
                        help="seconds per run (the 10-minute target); longer runs are stopped")
    parser.add_argument("--ladder-start", type=int, default=1024)
    parser.add_argument("--gpytorch-iters", type=int, default=50)
    parser.add_argument("--peer-mem-gb", type=float, default=12.0,
                        help="address-space cap of each peer process")
    parser.add_argument("--skip-sklearn", action="store_true")
    parser.add_argument("--skip-gpytorch", action="store_true")
    parser.add_argument("--reuse-peers", default=None, metavar="RESULT.json",
                        help="take the scikit-learn and GPyTorch rows from an earlier result "
                             "of the same --n/--d/--num-test instead of running them again "
                             "(they do not depend on scalegp); recorded under peers_from")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    run = harness.Run(__file__)
    report = {
        "machine": {**harness.host(), "processor": platform.processor()},
        "versions": {"python": platform.python_version(), **harness.versions(PEER_VERSIONS)},
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
    report["scalegp"] = in_child(run_scalegp, args.n, args, 2 * args.budget)
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
                                                       2 * args.budget)
    run.end()
    report["loadavg_end"] = run.loadavg_end
    if args.out:
        harness.write_json(args.out, report, indent=2)


if __name__ == "__main__":
    main()
