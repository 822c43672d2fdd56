"""`ScalableGPClassifier` against scikit-learn's GaussianProcessClassifier (issue 39).

    python benchmarks/gp_classify.py                                   # all sections
    python benchmarks/gp_classify.py --sections scale --scale-n 1000,5000,20000,50000
    python benchmarks/gp_classify.py --models scalegp --sections moons --merge   # one row again

Sections, every case in a fresh child process (`benchmarks.harness.run_in_child`) under a
timeout and an address-space limit, so a case past either becomes an error row:

- ``moons``: ``make_moons(2500, noise=0.3, random_state=0)``, 1,500 training and 1,000
  held-out points; the default model (``ScalableGPClassifier(random_state=0)``, learnt ARD
  ``C * RBF``) against ``GaussianProcessClassifier(C(1) * RBF(1), random_state=0)``: held-out
  accuracy (target: within 1 point) and log-loss (within 5%), fit seconds.
- ``multiclass``: ``make_classification(1500, n_features=4, n_informative=3, n_redundant=0,
  n_classes=3, n_clusters_per_class=1, random_state=0)``, 1,000 training and 500 held-out
  points, one-vs-rest both (target: accuracy within 2 points).
- ``scale``: 4 features uniform on [-2, 2], labels drawn from ``p(y = 1 | x) = σ(g(x))``,
  ``g(x) = 3 (sin(1.5 x₁) + 0.5 x₂ x₃ - 0.4 x₄)``, a smooth boundary with label noise; the
  Bayes rate ``E[max(p, 1 - p)]`` on the held-out points is recorded beside the accuracy. A
  ladder: scikit-learn at ``--sklearn-n`` until a case passes ``--timeout`` or its memory
  limit, ours at ``--scale-n`` (8 GB address space, the issue's limit), each fit and
  ``predict_proba`` on 10,000 held-out points, with seconds and peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `scalegp` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gp_classify_cpu.json"
SECTIONS = ("moons", "multiclass", "scale")
NUM_TEST = 10_000


def _scale_data(n, num_test=NUM_TEST, seed=0):
    import numpy as np

    rng = np.random.RandomState(seed)
    x = rng.uniform(-2, 2, (n + num_test, 4))
    g = 3.0 * (np.sin(1.5 * x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] - 0.4 * x[:, 3])
    p = 1.0 / (1.0 + np.exp(-g))
    y = (rng.uniform(size=n + num_test) < p).astype(int)
    bayes = float(np.mean(np.maximum(p[n:], 1 - p[n:])))
    return x[:n], y[:n], x[n:], y[n:], bayes


def _split_data(section):
    from sklearn.datasets import make_classification, make_moons

    if section == "moons":
        X, y = make_moons(2500, noise=0.3, random_state=0)
        return X[:1500], y[:1500], X[1500:], y[1500:], None
    X, y = make_classification(1500, n_features=4, n_informative=3, n_redundant=0,
                               n_classes=3, n_clusters_per_class=1, random_state=0)
    return X[:1000], y[:1000], X[1000:], y[1000:], None


def _case(section, model, n):
    """One fit and held-out evaluation (in a child process): a result row."""
    import warnings

    import numpy as np
    from sklearn.metrics import log_loss

    if section == "scale":
        X, y, X_test, y_test, bayes = _scale_data(n)
    else:
        X, y, X_test, y_test, bayes = _split_data(section)
    if model == "scalegp":
        from scalegp import ScalableGPClassifier

        estimator = ScalableGPClassifier(random_state=0)
    else:
        from sklearn.gaussian_process import GaussianProcessClassifier
        from sklearn.gaussian_process.kernels import RBF
        from sklearn.gaussian_process.kernels import ConstantKernel as C

        estimator = GaussianProcessClassifier(C(1.0) * RBF(1.0), random_state=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        estimator.fit(X, y)
        fit_s = time.perf_counter() - start
        start = time.perf_counter()
        proba = estimator.predict_proba(X_test)
        predict_s = time.perf_counter() - start
    predicted = estimator.classes_[np.argmax(proba, axis=1)]
    row = {
        "section": section, "model": model, "n_train": int(len(X)),
        "n_test": int(len(X_test)), "fit_s": round(fit_s, 2),
        "predict_proba_s": round(predict_s, 2),
        "accuracy": float(np.mean(predicted == y_test)),
        "log_loss": float(log_loss(y_test, proba, labels=estimator.classes_)),
        "kernel": str(estimator.kernel_),
        "log_marginal_likelihood": float(estimator.log_marginal_likelihood_value_),
        "peak_rss_mb": round(harness.rss_peak_mb(), 1),
        "warnings": sorted({f"{w.category.__name__}: {str(w.message)[:160]}"
                            for w in caught}),
    }
    if model == "scalegp":
        row["solver"] = estimator.solver_
    if bayes is not None:
        row["bayes_accuracy"] = bayes
    return row


def _machine() -> dict:
    import jax

    return harness.machine_info(jax.default_backend())


def _run_case(section, model, n, timeout, mem_gb):
    head = {"section": section, "model": model, "n_train": n}
    harness.log(f"{section} {model} n={n} ...")
    row = harness.run_in_child(_case, (section, model, n), timeout=timeout, mem_limit_gb=mem_gb,
                               head=head)
    row["timeout_s"], row["mem_limit_gb"] = timeout, mem_gb
    shown = ("accuracy", "log_loss", "fit_s", "predict_proba_s", "peak_rss_mb", "error")
    harness.log(f"  -> { {k: row.get(k) for k in shown} }")
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--scale-n", default="1000,2000,5000,10000,20000,50000")
    parser.add_argument("--sklearn-n", default="1000,2000,4000,8000")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per scikit-learn case of the ladder")
    parser.add_argument("--our-timeout", type=float, default=3600.0)
    parser.add_argument("--mem-gb", type=float, default=8.0, help="our address-space limit")
    parser.add_argument("--sklearn-mem-gb", type=float, default=12.0)
    parser.add_argument("--models", default="sklearn,scalegp")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of --out that this run does not measure again")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    run = harness.Run(__file__, argv)
    # from a child: a TPU serves one process, and every case runs in a child of its own
    device = harness.run_in_child(_machine, (), timeout=300)
    rows, kept, earlier = [], [], []
    if args.merge and Path(args.out).exists():
        previous = json.loads(Path(args.out).read_text())
        kept = previous["results"]
        earlier = previous.get("earlier_runs", []) + [
            {k: previous.get(k) for k in ("command", "total_s", "loadavg_start",
                                          "loadavg_end")}]

    def key(row):
        return row["section"], row["model"], row.get("n_train")

    def record(row):
        # written after every case: an interrupted ladder keeps what it measured
        rows.append(row)
        measured = {key(r) for r in rows}
        total = run.end()
        harness.write_json(args.out, {
            "benchmark": "gp_classify", "command": run.command, "total_s": round(total, 1),
            "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end,
            "earlier_runs": earlier, "device": device,
            "results": [r for r in kept if key(r) not in measured] + rows,
        })
        return row

    sections = [s for s in args.sections.split(",") if s]
    for section in ("moons", "multiclass"):
        if section in sections:
            for model in models:
                record(_run_case(section, model, None, args.our_timeout,
                                 args.sklearn_mem_gb if model == "sklearn" else args.mem_gb))
    if "scale" in sections:
        for model, ladder, timeout, mem_gb in (
                ("sklearn", args.sklearn_n, args.timeout, args.sklearn_mem_gb),
                ("scalegp", args.scale_n, args.our_timeout, args.mem_gb)):
            if model not in models:
                continue
            for n in [int(v) for v in ladder.split(",") if v]:
                if "error" in record(_run_case("scale", model, n, timeout, mem_gb)):
                    break
    harness.log(f"wrote {args.out}")

if __name__ == "__main__":
    main()
