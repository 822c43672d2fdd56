"""What every benchmark runner shares: the machine, timers, child processes, the results file.

- Machine: ``host()`` (CPU model, cores, memory, platform, Python), ``versions(names)`` and
  ``machine_info(device)``, the full "device" block (JAX backend and devices, GPU, peer library
  versions, BLAS, the scalegp commit). A runner records these so that a result file says where
  and with what its numbers were made.
- ``import_scalegp(tree)``: in a child process, import scalegp from another checkout (an older
  commit's worktree) and say which file and commit it came from.
- ``Run``: the command line and the load averages at the start and the end of a run. CPU timings
  on a shared machine move with other load, so every result file carries them.
- Timers: ``timed`` (one call), ``quartiles`` (q1, median, q3), ``measure`` (the calibrated
  samples of the kernel benchmarks), peak memory (``rss_peak_mb``, ``jax_peak_mb``).
- ``RssSampler``: the resident set size over time, for the peak of each phase of a run.
- Child processes: ``run_in_child`` runs a function in a fresh process under a timeout and an
  optional address-space limit (``limit_memory``), so a hang, an out-of-memory error or a crash
  becomes an error row instead of the end of the run.
- ``write_json``: results written atomically (an interrupted run never leaves half a file), with
  non-finite floats as strings (JSON has no NaN).

It imports nothing heavy at module level: the kernel_mv parent process, which must not hold a
device, imports it too.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The peer libraries whose versions the "device" block records.
PEER_LIBRARIES = ("numpy", "scipy", "sklearn", "torch", "pykeops", "threadpoolctl")


# ----------------------------------------------------------------------------------------------
# the machine


def core_count() -> int:
    """CPU cores this process may use (its affinity set), which peers size their thread pools by."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> float | None:
    """Physical memory in GiB (one decimal), or None where the OS does not say."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def host() -> dict:
    """The machine without JAX: CPU model, cores, memory, platform and Python version."""
    return {"cpu": cpu_model(), "cpu_count": core_count(), "memory_gb": memory_gb(),
            "platform": platform.platform(), "python": platform.python_version()}


def versions(names) -> dict:
    """``{name: __version__}`` of each importable module, None for one that does not import."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:  # missing or broken: a runner skips that peer with its own note
            out[name] = None
    return out


def _run(cmd, cwd=ROOT) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _gpu() -> dict:
    q = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
              "--format=csv,noheader,nounits"])
    if not q:
        return {}
    name, driver, mem = [s.strip() for s in q.splitlines()[0].split(",")]
    return {"gpu": name, "driver": driver, "gpu_memory_gb": round(float(mem) / 1024, 1)}


def scalegp_commit(root=ROOT, paths=(), untracked: bool = False) -> str | None:
    """The short commit of the checkout at ``root`` (default: this one), with "+dirty" when
    tracked files (under ``paths``, when given) are modified, or with ``untracked`` when new
    files that git does not ignore are there too; None outside git."""
    commit = _run(["git", "rev-parse", "--short", "HEAD"], cwd=root)
    status = ["git", "status", "--porcelain", f"--untracked-files={'all' if untracked else 'no'}"]
    if commit and _run([*status, "--", *paths], cwd=root):
        commit += "+dirty"
    return commit


def _diff_digest(root, paths) -> str | None:
    """sha1 (12 digits) of ``git diff HEAD -- paths`` and of the untracked files there (names
    and contents): tells uncommitted states apart."""
    digest = hashlib.sha1((_run(["git", "diff", "HEAD", "--", *paths], cwd=root) or "").encode())
    others = _run(["git", "ls-files", "--others", "--exclude-standard", "--", *paths], cwd=root)
    for name in sorted((others or "").splitlines()):
        digest.update(name.encode())
        try:
            digest.update((Path(root) / name).read_bytes())
        except OSError:
            pass
    return digest.hexdigest()[:12]


