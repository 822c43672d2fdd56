"""Pathwise `ScalableGPRegressor.sample_y` (issue 42 point 1): memory, calibration and time.

    python benchmarks/gp_sample.py                 # the 6 GB case and the small float64 case
    python benchmarks/gp_sample.py --full          # and m = n = 100,000, 10 samples
    python benchmarks/gp_sample.py --only full --full --full-n 50000  # one section, merged
                                                   # into the existing result file

Sections, each in a fresh subprocess (its own limits, its own JAX settings):

- ``memory``: a 20,000-point BBMM model (fixed hyperparameters, ``optimizer=None``: the fit is
  the final solve and its preconditioner), ``sample_y`` at 50,000 test points, 4 samples,
  under an address-space limit of 6 GB (``resource.setrlimit(RLIMIT_AS)``; the limit covers
  JAX's own reservations too). Reports the standardised draws ``(s - mean) / std`` (``predict``
  with ``return_std``, the LOVE cache) pooled: their mean and sd (targets 0 ± 0.05, 1 ± 0.1),
  the seconds of the fit, of ``sample_y`` and of ``predict(return_std=True)``, and the peak
  resident memory.
- ``small``: float64 (x64 on in that process), 200 training points, 40 test points, 4,000
  draws, pathwise and exact: the largest |sample mean - predict| in standard errors (target
  ≤ 4.5) and the relative Frobenius distance of the sample covariance to
  ``predict(return_cov=True)`` (target ≤ 0.15); the exact draw's figures show the Monte Carlo
  level both share.
- ``full`` (``--full``): ``--full-n`` training and test points (default 100,000), 10 samples:
  seconds of the fit, of ``sample_y``, of ``predict`` (mean) for scale.

Data: ``y = sin(6 x₁) cos(4 x₂) + ε`` on the unit square, ``σ = 0.1``; model
``1.0 * RBF(0.1) + WhiteKernel(0.01)`` at its true values (fixed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `scalegp` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gp_sample_cpu.json"
ADDRESS_LIMIT = 6_000_000_000


def _data(n, m, seed=0):
    import numpy as np

    rng = np.random.RandomState(seed)
    x = rng.uniform(0, 1, (n, 2))
    y = np.sin(6 * x[:, 0]) * np.cos(4 * x[:, 1]) + 0.1 * rng.standard_normal(n)
    return x, y, rng.uniform(0, 1, (m, 2))


def _model(**settings):
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    from scalegp.estimators import ScalableGPRegressor

    kernel = ConstantKernel(1.0) * RBF(0.1) + WhiteKernel(0.01)
    return ScalableGPRegressor(kernel=kernel, optimizer=None, mean=0.0, random_state=0,
                               **settings)


def _peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _fit_and_sample(n, m, samples):
    """A BBMM model of n points and ``samples`` draws at m test points, with both timings."""
    x, y, xt = _data(n, m)
    t = time.perf_counter()
    model = _model(solver="bbmm").fit(x, y)
    fit_s = time.perf_counter() - t
    t = time.perf_counter()
    draws = model.sample_y(xt, samples, random_state=0)
    return model, xt, draws, fit_s, time.perf_counter() - t


def section_memory(n=20_000, m=50_000, samples=4):
    import numpy as np

    model, xt, draws, fit_s, sample_s = _fit_and_sample(n, m, samples)
    t = time.perf_counter()
    mean, std = model.predict(xt, return_std=True)
    predict_std_s = time.perf_counter() - t
    z = (draws - mean[:, None]) / std[:, None]
    return {"n": n, "m": m, "samples": samples, "shape": list(draws.shape),
            "address_limit_bytes": ADDRESS_LIMIT, "fit_s": fit_s, "sample_s": sample_s,
            "predict_std_s": predict_std_s, "standardised_mean": float(z.mean()),
            "standardised_sd": float(z.std()),
            "standardised_sd_per_sample": [float(s) for s in z.std(axis=0)],
            "finite": bool(np.isfinite(draws).all()), "peak_rss_gb": _peak_rss_gb()}


def section_small(n=200, m=40, draws=4000):
    import jax
    import numpy as np

    from scalegp.estimators import ScalableGPRegressor

    assert jax.numpy.asarray(1.0).dtype == np.float64, "run with x64 on"
    rng = np.random.RandomState(0)
    x = rng.uniform(-3, 3, (n, 2))
    y = np.sin(x[:, 0]) + 0.1 * rng.standard_normal(n)
    xt = rng.uniform(-3, 3, (m, 2))
    model = ScalableGPRegressor(normalize_y=True, random_state=0, dtype="float64").fit(x, y)
    mean, cov = model.predict(xt, return_cov=True)
    out = {"n": n, "m": m, "draws": draws}
    for method in ("pathwise", "exact"):
        t = time.perf_counter()
        s = model.sample_y(xt, draws, random_state=1, method=method)
        seconds = time.perf_counter() - t
        out[method] = {
            "seconds": seconds,
            "max_mean_error_in_se": float(np.max(np.abs(s.mean(1) - mean)
                                                 / np.sqrt(np.diag(cov) / draws))),
            "cov_relative_frobenius": float(np.linalg.norm(np.cov(s) - cov)
                                            / np.linalg.norm(cov))}
    return out


def section_full(n=100_000, m=100_000, samples=10):
    model, xt, draws, fit_s, sample_s = _fit_and_sample(n, m, samples)
    t = time.perf_counter()
    model.predict(xt)
    predict_s = time.perf_counter() - t
    return {"n": n, "m": m, "samples": samples, "shape": list(draws.shape), "fit_s": fit_s,
            "sample_s": sample_s, "predict_mean_s": predict_s, "peak_rss_gb": _peak_rss_gb()}


SECTIONS = {"memory": section_memory, "small": section_small, "full": section_full}


def _child(name, kwargs):
    if name == "memory":
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_LIMIT, ADDRESS_LIMIT))
    print(json.dumps(SECTIONS[name](**kwargs)))


def _run_section(name, kwargs, timeout):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if name == "small":
        env["JAX_ENABLE_X64"] = "1"
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", name, json.dumps(kwargs)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "args": kwargs}
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:],
                "args": kwargs}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--full", action="store_true", help="also the m = n = --full-n case")
    p.add_argument("--full-n", type=int, default=100_000)
    p.add_argument("--only", choices=sorted(SECTIONS), action="append",
                   help="run only these sections (repeatable)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per section")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child[0], json.loads(args.child[1]))
        return
    from benchmarks import harness

    names = args.only or ["memory", "small"] + (["full"] if args.full else [])
    record = {"machine": harness.machine_info("cpu", ("numpy", "scipy", "sklearn")),
              "command": "python benchmarks/gp_sample.py "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "loadavg_start": list(os.getloadavg()), "sections": {}}
    if args.only and args.out.exists():  # the other sections' earlier results stay
        earlier = json.loads(args.out.read_text())
        record["sections"] = earlier.get("sections", {})
        record["earlier_commands"] = earlier.get("earlier_commands", []) + [earlier["command"]]
    for name in names:
        kwargs = {"n": args.full_n, "m": args.full_n} if name == "full" else {}
        record["sections"][name] = _run_section(name, kwargs, args.timeout)
        print(name, json.dumps(record["sections"][name], indent=1), flush=True)
    record["loadavg_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
