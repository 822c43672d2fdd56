"""Issue 62's largest case on one chip: `ScalableGPRegressor` with its defaults (float32) on
``gp_scale.make_data``'s d = 4 data, as `benchmarks/gp_scale.py` fits it, then the mean, and
the mean with the standard deviation, of ``--num-test`` rows. `gp_scale.py` writes a fit's row
only when its child ends; a 10⁶-point fit takes most of a device call, so this runs in the
process itself and rewrites its JSON after every phase (data, fit, mean, mean and standard
deviation): a run cut short keeps what it measured. With ``--paired-rows``, the prediction's
blocks are timed in pairs first (`_paired_blocks`), which compiles the programs of the mean and
standard deviation that the last phase then runs on. The fit's phases come from the
estimator's log records by `gp_scale.phase_split`; the device's peak is its runtime's
``peak_bytes_in_use`` (arrays held, not a program's temporaries: `compile_times.py` gives
those).

    python benchmarks/tpu/gp_million.py --n 1000000 --num-test 1000000 --out OUT.json
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
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gp_scale import cg_iterations, make_data, metrics, phase_split  # noqa: E402


def _device_peak(jax):
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    return (device.memory_stats() or {}).get("peak_bytes_in_use")


def _paired_blocks(model, rows, save, report):
    """Mean and standard deviation of ``rows`` in blocks of `PREDICT_BLOCK` rows only (as
    before `TALL_PREDICT_BLOCK`) and in the default blocks, alternating, twice each (the first
    of each compiles its block's program); the largest difference between the two (0: the
    rows' bits do not depend on the blocks)."""
    from scalegp.gp import _predict

    tall = _predict.TALL_PREDICT_BLOCK
    out = {"rows": len(rows), "short_s": [], "tall_s": []}
    results = {}
    try:
        for label in ("short", "tall") * 2:
            _predict.TALL_PREDICT_BLOCK = tall if label == "tall" else _predict.PREDICT_BLOCK
            t0 = time.perf_counter()
            results[label] = [np.asarray(a) for a in model.predict(rows, return_std=True)]
            out[f"{label}_s"].append(time.perf_counter() - t0)
            report["paired"] = out
            save()
    finally:
        _predict.TALL_PREDICT_BLOCK = tall
    out["max_abs_difference"] = max(float(np.max(np.abs(a - b)))
                                    for a, b in zip(results["short"], results["tall"]))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--num-test", type=int, default=1_000_000)
    parser.add_argument("--paired-rows", type=int, default=0,
                        help="first time this many test rows' predictions in the blocks of "
                             "before and in the default blocks (`_paired_blocks`)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    report = {"benchmark": "gp_million", "command": " ".join(sys.argv), "args": vars(args),
              "machine": {"platform": platform.platform(), "python": platform.python_version()},
              "phases_s": {}}

    def save():
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    t0 = time.perf_counter()
    import jax

    import scalegp
    from scalegp import ScalableGPRegressor

    report["device"] = jax.devices()[0].device_kind
    report["versions"] = {"jax": jax.__version__, "numpy": np.__version__,
                          "scalegp": getattr(scalegp, "__version__", None)}
    report["phases_s"]["start_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    x, y, x_test, y_test = make_data(args.n, args.d, args.num_test)
    report["phases_s"]["data_s"] = time.perf_counter() - t0
    save()

    records = []

    class Recorder(logging.Handler):
        def emit(self, record):
            records.append((time.perf_counter(), record.getMessage()))

    logger = logging.getLogger("scalegp.gp")
    logger.addHandler(Recorder())
    logger.setLevel(logging.INFO)
    model = ScalableGPRegressor(normalize_y=True, random_state=0, verbose=1)
    start = time.perf_counter()
    model.fit(x, y)
    fit_end = time.perf_counter()
    subset_end, full_end = (r[0] for r in phase_split(records, (start,), (fit_end,)))
    full_iters = [m for _, m in records if m.startswith("BBMM fit")]
    report.update({
        "fit_s": fit_end - start, "solver": model.solver_, "kernel": str(model.kernel_),
        "full_data_iterations": full_iters, "full_cg_iterations": cg_iterations(full_iters),
        "device_peak_bytes_after_fit": _device_peak(jax)})
    report["phases_s"].update({"subset_s": subset_end - start, "full_s": full_end - subset_end,
                               "solve_s": fit_end - full_end})
    save()

    if args.paired_rows:
        report["paired"] = _paired_blocks(model, x_test[:args.paired_rows], save, report)

    t0 = time.perf_counter()
    mean = np.asarray(model.predict(x_test))
    report["predict_mean_s"] = time.perf_counter() - t0
    report["rmse"] = float(np.sqrt(np.mean((mean - y_test) ** 2)))
    save()

    t0 = time.perf_counter()
    mean, std = model.predict(x_test, return_std=True)
    report["predict_mean_std_s"] = time.perf_counter() - t0
    report["rmse"], report["nll"] = metrics(np.asarray(mean), np.asarray(std), y_test)
    report["device_peak_bytes"] = _device_peak(jax)
    save()
    print(json.dumps({k: v for k, v in report.items() if k not in ("args", "machine")}),
          flush=True)


if __name__ == "__main__":
    main()
