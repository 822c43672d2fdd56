"""What a scalegp process sets up around JAX: a bounded host BLAS beside XLA's threads, and JAX's
persistent compilation cache.

- Host BLAS (:func:`bounded_host_blas`). On CPU, JAX's LAPACK calls (Cholesky, triangular
  solves) and scalegp's host callbacks (``potri``, the Lanczos tridiagonals) run in scipy's
  OpenBLAS, whose threads spin while they wait for each other, while XLA's own pool already
  occupies the cores (measured: benchmarks/results/busy_machine_cpu.json, docs/decisions.md
  #24). So scalegp's dense linear algebra runs with
  OpenBLAS bounded to half the usable cores (one on a 2-core machine), never raised above the
  caller's own limit, and restored afterwards.
- Compilation cache (:func:`enable_compilation_cache`): compiled XLA programs are written to a
  folder and read back by later processes, so a second ``scalegp`` command does not compile
  again. The command line turns it on always (:func:`configure_command_line`); the library only
  when asked, as JAX itself does: a library should not write to the user's home or change a
  process-wide JAX setting unasked. The folder is ``$SCALEGP_CACHE_DIR``, by default
  ``$XDG_CACHE_HOME/scalegp`` or ``~/.cache/scalegp``; ``SCALEGP_CACHE_DIR=off`` turns it off.
  A folder that cannot be written is skipped with one warning; JAX's own cache settings
  (``JAX_COMPILATION_CACHE_DIR``) win over these. Every program is cached, however quick its
  compilation (there are many small ones). JAX does not cache programs
  with host callbacks (the exact GP objective on CPU, the BBMM one with host quadrature) and
  never evicts entries: delete the folder to reclaim its space.

Nothing here imports JAX at module level: the command line answers ``--help`` without it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import re
import sys
import tempfile
import threading
import warnings
from pathlib import Path

#: The environment variable naming the compilation cache's folder; "off" turns the cache off.
CACHE_ENV = "SCALEGP_CACHE_DIR"

# What JAX says when it cannot read or write a cache entry (it warns once per entry and
# compiles afresh): a corrupt or truncated file, a full disk.
_JAX_CACHE_WARNING = re.compile(r"Error (reading|writing) persistent compilation cache entry")


def cache_dir(environ=None) -> Path | None:
    """The compilation cache's folder: ``$SCALEGP_CACHE_DIR``, else ``$XDG_CACHE_HOME/scalegp``
    (an absolute ``XDG_CACHE_HOME`` only, as the XDG specification asks), else
    ``~/.cache/scalegp``; None for ``SCALEGP_CACHE_DIR=off`` (any case). An empty variable
    counts as unset. ``environ`` defaults to ``os.environ``."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(CACHE_ENV, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    xdg = environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "scalegp"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Turns on JAX's persistent compilation cache for this process, in ``path``; by default
    in ``$SCALEGP_CACHE_DIR``, else ``$XDG_CACHE_HOME/scalegp`` or ``~/.cache/scalegp``, and
    not at all for ``SCALEGP_CACHE_DIR=off``.

    Later processes that enable the same folder load the programs this one compiles instead of
    compiling them (same program, JAX version and devices). A folder that cannot be created or
    written is skipped with one ``RuntimeWarning``, never an error; so are entries JAX cannot
    read (one warning for all of them). A cache folder already set in JAX's configuration is
    kept.

    Returns:
      The folder in use, or None (turned off, or not usable).
    """
    import jax

    folder, problem = _usable_folder(path)
    if problem:
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
    if folder is None:
        return None
    quiet_repeated_cache_warnings()
    chosen = jax.config.jax_compilation_cache_dir
    if chosen:
        return Path(chosen)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


#: The size of libtpu's pinned host pool for transfers that the command line asks for, in
#: place of libtpu's 4 GiB: libtpu maps its whole pool when its client starts, and without
#: transparent huge pages (a TPU host as lent to this project) that mapping was most of the
#: client's start, paid by every command (docs/decisions.md #58). A command's transfers above
#: the pool's size take libtpu's unpooled path.
TPU_TRANSFER_POOL_BYTES = 256 << 20
_TPU_POOL_ENV = ("TPU_PREMAPPED_BUFFER_SIZE", "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES")


def configure_command_line() -> str | None:
    """The command line's setup, before it parses its arguments: the compilation cache in
    :func:`cache_dir`, set through JAX's environment variables so that ``--help`` does not
    import JAX (a JAX already imported is configured directly), and libtpu's transfer pool at
    `TPU_TRANSFER_POOL_BYTES` unless either of its variables is set (read when a TPU client
    starts; nothing elsewhere). Returns the warning to show when the folder is not usable,
    else None."""
    if not any(os.environ.get(name) for name in _TPU_POOL_ENV):
        for name in _TPU_POOL_ENV:
            os.environ[name] = str(TPU_TRANSFER_POOL_BYTES)
    folder, problem = _usable_folder(None)
    if folder is not None:
        if "jax" in sys.modules:
            enable_compilation_cache(folder)
        elif not os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # JAX's own setting wins
            os.environ["JAX_COMPILATION_CACHE_DIR"] = str(folder)
            os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return problem


def attached_accelerator() -> str | None:
    """The platform of an accelerator attached to this machine, found without starting JAX's
    client for it: "tpu" where JAX's hardware probe finds TPU chips on the PCI bus, else None
    (also where that probe, a private module of JAX, is missing). GPUs are not looked for."""
    try:
        from jax._src import hardware_utils

        chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    except Exception:  # noqa: BLE001 - an unreadable bus or a JAX without the probe: unknown
        return None
    return "tpu" if chips else None


def host_only() -> bool:
    """Keeps this process's JAX to the host CPU (``jax_platforms``), so that no accelerator's
    client starts, for a command whose work all runs on the host. Only where no JAX backend has
    started yet and the user chose no platforms (``JAX_PLATFORMS``; the "tpu,cpu" that JAX's
    import sets on a TPU machine is JAX's default, not a choice); returns whether it did."""
    import jax
    from jax._src import xla_bridge

    if os.environ.get("JAX_PLATFORMS") or xla_bridge.backends_are_initialized():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


# The thread `start_backends_early` started, if any.
_EARLY_BACKENDS: threading.Thread | None = None


def start_backends_early() -> None:
    """Starts JAX's backends (an accelerator's client, the host CPU's) in a thread, for a
    command that uses them only after work of its own: importing the library, reading its
    data. Why: a TPU client's start takes seconds (libtpu maps and pins its transfer pool,
    docs/decisions.md #58), and in a thread it ends while the command imports and reads
    (measured on the command whole: docs/decisions.md #67). The command's first use of JAX
    waits for a start in progress (JAX makes its backends under one lock).

    A start that fails raises nothing here: the command's first use of JAX starts the backends
    again and reports what it finds, as it would have without this call. The process's exit
    waits for a start in progress (an ``atexit`` hook, run before JAX's own clean-up), so that
    no client is torn down half made. Does nothing where the backends are up, or a start was
    made already."""
    global _EARLY_BACKENDS
    import jax  # noqa: F401 - imported here, not in the thread, which would race the caller's
    from jax._src import xla_bridge

    if _EARLY_BACKENDS is not None or xla_bridge.backends_are_initialized():
        return
    _EARLY_BACKENDS = threading.Thread(target=_start_backends, daemon=True,
                                       name="scalegp-backends")
    _EARLY_BACKENDS.start()
    atexit.register(_EARLY_BACKENDS.join)


def _start_backends() -> None:
    from jax._src import xla_bridge

    try:
        xla_bridge.backends()
    except Exception:  # noqa: BLE001 - raised again, and reported, where JAX is first used
        pass


def _usable_folder(path) -> tuple[Path | None, str | None]:
    """(folder, None) when ``path`` (default :func:`cache_dir`) can be created and written,
    (None, None) when the cache is off, (None, why) otherwise."""
    try:
        folder = cache_dir() if path is None else Path(path).expanduser()
    except RuntimeError as error:  # no home directory to put ~/.cache in
        return None, _not_usable("", error)
    if folder is None:
        return None, None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".scalegp-probe-"):
            pass
    except OSError as error:
        return None, _not_usable(f" {str(folder)!r}", error)
    return folder, None