def import_scalegp(tree=None) -> dict:
    """Imports scalegp in this process, from the checkout ``tree`` when given, and says which.

    ``tree`` (a directory holding ``scalegp/``, e.g. a git worktree of an older commit) goes
    first on ``sys.path``, so it wins over this checkout and over an editable install; scalegp
    must not be imported yet (call it first thing in a child process). Returns ``{"tree",
    "scalegp_file", "scalegp_commit"}``: the directory scalegp came from, its ``__file__`` and
    that directory's git commit (what a result row records to show which code it timed), with
    "+dirty" when files under its scalegp/ differ from that commit or are new there, and then
    ``scalegp_diff_sha1``, a digest of that difference."""
    if tree is not None:
        tree = Path(tree).resolve()
        if not (tree / "scalegp" / "__init__.py").is_file():
            raise FileNotFoundError(f"{tree} has no scalegp/__init__.py")
        loaded = sys.modules.get("scalegp")
        if loaded is not None and Path(loaded.__file__).resolve().parents[1] != tree:
            raise RuntimeError(f"scalegp is already imported from {loaded.__file__}")
        sys.path.insert(0, str(tree))
    import scalegp

    root = Path(scalegp.__file__).resolve().parents[1]
    if tree is not None and root != tree:
        raise RuntimeError(f"asked for scalegp from {tree}, got {scalegp.__file__}")
    out = {"tree": str(root), "scalegp_file": str(Path(scalegp.__file__).resolve()),
           "scalegp_commit": scalegp_commit(root, ("scalegp",), untracked=True)}
    if (out["scalegp_commit"] or "").endswith("+dirty"):
        out["scalegp_diff_sha1"] = _diff_digest(root, ("scalegp",))
    return out


def machine_info(device: str, libraries=PEER_LIBRARIES) -> dict:
    """The "device" block of a result file: JAX and its devices, the host, library versions."""
    import jax

    devices = jax.devices()
    h = host()
    info = {
        "jax": jax.__version__,
        "jaxlib": importlib.import_module("jaxlib").__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "python": h["python"],
        "device_kind": devices[0].device_kind,
        **{k: h[k] for k in ("cpu", "cpu_count", "memory_gb", "platform")},
    }
    if device == "gpu":
        info.update(_gpu())
    info.update(versions(libraries))
    if info.get("torch"):
        import torch

        info["torch_threads"] = torch.get_num_threads() if device == "cpu" else None
        info["torch_cuda"] = torch.version.cuda
        info["torch_cuda_available"] = bool(torch.cuda.is_available())
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [
            {k: p.get(k) for k in ("internal_api", "num_threads", "version")}
            for p in threadpool_info()
            if p.get("user_api") == "blas"
        ]
    except Exception:
        pass
    commit = scalegp_commit()
    if commit:
        info["scalegp_commit"] = commit
    return info


# ----------------------------------------------------------------------------------------------
# the run


def loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews CPU timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def command_line(script, argv=None) -> str:
    """How a result file was made: ``python benchmarks/<script> <arguments>``.

    ``script`` is the runner's ``__file__`` (or a path relative to the checkout); ``argv``
    defaults to this process's arguments."""
    path = Path(script)
    if path.is_absolute():
        try:
            path = path.resolve().relative_to(ROOT)
        except ValueError:
            pass
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(shlex.quote(str(a)) for a in ["python", path.as_posix(), *args])


class Run:
    """One run of a runner: its command line and the load averages at its start and its end."""

    def __init__(self, script, argv=None):
        self.command = command_line(script, argv)
        self.loadavg_start = loadavg()
        self.loadavg_end = None
        self.started = time.time()

    def end(self) -> float:
        """Records the load average now; returns the seconds since the start."""
        self.loadavg_end = loadavg()
        return time.time() - self.started


def log(msg: str, file=None) -> None:
    """A progress line with the wall-clock time (stdout unless ``file``)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=file or sys.stdout, flush=True)


def _sanitize(obj):
    """JSON has no NaN or infinity: write them as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    return obj


def write_json(path, data, indent: int = 1) -> None:
    """Writes ``data`` atomically; numpy scalars become floats, NaN and infinities strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_sanitize(data), indent=indent, default=float) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# timers

TARGET_SAMPLE_S = 0.02  # one sample lasts at least this long ...
MAX_INNER = 200  # ... unless that would take more than this many calls


def timed(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``."""
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def quartiles(values) -> tuple[float, float, float]:
    """(q1, median, q3), linearly interpolated (numpy's default percentiles)."""
    import numpy as np

    q1, med, q3 = np.percentile(np.asarray(values, np.float64), [25, 50, 75])
    return float(q1), float(med), float(q3)


