"""Calibrated timing and peak-memory readings inside a child process."""

from __future__ import annotations

import math
import resource
import sys
import time

import numpy as np

TARGET_SAMPLE_S = 0.02  # one sample lasts at least this long ...
MAX_INNER = 200  # ... unless that would take more than this many calls


def measure(bench, repeats: int, budget_s: float = math.inf, target_s: float = TARGET_SAMPLE_S):
    """Times ``bench.call()``: one warm-up call, ``repeats`` samples of ``inner`` calls each.

    ``inner`` is calibrated so that a sample lasts at least ``target_s``. Sampling stops early once
    the samples have taken ``budget_s`` in all (at least one sample is always taken). Calls within a
    sample are dispatched back to back and waited for once at the end (asynchronous backends
    overlap dispatch with the previous call, as in real use).

    Returns (fields, warm-up output, warm-up seconds): fields are median_ms, q1_ms, q3_ms per
    call, inner, and samples when fewer than ``repeats`` were taken.
    """
    t0 = time.perf_counter()
    first = bench.sync(bench.call())
    first_s = per_call = time.perf_counter() - t0
    if per_call < target_s:  # the warm-up may include one-time costs: calibrate on a second call
        t0 = time.perf_counter()
        bench.sync(bench.call())
        per_call = min(per_call, time.perf_counter() - t0)
    inner = int(min(MAX_INNER, max(1, math.ceil(target_s / max(per_call, 1e-9)))))
    samples = []
    start = time.perf_counter()
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = bench.call()
        bench.sync(out)
        del out
        samples.append((time.perf_counter() - t0) / inner)
        if time.perf_counter() - start >= budget_s:
            break
    q1, med, q3 = np.percentile(np.asarray(samples) * 1e3, [25, 50, 75])
    fields = {"inner": inner, "median_ms": float(med), "q1_ms": float(q1), "q3_ms": float(q3)}
    if len(samples) < repeats:
        fields["samples"] = len(samples)
    return fields, first, first_s


def rss_peak_mb() -> float:
    """Peak resident set size of this process so far (ru_maxrss), in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def jax_peak_mb() -> float | None:
    """Peak bytes in use on JAX's first device since the process started, in MiB (GPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**20
