"""Ctrl-C (SIGINT) and SIGTERM during a command: it stops within seconds with exit code 130 or
143 and leaves none of its files (no output, no temporary file), wherever the signal finds it.

Python raises KeyboardInterrupt wherever the main thread next runs Python code, and loses it in
two kinds of places: a garbage-collection callback or ``__del__`` (printed as "Exception
ignored" and dropped; JAX's ``_xla_gc_callback`` runs at every collection, so a Ctrl-C early in
``scalegp gp fit`` was mostly lost and the fit went on to write its model), and code that
catches BaseException. And while the main thread waits in a long compiled XLA call, the handler
does not run at all. So, within :func:`handling_signals`:

- the handler notes the signal and raises :class:`Interrupted`, a KeyboardInterrupt, once: the
  command unwinds through its own cleanup (the threaded KDE pipelines end their other runs, the
  progress display closes); a second signal does not break into that cleanup. Inside an import
  it waits until the import is done (an extension module's initialisation, interrupted,
  crashed the interpreter);
- the command notes its files here as it creates them (:func:`note_files`, under
  :func:`guarded` where a file becomes ours only once it is there) and checks for a signal at
  safe points (:func:`raise_if_interrupted`: between phases, before an output is put in place,
  at its end), so that an interrupt that was lost still ends in 130 or 143 and no output;
- with a ``deadline`` (the ``scalegp`` executable, :func:`run_executable`) a watcher thread is
  woken by the signal itself (`signal.set_wakeup_fd`: written by the C-level handler, even
  while the main thread is inside XLA). It raises a lost interrupt again, and if the command
  has not ended ``deadline`` seconds after the signal it removes the noted files and ends the
  process (``os._exit``);
- the executable ends the process itself once the command is done, with the handlers still
  in place (a signal now is noted, and acted upon at the very end): the interpreter's own
  finalization, over a second with JAX loaded, would have restored the default handlers, and
  a signal then killed the process with the outputs in place.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

#: Seconds the executable gives a command to unwind after Ctrl-C or SIGTERM before it removes
#: the command's files itself and ends the process.
DEADLINE = 2.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM during a command; ``signum`` says which."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Scope:
    """One command's signal state: the first signal (``signum``), whether an Interrupted was
    raised for it and whether that one was lost, whether the process is ending (``final``: a
    signal is noted only), the files to remove if it ends interrupted."""

    def __init__(self):
        self.signum: int | None = None
        self.raised = False
        self.lost = False
        self.final = False
        self.files: dict[Path, None] = {}  # an ordered set
        self.lock = threading.Lock()  # held while a file becomes ours and is noted
        self.ended = threading.Event()


_scope: _Scope | None = None


def exit_code(default: int = 130) -> int:
    """128 + the signal that interrupted the command (``default`` when none was noted)."""
    scope = _scope
    return default if scope is None or scope.signum is None else 128 + scope.signum


def raise_if_interrupted() -> None:
    """A safe point: raises :class:`Interrupted` when the command received a signal, also one
    whose KeyboardInterrupt was lost."""
    scope = _scope
    if scope is not None and scope.signum is not None:
        scope.raised, scope.lost = True, False
        raise Interrupted(scope.signum)


def note_files(*paths: Path) -> None:
    """``paths`` are this command's: removed if it ends interrupted. Note a temporary file's
    random name before creating it; a destination once it is placed, under :func:`guarded`."""
    if _scope is not None:
        _scope.files.update(dict.fromkeys(Path(p) for p in paths))


def guarded():
    """The lock the deadline's forced exit takes before it removes the noted files: hold it
    while a file becomes this command's and is noted, so that neither is half done."""
    return _scope.lock if _scope is not None else contextlib.nullcontext()


def exit_if_interrupted() -> None:
    """At a command's end: after a signal, its noted files removed and SystemExit(128 +
    signal), whatever the command returned."""
    scope = _scope
    if scope is None or scope.signum is None:
        return
    with scope.lock:
        _remove(scope.files)
    raise SystemExit(128 + scope.signum)


@contextlib.contextmanager
def handling_signals(deadline: float | None = None):
    """SIGINT and SIGTERM raise :class:`Interrupted` within the block (module docstring); with
    ``deadline`` a watcher ends a command that has not stopped that many seconds after the
    signal. Yields the scope, or None where handlers cannot be set (not the main thread).
    Nested blocks share the outer one's; a signal the caller ignores stays ignored."""
    global _scope
    if _scope is not None or threading.current_thread() is not threading.main_thread():
        yield _scope
        return
    scope = _Scope()
    _scope = scope
    previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    previous = {signum: handler for signum, handler in previous.items()
                if handler != signal.SIG_IGN}
    hook = sys.unraisablehook
    try:
        for signum in previous:
            signal.signal(signum, _on_signal)
        sys.unraisablehook = _lost_interrupts_noted(hook)
        with _watcher(scope, deadline) if deadline is not None else contextlib.nullcontext():
            yield scope
    finally:
        scope.ended.set()
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        sys.unraisablehook = hook
        _scope = None


