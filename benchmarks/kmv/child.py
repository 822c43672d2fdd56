"""What runs inside a child process: the configurations of one spec file, one after another.

Protocol with the parent (runner.py): the child appends one JSON line ``{"start": i}`` before
configuration i and ``{"done": i, "records": [...]}`` after it, flushing each, so the parent knows
at any moment which configuration is running (for its timeout) and keeps every finished record
even if the child later crashes. An exception inside a configuration becomes an error record and
the child goes on with the next one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.kmv import catalog, problems
from benchmarks.kmv.sections import record_head

ERROR_CHARS = 300


DENSE_IMPLS = ("dense", "numpy_dense", "torch_dense")  # they hold the n x m kernel matrix


def error_text(exc: BaseException, spec=None, bench=None, mem_limit_gb=None) -> str:
    """``Type: message``, cut to ERROR_CHARS. When the memory the configuration must hold is over
    the limit, says so: XLA's CPU errors do not always (a dense product fused into one YNNPACK
    call fails with "YNNPACK operation failed", and XLA's memory analysis does not see its
    buffer)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:ERROR_CHARS]
    if not mem_limit_gb:
        return text
    limit = mem_limit_gb * 2**30
    needed = getattr(bench, "needed_bytes", None)
    if needed and needed > limit:
        return text + (f" [out of memory: the compiled program needs {needed / 2**30:.1f} GiB, "
                       f"over the {mem_limit_gb:g} GiB limit]")
    if spec and spec.get("impl") in DENSE_IMPLS and spec["n"] * spec["m"] * 4 > limit:
        return text + (f" [out of memory: the float32 kernel matrix alone is "
                       f"{spec['n'] * spec['m'] * 4 / 2**30:.1f} GiB, over the "
                       f"{mem_limit_gb:g} GiB limit]")
    return text


class ConfigError(Exception):
    """A configuration failed; ``str`` is the whole error text of its row."""


def build_bench(spec, inputs, device, threads):
    """The timed object of one configuration: ours (``JaxBench``) or a peer's."""
    impl = spec["impl"]
    if impl in catalog.OURS:
        from benchmarks.kmv.ours import JaxBench

        tiles = {k: spec.get(k) for k in ("block_q", "block_k", "block_o")}
        return JaxBench(impl, spec["family"], spec["mode"], inputs, **tiles)
    from benchmarks.kmv.peers import make_peer

    return make_peer(impl, spec["family"], spec["mode"], inputs, device, threads)


class _Peak:
    """Peak memory of one configuration: device peak on GPU, the compiled program's on TPU,
    resident-set peak on CPU."""

    def __init__(self, spec, device, bench):
        self.device, self.bench = device, bench
        self.torch_cuda = device == "gpu" and spec["impl"] in ("torch_dense", "torch_chunked",
                                                               "pykeops")
        # torch can reset its peak per configuration; JAX and ru_maxrss cannot, so those are only
        # meaningful when the configuration has the process to itself (measure_peak).
        self.enabled = bool(spec.get("measure_peak")) or self.torch_cuda
        self.base = harness.rss_peak_mb() if device == "cpu" else None
        if self.torch_cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def fields(self) -> dict:
        if not self.enabled:
            return {}
        if self.torch_cuda:
            import torch

            return {"peak_mb": torch.cuda.max_memory_allocated() / 2**20}
        if self.device == "tpu":
            # XLA's memory analysis: the chip's memory_stats need not count a program's
            # temporaries (a dense product's 1 GiB matrix at n = 16,384 read far lower once)
            needed = self.bench.needed_bytes
            return {} if needed is None else {"peak_mb": needed / 2**20}
        if self.device == "gpu":
            peak = harness.jax_peak_mb()
            return {} if peak is None else {"peak_mb": peak}
        return {"peak_mb": harness.rss_peak_mb(), "rss_base_mb": self.base}


@contextlib.contextmanager
def _configuration(spec, device, threads, mem_limit_gb=None):
    """The bench of one timed configuration and its peak-memory reader; any exception inside
    becomes a ConfigError whose text explains an out-of-memory failure."""
    inputs = problems.make_inputs(spec["family"], spec["n"], spec["m"], spec["dim"],
                                  spec["out"], spec["seed"])
    bench = build_bench(spec, inputs, device, threads)
    try:
        yield bench, _Peak(spec, device, bench)
    except Exception as exc:
        raise ConfigError(error_text(exc, spec, bench, mem_limit_gb)) from exc
    finally:
        bench.close()


