"""How fast a machine's host CPU runs what the exact GP runs there: one thread of plain Python
(a loop of 3·10⁶ additions), and OpenBLAS on 1, 2, 6 and 12 threads for a 2,000 × 2,000 float64
product, Cholesky (``potrf``) and inverse from a lower triangular factor (``potri``), best of
three each. For comparing a TPU machine's host with this project's CPU (issue 62: the exact
path and the quick start's command run there).

    python benchmarks/tpu/host_speed.py OUT.json
"""

import json
import os
import sys
import time

import numpy as np
import scipy.linalg
from threadpoolctl import threadpool_limits


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(out: str) -> None:
    record = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}
    start, total = time.perf_counter(), 0
    for i in range(3_000_000):
        total += i
    record["python_loop_3e6_s"] = time.perf_counter() - start
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2000, 2000))
    spd = a @ a.T + 2000 * np.eye(2000)
    factor = np.tril(spd) / 100  # a lower triangle of positive diagonal: a factor to invert
    for threads in (1, 2, 6, 12):
        with threadpool_limits(threads, user_api="blas"):
            record[f"blas_{threads}"] = {
                "matmul": _best(lambda: a @ a),
                "potrf": _best(lambda: scipy.linalg.lapack.dpotrf(spd, lower=1)),
                "potri": _best(lambda: scipy.linalg.lapack.dpotri(factor, lower=1))}
    print(json.dumps(record))
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
