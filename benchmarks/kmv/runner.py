"""The parent process: plans the sections, runs every configuration in a child, writes the JSON.

Children are ``python -m benchmarks.kernel_mv --child SPEC OUT`` (see child.py for the protocol).
A child gets one configuration (isolated: its peak memory is that configuration's) or a group of
them (one start-up for many). The parent watches the child's progress file: a configuration that
runs past its timeout has its child's whole process group killed and becomes a ``timeout>Ns``
row; a child that dies (out-of-memory kill, segfault, abort in a compiler) turns the configuration
it was running into an error row with the tail of its stderr. Either way the remaining
configurations of the group go on in a fresh child. The result file is rewritten after every
section, so an interrupted run keeps what it measured.

Children run one at a time, never side by side (a TPU chip admits one process). On a TPU each
child opens the chip anew (10 to 15 s, and a few more to close it), so there fewer, larger
children are preferable: ``--isolate section`` (the TPU presets) runs each section's
configurations in one child, peak and max_n included (one child per implementation's ladder),
which the TPU's peak reading allows (child.py); the float64 references run on the host's CPU,
without opening the chip.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.kmv import catalog, sections
from benchmarks.kmv.options import runs_entry

ROOT = harness.ROOT
STARTUP_TIMEOUT_S = 180.0  # a child that has not started its first configuration by then is hung
POLL_S = 0.05
BUDGET_TEXT = "time budget spent (--max-total-s / --section-budget)"
BUDGET_SKIP = f"skipped: {BUDGET_TEXT}"

DATA_NOTE = (
    "float32 inputs generated from the configuration (benchmarks/kmv/problems.py): kernel_mv: "
    "x1, x2, v, G standard normal, lengthscale sqrt(d); fwd_bwd = value and gradient of "
    "sum(out * G) w.r.t. x1, x2, v, lengthscale. kde_density: data whitened to unit sample "
    "covariance, queries standard normal, bandwidth m**(-1/(d+4)); fwd_bwd w.r.t. queries, data, "
    "bandwidth. kernel_mv_matern32 (kernels section): the same x1, x2, v, G as kernel_mv at that "
    "shape, ARD Matern-3/2 with lengthscale sqrt(d)*ones(d). kernel_mv_composite: the same "
    "inputs, k = 1.0*RBF(L) + 0.5*RBF(2L)*ExpSineSquared(1.0, period=L) + "
    "0.5*RationalQuadratic(L, alpha=1.5) + 0.25*Matern(L, nu=0.5), L = sqrt(d), scalar "
    "lengthscales; fwd_bwd w.r.t. x1, x2, v and every hyperparameter (rel_err dhyper: all of "
    "them as one vector, dhyper_max: the worst single one)."
)
REL_ERR_NOTE = (
    "norm-wise |x - ref| / |ref| against a float64 reference (JAX x64, chunked, autodiff for "
    "gradients; independent of scalegp.ops); computed for grid and kde rows with n <= "
    "{ref_max_n}, omitted above (the reference costs as much as a float64 run of the product)."
)
PEAK_NOTE = {
    "cpu": "peak_mb = peak resident set size (ru_maxrss) of the child process, which runs that "
    "configuration alone; it includes the runtime's own footprint (rss_base_mb: the peak before "
    "compiling or running). Children run under an address-space limit of {mem_limit_gb} GB.",
    "gpu": "peak_mb = device peak bytes in use (JAX memory_stats; torch max_memory_allocated) "
    "in a process that ran only that configuration (peak, max_n), or torch rows (resettable).",
    "tpu": "peak_mb = the compiled program's device memory, from XLA's memory analysis "
    "(arguments + outputs + temporaries): the chip's memory_stats need not count a program's "
    "temporaries. It needs no process of its own, so configurations share a child.",
}
#: Devices whose peak reading (ru_maxrss, JAX memory_stats) cannot be reset, so that peak and
#: max_n configurations need a child each there.
OWN_PROCESS_PEAK = ("cpu", "gpu")
REF_DEVICE_NOTE = {"tpu": " The references are computed on the host's CPU."}


def format_error_timeout(seconds: float) -> str:
    return f"timeout>{seconds:g}s"


def _stderr_tail(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Exhausted|Killed|Aborted)\b", line) or \
                "Check failed" in line or "out of memory" in line.lower():
            return line[:240]
    return lines[-1][:240] if lines else ""


def _crash_text(rc: int, err_path: Path) -> str:
    tail = _stderr_tail(err_path)
    if rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        what = f"child killed by {sig}" + (" (out of memory?)" if sig == "SIGKILL" else "")
    else:
        what = f"child exited with code {rc}"
    return f"{what}: {tail}" if tail else what


class Runner:
    """Runs specs in child processes under per-configuration timeouts and a run budget."""

    def __init__(self, opts, workdir: Path, log=None):
        self.opts = opts
        self.work = workdir
        self.start = time.monotonic()
        self.deadline = None if opts.max_total_s is None else self.start + opts.max_total_s
        self.section_deadline = None
        self.count = 0
        self.log = log or (lambda msg: None)
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        if opts.device == "cpu":
            self.env["JAX_PLATFORMS"] = "cpu"
            self.env.setdefault("CUDA_VISIBLE_DEVICES", "")

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def begin_section(self, budget_s: float | None) -> None:
        """Later configurations must finish within ``budget_s`` (and the run's budget)."""
        self.section_deadline = None if budget_s is None else time.monotonic() + budget_s

    def remaining(self) -> float:
        ends = [d for d in (self.deadline, self.section_deadline) if d is not None]
        return min(ends) - time.monotonic() if ends else math.inf

    def run(self, specs: list[dict], stop_on_error: bool = False) -> list[list[dict] | None]:
        """Runs ``specs`` in order in one child (more after a crash or timeout).

        Returns one list of records per spec; a spec that failed as a whole gets one error record.
        With ``stop_on_error`` (a max_n ladder) the first error ends the run: the specs after it
        get None (and only the first of them a row when the budget is spent).
        """
        results: list[list[dict] | None] = [None] * len(specs)
        pending = list(range(len(specs)))
        while pending:
            if self.remaining() <= 0:
                for i in pending[:1] if stop_on_error else pending:
                    results[i] = [self._error(specs[i], BUDGET_SKIP)]
                break
            self._run_child([specs[i] for i in pending], pending, results, stop_on_error)
            if stop_on_error and any("error" in r for i in pending for r in results[i] or []):
                break
            pending = [i for i in pending if results[i] is None]
        return results

    def child_command(self, spec_path, out_path) -> list[str]:
        return [sys.executable, "-m", "benchmarks.kernel_mv", "--child", str(spec_path),
                str(out_path)]

    def _error(self, spec, text):
        head = sections.record_head(spec) if spec["kind"] in ("time", "single") else {}
        rec = {**head, "error": text}
        self.log(f"{sections.describe(spec)}: {text}")
        return rec

    def _run_child(self, specs, index, results, stop_on_error=False) -> None:
        self.count += 1
        stem = self.work / f"child{self.count:04d}"
        spec_path, out_path, err_path = (stem.with_suffix(s) for s in (".json", ".jsonl", ".err"))
        payload = {"device": self.opts.device, "threads": self.opts.threads,
                   "mem_limit_gb": self.opts.mem_limit_gb, "specs": specs}
        spec_path.write_text(json.dumps(payload))
        out_path.touch()
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(self.child_command(spec_path, out_path), cwd=ROOT,
                                    env=self.env, stdout=err, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        state = {"current": None, "started": time.monotonic(), "offset": 0, "buf": "",
                 "stop": False}

        def consume():
            with open(out_path) as f:
                f.seek(state["offset"])
                state["buf"] += f.read()
                state["offset"] = f.tell()
            *lines, state["buf"] = state["buf"].split("\n")
            for line in filter(None, lines):
                if state["stop"]:
                    break  # what the child ran past an error that ends the run is not kept
                msg = json.loads(line)
                if "start" in msg:
                    state["current"], state["started"] = msg["start"], time.monotonic()
                elif "done" in msg:
                    j = msg["done"]
                    results[index[j]] = msg["records"]
                    self._report(specs[j], msg["records"], time.monotonic() - state["started"])
                    state["current"], state["started"] = None, time.monotonic()
                    state["stop"] = stop_on_error and j + 1 < len(specs) and any(
                        "error" in r for r in msg["records"])

        failure = None
        try:
            while True:
                consume()
                if state["stop"]:
                    break  # the specs after an error are not run: the child is killed below
                rc = proc.poll()
                if rc is not None:
                    consume()  # what the child wrote just before it ended
                    if rc != 0 or any(results[i] is None for i in index):
                        failure = _crash_text(rc, err_path)
                    break
                current = state["current"]
                waited = time.monotonic() - state["started"]
                limit = STARTUP_TIMEOUT_S if current is None else float(
                    specs[current].get("timeout") or math.inf)
                over_budget = self.remaining() <= 0
                if waited > limit or over_budget:
                    self._kill(proc)
                    consume()
                    if state["current"] is None:
                        failure = (BUDGET_SKIP if over_budget
                                   else f"child did not start within {limit:g}s")
                    elif over_budget and waited <= limit:
                        failure = f"{format_error_timeout(round(waited))} ({BUDGET_TEXT})"
                    else:
                        failure = format_error_timeout(limit)
                    break
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                self._kill(proc)
        if failure is not None:
            j = state["current"]
            if j is None:
                j = next((k for k, i in enumerate(index) if results[i] is None), None)
            if j is not None and results[index[j]] is None:
                results[index[j]] = [self._error(specs[j], failure)]

    @staticmethod
    def _kill(proc) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def _report(self, spec, records, seconds) -> None:
        for rec in records:
            if "error" in rec:
                text = rec["error"]
            elif "median_ms" in rec:
                text = f"{rec['median_ms']:.4g} ms (inner {rec.get('inner', '-')})"
                if "peak_mb" in rec:
                    text += f", peak {rec['peak_mb']:.0f} MB"
                err = rec.get("rel_err")
                if isinstance(err, dict):
                    text += ", rel_err " + " ".join(f"{k}={v:.1e}" for k, v in err.items())
                elif err is not None:
                    text += f", rel_err {err:.1e}"
            elif "run_s" in rec:
                text = f"{rec['run_s']:.3g} s, peak {rec.get('peak_mb', float('nan')):.0f} MB"
            elif "reference" in rec:
                text = f"reference in {rec['seconds']:.1f} s"
            elif "machine" in rec:
                text = "machine info"
            else:
                text = "done"
            repeat = f" #{rec['repeat']}" if "repeat" in rec else ""
            self.log(f"{sections.describe(spec)}{repeat}: {text} [{seconds:.1f} s]")


# ----------------------------------------------------------------------------------------------
# sections


def _available(opts, machine) -> tuple[list[str], dict]:
    """The requested impls that can run here, and why the others are skipped."""
    skipped = {}
    wanted = list(dict.fromkeys(opts.impls + opts.peak_impls + opts.ladder_impls
                                + opts.cross_impls + opts.kernel_impls))
    for impl in wanted:
        info = catalog.IMPLS[impl]
        missing = catalog.missing_modules(impl)
        if missing:
            skipped[impl] = f"not importable: {', '.join(missing)}"
        elif opts.device not in info.devices:
            skipped[impl] = f"does not run on {opts.device}"
        elif opts.device == "gpu" and "torch" in info.modules and \
                not machine.get("torch_cuda_available"):
            skipped[impl] = "torch has no CUDA device here"
    return [i for i in wanted if i not in skipped], skipped


def run_timed_section(runner, opts, configs, impls, refs=True) -> list[dict]:
    """grid / kde: references first (one child), then every (config, impl)."""
    ref_paths = {}
    if refs and opts.ref_max_n:
        ref_specs = []
        for family, n, d, o, mode in configs:
            if n > opts.ref_max_n or not sections.impls_for(impls, family, mode, opts.device):
                continue
            path = str(runner.work / f"ref-{family}-{mode}-{n}-{d}-{o}.npz")
            ref_specs.append(sections.reference_spec(family, mode, n, d, o, path, opts))
        for spec, recs in zip(ref_specs, runner.run(ref_specs)):
            if recs and "reference" in recs[0]:
                ref_paths[(spec["family"], spec["mode"], spec["n"], spec["dim"], spec["out"])] = \
                    spec["ref"]
            else:
                runner.log(f"reference {sections.describe(spec)} failed: "
                           f"{recs[0].get('error') if recs else '?'}; no rel_err for it")
    specs = sections.timed_specs(configs, impls, opts)
    for spec in specs:
        spec["ref"] = ref_paths.get((spec["family"], spec["mode"], spec["n"], spec["dim"],
                                     spec["out"]))
        spec["measure_peak"] = opts.isolate == "config"
    return _run_specs(runner, specs, opts.isolate)


def _shared(opts) -> str:
    """How configurations that need no process of their own are grouped into children."""
    return "section" if opts.isolate == "section" else "group"


def _run_specs(runner, specs, isolate) -> list[dict]:
    """Runs specs one child each (isolate "config"), one child per impl ("group") or all in one
    child ("section"), keeping the specs' order."""
    if isolate == "config":
        batches = [[i] for i in range(len(specs))]
    elif isolate == "section":
        batches = [list(range(len(specs)))]
    else:
        by_impl: dict[str, list[int]] = {}
        for i, spec in enumerate(specs):
            by_impl.setdefault(spec["impl"], []).append(i)
        batches = list(by_impl.values())
    out: list[list[dict] | None] = [None] * len(specs)
    for batch in batches:
        for i, recs in zip(batch, runner.run([specs[i] for i in batch])):
            out[i] = recs
    return [rec for recs in out for rec in recs]


def run_section(name, runner, opts, available) -> list[dict]:
    """The records of one section, with the implementations in ``available`` only."""
    impls = [i for i in opts.impls if i in available]
    if name == "kernels":
        return run_timed_section(runner, opts, sections.kernel_configs(opts),
                                 [i for i in opts.kernel_impls if i in available])
    if name == "grid":
        return run_timed_section(runner, opts, sections.grid_configs(opts), impls)
    if name == "kde":
        return run_timed_section(runner, opts, sections.kde_configs(opts), impls)
    if name == "peak":
        specs = [s for s in sections.peak_specs(opts) if s["impl"] in available]
        for s in specs:
            s["measure_peak"] = True
        own = opts.device in OWN_PROCESS_PEAK
        return _run_specs(runner, specs, "config" if own else _shared(opts))
    if name == "max_n":
        rows = []
        own = opts.device in OWN_PROCESS_PEAK
        for impl, ladder in sections.ladder_specs(opts).items():
            if impl not in available:
                continue
            for spec in ladder:
                spec["measure_peak"] = True
            for batch in [[s] for s in ladder] if own else [ladder]:
                recs = [r for rs in runner.run(batch, stop_on_error=True) if rs for r in rs]
                rows.extend(recs)
                if any("error" in r for r in recs):
                    break  # as in the RTX 3090 benchmark: a failed rung ends that ladder
        return rows
    if name == "tiles":
        return _run_specs(runner, sections.tile_specs(opts), _shared(opts))
    if name == "crossover":
        specs = [s for impl, impl_specs in sections.crossover_specs(opts).items()
                 if impl in available for s in impl_specs]
        return _run_specs(runner, specs, _shared(opts))
    raise ValueError(f"unknown section {name!r}")


def _auto_shapes(opts):
    shapes = {(n, n, d, o) for n in opts.sizes for d in opts.dims for o in opts.outs}
    shapes |= {(n, n, d, 1) for n in opts.kde_sizes for d in opts.kde_dims}
    if "kernels" in opts.sections:
        shapes |= {(n, n, d, o) for n in opts.kernel_sizes for d in opts.kernel_dims
                   for o in opts.kernel_outs}
    return sorted(shapes)


def plan_summary(opts) -> str:
    lines = []
    counts = {
        "grid": len(sections.timed_specs(sections.grid_configs(opts), opts.impls, opts)),
        "kde": len(sections.timed_specs(sections.kde_configs(opts), opts.impls, opts)),
        "peak": len(sections.peak_specs(opts)),
        "max_n": sum(len(v) for v in sections.ladder_specs(opts).values()),
        "tiles": len(sections.tile_specs(opts)),
        "crossover": sum(len(v) for v in sections.crossover_specs(opts).values()),
        "kernels": len(sections.timed_specs(sections.kernel_configs(opts), opts.kernel_impls,
                                            opts)),
    }
    for name in opts.sections:
        lines.append(f"{name}: {counts[name]} configurations (at most)")
    return "\n".join(lines)


def main(opts) -> int:
    log = (lambda msg: None) if opts.quiet else (lambda msg: harness.log(msg, file=sys.stderr))
    if opts.list:
        print(json.dumps(runs_entry(opts), indent=1))
        print(plan_summary(opts))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="kmvbench-"))
    runner = Runner(opts, workdir, log)
    try:
        (recs,) = runner.run([{"kind": "machine", "auto_shapes": _auto_shapes(opts),
                               "timeout": 300}])
        if not recs or "machine" not in recs[0]:
            print(f"error: could not start a child on {opts.device}: "
                  f"{recs[0].get('error') if recs else '?'}", file=sys.stderr)
            return 1
        machine, auto = recs[0]["machine"], recs[0]["auto"]
        if opts.device != "cpu" and machine["backend"] != opts.device:
            print(f"error: --device {opts.device} but JAX's backend is {machine['backend']!r} "
                  f"(no {opts.device.upper()} here, or JAX_PLATFORMS chooses another)",
                  file=sys.stderr)
            return 2
        impls, skipped = _available(opts, machine)
        for impl, why in skipped.items():
            log(f"skipping {impl}: {why}")
        out_name = Path(opts.out).name
        result = {
            "device": machine,
            "config": {
                "runner": "benchmarks/kernel_mv.py",
                "command": harness.command_line("benchmarks/kernel_mv.py"),
                "runs": {out_name: runs_entry(opts)},
                "skipped": skipped,
                "impls": {i: catalog.IMPLS[i].description for i in impls},
                "data": DATA_NOTE,
                "rel_err": REL_ERR_NOTE.format(ref_max_n=opts.ref_max_n)
                + REF_DEVICE_NOTE.get(opts.device, ""),
                "peak": PEAK_NOTE[opts.device].format(mem_limit_gb=opts.mem_limit_gb),
                "auto": auto,
                "loadavg_start": harness.loadavg(),
            },
            "results": [],
        }
        for name in opts.sections:
            budget = opts.section_budget.get(name)
            log(f"section {name}" + (f" (budget {budget:g} s)" if budget else ""))
            runner.begin_section(budget)
            result["results"].extend(run_section(name, runner, opts, impls))
            result["config"]["elapsed_s"] = round(runner.elapsed(), 1)
            result["config"]["loadavg_end"] = harness.loadavg()
            harness.write_json(opts.out, result)
        log(f"wrote {opts.out} ({len(result['results'])} rows, {runner.elapsed():.0f} s)")
        return 0
    finally:
        if opts.keep_work:
            log(f"work folder kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
