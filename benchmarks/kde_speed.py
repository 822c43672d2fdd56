"""KDE speed: scalegp against scipy, scikit-learn, KDEpy and statsmodels (issue 6, "Speed").

Sections (all in one run, in this process; peers that are not installed are recorded as skipped):

- ``density``: log-density of 10,000 queries against n = 100,000 points at d = 2 and d = 8, all
  methods on the same whitened data with the same isotropic bandwidth (Scott's factor):
  scalegp (float32, compile timed separately), scipy.stats.gaussian_kde.logpdf, scikit-learn
  KernelDensity(algorithm="kd_tree", atol=rtol=0, i.e. exact), and for d = 2 KDEpy's FFTKDE on a
  512 x 512 grid (grid only, and linearly interpolated at the queries). Accuracy: the largest
  absolute log-density error against an exact float64 evaluation (numpy) of the first 1,000 queries.
- ``cv``: bandwidth selection on n = 20,000 points, d = 2: ScalableKernelDensity(bandwidth="cv")
  against GridSearchCV over 20 bandwidths with 5 folds on scikit-learn's KernelDensity (kd_tree,
  exact), both scored on 20,000 held-out points of the same distribution.
- ``statsmodels``: KDEMultivariate(bw="cv_ml") at n = 1,000 and 2,000 (d = 2) for reference, with
  scalegp's "cv-diag" (full leave-one-out, ``cv_subsample=None``) on the same data and the LOO
  log-likelihood each bandwidth reaches (exact float64).
- ``gpu``: "cv" on 1,000,000 points, d = 3, time and peak device memory; only on a GPU backend.

    python benchmarks/kde_speed.py                                   # the committed CPU run
    python benchmarks/kde_speed.py --quick --out /tmp/kde_quick.json # smaller sizes, a smoke test

scalegp runs on all cores through XLA; scipy's logpdf and scikit-learn's tree queries use one
core, and GridSearchCV gets ``--jobs`` worker processes (default: all cores). The load average
at the start and the end is recorded: CPU timings on shared machines move with other load.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.harness import log, timed  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "kde_speed_cpu.json"


# ----------------------------------------------------------------------------------------------
# helpers


def _optional(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def machine_info() -> dict:
    import jax

    return {
        **harness.host(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "x64": bool(jax.config.jax_enable_x64),
        "versions": harness.versions(("jax", "jaxlib", "numpy", "scipy", "sklearn", "KDEpy",
                                      "statsmodels")),
    }


def mixture(n, d, seed, draw):
    """n draws (seed ``draw``) from a fixed (seed ``seed``) correlated 4-component mixture."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=2.5, size=(4, d))
    mixing = np.eye(d) + 0.4 * rng.normal(size=(d, d))
    scales = np.array([0.3, 0.6, 1.0, 0.5])
    rng = np.random.default_rng([seed, draw])
    labels = rng.choice(4, size=n, p=[0.4, 0.3, 0.2, 0.1])
    return (centres[labels] + scales[labels, None] * rng.normal(size=(n, d))) @ mixing


def exact_log_density(Q, X, h, chunk=64):
    """Gaussian KDE log-density by the definition, float64 numpy, in query chunks."""
    from scipy.special import logsumexp

    Q, X = np.asarray(Q, np.float64), np.asarray(X, np.float64)
    d = X.shape[1]
    x_sq = np.sum(X**2, axis=1)
    out = np.empty(Q.shape[0])
    for start in range(0, Q.shape[0], chunk):
        q = Q[start : start + chunk]
        # direct differences for accuracy (no |a|^2 + |b|^2 - 2ab cancellation)
        sq = np.sum((q[:, None, :] - X[None, :, :]) ** 2, axis=-1) if d <= 8 else (
            np.sum(q**2, 1)[:, None] + x_sq[None, :] - 2 * q @ X.T
        )
        out[start : start + chunk] = logsumexp(-0.5 * sq / h**2, axis=1)
    return out - np.log(X.shape[0]) - 0.5 * d * np.log(2 * np.pi) - d * np.log(h)


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ----------------------------------------------------------------------------------------------
# sections


