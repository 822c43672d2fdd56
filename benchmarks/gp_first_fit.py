"""Where a process's first `ScalableGPRegressor` fit goes, against its second (issue 62: a first
fit pays every program's compilation): the default estimator fitted and asked for mean and
standard deviation of 1,000 test rows twice in one process, each time under cProfile, on
``gp_scale.make_data``'s d = 4 data. JAX's backend is started before, and timed apart (a TPU's
client takes seconds). With ``JAX_LOG_COMPILES=1`` in the environment, JAX logs each program's
compilation seconds to stderr. ``--no-compile-ahead`` turns off the compilation of the fit's
programs in background threads (`scalegp.ops.compiles_ahead`: on by default on a TPU and on a
host CPU of 8 or more cores), for a paired run.

    python benchmarks/gp_first_fit.py --n 10000 --out /tmp/gp_first_fit_10000.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gp_scale import make_data  # noqa: E402


def _top(profile: cProfile.Profile, rows: int) -> list[dict]:
    """The ``rows`` functions of most cumulative time."""
    stats = pstats.Stats(profile).stats
    top = sorted(stats.items(), key=lambda item: -item[1][3])[:rows]
    return [{"function": f"{Path(file).name}:{line}({name})", "cumulative_s": round(v[3], 3),
             "own_s": round(v[2], 3), "calls": v[1]} for (file, line, name), v in top]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--profile-rows", type=int, default=60)
    parser.add_argument("--no-compile-ahead", action="store_true",
                        help="no BBMM programs compiled in background threads")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import jax

    start = time.perf_counter()
    backend = jax.default_backend()
    record = {"benchmark": "gp_first_fit", "command": " ".join(["python", *sys.argv]),
              "n": args.n, "d": 4, "backend": backend, "jax": jax.__version__,
              "backend_start_s": time.perf_counter() - start}
    from scalegp import ScalableGPRegressor
    from scalegp.estimators import _gpr_fit

    if args.no_compile_ahead:
        _gpr_fit.compiles_ahead = lambda: False
    record["compile_ahead"] = bool(_gpr_fit.compiles_ahead())

    x, y, x_test, y_test = make_data(args.n, 4, 1000)
    for attempt in ("first", "second"):
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        model = ScalableGPRegressor(random_state=0).fit(x, y)
        fitted = time.perf_counter()
        mean, _ = model.predict(x_test, return_std=True)
        profile.disable()
        record[f"{attempt}_s"] = time.perf_counter() - start
        record[f"{attempt}_fit_s"] = fitted - start
        record[f"{attempt}_rmse"] = float(np.sqrt(np.mean((mean - y_test) ** 2)))
        record[f"{attempt}_profile"] = _top(profile, args.profile_rows)
        record["solver"] = model.solver_
        args.out.write_text(json.dumps(record, indent=1))
        print(attempt, round(record[f"{attempt}_s"], 2), "s, the fit",
              round(record[f"{attempt}_fit_s"], 2), "s", flush=True)


if __name__ == "__main__":
    main()
