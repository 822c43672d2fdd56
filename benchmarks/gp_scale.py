"""End-to-end GP regression at scale on CPU: ScalableGPRegressor vs scikit-learn's GPR.

Pipeline timed: hyperparameters (subset recipe + BBMM steps), the alpha solve, then mean and std
for ``--num-test`` points. scikit-learn's GaussianProcessRegressor (same kernel, same start) is
run at n = 1024, 2048, ... until one fit exceeds ``--sklearn-budget`` seconds or n reaches
``--n``; the largest n it finished is reported.

    python benchmarks/gp_scale.py --n 32768 --out benchmarks/results/gp_scale_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

import numpy as np


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


def run_scalegp(x, y, x_test, y_test, args):
    import jax

    if args.float64:
        jax.config.update("jax_enable_x64", True)
    from scalegp._gp_regressor import ScalableGPRegressor

    model = ScalableGPRegressor(
        normalize_y=True, random_state=0, subset_size=args.subset_size,
        max_iter_full=args.full_steps, preconditioner_rank=args.rank, num_probes=args.probes,
        verbose=args.verbose,
    )
    start = time.perf_counter()
    model.fit(x, y)
    fit_time = time.perf_counter() - start
    mean, std = model.predict(x_test, return_std=True)
    total = time.perf_counter() - start
    rmse, nll = metrics(mean, std, y_test)
    return {
        "n": len(y), "fit_s": fit_time, "total_s": total, "rmse": rmse, "nll": nll,
        "solver": model.solver_, "lengthscale": model.lengthscale_.tolist(),
        "noise": model.noise_, "outputscale": model.outputscale_,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_sklearn(x, y, x_test, y_test, n_max, budget):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    d = x.shape[1]
    results = []
    n = 1024
    while n <= n_max:
        model = GaussianProcessRegressor(
            ConstantKernel() * RBF(np.ones(d)) + WhiteKernel(0.1), normalize_y=True,
            random_state=0)
        start = time.perf_counter()
        model.fit(x[:n], y[:n])
        mean, std = model.predict(x_test, return_std=True)
        elapsed = time.perf_counter() - start
        rmse, nll = metrics(mean, std, y_test)
        results.append({"n": n, "total_s": elapsed, "rmse": rmse, "nll": nll})
        print(f"sklearn n={n}: {elapsed:.1f} s, RMSE {rmse:.4f}, NLL {nll:.4f}", flush=True)
        if elapsed > budget:
            break
        n *= 2
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--num-test", type=int, default=1000)
    parser.add_argument("--subset-size", type=int, default=2048)
    parser.add_argument("--full-steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=100)
    parser.add_argument("--probes", type=int, default=30)
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--sklearn-budget", type=float, default=600.0)
    parser.add_argument("--skip-sklearn", action="store_true")
    parser.add_argument("--verbose", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    x, y, x_test, y_test = make_data(args.n, args.d, args.num_test)
    report = {"machine": platform.platform(), "args": vars(args)}
    report["scalegp"] = run_scalegp(x, y, x_test, y_test, args)
    print("scalegp:", json.dumps(report["scalegp"]), flush=True)
    if not args.skip_sklearn:
        report["sklearn"] = run_sklearn(x, y, x_test, y_test, args.n, args.sklearn_budget)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