def run_timed(spec, device, threads, mem_limit_gb=None) -> list[dict]:
    with _configuration(spec, device, threads, mem_limit_gb) as (bench, peak):
        fields = bench.setup()
        rounds = spec.get("rounds")
        records = []
        first = None
        for r in range(rounds or 1):
            measured, out, first_s = harness.measure(bench, spec["repeats"],
                                                     spec.get("sample_budget_s") or math.inf)
            if first is None:
                first = out
                # peers compile nothing ahead of time: their first call (torch's lazy set-up,
                # KeOps' formula compilation) is what compile_s means for them
                fields.setdefault("compile_s", first_s)
            if rounds:  # crossover: timings only, one record per repeat
                head = record_head({**spec, "repeat": r})
                records.append({**head, **{k: measured[k] for k in
                                           ("median_ms", "q1_ms", "q3_ms")}})
            else:
                records.append({**record_head(spec), **fields, **measured, **peak.fields()})
        if spec.get("ref") and not rounds:
            ref = problems.load_reference(spec["ref"])
            records[0]["rel_err"] = problems.rel_err(bench.result(first), ref)
        return records


def run_single(spec, device, threads, mem_limit_gb=None) -> list[dict]:
    """One call, compile included (run_s), and the peak memory of the whole process."""
    with _configuration(spec, device, threads, mem_limit_gb) as (bench, peak):
        t0 = time.perf_counter()
        bench.setup()
        bench.sync(bench.call())
        run_s = time.perf_counter() - t0
        return [{**record_head(spec), "run_s": run_s, **peak.fields()}]


def run_reference(spec) -> list[dict]:
    inputs = problems.make_inputs(spec["family"], spec["n"], spec["m"], spec["dim"],
                                  spec["out"], spec["seed"])
    t0 = time.perf_counter()
    ref = problems.reference(spec["family"], spec["mode"], inputs)
    problems.save_reference(spec["ref"], ref)
    return [{"reference": spec["ref"], "seconds": time.perf_counter() - t0}]


def auto_choices(shapes) -> list[dict]:
    """What impl="auto" picks for each (n, m, d, o) on this backend."""
    from scalegp.ops import auto_config

    rows = []
    for n, m, d, o in shapes:
        impl, bs = auto_config(m, d)
        row = {"n": n, "m": m, "dim": d, "out": o, "impl": impl}
        if bs is not None:
            row.update(block_q=bs.block_q, block_k=bs.block_k, block_o=bs.block_o)
        rows.append(row)
    return rows


def run_machine(spec, device) -> list[dict]:
    return [{"machine": harness.machine_info(device),
             "auto": auto_choices(spec.get("auto_shapes", []))}]


def run_spec(spec, device, threads, mem_limit_gb=None) -> list[dict]:
    kind = spec["kind"]
    if kind == "time":
        return run_timed(spec, device, threads, mem_limit_gb)
    if kind == "single":
        return run_single(spec, device, threads, mem_limit_gb)
    if kind == "reference":
        return run_reference(spec)
    if kind == "machine":
        return run_machine(spec, device)
    raise ValueError(f"unknown spec kind {kind!r}")


def _free_memory():
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(spec_path: str, out_path: str) -> int:
    payload = json.loads(Path(spec_path).read_text())
    device, threads = payload["device"], payload["threads"]
    if device == "cpu" and payload.get("mem_limit_gb"):
        harness.limit_memory(payload["mem_limit_gb"])
    specs = payload["specs"]
    if any(s["kind"] == "reference" for s in specs):
        import jax

        jax.config.update("jax_enable_x64", True)
        if device == "tpu":  # float64 on the host: the chip only emulates it (and stays free)
            jax.config.update("jax_platforms", "cpu")
    with open(out_path, "a") as out:

        def emit(obj):
            out.write(json.dumps(obj) + "\n")
            out.flush()

        for i, spec in enumerate(specs):
            emit({"start": i})
            try:
                records = run_spec(spec, device, threads, payload.get("mem_limit_gb"))
            except Exception as exc:  # one configuration failed: record it, go on
                head = record_head(spec) if spec["kind"] in ("time", "single") else {}
                text = str(exc) if isinstance(exc, ConfigError) else error_text(exc)
                records = [{**head, "error": text}]
                _free_memory()
            emit({"done": i, "records": records})
    return 0