def section_density(cfg) -> list[dict]:
    from scalegp import kde

    scipy_stats = _optional("scipy.stats")
    neighbors = _optional("sklearn.neighbors")
    kdepy = _optional("KDEpy")
    rows = []
    for d in cfg["density_dims"]:
        n, n_q, n_ref = cfg["density_n"], cfg["density_queries"], cfg["density_ref"]
        m = min(cfg["peer_queries"], n_q)  # queries timed for scipy and scikit-learn
        raw = mixture(n, d, seed=d, draw=0)
        # whiten with the sample covariance: every method then uses the kernel covariance h^2 I
        location = raw.mean(axis=0)
        whitening = np.linalg.inv(np.linalg.cholesky(np.cov(raw.T))).T
        X = (raw - location) @ whitening
        Q = (mixture(n_q, d, seed=d, draw=1) - location) @ whitening
        h = kde.scott_factor(n, d)
        log(f"density d={d}: exact float64 reference on {n_ref} queries")
        reference = exact_log_density(Q[:n_ref], X, h)
        base = {"section": "density", "n": n, "queries": n_q, "dim": d, "bandwidth": h}

        def error(values):
            k = min(n_ref, len(values))
            return max_err(values[:k], reference[:k])

        X32, Q32 = X.astype(np.float32), Q.astype(np.float32)
        _, first_s = timed(kde.log_density, Q32, X32, h)
        times = []
        for _ in range(cfg["repeats"]):
            values, seconds = timed(kde.log_density, Q32, X32, h)
            times.append(seconds)
        rows.append({
            **base, "method": "scalegp kde.log_density (float32, impl=auto)",
            "seconds": float(np.median(times)), "seconds_all": times,
            "first_call_seconds": first_s, "timed_queries": n_q, "max_abs_err": error(values),
        })
        log(f"  scalegp {np.median(times):.2f} s (first call {first_s:.2f} s)")

        if scipy_stats is None:
            rows.append({**base, "method": "scipy gaussian_kde.logpdf", "skipped": "not installed"})
        else:
            model = scipy_stats.gaussian_kde(X.T, bw_method=h)
            values, seconds = timed(model.logpdf, Q[:m].T)
            rows.append({
                **base, "method": "scipy gaussian_kde.logpdf", "timed_queries": m,
                "seconds": seconds * n_q / m, "max_abs_err": error(values),
            })
            log(f"  scipy {seconds:.2f} s for {m} queries")

        if neighbors is None:
            rows.append({**base, "method": "sklearn KernelDensity", "skipped": "not installed"})
        else:
            estimator = neighbors.KernelDensity(bandwidth=h, algorithm="kd_tree", atol=0, rtol=0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, fit_s = timed(estimator.fit, X)
                values, seconds = timed(model.score_samples, Q[:m])
            rows.append({
                **base, "method": "sklearn KernelDensity(kd_tree, atol=rtol=0)",
                "timed_queries": m, "seconds": fit_s + seconds * n_q / m, "fit_seconds": fit_s,
                "max_abs_err": error(values),
            })
            log(f"  sklearn fit {fit_s:.2f} s, {seconds:.2f} s for {m} queries")

        if d == 2:
            rows.extend(_fft_rows(kdepy, cfg, base, X, Q, h, reference))
    return rows


def _fft_rows(kdepy, cfg, base, X, Q, h, reference) -> list[dict]:
    """KDEpy's FFTKDE on a grid: grid time, error on grid nodes, and linear interpolation."""
    if kdepy is None:
        return [{**base, "method": "KDEpy FFTKDE", "skipped": "not installed"}]
    from scipy.interpolate import RegularGridInterpolator

    g = cfg["fft_grid"]
    (grid, values), seconds = timed(
        lambda: kdepy.FFTKDE(kernel="gaussian", bw=h).fit(X).evaluate(grid_points=g)
    )
    axes = [np.unique(grid[:, k]) for k in range(2)]
    table = values.reshape(len(axes[0]), len(axes[1]))
    interp, interp_s = timed(
        lambda: RegularGridInterpolator(axes, table, bounds_error=False, fill_value=0.0)(Q)
    )
    # accuracy on 1,000 random grid nodes where the density is not negligible
    nodes = np.random.default_rng(0).choice(len(grid), size=min(1000, len(grid)), replace=False)
    exact_nodes = exact_log_density(grid[nodes], X, h)
    keep = exact_nodes > np.log(1e-4)
    with np.errstate(divide="ignore"):
        node_err = max_err(np.log(values[nodes][keep]), exact_nodes[keep])
        query_err = max_err(np.log(interp[: len(reference)]), reference)
    log(f"  KDEpy {seconds:.2f} s grid, {interp_s:.2f} s interpolation")
    return [
        {**base, "method": f"KDEpy FFTKDE ({g}x{g} grid)", "seconds": seconds,
         "timed_queries": 0, "grid_points": int(len(grid)), "max_abs_err_grid_nodes": node_err,
         "note": "grid only; error on 1,000 random grid nodes with density > 1e-4"},
        {**base, "method": f"KDEpy FFTKDE ({g}x{g} grid) + linear interpolation at the queries",
         "seconds": seconds + interp_s, "timed_queries": len(Q), "max_abs_err": query_err},
    ]


def section_cv(cfg) -> list[dict]:
    from scalegp import kde
    from scalegp import ScalableKernelDensity

    n = cfg["cv_n"]
    X = mixture(n, 2, seed=20, draw=0)
    test = mixture(n, 2, seed=20, draw=1)
    # standardise both with the training statistics: one scalar bandwidth then suits both axes
    location, spread = X.mean(axis=0), X.std(axis=0)
    X, test = (X - location) / spread, (test - location) / spread
    rows = []
    base = {"section": "cv", "n": n, "dim": 2, "test_points": n}

    def heldout(bandwidth):
        """Mean held-out log-likelihood, by one evaluator (scalegp float32) for every row."""
        return float(np.mean(ScalableKernelDensity(bandwidth=bandwidth).fit(X).score_samples(test)))

    for bandwidth in ("cv", "cv-diag"):
        model, cold_s = timed(ScalableKernelDensity(bandwidth=bandwidth, random_state=0).fit, X)
        _, warm_s = timed(ScalableKernelDensity(bandwidth=bandwidth, random_state=0).fit, X)
        result = model.cv_result_
        rows.append({
            **base, "method": f"scalegp ScalableKernelDensity(bandwidth={bandwidth!r})",
            "seconds": cold_s, "seconds_warm": warm_s,
            "note": "seconds: first fit in the process (JAX compilation included)",
            "bandwidth": np.atleast_1d(model.bandwidth_).tolist(),
            "heldout_mean_loglik": heldout(model.bandwidth_),
            "n_held_out_in_objective": result.n_held_out,
            "objective_evaluations": result.n_evaluations, "lbfgs_iterations": result.n_iter,
            "converged": result.converged,
        })
        log(f"cv {bandwidth}: {cold_s:.2f} s cold, {warm_s:.2f} s warm, "
            f"h={model.bandwidth_}, held-out {rows[-1]['heldout_mean_loglik']:.4f}")

    scott = ScalableKernelDensity(bandwidth="scott").fit(X)
    rows.append({
        **base, "method": "scalegp ScalableKernelDensity(bandwidth='scott')", "seconds": None,
        "bandwidth": np.atleast_1d(scott.bandwidth_).tolist(),
        "heldout_mean_loglik": heldout(scott.bandwidth_),
    })

    neighbors = _optional("sklearn.neighbors")
    if neighbors is None:
        rows.append({**base, "method": "GridSearchCV(KernelDensity)", "skipped": "no sklearn"})
        return rows
    from sklearn.model_selection import GridSearchCV

    grid = kde.scott_factor(n, 2) * np.logspace(-1.5, 0.2, cfg["grid_bandwidths"])
    folds, jobs = cfg["grid_folds"], cfg["jobs"]
    search = GridSearchCV(
        neighbors.KernelDensity(kernel="gaussian", algorithm="kd_tree"),
        {"bandwidth": grid}, cv=folds, n_jobs=jobs,
    )
    log(f"GridSearchCV: {len(grid)} bandwidths x {folds} folds, n_jobs={jobs}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, seconds = timed(search.fit, X)
        by_sklearn = float(np.mean(search.best_estimator_.score_samples(test)))
    best = float(search.best_params_["bandwidth"])
    rows.append({
        **base,
        "method": f"GridSearchCV(KernelDensity(kd_tree), {len(grid)} bandwidths, {folds} folds, "
                  f"n_jobs={jobs})",
        "seconds": seconds, "bandwidth": [best], "grid": grid.tolist(),
        "best_on_grid_edge": bool(best in (grid[0], grid[-1])),
        "heldout_mean_loglik": heldout(best), "heldout_mean_loglik_by_sklearn": by_sklearn,
    })
    log(f"GridSearchCV {seconds:.1f} s, h={best:.4f}, "
        f"held-out {rows[-1]['heldout_mean_loglik']:.4f}")
    return rows


def exact_loo(X, h):
    """Leave-one-out log-densities by the definition (float64; X has no duplicates)."""
    from scipy.special import logsumexp

    h = np.broadcast_to(np.asarray(h, np.float64), (X.shape[1],))
    e = -0.5 * np.sum(((X[:, None, :] - X[None, :, :]) / h) ** 2, axis=-1)
    np.fill_diagonal(e, -np.inf)
    n, d = X.shape
    return logsumexp(e, axis=1) - np.log(n - 1) - 0.5 * d * np.log(2 * np.pi) - np.log(h).sum()


def section_statsmodels(cfg) -> list[dict]:
    from scalegp import kde

    sm = _optional("statsmodels.nonparametric.kernel_density")
    rows = []
    for n in cfg["statsmodels_n"]:
        X = mixture(n, 2, seed=30, draw=n)
        base = {"section": "statsmodels", "n": n, "dim": 2}
        result, seconds = timed(
            kde.cross_validate_bandwidth, X.astype(np.float32), diagonal=True, cv_subsample=None
        )
        rows.append({
            **base, "method": "scalegp kde.cross_validate_bandwidth(diagonal=True, full LOO)",
            "seconds": seconds, "bandwidth": np.asarray(result.bandwidth).tolist(),
            "loo_mean_loglik": float(np.mean(exact_loo(X, result.bandwidth))),
            "note": "seconds include JAX compilation (new shapes)",
        })
        log(f"statsmodels section n={n}: scalegp {seconds:.2f} s")
        if sm is None:
            rows.append({**base, "method": "statsmodels KDEMultivariate", "skipped": "missing"})
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, seconds = timed(sm.KDEMultivariate, X, var_type="cc", bw="cv_ml")
        rows.append({
            **base, "method": "statsmodels KDEMultivariate(bw='cv_ml')", "seconds": seconds,
            "bandwidth": model.bw.tolist(),
            "loo_mean_loglik": float(np.mean(exact_loo(X, model.bw))),
        })
        log(f"  statsmodels {seconds:.2f} s")
    return rows


def section_gpu(cfg) -> list[dict]:
    import jax

    if jax.default_backend() != "gpu":
        return [{"section": "gpu", "skipped": f"backend is {jax.default_backend()!r}, not gpu"}]
    from scalegp import kde

    n = cfg["gpu_n"]
    X = mixture(n, 3, seed=40, draw=0).astype(np.float32)
    result, cold = timed(kde.cross_validate_bandwidth, X, random_state=0)
    _, warm = timed(kde.cross_validate_bandwidth, X, random_state=0)
    stats = jax.devices()[0].memory_stats() or {}
    return [{
        "section": "gpu", "n": n, "dim": 3, "method": "scalegp kde.cross_validate_bandwidth",
        "seconds": cold, "seconds_warm": warm, "bandwidth": [float(result.bandwidth)],
        "n_held_out_in_objective": result.n_held_out,
        "peak_device_mb": stats.get("peak_bytes_in_use", 0) / 2**20,
    }]


# ----------------------------------------------------------------------------------------------
# summary


def summarise(rows) -> dict:
    def find(section, dim, prefix):
        for r in rows:
            if (r.get("section") == section and r.get("dim") == dim
                    and r.get("method", "").startswith(prefix) and r.get("seconds") is not None):
                return r
        return None

    summary = {}
    for d in sorted({r["dim"] for r in rows if r.get("section") == "density"}):
        ours = find("density", d, "scalegp")
        entry = {"scalegp_seconds": ours["seconds"], "scalegp_max_abs_err": ours["max_abs_err"]}
        scipy_row, sk_row = find("density", d, "scipy"), find("density", d, "sklearn")
        if scipy_row:
            entry["speedup_vs_scipy"] = scipy_row["seconds"] / ours["seconds"]
            entry["at_least_5x_faster_than_scipy"] = entry["speedup_vs_scipy"] >= 5
        if sk_row:
            entry["speedup_vs_sklearn_kd_tree"] = sk_row["seconds"] / ours["seconds"]
            entry["faster_than_sklearn_kd_tree"] = entry["speedup_vs_sklearn_kd_tree"] > 1
            entry["sklearn_max_abs_err"] = sk_row["max_abs_err"]
        summary[f"density_d{d}"] = entry
    ours = find("cv", 2, "scalegp ScalableKernelDensity(bandwidth='cv')")
    grid = find("cv", 2, "GridSearchCV")
    if ours:
        entry = {"scalegp_cv_seconds": ours["seconds"], "under_60_seconds": ours["seconds"] < 60,
                 "scalegp_heldout": ours["heldout_mean_loglik"]}
        if grid:
            speedup = grid["seconds"] / ours["seconds"]
            entry.update({
                "gridsearch_seconds": grid["seconds"],
                "speedup_vs_gridsearch": speedup,
                "at_least_10x_faster": speedup >= 10,
                "gridsearch_heldout": grid["heldout_mean_loglik"],
                "heldout_equal_or_better": (
                    ours["heldout_mean_loglik"] >= grid["heldout_mean_loglik"] - 1e-4
                ),
            })
        summary["cv"] = entry
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--sections", nargs="+", default=["density", "cv", "statsmodels", "gpu"],
                        choices=["density", "cv", "statsmodels", "gpu"])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--peer-queries", type=int, default=None,
                        help="queries timed for scipy and scikit-learn (scaled linearly to all "
                             "queries); default: all of them")
    parser.add_argument("--jobs", type=int, default=-1, help="GridSearchCV n_jobs")
    args = parser.parse_args(argv)

    cfg = {
        "density_dims": [2, 8], "density_n": 100_000, "density_queries": 10_000,
        "density_ref": 1000, "repeats": 3, "fft_grid": 512, "cv_n": 20_000,
        "grid_bandwidths": 20, "grid_folds": 5,
        "statsmodels_n": [1000, 2000], "gpu_n": 1_000_000, "jobs": args.jobs,
    }
    if args.quick:
        cfg.update({"density_n": 10_000, "density_queries": 1000, "density_ref": 200, "repeats": 1,
                    "fft_grid": 128, "cv_n": 3000, "grid_bandwidths": 4, "grid_folds": 3,
                    "statsmodels_n": [300], "gpu_n": 100_000})
    cfg["peer_queries"] = args.peer_queries or cfg["density_queries"]

    run = harness.Run(__file__, argv)
    record = {
        "benchmark": "kde_speed",
        "command": run.command,
        "started": datetime.datetime.fromtimestamp(run.started, datetime.timezone.utc)
        .isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg_start": run.loadavg_start,
        "config": cfg,
        "notes": [
            "scalegp runs on all cores through XLA (float32); scipy logpdf and scikit-learn tree "
            "queries run on one core; GridSearchCV uses n_jobs worker processes.",
            "max_abs_err: largest absolute log-density error against an exact float64 numpy "
            "evaluation of the first density_ref queries.",
            "Peers timed on fewer queries than all (peer_queries < density_queries) are scaled "
            "linearly: every query costs the same for them.",
        ],
        "results": [],
    }
    sections = {"density": section_density, "cv": section_cv, "statsmodels": section_statsmodels,
                "gpu": section_gpu}
    for name in args.sections:
        log(f"section {name}")
        record["results"].extend(sections[name](cfg))
    record["summary"] = summarise(record["results"])
    record["wall_seconds"] = run.end()
    record["loadavg_end"] = run.loadavg_end
    record["peak_rss_mb"] = harness.rss_peak_mb()
    harness.write_json(args.out, record)
    log(f"wrote {args.out} in {record['wall_seconds']:.0f} s")
    print(json.dumps(record["summary"], indent=1, default=float))


if __name__ == "__main__":
    main()