def measure(bench, repeats: int, budget_s: float = math.inf, target_s: float = TARGET_SAMPLE_S):
    """Times ``bench.call()``: one warm-up call, ``repeats`` samples of ``inner`` calls each.

    ``inner`` is calibrated so that a sample lasts at least ``target_s``. Sampling stops early once
    the samples have taken ``budget_s`` in all (at least one sample is always taken). Calls within a
    sample are dispatched back to back and waited for once at the end (asynchronous backends
    overlap dispatch with the previous call, as in real use).

    Returns (fields, warm-up output, warm-up seconds): fields are median_ms, q1_ms, q3_ms per
    call, inner, and samples when fewer than ``repeats`` were taken.
    """
    first, first_s = timed(lambda: bench.sync(bench.call()))
    per_call = first_s
    if per_call < target_s:  # the warm-up may include one-time costs: calibrate on a second call
        per_call = min(per_call, timed(lambda: bench.sync(bench.call()))[1])
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
    q1, med, q3 = quartiles([s * 1e3 for s in samples])
    fields = {"inner": inner, "median_ms": med, "q1_ms": q1, "q3_ms": q3}
    if len(samples) < repeats:
        fields["samples"] = len(samples)
    return fields, first, first_s


def rss_peak_mb() -> float:
    """Peak resident set size of this process so far (ru_maxrss), in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


class RssSampler:
    """The resident set size of this process, sampled every ``interval`` seconds on a daemon
    thread from /proc/self/statm (Linux; elsewhere nothing is sampled): where in a run the
    memory peaks, which ``rss_peak_mb`` alone cannot say. Samples are
    ``(time.perf_counter(), MiB)``; a peak shorter than ``interval`` can be missed."""

    def __init__(self, interval: float = 0.1):
        self.interval, self.samples = interval, []
        self._stop = threading.Event()
        self._thread = None
        if os.path.exists("/proc/self/statm"):
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self):
        page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
        with open("/proc/self/statm") as statm:
            while not self._stop.is_set():
                statm.seek(0)
                self.samples.append((time.perf_counter(), int(statm.read().split()[1]) * page_mb))
                self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def peak_between(self, start: float, end: float) -> float | None:
        """The largest sample taken from ``start`` to ``end`` (perf_counter seconds), in MiB;
        None if there is none."""
        inside = [mb for t, mb in self.samples if start <= t <= end]
        return max(inside) if inside else None


def jax_peak_mb() -> float | None:
    """Peak bytes in use on JAX's first device since the process started, in MiB (GPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**20


# ----------------------------------------------------------------------------------------------
# child processes


def limit_memory(gb: float) -> None:
    """Caps this process's address space at ``gb`` GiB (never above the hard limit), so a run
    that cannot fit fails with an out-of-memory error instead of swapping or waking the OOM
    killer."""
    limit = int(gb * 2**30)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _child(queue, fn, args, head, mem_limit_gb):
    if mem_limit_gb:
        limit_memory(mem_limit_gb)
    try:
        queue.put(fn(*args))
    except MemoryError:
        queue.put({**head, "error": f"out of memory (address space capped at {mem_limit_gb} GB)"})
    except Exception as exc:  # an error row, not a crashed benchmark
        queue.put({**head, "error": f"{type(exc).__name__}: {exc}"[:500]})


def run_in_child(fn, args=(), timeout: float = math.inf, mem_limit_gb=None, head=None) -> dict:
    """``fn(*args)`` (a dict) from a fresh, spawned process, plus ``wall_s``.

    ``fn`` must be a module-level function. A run past ``timeout`` seconds is terminated; it, an
    exception, or a child that dies without an answer (killed for memory) becomes
    ``{**head, "error": ...}``. ``mem_limit_gb`` caps the child's address space."""
    head = dict(head or {})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, fn, tuple(args), head, mem_limit_gb))
    start = time.perf_counter()
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join()
        result = {**head, "error": f"timeout: not done after {timeout:.0f} s"}
    else:
        try:
            result = queue.get(timeout=10)
        except Exception:  # queue.Empty: the child died without a word
            result = {**head, "error": f"child exited with code {proc.exitcode} (killed: out "
                                       "of memory?)"}
    result["wall_s"] = time.perf_counter() - start
    return result
