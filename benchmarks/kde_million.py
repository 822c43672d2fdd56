"""KDE at a million points, as a user runs it (issue 41): the CLI end to end, the peers, the engine.

    python benchmarks/kde_million.py --out benchmarks/results/kde_million_cpu.json
    python benchmarks/kde_million.py --quick --out /tmp/kde_million_quick.json   # smoke test

Sections (``--sections``, default all):

- ``cli``: writes ``n`` 2-D points from an overlapping Gaussian mixture (`overlapping_mixture`:
  dozens of rotated elliptical clusters with log-normal spreads and unequal weights, as spatial
  data look) to a CSV and runs ``scalegp kde big.csv --bandwidth cv --out logp.npy`` in a child
  process: wall time, the child's peak RSS (``wait4``), the cv bandwidth, and the largest
  absolute error of the written log-densities on ``check_rows`` random rows against a float64
  evaluation of the same model (standardised features, ``ddof=1``, the printed bandwidth);
  with ``--cli-warm`` a second time, on the compilation cache the first run filled; with
  ``--cli-profile`` once more under cProfile (the functions that took the most time).
- ``cv``: the estimator's ``bandwidth="cv"`` fit on the n points in a fresh process, and its
  held-out log-likelihood against the optimum of the same objective in float64 (same points and
  held-out set; planned path at ``prune_tol=1e-15``, below float64's rounding of each row).
- ``peers``: on the first 10⁵ and 10⁶ of those points (standardised by the mean and standard
  deviation of all n, as the CLI standardises the whole file) at the cv bandwidth, every point
  scored against all of them: scikit-learn's ``KernelDensity`` (kd_tree, ``rtol=1e-4`` and
  ``rtol=0``) and ``ScalableKernelDensity(bandwidth=h).fit(X).score_samples(X)``, each in a
  child process with a time limit, with the float64 error on ``check_rows`` rows.
- ``scale``: the estimator's ``bandwidth="cv"`` fit (`overlapping_mixture` points of each
  ``--scale-cases`` size and dimension) in a fresh process, then ``score_samples`` of its own
  points (all of them, or ``--scale-score-rows``), each timed (compilation included: a user's
  first call; JAX's start of its backend, which every program pays once, timed apart before),
  with the cross-validation's evaluations.
- ``bandwidth``: on an accelerator, the cv bandwidth of the ``cli`` section's mixture (its n
  points in float32, given to the estimator, standardised, ``random_state=0``) on it and on the
  same machine's CPU (a child with ``JAX_PLATFORMS=cpu``): their relative difference.
- ``features``: issue 61's point 4 on JAX's default device and on the host CPU (a child
  each): ``bandwidth="cv-diag"``, ``cv`` with weights, ``sample`` and the weighted model's
  log-densities on ``--features-n`` points of the mixture; their times and differences.
- ``prune``: the estimator's scoring paths on the n 2-D points at fixed bandwidths (the cli
  section's cv bandwidth, or ``--bandwidth``, times each of ``--prune-factors``):
  ``ScalableKernelDensity(bandwidth=h, prune=p).fit(X).score_samples(X)`` for ``p`` True
  (the host-planned path where the backend has one), False and "auto", each in a fresh
  process: the fit, the first scoring (compilation included) and a second, the shares of tile
  pairs the last plans visited (near and rest), and at the first factor the float64 error on
  ``check_rows`` rows. With ``--prefetch-depths``, the planned path of the Mosaic backend
  scores twice more at each depth of its key tiles' prefetch (`mosaic._planned.PREFETCH_DEPTH`),
  the second timed.
- ``engine``: ``rbf_kde_density(queries, keys, 0.3, log=True)`` with 2¹⁷ keys in 300 clusters
  (sd 0.4 in a 100 x 100 square) and 2¹³ (and 2¹⁰) queries, ``prune`` True, False and "auto",
  each a fresh jitted call, compiled first, then the three timed in alternating rounds
  (`kde_auto_grid.time_modes`): the ratio of "auto" to the better;
  with the keys as given (every pruned call sorts them) and in `spatial_order`, made once
  outside the timing and passed with ``keys_in_order=True`` (as the estimators keep them).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.harness import log, timed  # noqa: E402
from benchmarks.kde_auto_grid import time_modes  # noqa: E402
from benchmarks.kde_speed import exact_kde_log_density, log_density_errors  # noqa: E402

DEFAULT_OUT = Path(__file__).parent / "results" / "kde_million_cpu.json"


def overlapping_mixture(n: int, clusters: int = 64, seed: int = 0, dim: int = 2) -> np.ndarray:
    """(n, dim) float64 draws from a fixed mixture of ``clusters`` rotated elliptical Gaussians:
    centres uniform in the unit square, axis spreads log-normal around 0.03 (sd of the log 0.7,
    so clusters from tight to wide overlap), axis ratios up to ~4, weights log-normal. Above two
    dimensions the centres fill the unit cube, the spreads are log-normal around 0.015 dim
    (so that clusters still overlap there) and the rotations random (QR of Gaussian matrices)."""
    if dim != 2:
        return _mixture_in(n, clusters, seed, dim)
    rng = np.random.default_rng(seed)
    centres = rng.uniform(size=(clusters, 2))
    axes = np.exp(rng.normal(np.log(0.03), 0.7, size=(clusters, 2)))
    angles = rng.uniform(0, np.pi, clusters)
    rotations = np.stack([np.stack([np.cos(angles), -np.sin(angles)], -1),
                          np.stack([np.sin(angles), np.cos(angles)], -1)], -2)
    weights = np.exp(rng.normal(0.0, 0.8, clusters))
    label = rng.choice(clusters, size=n, p=weights / weights.sum())
    local = rng.standard_normal((n, 2)) * axes[label]
    return centres[label] + np.einsum("nij,nj->ni", rotations[label], local)


def _mixture_in(n: int, clusters: int, seed: int, dim: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.uniform(size=(clusters, dim))
    axes = np.exp(rng.normal(np.log(0.015 * dim), 0.7, size=(clusters, dim)))
    rotations = np.linalg.qr(rng.standard_normal((clusters, dim, dim)))[0]
    weights = np.exp(rng.normal(0.0, 0.8, clusters))
    label = rng.choice(clusters, size=n, p=weights / weights.sum())
    out = np.empty((n, dim))
    for c in range(clusters):  # by cluster: a (n, dim, dim) stack of rotations would not fit
        rows = np.flatnonzero(label == c)
        out[rows] = centres[c] + (rng.standard_normal((rows.size, dim)) * axes[c]) @ rotations[c].T
    return out


def write_csv(path: Path, x: np.ndarray) -> None:
    np.savetxt(path, x, delimiter=",", header="x,y", comments="", fmt="%.9g")


def standardised_log_density(queries, data, bandwidth: float) -> np.ndarray:
    """float64 log-density of the CLI's model: features standardised by the data's mean and
    standard deviation (ddof=1), an isotropic Gaussian kernel of ``bandwidth`` there, and the
    Jacobian back to the data's units."""
    location, std = data.mean(axis=0), data.std(axis=0, ddof=1)
    z_q, z = (queries - location) / std, (data - location) / std
    return exact_kde_log_density(z_q, z, bandwidth) - np.log(std).sum()