def _not_usable(where: str, error: Exception) -> str:
    return (f"the compilation cache folder{where} is not usable ({error}); running without it. "
            f"Set {CACHE_ENV} to a writable folder, or to 'off'.")


class _FirstCacheWarningOnly:
    """A warnings-filter message matcher (``warnings.filters`` calls ``match(text)``): no match
    for the first of JAX's cache read/write warnings in this process, so it is shown, and a
    match, to ignore them, for every later one: one line, not one per corrupt entry."""

    def __init__(self):
        self.seen = False

    def match(self, text: str) -> bool:
        if not _JAX_CACHE_WARNING.match(text):
            return False
        seen, self.seen = self.seen, True
        return seen


_first_cache_warning_only = _FirstCacheWarningOnly()


def quiet_repeated_cache_warnings() -> None:
    """Shows only the first of JAX's warnings about cache entries it cannot read or write (it
    compiles those programs afresh). Put in front of the warning filters; call it again after
    ``warnings.simplefilter`` or inside ``warnings.catch_warnings``, which replace them."""
    entry = ("ignore", _first_cache_warning_only, Warning, None, 0)
    while entry in warnings.filters:
        warnings.filters.remove(entry)
    # filterwarnings puts a filter in front and resets the "already shown" registries; its
    # message pattern, a string, then gives way to the matcher.
    warnings.filterwarnings("ignore", message=_JAX_CACHE_WARNING.pattern)
    warnings.filters[0] = entry


