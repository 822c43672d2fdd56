"""The float32-accurate dense products on a TPU: XLA's dot at ``HIGHEST`` against the Mosaic
kernels (`scalegp.ops.backends.mosaic._dense`) that `scalegp.ops.dense_products` takes there:
each one's compile seconds, its run time (the median of ``--repeats`` after one warm-up) and
its error against float64 products on the host, on offset random operands.

    PYTHONPATH=. python benchmarks/tpu/dense_products.py --out OUT/dense_products.json

Shapes (``--cases``): ``tn:N:K:T`` for ``Aᵀ B`` with A (N, K), B (N, T); ``nn:N:K:T`` for
``A S`` with A (N, K), S (K, T). The defaults are the GP's: the preconditioner's Gram matrices
(rank 768) and its solves against 31 columns, at 10⁵ and 10⁶ rows. The JSON is rewritten after
every case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DEFAULT_CASES = ["tn:100000:768:768", "nn:100000:768:768", "tn:1000000:768:31",
                 "nn:1000000:768:31"]


def _implementations(form: str):
    from scalegp.ops.backends.mosaic import _dense

    if form == "tn":
        return {"xla_highest": lambda a, b: jnp.matmul(a.T, b, precision=lax.Precision.HIGHEST),
                "mosaic": _dense.matmul_tn}
    return {"xla_highest": lambda a, s: jnp.matmul(a, s, precision=lax.Precision.HIGHEST),
            "mosaic": _dense.matmul}


def run_case(case: str, repeats: int) -> list[dict]:
    form, n, k, t = case.split(":")
    n, k, t = int(n), int(k), int(t)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, k), dtype=np.float32) + np.float32(2.0)
    b = rng.standard_normal((n, t) if form == "tn" else (k, t), dtype=np.float32)
    a64 = a.astype(np.float64)
    want = a64.T @ b if form == "tn" else a64 @ b
    a_dev, b_dev = jax.device_put(a), jax.device_put(b)
    rows = []
    for name, fn in _implementations(form).items():
        row = {"case": case, "form": form, "n": n, "k": k, "t": t, "impl": name}
        try:
            start = time.perf_counter()
            compiled = jax.jit(fn).lower(a_dev, b_dev).compile()
            row["compile_s"] = time.perf_counter() - start
            got = compiled(a_dev, b_dev).block_until_ready()  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                got = compiled(a_dev, b_dev).block_until_ready()
                times.append(time.perf_counter() - start)
            row["run_s"] = statistics.median(times)
            got = np.asarray(got, np.float64)
            row["rel_error"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        except Exception as error:  # a refused kernel is a row, not the end of the run
            row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    doc = {"benchmark": "dense_products", "command": " ".join(["python", *sys.argv]),
           "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
               timespec="seconds"),
           "device": device.device_kind,
           "host": {"machine": platform.machine(), "python": platform.python_version(),
                    "jax": jax.__version__}, "results": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for case in args.cases:
        doc["results"] += run_case(case, args.repeats)
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