def run_executable(command) -> None:
    """The ``scalegp`` executable: ``command()`` (which ends in SystemExit, as click's
    standalone mode does) within `handling_signals` with `DEADLINE`; then the process ends here
    (`_end_process`) with the command's exit code, or 128 + the signal and none of its files."""
    with handling_signals(deadline=DEADLINE) as scope:
        status = 1
        try:
            status = _run(command)
        except KeyboardInterrupt:  # just after the command's end
            status = 130
        finally:
            if scope is not None:
                scope.final = True
        if scope is None:  # not the main thread: no handlers, the interpreter's exit
            raise SystemExit(status)
        _end_process(scope, status)


def _run(command):
    """The status ``command`` ends with, as `SystemExit` carries it."""
    try:
        command()
    except SystemExit as stop:
        return stop.code
    except KeyboardInterrupt:
        return 130
    return None


def _end_process(scope: _Scope, status) -> None:
    """Ends the process as the interpreter's exit would, without its finalization: the atexit
    functions run (not after a signal) and the standard streams are flushed, then ``os._exit``
    (threads still inside XLA after an interrupt are not waited for). A signal noted by then
    makes the exit code 128 + signal, with the command's files removed."""
    if status is None:
        code = 0
    elif isinstance(status, int):
        code = status
    else:  # SystemExit("message"), as the interpreter reports it
        print(status, file=sys.stderr)
        code = 1
    if scope.signum is None:  # after a signal, threads may be inside XLA: JAX's clean-up waits
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    scope.lock.acquire()  # the watcher's forced exit waits, or has happened
    if scope.signum is not None:
        _remove(scope.files)
        code = 128 + scope.signum
    os._exit(code)


def _on_signal(signum, frame):
    scope = _scope
    if scope is None:
        raise Interrupted(signum)
    if scope.signum is None:
        scope.signum = signum
    if scope.final:  # the process is ending: the exit code says so, no exception
        return
    if scope.raised and not scope.lost:  # once: a second signal would break into the cleanup
        return
    if _importing(frame):  # an extension module's initialisation is not safe to interrupt
        scope.lost = True  # raised once the import is done (the watcher, a safe point)
        return
    scope.raised, scope.lost = True, False
    raise Interrupted(scope.signum)


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import: a KeyboardInterrupt in jaxlib's (``import jax``,
    plain Python) crashed the interpreter with a segmentation fault, 1 run in 60 here."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _lost_interrupts_noted(hook):
    """An `sys.unraisablehook` that notes an :class:`Interrupted` lost in a gc callback or
    ``__del__`` (the next safe point, or the watcher, raises it again) instead of printing it;
    other exceptions go to ``hook``."""
    def noted(unraisable):
        if isinstance(unraisable.exc_value, Interrupted) and _scope is not None:
            _scope.lost = True
            return
        hook(unraisable)

    return noted


@contextlib.contextmanager
def _watcher(scope: _Scope, deadline: float):
    """The watcher thread, woken by the bytes the C-level handler writes for each signal."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # set_wakeup_fd needs it
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    thread = threading.Thread(target=_watch, args=(scope, read_end, deadline), daemon=True,
                              name="scalegp-signals")
    thread.start()
    try:
        yield
    finally:
        scope.ended.set()
        signal.set_wakeup_fd(previous)
        os.close(write_end)  # the watcher reads the end of the pipe, or has seen `ended`
        thread.join()
        os.close(read_end)


def _watch(scope: _Scope, read_end: int, deadline: float) -> None:
    while True:
        byte = os.read(read_end, 1)
        if not byte:
            return  # the command ended without a signal
        if byte[0] in _SIGNALS:
            break
    if scope.signum is None:  # the main thread has not run its handler yet
        scope.signum = byte[0]
    stop = time.monotonic() + deadline
    while not scope.ended.wait(0.05):
        if time.monotonic() > stop:
            _end_now(scope)
        if scope.lost:  # raised in a gc callback or __del__: raise it again, in the main thread
            signal.pthread_kill(threading.main_thread().ident, scope.signum)


def _end_now(scope: _Scope) -> None:
    """The forced exit: the noted files removed, the cursor a progress display hid shown again,
    the process ended (other threads may be inside XLA)."""
    scope.lock.acquire(timeout=1.0)  # not between a file's placing and its noting
    _remove(scope.files, with_temporaries=True)
    with contextlib.suppress(OSError):
        if os.isatty(2):
            os.write(2, b"\x1b[?25h\n")
    os._exit(128 + scope.signum)


def _remove(files, with_temporaries: bool = False) -> None:
    """Removes ``files``; ``with_temporaries`` also the temporary files that a writer into one
    of our temporary files keeps beside it (``.{name}.{random}.tmp``: `scalegp.persistence`'s
    atomic writes), which its own cleanup had no time to remove."""
    for path in list(files):
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        if with_temporaries and path.name.endswith(".tmp"):  # random names: none but ours
            prefix = f".{path.name[:100]}."
            with contextlib.suppress(OSError):
                for entry in os.scandir(path.parent):
                    if entry.name.startswith(prefix) and entry.name.endswith(".tmp"):
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
