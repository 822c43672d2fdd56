"""KDE speed: scalegp against scipy, scikit-learn, KDEpy and statsmodels (issue 6, "Speed"), and
exact pruning (issue 18).

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
- ``prune`` (not in the default run; its own result file): the pruned engine
  (``scalegp.ops.rbf_kde_density`` / ``rbf_kernel_mv`` with ``prune=True`` and ``"auto"``)
  against the unpruned one (``prune=False``) and the peers, on three problems:

  - ``kde_clustered_d2`` / ``_d3``: 1,000,000 points from a mixture of 1,000 Gaussians of sd
    0.003 (centres uniform in the unit cube), log-density of 100,000 queries from the same
    mixture, at the cv bandwidth (``ScalableKernelDensity(bandwidth="cv")`` fitted on all n
    points, that fit timed: the data's spatial order is taken there). Timed: the engine call
    ``rbf_kde_density`` (pruned, "auto", unpruned; it sorts the data itself) and the fitted
    estimator's ``score_samples``. Peers: scikit-learn
    ``KernelDensity(algorithm="kd_tree", rtol=1e-4)`` (fit + score_samples), scipy's
    gaussian_kde with kernel covariance h² I (1,000 queries, time scaled), KDEpy's FFTKDE (a
    grid, linearly interpolated at the queries). Errors against float64 on the first 1,000
    queries: the largest absolute log-density error and the norm-wise relative density error,
    each against the exact density of the inputs the method was given (float32 for scalegp,
    float64 for the peers; the gap the float32 rounding of the inputs alone makes is recorded).
  - ``kde_cv_check_d2``: on a 20,000 point subsample (2-D), the full leave-one-out bandwidth
    cross-validation (``cv_subsample=None``: every point held out, so every fit scores the same
    points) pruned in float32, unpruned in float32 and unpruned in float64 (JAX x64, the exact
    reference); the held-out log-likelihood each reaches.
  - ``gp_kernel_mv_uniform_d2``: ``rbf_kernel_mv(x, x, v, l)``, 1,000,000 points uniform in the
    unit square, l = 1% of their extent, v standard normal; the unpruned product on the first
    100,000 rows (time scaled by 10: its cost is linear in the rows), and the pruned one on the
    same rows; norm-wise relative error on the first 1,000 rows, against float64 on the same
    float32 inputs.
  - ``gp_kernel_mv_composite_uniform_d2``: the same for ``kernel_mv`` with a composite kernel,
    ``0.5 RBF(l) ExpSineSquared(1, period 0.05) + 0.5 Matern(l, ν = 3/2)`` (the generic pruned
    path of kernel expressions).
  - ``kde_no_locality_d32``: 100,000 standard normal keys, 10,000 queries, d = 32, Scott's
    bandwidth: ``prune="auto"`` against ``prune=False`` in alternating rounds (the price of
    "auto" where pruning cannot pay), and one ``prune=True`` call for reference.

  scalegp calls are jax.jit-compiled; the first call (compilation included) is recorded apart
  from the median of the later ones, which run in rounds alternating the implementations.

    python benchmarks/kde_speed.py                                   # the committed CPU run
    python benchmarks/kde_speed.py --quick --out /tmp/kde_quick.json # smaller sizes, a smoke test
    python benchmarks/kde_speed.py --sections prune --out benchmarks/results/prune_cpu.json
    python benchmarks/kde_speed.py --sections prune-gp --out benchmarks/results/prune_gp_cpu.json

scalegp runs on all cores through XLA; scipy's logpdf and scikit-learn's tree queries use one
core, and GridSearchCV gets ``--jobs`` worker processes (default: all cores). The load average
at the start and the end is recorded: CPU timings on shared machines move with other load.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
        "scalegp_commit": harness.scalegp_commit(),
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
# prune: exact pruning (issue 18) on clustered data, a narrow GP kernel, and data with no locality


def clustered_mixture(n, d, seed, draw, clusters, sd):
    """n draws (seed ``draw``) from a fixed (seed ``seed``) mixture of ``clusters`` equally
    likely isotropic Gaussians of standard deviation ``sd``, centres uniform in the unit cube."""
    centres = np.random.default_rng(seed).uniform(size=(clusters, d))
    rng = np.random.default_rng([seed, draw])
    return centres[rng.integers(clusters, size=n)] + sd * rng.standard_normal((n, d))


def exact_rbf_sums(Q, X, scale, v=None, chunk=16):
    """float64 numpy by direct differences, ``|q - x|²`` summed feature by feature (no
    ``|a|² + |b|² - 2ab`` cancellation), in chunks of ``chunk`` queries: with ``v=None`` the
    log of ``Σ_j exp(-|q_i - x_j|² / 2 scale²)``, else ``Σ_j exp(...) v_j``."""
    Q, X = np.asarray(Q, np.float64), np.asarray(X, np.float64)
    out = np.empty(Q.shape[0])
    coef = -0.5 / float(scale) ** 2
    for start in range(0, Q.shape[0], chunk):
        q = Q[start : start + chunk]
        e = np.zeros((q.shape[0], X.shape[0]))
        for k in range(X.shape[1]):
            diff = np.subtract.outer(q[:, k], X[:, k])
            diff *= diff
            e += diff
        e *= coef
        if v is None:
            top = e.max(axis=1)
            e -= top[:, None]
            np.exp(e, out=e)
            out[start : start + chunk] = top + np.log(e.sum(axis=1))
        else:
            np.exp(e, out=e)
            out[start : start + chunk] = e @ np.asarray(v, np.float64)
    return out


def exact_kde_log_density(Q, X, h, chunk=16):
    """Gaussian KDE log-density (equal weights, kernel covariance h² I), float64 by definition."""
    d = X.shape[1]
    return (exact_rbf_sums(Q, X, h, chunk=chunk) - np.log(X.shape[0])
            - 0.5 * d * np.log(2 * np.pi) - d * np.log(h))


def log_density_errors(values, reference) -> dict:
    """Against a float64 reference of the first len(reference) queries: the largest absolute
    log-density error and the norm-wise relative error of the densities."""
    k = min(len(values), len(reference))
    a, r = np.asarray(values[:k], np.float64), np.asarray(reference[:k], np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        abs_err = np.abs(a - r)
        max_abs = float(np.max(abs_err)) if np.all(np.isfinite(abs_err)) else float("inf")
        rel = float(np.linalg.norm(np.exp(a) - np.exp(r)) / np.linalg.norm(np.exp(r)))
    return {"max_abs_log_err": max_abs, "rel_density_err": rel, "error_queries": k}


def rel_err(values, reference) -> float:
    a, r = np.asarray(values, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(a - r) / np.linalg.norm(r))


def _run_jax(fn, *args):
    """fn(*args) waited for and brought to the host (float64 numpy)."""
    import jax

    return np.asarray(jax.block_until_ready(fn(*args)), np.float64)


def _timed_rounds(calls: dict, repeats: int, limited: dict | None = None) -> dict:
    """Times each callable in ``calls`` (name -> no-argument function returning an array): a
    first call each (compilation included), then ``repeats`` rounds in which every callable runs
    once, the order reversed on odd rounds so that no implementation always follows another.
    ``limited`` caps the rounds of an expensive callable (name -> rounds). Returns name ->
    {"first_call_seconds", "seconds_all", "seconds" (median), "compile_seconds" (first call
    less the median, an estimate), "values" (of the last call)}."""
    out = {}
    for name, fn in calls.items():
        values, first = timed(fn)
        out[name] = {"first_call_seconds": first, "seconds_all": [], "values": values}
        log(f"    {name}: first call {first:.2f} s")
    names = list(calls)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            if limited and r >= limited.get(name, repeats):
                continue
            values, seconds = timed(calls[name])
            out[name]["seconds_all"].append(seconds)
            out[name]["values"] = values
        log(f"    round {r + 1}: " + ", ".join(
            f"{n} {out[n]['seconds_all'][-1]:.3f} s" for n in names
            if len(out[n]["seconds_all"]) > r))
    for entry in out.values():
        times = entry["seconds_all"] or [entry["first_call_seconds"]]
        entry["seconds"] = float(np.median(times))
        entry["compile_seconds"] = max(0.0, entry["first_call_seconds"] - entry["seconds"])
    return out


def _scalegp_row(base, method, timing, note=None, **extra) -> dict:
    row = {**base, "method": method, "seconds": timing["seconds"],
           "seconds_all": timing["seconds_all"], "first_call_seconds": timing["first_call_seconds"],
           "compile_seconds": timing["compile_seconds"], **extra}
    if note:
        row["note"] = note
    return row


def cv_bandwidth(X, d, cfg):
    """The bandwidth of the prune section: ``ScalableKernelDensity(bandwidth="cv")`` fitted on
    ``prune_cv_n`` points (None: all of them; else a random subsample, its bandwidth carried to
    all n points by the AMISE rate ``h_n = h_sub (n_sub / n)^(1/(d+4))``, Scott's rate).
    Returns (fields for the rows, the fitted model when it saw all the points, else None)."""
    from scalegp import ScalableKernelDensity

    n = X.shape[0]
    n_sub = min(n, cfg["prune_cv_n"] or n)
    sub = X if n_sub == n else X[np.sort(np.random.default_rng(d).choice(n, n_sub, replace=False))]
    model, seconds = timed(ScalableKernelDensity(bandwidth="cv", random_state=0).fit,
                           sub.astype(np.float32))
    h_sub = float(np.atleast_1d(model.bandwidth_)[0])
    h = h_sub * (n_sub / n) ** (1.0 / (d + 4))
    log(f"  cv bandwidth on {n_sub} points: {h_sub:.5g} ({seconds:.1f} s) -> {h:.5g} at n={n}")
    result = model.cv_result_
    fields = {"bandwidth": h, "cv_bandwidth_on_subsample": h_sub, "cv_subsample_points": n_sub,
              "cv_seconds": seconds, "cv_objective_evaluations": result.n_evaluations,
              "cv_held_out_in_objective": result.n_held_out, "cv_converged": result.converged,
              "bandwidth_rule": "ScalableKernelDensity(bandwidth='cv', random_state=0)"
              + ("" if n_sub == n else " on a random subsample, times (n_sub / n)^(1/(d+4))")}
    return fields, (model if n_sub == n else None)


def _prune_cv_check(cfg, X) -> list[dict]:
    """Full leave-one-out cross-validation on a subsample: pruned float32, unpruned float32 and
    unpruned float64 (the exact reference) reach the same held-out log-likelihood?"""
    import jax

    from scalegp import ScalableKernelDensity

    n_sub = min(cfg["prune_cv_check_n"], X.shape[0])
    sub = X[np.sort(np.random.default_rng(7).choice(X.shape[0], n_sub, replace=False))]
    sub = sub.astype(np.float32)  # the float64 fit sees the same points as the float32 ones
    log(f"prune cv check: full LOO cross-validation on {n_sub} points")
    base = {"section": "prune", "problem": f"kde_cv_check_d{X.shape[1]}", "n": n_sub,
            "dim": X.shape[1], "cv_subsample": None}
    fits = {}
    for name, prune, dtype in (("prune=True, float32", True, np.float32),
                               ("prune=False, float32", False, np.float32),
                               ("prune=False, float64", False, np.float64)):
        x64 = bool(jax.config.jax_enable_x64)
        jax.config.update("jax_enable_x64", dtype == np.float64)
        try:
            model, seconds = timed(ScalableKernelDensity(
                bandwidth="cv", cv_subsample=None, prune=prune, random_state=0).fit,
                sub.astype(dtype))
        finally:
            jax.config.update("jax_enable_x64", x64)
        fits[name] = (model, seconds)
        log(f"  {name}: h={float(model.bandwidth_):.6g}, held-out log-likelihood "
            f"{model.cv_result_.log_likelihood:.9g} ({seconds:.1f} s)")
    exact = fits["prune=False, float64"][0].cv_result_.log_likelihood
    rows = []
    for name, (model, seconds) in fits.items():
        result = model.cv_result_
        rows.append({
            **base, "method": f"scalegp ScalableKernelDensity(bandwidth='cv', {name})",
            "seconds": seconds, "bandwidth": float(model.bandwidth_),
            "heldout_mean_loglik": result.log_likelihood,
            "rel_diff_to_unpruned_float64": abs(result.log_likelihood - exact) / abs(exact),
            "objective_evaluations": result.n_evaluations, "converged": result.converged,
            "note": "seconds: the fit, JAX compilation included; heldout_mean_loglik: the mean "
                    "leave-one-out log-likelihood at the selected bandwidth (every point held "
                    "out), as the fit computed it"})
    return rows


def section_prune(cfg) -> list[dict]:
    rows = []
    for d in cfg["prune_kde_dims"]:
        rows.extend(_prune_kde(cfg, d))
    if cfg["prune_cv_check_n"]:
        rows.extend(_prune_cv_check(cfg, clustered_mixture(
            cfg["prune_kde_n"], 2, seed=102, draw=0, clusters=cfg["prune_clusters"],
            sd=cfg["prune_cluster_sd"])))
    rows.extend(_prune_gp(cfg))
    rows.extend(_prune_no_locality(cfg))
    return rows


def _prune_kde(cfg, d) -> list[dict]:
    import functools

    import jax

    from scalegp.ops import rbf_kde_density

    n, n_q, n_ref = cfg["prune_kde_n"], cfg["prune_kde_queries"], cfg["prune_ref"]
    clusters, sd = cfg["prune_clusters"], cfg["prune_cluster_sd"]
    X = clustered_mixture(n, d, seed=100 + d, draw=0, clusters=clusters, sd=sd)
    Q = clustered_mixture(n_q, d, seed=100 + d, draw=1, clusters=clusters, sd=sd)
    log(f"prune kde d={d}: n={n}, {n_q} queries, {clusters} clusters of sd {sd}")
    bw, model = cv_bandwidth(X, d, cfg)
    h = bw["bandwidth"]
    base = {"section": "prune", "problem": f"kde_clustered_d{d}", "n": n, "queries": n_q,
            "dim": d, "clusters": clusters, "cluster_sd": sd, **bw}
    log(f"  exact float64 references on {n_ref} queries (float64 and float32 inputs)")
    X32, Q32 = X.astype(np.float32), Q.astype(np.float32)
    reference, ref_s = timed(exact_kde_log_density, Q[:n_ref], X, h)
    reference32 = exact_kde_log_density(Q32[:n_ref], X32, h)  # what the float32 runs are given
    base["reference_seconds"] = ref_s
    base["input_rounding_errors"] = log_density_errors(reference32, reference)

    fns = {name: jax.jit(functools.partial(rbf_kde_density, bandwidth=h, log=True, prune=prune))
           for name, prune in (("prune=True", True), ("prune='auto'", "auto"),
                               ("prune=False", False))}
    X32_dev, Q32_dev = jax.device_put(X32), jax.device_put(Q32)
    calls = {f"rbf_kde_density({k}, float32)": functools.partial(_run_jax, f, Q32_dev, X32_dev)
             for k, f in fns.items()}
    if model is not None:  # the cv fit above: data in spatial order since fit
        calls["ScalableKernelDensity(bandwidth='cv').score_samples (prune='auto', float32)"] = (
            lambda: np.asarray(model.score_samples(Q32), np.float64))
    unpruned = "rbf_kde_density(prune=False, float32)"
    timing = _timed_rounds(calls, cfg["prune_repeats"], {unpruned: cfg["prune_unpruned_repeats"]})
    rows = []
    for name, entry in timing.items():
        rows.append(_scalegp_row(
            base, f"scalegp {name}", entry, timed_queries=n_q,
            **log_density_errors(entry["values"], reference32),
            vs_float64_inputs=log_density_errors(entry["values"], reference)))
    rows.extend(_kde_peers(cfg, base, X, Q, h, reference))
    return rows


def _kde_peers(cfg, base, X, Q, h, reference) -> list[dict]:
    n_q, d = Q.shape
    rows = []
    neighbors = _optional("sklearn.neighbors")
    if neighbors is None:
        rows.append({**base, "method": "sklearn KernelDensity", "skipped": "not installed"})
    else:
        m = min(cfg["prune_sklearn_queries"] or n_q, n_q)
        estimator = neighbors.KernelDensity(bandwidth=h, algorithm="kd_tree", rtol=1e-4)
        model, fit_s = timed(estimator.fit, X)
        values, seconds = timed(model.score_samples, Q[:m])
        rows.append({
            **base, "method": "sklearn KernelDensity(kd_tree, rtol=1e-4)", "timed_queries": m,
            "seconds": fit_s + seconds * n_q / m, "fit_seconds": fit_s,
            "score_seconds": seconds * n_q / m, **log_density_errors(values, reference),
            "note": "one core; fit (tree build) plus score_samples"
                    + ("" if m == n_q else f", scored on {m} queries and scaled to {n_q}"),
        })
        log(f"  sklearn kd_tree: fit {fit_s:.2f} s, {seconds:.2f} s for {m} queries")

    scipy_stats = _optional("scipy.stats")
    if scipy_stats is None:
        rows.append({**base, "method": "scipy gaussian_kde.logpdf", "skipped": "not installed"})
    else:
        m = min(cfg["prune_scipy_queries"], n_q)
        model = scipy_stats.gaussian_kde(X.T)
        # kernel covariance h² I: scipy's is factor² times the data covariance, so the data
        # covariance it caches is set to the identity before the bandwidth (factor h) is set
        model._data_covariance = np.eye(d)
        model._data_cho_cov = np.eye(d)
        model.set_bandwidth(bw_method=h)
        values, seconds = timed(model.logpdf, Q[:m].T)
        rows.append({
            **base, "method": "scipy gaussian_kde.logpdf", "timed_queries": m,
            "seconds": seconds * n_q / m, "measured_seconds": seconds,
            **log_density_errors(values, reference),
            "note": f"one core; timed on the first {m} queries and scaled to {n_q} (its cost is "
                    "linear in the queries)",
        })
        log(f"  scipy: {seconds:.2f} s for {m} queries")

    kdepy = _optional("KDEpy")
    if kdepy is None:
        rows.append({**base, "method": "KDEpy FFTKDE", "skipped": "not installed"})
        return rows
    from scipy.interpolate import RegularGridInterpolator

    g = cfg["prune_fft_grid"][d]
    (grid, values), seconds = timed(
        lambda: kdepy.FFTKDE(kernel="gaussian", bw=h).fit(X).evaluate(grid_points=g))
    axes = [np.unique(grid[:, k]) for k in range(d)]  # the last coordinate varies fastest
    table = values.reshape([len(a) for a in axes])
    interp, interp_s = timed(
        lambda: RegularGridInterpolator(axes, table, bounds_error=False, fill_value=0.0)(Q))
    spacing = float(max(a[1] - a[0] for a in axes))
    with np.errstate(divide="ignore", invalid="ignore"):
        errors = log_density_errors(np.log(interp[: len(reference)]), reference)
    rows.append({
        **base, "method": f"KDEpy FFTKDE ({'x'.join([str(g)] * d)} grid) + linear interpolation",
        "seconds": seconds + interp_s, "grid_seconds": seconds, "interp_seconds": interp_s,
        "timed_queries": n_q, "grid_points": len(grid), "grid_spacing": spacing,
        "grid_spacing_over_bandwidth": spacing / h, **errors,
        "note": "one core; density on a regular grid only (binning + FFT convolution), linearly "
                "interpolated at the queries; the error is the interpolation's at the queries",
    })
    log(f"  KDEpy: grid {seconds:.2f} s, interpolation {interp_s:.2f} s, spacing/h "
        f"{spacing / h:.2f}")
    return rows


#: The composite kernel of the prune section's expression row, at lengthscale ``l``: a
#: locally periodic term (RBF times a periodic factor) plus a Matérn-3/2, as a GP user composes
#: them; it decays because every sum term does.
COMPOSITE_PERIOD = 0.05


def composite_kernel(ls, dtype=np.float32):
    from scalegp.ops import RBF, ExpSineSquared, Matern

    f = functools.partial(np.asarray, dtype=dtype)
    return (f(0.5) * RBF(f(ls)) * ExpSineSquared(f(1.0), f(COMPOSITE_PERIOD))
            + f(0.5) * Matern(f(ls), nu=1.5))


def exact_composite_sums(Q, X, ls, v, chunk=16):
    """`composite_kernel` times v, float64 numpy by direct differences, in chunks of queries."""
    Q, X, v = (np.asarray(t, np.float64) for t in (Q, X, v))
    out = np.empty(Q.shape[0])
    for start in range(0, Q.shape[0], chunk):
        q = Q[start : start + chunk]
        sq = sum(np.subtract.outer(q[:, k], X[:, k]) ** 2 for k in range(X.shape[1]))
        r = np.sqrt(sq)
        periodic = np.exp(-2.0 * np.sin(np.pi * r / COMPOSITE_PERIOD) ** 2)
        t = np.sqrt(3.0) * r / ls
        k = 0.5 * np.exp(-0.5 * sq / ls**2) * periodic + 0.5 * (1.0 + t) * np.exp(-t)
        out[start : start + chunk] = k @ v
    return out


def _prune_gp(cfg) -> list[dict]:
    from scalegp.ops import kernel_mv, rbf_kernel_mv

    rbf = _prune_kernel_mv(
        cfg, "gp_kernel_mv_uniform_d2", "rbf_kernel_mv",
        lambda ls, p: lambda x1, x2, v: rbf_kernel_mv(x1, x2, v, ls, prune=p),
        lambda q, x, ls, v: exact_rbf_sums(q, x, ls, v))
    composite = _prune_kernel_mv(
        cfg, "gp_kernel_mv_composite_uniform_d2", "kernel_mv(composite)",
        lambda ls, p: lambda x1, x2, v: kernel_mv(composite_kernel(ls), x1, x2, v, prune=p),
        exact_composite_sums, kernel="0.5 RBF(l) ExpSineSquared(1, period 0.05) + 0.5 "
                                     "Matern(l, nu=1.5)")
    return rbf + composite


def _prune_kernel_mv(cfg, problem, function, product, reference_of, **about) -> list[dict]:
    """K v on uniform 2-D points at a lengthscale 1% of their extent, pruned (all rows) against
    unpruned (the first rows, scaled): ``product(ls, prune)`` gives ``(x1, x2, v) -> K v``."""
    import jax

    n, n_ref, rows_sub = cfg["prune_gp_n"], cfg["prune_ref"], cfg["prune_gp_unpruned_rows"]
    rng = np.random.default_rng(200)
    x = rng.uniform(size=(n, 2))
    v = rng.standard_normal(n)
    extent = float(np.max(x.max(axis=0) - x.min(axis=0)))
    ls = 0.01 * extent
    rows_sub = min(rows_sub or n, n)
    log(f"prune gp: {function}, n={n}, d=2 uniform, lengthscale {ls:.5g}; unpruned on "
        f"{rows_sub} rows")
    base = {"section": "prune", "problem": problem, "function": function, "n": n, "dim": 2,
            **about,
            "lengthscale": ls, "lengthscale_rule": "0.01 x the data's extent (largest range)"}
    x, v = x.astype(np.float32), v.astype(np.float32)  # the reference sees the same inputs
    reference, ref_s = timed(reference_of, x[:n_ref], x, ls, v)
    base["reference_seconds"] = ref_s

    x32, v32 = jax.device_put(x), jax.device_put(v)
    xs32 = jax.device_put(x[:rows_sub].astype(np.float32))
    self_product = {p: jax.jit(lambda x, v, f=product(ls, p): f(x, x, v))
                    for p in (True, "auto")}
    cross = {p: jax.jit(product(ls, p)) for p in (True, False)}
    calls = {
        "prune=True": functools.partial(_run_jax, self_product[True], x32, v32),
        "prune='auto'": functools.partial(_run_jax, self_product["auto"], x32, v32),
        f"prune=True, first {rows_sub} rows": functools.partial(_run_jax, cross[True], xs32, x32,
                                                                v32),
        f"prune=False, first {rows_sub} rows": functools.partial(_run_jax, cross[False], xs32,
                                                                 x32, v32),
    }
    timing = _timed_rounds(calls, cfg["prune_repeats"],
                           {f"prune=False, first {rows_sub} rows": cfg["prune_unpruned_repeats"]})
    out = []
    for name, entry in timing.items():
        partial_rows = "first" in name
        extra = {"rows": rows_sub if partial_rows else n,
                 "rel_err": rel_err(entry["values"][:n_ref], reference), "error_rows": n_ref}
        note = None
        if partial_rows and "prune=False" in name:
            extra["seconds_scaled_to_all_rows"] = entry["seconds"] * n / rows_sub
            note = (f"{function}(x[:{rows_sub}], x, v): the first {rows_sub} rows of the "
                    f"product; seconds_scaled_to_all_rows = seconds x {n}/{rows_sub} (the "
                    "unpruned cost is linear in the rows)")
        elif partial_rows:
            note = (f"{function}(x[:{rows_sub}], x, v): the same rows as the unpruned row, "
                    "pruned (the queries get their own k-d order: not a self product)")
        out.append(_scalegp_row(base, f"scalegp {function}({name}, float32)", entry, note,
                                **extra))
    return out


def _prune_no_locality(cfg) -> list[dict]:
    import functools

    import jax

    from scalegp import kde
    from scalegp.ops import rbf_kde_density

    m, n_q, d = cfg["prune_nl_keys"], cfg["prune_nl_queries"], cfg["prune_nl_dim"]
    rng = np.random.default_rng(300)
    X, Q = rng.standard_normal((m, d)), rng.standard_normal((n_q, d))
    h = kde.scott_factor(m, d)  # the data's standard deviation is 1
    log(f"prune no locality: KDE d={d}, {m} keys, {n_q} queries, Scott's bandwidth {h:.4g}")
    base = {"section": "prune", "problem": f"kde_no_locality_d{d}", "n": m, "queries": n_q,
            "dim": d, "bandwidth": h, "bandwidth_rule": "Scott's factor (unit standard deviation)"}
    n_ref = min(cfg["prune_ref"], n_q)
    reference, ref_s = timed(exact_kde_log_density, Q[:n_ref], X, h)
    base["reference_seconds"] = ref_s
    X32, Q32 = jax.device_put(X.astype(np.float32)), jax.device_put(Q.astype(np.float32))
    names = [("prune='auto'", "auto"), ("prune=False", False)]
    if cfg["prune_nl_forced"]:
        names.append(("prune=True", True))
    calls = {name: functools.partial(_run_jax, jax.jit(functools.partial(
        rbf_kde_density, bandwidth=h, log=True, prune=p)), Q32, X32) for name, p in names}
    timing = _timed_rounds(calls, cfg["prune_nl_repeats"], {"prune=True": 1})
    auto, plain = timing["prune='auto'"], timing["prune=False"]
    paired = [a / b for a, b in zip(auto["seconds_all"], plain["seconds_all"])]
    out = []
    for name, entry in timing.items():
        extra = {}
        if name == "prune='auto'":
            extra = {"ratio_to_unpruned_per_round": paired,
                     "ratio_to_unpruned": float(np.median(paired))}
        out.append(_scalegp_row(base, f"scalegp rbf_kde_density({name}, float32)", entry,
                                timed_queries=n_q, **extra,
                                **log_density_errors(entry["values"], reference)))
    return out


PRUNE_NOTES = [
    ("prune: scalegp rows are jax.jit-compiled calls of scalegp.ops.rbf_kde_density / "
     "rbf_kernel_mv (float32, all cores); first_call_seconds includes compilation, seconds is "
     "the median of the later calls, which ran in rounds alternating the implementations (order "
     "reversed every other round); compile_seconds = first call - median."),
    ("prune: max_abs_log_err / rel_density_err (KDE) and rel_err (K v, norm-wise) are against a "
     "float64 numpy evaluation by direct differences of the first prune_ref queries or rows, "
     "on the inputs each method was given: the float32-rounded points for scalegp's float32 "
     "rows (its vs_float64_inputs adds the rounding of the inputs; input_rounding_errors is that "
     "rounding alone), the float64 points for the peers."),
    ("prune: sklearn, scipy and KDEpy run on one core; scipy is timed on prune_scipy_queries "
     "queries and scaled linearly; KDEpy computes a grid only, interpolated at the queries."),
]


def summarise_prune(rows) -> dict:
    def find(problem, prefix):
        for r in rows:
            if (r.get("section") == "prune" and r.get("problem") == problem
                    and r.get("method", "").startswith(prefix) and r.get("seconds") is not None):
                return r
        return None

    summary = {}
    for problem in sorted({r["problem"] for r in rows if r.get("section") == "prune"}):
        if problem.startswith("kde_clustered"):
            pruned = find(problem, "scalegp rbf_kde_density(prune=True")
            auto = find(problem, "scalegp rbf_kde_density(prune='auto'")
            plain = find(problem, "scalegp rbf_kde_density(prune=False")
            sk = find(problem, "sklearn")
            entry = {"pruned_seconds": pruned["seconds"], "auto_seconds": auto["seconds"],
                     "unpruned_seconds": plain["seconds"],
                     "speedup_pruned_vs_unpruned": plain["seconds"] / pruned["seconds"],
                     "speedup_auto_vs_unpruned": plain["seconds"] / auto["seconds"]}
            entry["at_least_10x"] = entry["speedup_pruned_vs_unpruned"] >= 10
            fitted = find(problem, "scalegp ScalableKernelDensity")
            if fitted:
                entry["score_samples_seconds"] = fitted["seconds"]
                entry["speedup_score_samples_vs_unpruned"] = plain["seconds"] / fitted["seconds"]
            if sk:
                entry["speedup_pruned_vs_sklearn_kd_tree"] = sk["seconds"] / pruned["seconds"]
            entry["cv_seconds"] = pruned["cv_seconds"]
            entry["cv_points"] = pruned["cv_subsample_points"]
            for key in ("max_abs_log_err", "rel_density_err"):
                entry[key] = {r["method"]: r.get(key) for r in rows
                              if r.get("problem") == problem and "seconds" in r}
        elif problem.startswith("kde_cv_check"):
            entry = {r["method"]: {k: r[k] for k in ("bandwidth", "heldout_mean_loglik",
                                                       "rel_diff_to_unpruned_float64")}
                     for r in rows if r.get("problem") == problem}
        elif problem.startswith("gp_kernel_mv"):
            function = next(r["function"] for r in rows if r.get("problem") == problem)
            pruned = find(problem, f"scalegp {function}(prune=True, float32)")
            same_rows = find(problem, f"scalegp {function}(prune=True, first")
            plain = find(problem, f"scalegp {function}(prune=False, first")
            entry = {"pruned_seconds": pruned["seconds"],
                     "unpruned_seconds_scaled_to_all_rows": plain["seconds_scaled_to_all_rows"],
                     "speedup_pruned_vs_unpruned": (plain["seconds_scaled_to_all_rows"]
                                                    / pruned["seconds"]),
                     "speedup_same_rows": plain["seconds"] / same_rows["seconds"],
                     "pruned_rel_err": pruned["rel_err"], "unpruned_rel_err": plain["rel_err"]}
            entry["at_least_10x"] = entry["speedup_pruned_vs_unpruned"] >= 10
        else:
            auto = find(problem, "scalegp rbf_kde_density(prune='auto'")
            entry = {"auto_over_unpruned": auto["ratio_to_unpruned"],
                     "within_10_percent": abs(auto["ratio_to_unpruned"] - 1) <= 0.10}
        summary[problem] = entry
    return summary


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
    if any(r.get("section") == "prune" for r in rows):
        summary["prune"] = summarise_prune(rows)
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--sections", nargs="+", default=["density", "cv", "statsmodels", "gpu"],
                        choices=["density", "cv", "statsmodels", "gpu", "prune", "prune-gp"],
                        help="default: all but prune (run it on its own, with its own --out); "
                             "prune-gp: only its two GP kernel products")
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
        # prune section
        "prune_kde_dims": [2, 3], "prune_kde_n": 1_000_000, "prune_kde_queries": 100_000,
        "prune_clusters": 1000, "prune_cluster_sd": 0.003, "prune_cv_n": None,
        "prune_cv_check_n": 20_000,
        "prune_ref": 1000, "prune_repeats": 3, "prune_unpruned_repeats": 1,
        "prune_sklearn_queries": None, "prune_scipy_queries": 1000,
        "prune_fft_grid": {2: 2048, 3: 256},
        "prune_gp_n": 1_000_000, "prune_gp_unpruned_rows": 100_000,
        "prune_nl_keys": 100_000, "prune_nl_queries": 10_000, "prune_nl_dim": 32,
        "prune_nl_repeats": 7, "prune_nl_forced": True,
    }
    if args.quick:
        cfg.update({"density_n": 10_000, "density_queries": 1000, "density_ref": 200, "repeats": 1,
                    "fft_grid": 128, "cv_n": 3000, "grid_bandwidths": 4, "grid_folds": 3,
                    "statsmodels_n": [300], "gpu_n": 100_000,
                    "prune_kde_dims": [2], "prune_kde_n": 20_000, "prune_kde_queries": 2000,
                    "prune_clusters": 50,
                    "prune_cv_n": None, "prune_cv_check_n": 1500, "prune_ref": 100,
                    "prune_repeats": 1,
                    "prune_scipy_queries": 200, "prune_fft_grid": {2: 256, 3: 32},
                    "prune_gp_n": 20_000, "prune_gp_unpruned_rows": 5000,
                    "prune_nl_keys": 2000, "prune_nl_queries": 500, "prune_nl_repeats": 1,
                    "prune_nl_forced": False})
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
    if {"prune", "prune-gp"} & set(args.sections):
        record["notes"] += PRUNE_NOTES
    sections = {"density": section_density, "cv": section_cv, "statsmodels": section_statsmodels,
                "gpu": section_gpu, "prune": section_prune, "prune-gp": _prune_gp}
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