@contextlib.contextmanager
def bounded_host_blas(*, lapack: bool = True):
    """Within the block, the BLAS libraries loaded in this process (numpy's and scipy's
    OpenBLAS; JAX's CPU LAPACK calls are scipy's) use at most :func:`host_blas_threads` threads,
    or fewer if the caller set fewer; their settings are restored on exit. Nested blocks, and
    blocks entered by other threads (a host callback inside a bounded computation), leave the
    outer bound in place.

    ``lapack=False``, for work that runs no LAPACK (no scipy, no XLA factorisation): scipy is
    not imported for its OpenBLAS (an import a short command would mostly consist of); the
    libraries loaded already are bounded, scipy's among them if something imported it."""
    controller = _blas_controller(lapack or "scipy.linalg" in sys.modules, wait=False)
    if controller is None or not controller.lib_controllers:
        yield
        return
    current = [lib.num_threads for lib in controller.lib_controllers]
    threads = min([host_blas_threads()] + [n for n in current if n])
    with controller.limit(limits=threads, user_api="blas"):
        yield


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one), at least
    one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def host_blas_threads() -> int:
    """Half the cores this process may use, at least one: XLA's pool takes the others' share,
    and a bound below the core count leaves room for one other busy process without OpenBLAS's
    spinning threads waiting on a descheduled one."""
    return max(1, usable_cores() // 2)


# The searches for the BLAS libraries, one per ``with_scipy``: futures of their controllers.
_BLAS_SEARCHES: dict = {}
_BLAS_LOCK = threading.Lock()


def search_host_blas_early() -> None:
    """Starts the search for the host BLAS libraries (scipy's among them) in a thread, for a
    call that will bound them soon (`bounded_host_blas`) and has other work first. Why: the
    search resolves the path of every library the process has loaded, about a thousand in a
    TPU process, slow where the file system is (docs/decisions.md #62). Until it ends,
    `bounded_host_blas` does not wait for it: the BLAS runs at its own thread counts
    meanwhile."""
    with _BLAS_LOCK:
        if True in _BLAS_SEARCHES:
            return
        future = _BLAS_SEARCHES[True] = concurrent.futures.Future()
    threading.Thread(target=_search_blas, args=(future, True), daemon=True,
                     name="scalegp-blas-search").start()


def _blas_controller(with_scipy: bool, wait: bool = True):
    """The BLAS libraries of this process, found once (a search of the loaded libraries; a
    limit through the found ones takes microseconds). ``with_scipy``: scipy.linalg is imported
    first, so that its OpenBLAS, the one JAX's CPU LAPACK calls use, is among them. None where
    a search started by `search_host_blas_early` is still running and not ``wait``."""
    with _BLAS_LOCK:
        future = _BLAS_SEARCHES.get(with_scipy)
        here = future is None
        if here:
            future = _BLAS_SEARCHES[with_scipy] = concurrent.futures.Future()
    if here:
        _search_blas(future, with_scipy)
    elif not wait and not future.done():
        return None
    return future.result()


def _search_blas(future, with_scipy: bool) -> None:
    try:
        if with_scipy:
            import scipy.linalg  # noqa: F401 - loads scipy's OpenBLAS
        from threadpoolctl import ThreadpoolController

        future.set_result(ThreadpoolController().select(user_api="blas"))
    except BaseException as error:  # noqa: BLE001 - the caller's to raise
        future.set_exception(error)