def run_child(cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> dict:
    """Runs ``cmd``: its wall time, exit status, output tail and peak RSS (its own, by wait4)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=output, stderr=subprocess.STDOUT, text=True,
                                env=env)
        while True:  # wait4 rather than Popen.wait: it also returns the child's resource usage
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                proc.kill()
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        output.seek(0)
        tail = output.read()[-4000:]
    return {"wall_s": time.perf_counter() - start, "returncode": proc.returncode,
            "peak_rss_mb": usage.ru_maxrss / 1024, "output_tail": tail}


def section_cli(cfg, workdir: Path) -> list[dict]:
    n = cfg["n"]
    x = overlapping_mixture(n)
    data = workdir / "big.csv"
    write_csv(data, x)
    x = np.loadtxt(data, delimiter=",", skiprows=1)  # what the CLI reads (9 digits)
    log(f"cli: {n:,} points written to {data} ({data.stat().st_size / 2**20:.0f} MiB)")
    cmd = ["scalegp", "kde", str(data), "--bandwidth", "cv", "--out", "logp.npy", "--force",
           "--json"]
    out, reference = [], None
    # cold: a fresh compilation cache (the CLI always keeps one), as a first run has it; warm
    # (--cli-warm): the same command again, on the cache the first run filled
    with tempfile.TemporaryDirectory(dir=workdir) as cache:
        for state in ("cold (an empty folder)", "warm (the first run's)")[:1 + cfg["cli_warm"]]:
            result = run_child(cmd, workdir, cfg["cli_timeout"],
                               env={**os.environ, "SCALEGP_CACHE_DIR": cache})
            row = {"section": "cli", "n": n, "dim": 2, "command": " ".join(cmd[:6]),
                   "compilation_cache": state, **result}
            out.append(row)
            if result["returncode"] != 0:
                log(f"  failed: {result['output_tail'][-500:]}")
                break
            tail = result["output_tail"]  # the --json summary, then maybe a warning on stderr
            summary = json.JSONDecoder().raw_decode(tail[tail.index("{"):])[0]
            h = float(np.atleast_1d(summary["bandwidth"])[0])
            log(f"  {state}: {result['wall_s']:.1f} s, peak RSS {result['peak_rss_mb']:.0f} MB, "
                f"bandwidth {h:.5g}")
            rows = np.sort(np.random.default_rng(1).choice(n, min(cfg["check_rows"], n),
                                                           replace=False))
            if reference is None or reference[0] != h:
                reference = (h, *timed(standardised_log_density, x[rows], x, h))
            written = np.load(workdir / "logp.npy")
            row.update({"bandwidth": h, "fit_seconds": summary.get("fit_seconds"),
                        "reference_seconds": reference[2],
                        **log_density_errors(written[rows], reference[1])})
            row.pop("output_tail")
        if cfg["cli_profile"] and out and out[-1]["returncode"] == 0:
            out.append(_profiled_cli(cmd, workdir, cache, cfg["cli_timeout"], n,
                                     cfg["cli_profile_rows"]))
    return out


def _profiled_cli(cmd, workdir: Path, cache: str, timeout: float, n: int,
                  rows: int = 80) -> dict:
    """The command once more on the same cache, under cProfile: its wall time, the ``rows``
    functions that took the most of it (cumulative seconds) and the 40 of most own time."""
    import pstats

    profile = workdir / "cli.prof"
    # the profile is written by an atexit function: the command ends with os._exit after them
    # (cli/interrupts.py), which `python -m cProfile` would not survive
    script = ("import atexit, cProfile, runpy, sys; p = cProfile.Profile(); "
              f"atexit.register(lambda: (p.disable(), p.dump_stats({str(profile)!r}))); "
              f"sys.argv = {['scalegp', *cmd[1:]]!r}; p.enable(); "
              "runpy.run_module('scalegp', run_name='__main__')")
    result = run_child([sys.executable, "-c", script], workdir, timeout,
                       env={**os.environ, "SCALEGP_CACHE_DIR": cache})
    row = {"section": "cli", "n": n, "dim": 2, "command": " ".join(cmd[:6]),
           "compilation_cache": "warm, under cProfile", **result}
    if result["returncode"] == 0 and profile.exists():
        stats = pstats.Stats(str(profile))
        for key, column, count in (("profile_cumulative_s", 3, rows), ("profile_own_s", 2, 40)):
            entries = sorted(stats.stats.items(), key=lambda item: -item[1][column])[:count]
            row[key] = [
                {"function": f"{Path(file).name}:{line}({name})", "cumulative_s": round(cum, 3),
                 "own_s": round(own, 3), "calls": calls}
                for (file, line, name), (_, calls, own, cum, _) in entries]
        row.pop("output_tail")
    log(f"  under cProfile: {result['wall_s']:.1f} s")
    return row


def _sklearn_scores(x, h, rtol, rows):
    from sklearn.neighbors import KernelDensity

    start = time.perf_counter()
    values = KernelDensity(bandwidth=h, algorithm="kd_tree", rtol=rtol).fit(x).score_samples(x)
    return {"seconds": time.perf_counter() - start, "checked": values[rows].tolist()}


def _scalegp_scores(x, h, rows):
    from scalegp import ScalableKernelDensity

    x32 = x.astype(np.float32)
    start = time.perf_counter()
    model = ScalableKernelDensity(bandwidth=h, scale=None).fit(x32)
    fitted = time.perf_counter()
    values = model.score_samples(x32)
    return {"seconds": time.perf_counter() - start, "fit_seconds": fitted - start,
            "checked": np.asarray(values, np.float64)[rows].tolist()}


def section_peers(cfg, bandwidth: float | None) -> list[dict]:
    """Each peer scores the standardised points (the cli section's model) against themselves."""
    full = overlapping_mixture(cfg["n"])
    z = (full - full.mean(axis=0)) / full.std(axis=0, ddof=1)
    h = bandwidth or cfg["fallback_bandwidth"]
    out = []
    for n in cfg["peer_sizes"]:
        x = z[:n].astype(np.float32).astype(np.float64)  # what every method is given
        rows = np.sort(np.random.default_rng(2).choice(n, min(cfg["check_rows"], n),
                                                       replace=False))
        reference = exact_kde_log_density(x[rows], x, h)
        base = {"section": "peers", "n": n, "dim": 2, "bandwidth": h}
        runs = {f"sklearn KernelDensity(kd_tree, rtol={rtol:g})": (_sklearn_scores,
                                                                    (x, h, rtol, rows))
                for rtol in (1e-4, 0.0)}
        runs["scalegp ScalableKernelDensity(bandwidth=h, scale=None).score_samples"] = (
            _scalegp_scores, (x, h, rows))
        for method, (fn, args) in runs.items():
            log(f"peers n={n:,}: {method}")
            got = harness.run_in_child(fn, args, timeout=cfg["peer_timeout"],
                                       head={**base, "method": method})
            checked = got.pop("checked", None)
            if checked is not None:
                got.update(log_density_errors(np.asarray(checked), reference))
            out.append({**base, "method": method, **got})
            log(f"  {got.get('seconds', got.get('error'))}")
    return out


def _cv_model(x32):
    """The estimator's cv fit (standardised, as the CLI; ``random_state=0``) of ``x32``, timed:
    (model, its summary)."""
    from scalegp import ScalableKernelDensity

    start = time.perf_counter()
    model = ScalableKernelDensity(bandwidth="cv", scale="standardize", random_state=0).fit(x32)
    seconds = time.perf_counter() - start
    result = model.cv_result_
    return model, {"seconds": seconds, "bandwidth": float(model.bandwidth_),
                   "heldout_mean_loglik": result.log_likelihood,
                   "n_held_out": result.n_held_out,
                   "objective_evaluations": result.n_evaluations,
                   "converged": result.converged}


def _cv_fit(x32):
    return _cv_model(x32)[1]


def _cv_float64_check(x32, h, tol):
    """The estimator's LOO objective (same standardised points, same held-out set) in float64,
    on the planned path with prune_tol ``tol`` (1e-15: every skipped tile's mass below 1e-15 of
    each row's, under float64's own rounding), at ``h`` and at its own optimum near ``h``."""
    import jax

    jax.config.update("jax_platforms", "cpu")  # float64 on the host, also beside an accelerator
    jax.config.update("jax_enable_x64", True)
    from scipy.optimize import minimize_scalar
    from sklearn.utils import check_random_state

    from scalegp.kde import _cv, _loo, _sample, _spread
    from scalegp.ops import Engine

    x = np.asarray(x32, np.float64)
    w = np.ones(len(x))
    unique, unique_w, _ = _loo.collapse_duplicates(x, w, drop_zero=True)
    z = np.asarray(_spread.fit_scaling(x, w, "standardize").transform(unique), np.float64)
    z, z_w, _ = _loo.collapse_duplicates(z, unique_w, drop_zero=True)  # as cross-validation
    u = len(z)
    seed = check_random_state(0).randint(np.iinfo(np.int32).max)  # as the estimator draws it
    held = np.sort(_sample.rng_from(seed).choice(u, size=min(_cv.DEFAULT_CV_SUBSAMPLE, u),
                                                 replace=False))
    objective = _cv._planned_objective(z, z_w, held, _cv._scott_start(z, z_w, len(x)), False,
                                       np.float64, Engine.create(prune=True, prune_tol=tol))
    start = time.perf_counter()
    at_h = -objective(np.array([np.log(h)]), False)[0]
    best = minimize_scalar(lambda t: objective(np.array([t]), False)[0], method="bounded",
                           bounds=(np.log(h) - 0.1, np.log(h) + 0.1), options={"xatol": 1e-5})
    return {"float64_at_bandwidth": at_h, "float64_optimum": -best.fun,
            "float64_optimal_bandwidth": float(np.exp(best.x)), "float64_evaluations": best.nfev,
            "float64_seconds": time.perf_counter() - start, "n_unique": u}


def section_cv(cfg) -> list[dict]:
    """The estimator's bandwidth="cv" fit on the n points (standardised, as the CLI), timed in a
    fresh process (compilation included), and its held-out log-likelihood against the float64
    objective's optimum over the same held-out set."""
    x32 = overlapping_mixture(cfg["n"]).astype(np.float32)
    base = {"section": "cv", "n": cfg["n"], "dim": 2,
            "method": "ScalableKernelDensity(bandwidth='cv', scale='standardize', "
                      "random_state=0).fit"}
    log(f"cv: {base['method']} on {cfg['n']:,} points")
    got = harness.run_in_child(_cv_fit, (x32,), timeout=cfg["cli_timeout"], head=base)
    log(f"  {got.get('seconds', got.get('error'))} s, h={got.get('bandwidth')}")
    if "bandwidth" not in got:
        return [{**base, **got}]
    check = harness.run_in_child(_cv_float64_check, (x32, got["bandwidth"], 1e-15),
                                 timeout=cfg["cli_timeout"], head=base)
    check["float64_wall_s"] = check.pop("wall_s", None)  # the fit's wall_s stays
    row = {**base, **got, **check}
    if "float64_optimum" in check:
        row["rel_diff_to_float64_optimum"] = (
            abs(check["float64_optimum"] - check["float64_at_bandwidth"])
            / abs(check["float64_optimum"]))
        log(f"  float64: at h {check['float64_at_bandwidth']:.10g}, optimum "
            f"{check['float64_optimum']:.10g} (rel {row['rel_diff_to_float64_optimum']:.2e})")
    return [row]


def _backend_start() -> float:
    """Seconds JAX takes to start its default backend (a TPU's client is slow to start), which
    a fit would otherwise count: every JAX program pays it once."""
    import jax

    start = time.perf_counter()
    jax.devices()
    return time.perf_counter() - start


def _fit_and_score(n: int, dim: int, score_rows: int | None, platform: str | None = None):
    """The estimator's cv fit on ``n`` points of `overlapping_mixture` in ``dim`` dimensions,
    then ``score_samples`` of its first ``score_rows`` points (None: all; 0: none), timed apart;
    on ``platform`` ("cpu": the host) where given, else JAX's default device."""
    import jax

    if platform:
        jax.config.update("jax_platforms", platform)
    x = overlapping_mixture(n, dim=dim).astype(np.float32)
    started = _backend_start()
    model, summary = _cv_model(x)
    out = {"backend": jax.default_backend(), "backend_start_seconds": started,
           "fit_seconds": summary.pop("seconds"), **summary}
    rows = n if score_rows is None else min(score_rows, n)
    if rows:
        start = time.perf_counter()
        model.score_samples(x[:rows])
        out.update(score_rows=rows, score_seconds=time.perf_counter() - start)
    return out


def section_scale(cfg) -> list[dict]:
    """`_fit_and_score` for each of ``cfg["scale_cases"]`` ((n, dim) pairs), each in a fresh
    process with the cli's time limit."""
    out = []
    for n, dim in cfg["scale_cases"]:
        score_rows = cfg["scale_score_rows"] if dim == 2 else 0
        base = {"section": "scale", "n": n, "dim": dim,
                "method": "ScalableKernelDensity(bandwidth='cv', scale='standardize', "
                          "random_state=0).fit(X), then .score_samples(X[:score_rows])"}
        log(f"scale: {n:,} points, d {dim}")
        got = harness.run_in_child(_fit_and_score, (n, dim, score_rows),
                                   timeout=cfg["cli_timeout"], head=base)
        log(f"  fit {got.get('fit_seconds', got.get('error'))} s, score "
            f"{got.get('score_seconds')} s, h={got.get('bandwidth')}")
        out.append({**base, **got})
    return out


def _score_paths(n: int, bandwidth: float, prune, check_rows: int, depths=()):
    """`section_prune`'s child: the fit at ``bandwidth`` with ``prune`` and two scorings of
    the n points, timed; the planned path's visited share; the float64 error on the first
    ``check_rows`` rows (0: none); on the Mosaic planned path, the second of two scorings at
    each prefetch depth in ``depths``."""
    import jax

    from scalegp import ScalableKernelDensity

    x = overlapping_mixture(n).astype(np.float32)
    started = _backend_start()
    start = time.perf_counter()
    model = ScalableKernelDensity(bandwidth=bandwidth, scale="standardize",
                                  prune=prune).fit(x)
    out = {"backend": jax.default_backend(), "backend_start_seconds": started,
           "fit_seconds": time.perf_counter() - start}
    for attempt in ("first", "second"):
        start = time.perf_counter()
        values = model.score_samples(x)
        out[f"score_{attempt}_seconds"] = time.perf_counter() - start
    density = getattr(model, "planned_density_", None)
    out["planned"] = density is not None
    if density is not None and density.plans:
        # the plans of the last chunks scored (each pipeline's): their share of tile pairs
        tiles = density.keys.tiles.shape[0]
        for name, plan in zip(("near", "rest"), density.plans):
            out[f"{name}_share"] = plan.pairs / (plan.count.shape[0] * tiles)
        out["planned_class"] = f"{type(density).__module__}.{type(density).__name__}"
    if depths and out.get("planned_class", "").startswith("scalegp.ops.backends.mosaic"):
        from scalegp.ops.backends.mosaic import _planned

        default, by_depth = _planned.PREFETCH_DEPTH, {}
        for depth in depths:
            _planned.PREFETCH_DEPTH = depth
            model.score_samples(x)  # compiles this depth's kernels
            start = time.perf_counter()
            model.score_samples(x)
            by_depth[str(depth)] = time.perf_counter() - start
        _planned.PREFETCH_DEPTH = default
        out["default_prefetch_depth"] = default
        out["score_second_seconds_by_prefetch_depth"] = by_depth
    if check_rows:
        reference = standardised_log_density(x[:check_rows].astype(np.float64),
                                             x.astype(np.float64), bandwidth)
        out.update(log_density_errors(values, reference))
    return out


def section_prune(cfg, bandwidth: float | None) -> list[dict]:
    """`_score_paths` for each bandwidth factor and prune setting, each in a fresh process."""
    h = bandwidth or cfg["fallback_bandwidth"]
    out = []
    for k, factor in enumerate(cfg["prune_factors"]):
        for prune in (True, False, "auto"):
            base = {"section": "prune", "n": cfg["n"], "dim": 2, "bandwidth": h * factor,
                    "prune": prune,
                    "method": "ScalableKernelDensity(bandwidth=h, scale='standardize', "
                              "prune=prune).fit(X), then .score_samples(X) twice"}
            log(f"prune: {cfg['n']:,} points, h {h * factor:.4g}, prune={prune}")
            got = harness.run_in_child(
                _score_paths, (cfg["n"], h * factor, prune, cfg["check_rows"] if k == 0 else 0,
                               cfg["prefetch_depths"] if prune is True else ()),
                timeout=cfg["cli_timeout"], head=base)
            log(f"  fit {got.get('fit_seconds', got.get('error'))} s, score "
                f"{got.get('score_first_seconds')} / {got.get('score_second_seconds')} s, "
                f"visited near {got.get('near_share')}, rest {got.get('rest_share')}")
            out.append({**base, **got})
    return out


def _planned_phases(n: int, bandwidth: float, repeats: int, pipelined: int,
                    block: int | None = None):
    """`section_phases`' child: the host-planned scoring of the n points (standardised) against
    themselves at ``bandwidth``, in the chunks `PlannedDensity.log_density` takes, each phase
    of each chunk run in this one thread and awaited, the seconds summed over the chunks: the
    near plan (host), the near pass (device), the levels' copy to the host, the rest plan
    (host), the rest pass (device); on the Mosaic path also the near pass's gather of each
    row's largest bound (`mosaic._planned.largest_bounds`) alone. ``repeats`` times (the first
    compiles); then the scoring as `PlannedDensity.log_density` runs it (its chunks pipelined
    in threads: a chunk per thread, then chunks of the estimators' batch), ``pipelined``
    times each, with its parts (`_pipeline_parts`). ``block``: the Mosaic path's tile height
    (`mosaic._planned.PLANNED_BLOCK`), where given."""
    import jax
    import jax.numpy as jnp

    from scalegp.ops import Engine
    from scalegp.ops.backends.mosaic import _planned as mosaic_planned
    from scalegp.ops.pruning import default_tolerance, lse_log_tol, near_plan, rest_plan
    from scalegp.ops.pruning._planned import plan_threads

    x = overlapping_mixture(n).astype(np.float32)
    z = (x - x.mean(axis=0)) / x.std(axis=0)
    out = {"backend_start_seconds": _backend_start(), "backend": jax.default_backend()}
    if block is not None:
        mosaic_planned.PLANNED_BLOCK = out["planned_block"] = block
    start = time.perf_counter()
    density = Engine.create(prune=True).planned_kde(z, bandwidth)
    out["build_seconds"] = time.perf_counter() - start
    out["planned_class"] = f"{type(density).__module__}.{type(density).__name__}"
    mosaic = out["planned_class"].startswith("scalegp.ops.backends.mosaic")
    keys, tree, (tk, _, d) = density.keys, density.tree, density.keys.tiles.shape
    inv, inv64 = jnp.full((d,), 1 / bandwidth, jnp.float32), np.full(d, 1 / bandwidth)
    log_tol = lse_log_tol(default_tolerance(jnp.float32), jnp.float32)
    step = -(-tk // plan_threads(tk))
    out["chunks"], out["query_tiles_per_chunk"] = -(-tk // step), step
    passes, clock, attempts = density.passes, time.perf_counter, []
    for _ in range(repeats):
        seconds = dict.fromkeys(("near_plan", "near_pass", "levels_to_host", "rest_plan",
                                 "rest_pass") + (("near_tops",) if mosaic else ()), 0.0)
        pairs = {"near": 0, "rest": 0}
        for first in range(0, tk, step):
            tiles = np.arange(first, min(first + step, tk))
            x_tiles, lo, hi = keys.tiles[tiles], tree.tile_lo[tiles], tree.tile_hi[tiles]
            began = clock()
            near = near_plan(tree, lo, hi, inv64, log_tol)
            seconds["near_plan"] += clock() - began
            if mosaic:  # the near pass's first part, each row's largest bound
                began = clock()
                jax.block_until_ready(mosaic_planned.largest_bounds(
                    x_tiles, near, density.operands.boxes, inv))
                seconds["near_tops"] += clock() - began
            began = clock()
            state, top, level = jax.block_until_ready(passes.near(
                x_tiles, keys.tiles, density.weights, inv, near, log_tol, None, False))
            seconds["near_pass"] += clock() - began
            began = clock()
            level_min = np.asarray(level, np.float64).min(axis=1)
            top_max = np.asarray(top, np.float64).max(axis=1)
            seconds["levels_to_host"] += clock() - began
            began = clock()
            rest = rest_plan(tree, lo, hi, inv64, log_tol, level_min, top_max)
            seconds["rest_plan"] += clock() - began
            began = clock()
            jax.block_until_ready(passes.rest(x_tiles, keys.tiles, density.weights, inv, rest,
                                              state, top, level, log_tol, None))
            seconds["rest_pass"] += clock() - began
            pairs["near"] += near.pairs
            pairs["rest"] += rest.pairs
        attempts.append({"seconds": seconds, "pairs": pairs})
        log(f"  {n:,}: " + ", ".join(f"{k} {v:.3f}" for k, v in seconds.items())
            + f"; pairs {pairs}")
    out["attempts"] = attempts
    out["pipelined"] = []
    for chunk_rows in (None, ESTIMATOR_BATCH):
        for _ in range(pipelined):
            with _pipeline_parts() as parts:
                began = clock()
                jax.block_until_ready(density.log_density(bandwidth, chunk_rows=chunk_rows))
                seconds = clock() - began
            out["pipelined"].append({"chunk_rows": chunk_rows, "seconds": seconds,
                                     "parts_summed_over_threads": parts})
            log(f"  pipelined, chunks of {chunk_rows or 'a thread'}: {seconds:.3f} s, "
                + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    return out


#: The estimators' ``batch_size``: the rows per chunk of their scoring of the data themselves.
ESTIMATOR_BATCH = 65_536


@contextlib.contextmanager
def _pipeline_parts():
    """Within the block, `PlannedDensity.log_density`'s pipelined parts timed in every thread
    and summed (seconds, filled into the yielded dict): the host plans, each chunk's near
    stage (its plan and the near pass dispatched) and rest stage (the wait for the near pass's
    levels, the rest plan, the rest pass dispatched), and the final reordering of the rows,
    awaited (so it also holds the wait for whatever passes were still running)."""
    import threading

    import jax

    from scalegp.ops.pruning import _planned as host

    parts, lock = {}, threading.Lock()

    def timed(name, fn, wait=False):
        def run(*args, **kwargs):
            began = time.perf_counter()
            result = fn(*args, **kwargs)
            if wait:
                jax.block_until_ready(result)
            with lock:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - began
            return result
        return run

    names = {"near_plan": False, "rest_plan": False, "_near_stage": False,
             "_rest_stage": False, "unordered": True}
    originals = {name: getattr(host, name) for name in names}
    try:
        for name, wait in names.items():
            setattr(host, name, timed(name.lstrip("_"), originals[name], wait))
        yield parts
    finally:
        for name, fn in originals.items():
            setattr(host, name, fn)


def section_phases(cfg) -> list[dict]:
    """`_planned_phases` at each ``--phases-cases`` size, bandwidth and tile height, each in a
    fresh process."""
    out = []
    for n, h, blocks in cfg["phases_cases"]:
        for block in blocks:
            base = {"section": "phases", "n": n, "dim": 2, "bandwidth": h,
                    "method": "the host-planned scoring's phases, one thread, each awaited; "
                              "then PlannedDensity.log_density"}
            log(f"phases: {n:,} points, h {h:.4g}, tiles {block or 'default'}")
            got = harness.run_in_child(
                _planned_phases, (n, h, cfg["phases_repeats"], 2 if n <= 2_000_000 else 1,
                                  block), timeout=cfg["cli_timeout"], head=base)
            out.append({**base, **got})
    return out


def section_bandwidth(cfg) -> list[dict]:
    """The cv bandwidth of the n 2-D points on JAX's default device and on the host CPU."""
    rows = {}
    for platform in (None, "cpu"):
        where = platform or "default device"
        log(f"bandwidth: the cv fit on {cfg['n']:,} points, {where}")
        rows[where] = harness.run_in_child(_fit_and_score, (cfg["n"], 2, 0, platform),
                                           timeout=cfg["cli_timeout"])
    got, host = rows["default device"], rows["cpu"]
    row = {"section": "bandwidth", "n": cfg["n"], "dim": 2, "default_device": got,
           "host_cpu": host}
    if "bandwidth" in got and "bandwidth" in host:
        row["rel_diff"] = abs(got["bandwidth"] - host["bandwidth"]) / host["bandwidth"]
        log(f"  {got['bandwidth']:.6g} ({got['backend']}) against {host['bandwidth']:.6g} "
            f"(cpu): {row['rel_diff']:.2e}")
    return [row]


def _features(n: int, draws: int, platform: str | None = None) -> dict:
    """Issue 61's point 4 in one process on ``platform`` (None: JAX's default device): on
    ``n`` 2-D points of the mixture (float32, standardised, ``random_state=0``), the
    ``cv-diag`` fit; the ``cv`` fit with weights (uniform on [0.5, 2], seed 5); ``draws``
    samples from the weighted model; the weighted model's log-densities of 2,000 fixed rows.
    Each timed (compilation included; the backend's start apart)."""
    import jax

    from scalegp import ScalableKernelDensity

    if platform:
        jax.config.update("jax_platforms", platform)
    x = overlapping_mixture(n).astype(np.float32)
    weights = np.random.default_rng(5).uniform(0.5, 2.0, n).astype(np.float32)
    rows = np.sort(np.random.default_rng(1).choice(n, min(2000, n), replace=False))
    started = _backend_start()  # before anything else starts it: not in the first fit's time
    out = {"backend": jax.default_backend(), "backend_start_seconds": started}
    start = time.perf_counter()
    diag = ScalableKernelDensity(bandwidth="cv-diag", scale="standardize",
                                 random_state=0).fit(x)
    out.update(cv_diag_seconds=time.perf_counter() - start,
               cv_diag_bandwidth=np.asarray(diag.bandwidth_, np.float64).tolist())
    start = time.perf_counter()
    weighted = ScalableKernelDensity(bandwidth="cv", scale="standardize",
                                     random_state=0).fit(x, sample_weight=weights)
    out.update(weighted_seconds=time.perf_counter() - start,
               weighted_bandwidth=float(weighted.bandwidth_))
    start = time.perf_counter()
    sampled = np.asarray(weighted.sample(draws, random_state=0), np.float64)
    out.update(sample_seconds=time.perf_counter() - start, sample_rows=len(sampled),
               sample_mean=sampled.mean(axis=0).tolist(),
               weighted_data_mean=np.average(x, axis=0, weights=weights).tolist())
    start = time.perf_counter()
    scores = np.asarray(weighted.score_samples(x[rows]), np.float64)
    out.update(score_seconds=time.perf_counter() - start, scores=scores.tolist())
    return out


def section_features(cfg) -> list[dict]:
    """`_features` on JAX's default device and on the host CPU (a child each): the times, and
    the relative differences of the bandwidths and the largest difference of log-densities."""
    rows = {}
    for platform in (None, "cpu"):
        where = platform or "default device"
        log(f"features: cv-diag, weights and sample on {cfg['features_n']:,} points, {where}")
        rows[where] = harness.run_in_child(_features,
                                           (cfg["features_n"], cfg["features_draws"], platform),
                                           timeout=cfg["cli_timeout"])
    got, host = rows["default device"], rows["cpu"]
    row = {"section": "features", "n": cfg["features_n"], "dim": 2}
    if "scores" in got and "scores" in host:
        diag, host_diag = np.array(got["cv_diag_bandwidth"]), np.array(host["cv_diag_bandwidth"])
        row.update(
            cv_diag_rel_diff=float(np.max(np.abs(diag - host_diag) / host_diag)),
            weighted_rel_diff=abs(got["weighted_bandwidth"] - host["weighted_bandwidth"])
            / host["weighted_bandwidth"],
            max_abs_log_density_diff=float(np.max(np.abs(np.array(got["scores"])
                                                         - np.array(host["scores"])))))
        log(f"  cv-diag rel {row['cv_diag_rel_diff']:.2e}, weighted rel "
            f"{row['weighted_rel_diff']:.2e}, log-density {row['max_abs_log_density_diff']:.2e}")
    for r in (got, host):
        r.pop("scores", None)
    row.update(default_device=got, host_cpu=host)
    return [row]


def section_engine(cfg) -> list[dict]:
    """The issue's engine case, called as a user calls it (keys as given: each pruned call
    sorts them) and with the keys put in `spatial_order` once, outside the timing, and passed
    with ``keys_in_order=True`` (as the estimators keep them; issue 41 point 2)."""
    import jax.numpy as jnp

    from scalegp.ops import spatial_order

    rng = np.random.default_rng(3)
    centres = rng.uniform(0, 100, size=(300, 2))
    keys = centres[rng.integers(300, size=cfg["engine_keys"])] + 0.4 * rng.standard_normal(
        (cfg["engine_keys"], 2))
    ordered = keys[spatial_order(keys, 0.3)]
    out = []
    for n_q in cfg["engine_queries"]:
        queries = centres[rng.integers(300, size=n_q)] + 0.4 * rng.standard_normal((n_q, 2))
        for in_order, k in ((False, keys), (True, ordered)):
            times = time_modes(jnp.asarray(queries, jnp.float32), jnp.asarray(k, jnp.float32),
                               0.3, cfg["engine_repeats"], in_order)
            best = min(times["True"], times["False"])
            row = {"section": "engine", "keys": cfg["engine_keys"], "queries": n_q,
                   "bandwidth": 0.3, "keys_in_order": in_order, "seconds": times,
                   "pruned_speedup": times["False"] / times["True"],
                   "auto_over_best": times["auto"] / best}
            log(f"engine {n_q} queries, keys_in_order={in_order}: {times}")
            out.append(row)
    return out


def _device() -> str:
    import jax

    return jax.default_backend()


def _machine() -> dict:
    return {"info": harness.machine_info(_device())}


def _phases_case(case: str):
    n, h, *blocks = case.split(":")
    return int(n), float(h), [int(b) for b in blocks[0].split(",")] if blocks else [None]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--sections", nargs="+", default=["cli", "cv", "peers", "engine"],
                        choices=["cli", "cv", "peers", "scale", "prune", "bandwidth",
                                 "features", "engine", "phases"])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="the peers' bandwidth without the cli section (its cv bandwidth "
                             "from an earlier run); default: the cli section's, else 0.006")
    parser.add_argument("--peer-timeout", type=float, default=3600.0,
                        help="seconds each peer may take per size (a child process)")
    parser.add_argument("--check-rows", type=int, default=2000,
                        help="rows whose log-densities are checked against float64")
    parser.add_argument("--cli-warm", action="store_true",
                        help="run the cli section's command a second time, on the compilation "
                             "cache the first run filled")
    parser.add_argument("--cli-profile", action="store_true",
                        help="run the cli section's command once more under cProfile, and keep "
                             "the functions that took the most of its time")
    parser.add_argument("--cli-profile-rows", type=int, default=80,
                        help="how many of those functions to keep, by cumulative time")
    parser.add_argument("--scale-cases", nargs="+", default=["10000000x2", "1000000x8"],
                        help="the scale section's sizes, as NxDIM")
    parser.add_argument("--scale-score-rows", type=int, default=None,
                        help="the scale section's scored rows at d 2 (default: all)")
    parser.add_argument("--prune-factors", nargs="+", type=float, default=[1.0, 4.0, 16.0],
                        help="the prune section's bandwidths, as multiples of the cv one")
    parser.add_argument("--phases-cases", nargs="+", default=["1000000:0.01246"],
                        help="the phases section's sizes and bandwidths (of the standardised "
                             "points), as N:H, or N:H:B1,B2 with the Mosaic path's tile "
                             "heights to try")
    parser.add_argument("--prefetch-depths", nargs="+", type=int, default=[],
                        help="the prune section's planned Mosaic path (prune=True) also "
                             "scored at each of these key-tile prefetch depths")
    parser.add_argument("--features-n", type=int, default=1_000_000,
                        help="the features section's points")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the CSV and logp.npy go (default: a temporary folder)")
    args = parser.parse_args(argv)
    cfg = {"n": 1_000_000, "check_rows": args.check_rows, "cli_timeout": 3600,
           "cli_warm": args.cli_warm, "cli_profile": args.cli_profile,
           "cli_profile_rows": args.cli_profile_rows, "peer_sizes": [100_000,
           1_000_000], "peer_timeout": args.peer_timeout, "fallback_bandwidth": 0.006,
           "engine_keys": 2**17, "engine_queries": [2**13, 2**10], "engine_repeats": 7,
           "scale_cases": [tuple(int(v) for v in case.split("x")) for case in args.scale_cases],
           "scale_score_rows": args.scale_score_rows, "prune_factors": args.prune_factors,
           "prefetch_depths": args.prefetch_depths, "phases_repeats": 2,
           "phases_cases": [_phases_case(case) for case in args.phases_cases],
           "features_n": args.features_n, "features_draws": 1_000_000}
    if args.quick:
        cfg.update({"n": 20_000, "features_n": 20_000, "features_draws": 1000,
                    "check_rows": 200, "peer_sizes": [5_000], "engine_keys": 2**13,
                    "engine_queries": [2**9], "engine_repeats": 1,
                    "scale_cases": [(40_000, 2), (10_000, 8)]})
    run = harness.Run(__file__, argv)
    record = {"benchmark": "kde_million", "command": run.command,
              "started": datetime.datetime.fromtimestamp(run.started, datetime.timezone.utc)
              .isoformat(timespec="seconds"),
              # from a child: a TPU is held by the first process that opens it, and the cli
              # section's command runs in a child of its own
              "machine": harness.run_in_child(_machine, (), timeout=300).get("info"),
              "loadavg_start": run.loadavg_start,
              "config": cfg, "results": []}

    def keep(rows):  # written after each section, so that a run cut short keeps what it measured
        record["results"] += rows
        harness.write_json(args.out, record)
        return rows

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        h = args.bandwidth
        if "cli" in args.sections:
            h = keep(section_cli(cfg, workdir))[0].get("bandwidth")
        if "peers" in args.sections:
            keep(section_peers(cfg, h))
        if "prune" in args.sections:
            keep(section_prune(cfg, h))
    if "cv" in args.sections:
        keep(section_cv(cfg))
    if "scale" in args.sections:
        keep(section_scale(cfg))
    if "bandwidth" in args.sections and (record["machine"] or {}).get("backend") != "cpu":
        keep(section_bandwidth(cfg))
    if "features" in args.sections:
        keep(section_features(cfg))
    if "engine" in args.sections:
        keep(section_engine(cfg))
    if "phases" in args.sections:
        keep(section_phases(cfg))
    record["wall_seconds"] = run.end()
    record["loadavg_end"] = run.loadavg_end
    harness.write_json(args.out, record)
    log(f"wrote {args.out} in {record['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
