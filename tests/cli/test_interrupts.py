"""cli.interrupts: Ctrl-C (SIGINT) and SIGTERM at any moment of a command end it with exit code
130 or 143 and none of its files, also when the KeyboardInterrupt is lost (in a gc callback, in
``__del__``, in code that swallows it) or the main thread does not come back (a long XLA call).

The lost cases are made deterministic: the handler is called inside a gc callback or
``__del__`` (in-process), or the signal is sent from one, with a loop there that runs the
handler before the callback returns (in a subprocess, the executable)."""

import gc
import importlib
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from typer.testing import CliRunner

from scalegp.cli import gp as gp_command
from scalegp.cli import interrupts
from scalegp.cli import kde as kde_command
from scalegp.cli.app import app
from scalegp.cli.interrupts import Interrupted, handling_signals

runner = CliRunner()
FAST = ["--max-iter", "0"]


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 2)), rng.normal(size=40)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return tmp_path


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def lose_in_a_gc_callback(signum):
    """The signal arrives while the main thread runs a gc callback (JAX's
    ``_xla_gc_callback``, in the issue): its handler raises there, and Python prints the
    exception as "Exception ignored" and drops it."""
    handler = signal.getsignal(signum)
    fired = []

    def callback(phase, info):
        if not fired:
            fired.append(phase)
            handler(signum, None)

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert fired


class _DeletedDuringASignal:
    def __init__(self, signum):
        self.signum = signum

    def __del__(self):
        signal.getsignal(self.signum)(self.signum, None)


def test_the_handler_raises_once_so_that_a_second_signal_does_not_break_the_cleanup():
    with handling_signals() as scope:
        handler = signal.getsignal(signal.SIGTERM)
        with pytest.raises(Interrupted) as raised:
            handler(signal.SIGTERM, None)
        assert raised.value.signum == signal.SIGTERM and isinstance(raised.value,
                                                                   KeyboardInterrupt)
        handler(signal.SIGINT, None)  # while the first unwinds: noted, not raised
        assert interrupts.exit_code() == 128 + signal.SIGTERM and scope.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is not handler  # restored


def test_a_lost_interrupt_is_raised_by_the_next_signal_and_at_safe_points():
    with handling_signals() as scope:
        handler = signal.getsignal(signal.SIGINT)
        lose_in_a_gc_callback(signal.SIGINT)
        assert scope.lost and scope.signum == signal.SIGINT
        with pytest.raises(Interrupted):  # lost: the next Ctrl-C raises again
            handler(signal.SIGINT, None)
        handler(signal.SIGINT, None)  # not the one after, while that one unwinds
        with pytest.raises(Interrupted):  # a safe point raises whenever a signal came
            interrupts.raise_if_interrupted()


def test_an_interrupt_waits_for_the_end_of_the_import_it_arrives_in(tmp_path, monkeypatch):
    # a KeyboardInterrupt inside jaxlib's import (plain `import jax`) crashed the interpreter
    # with a segmentation fault, 1 run in 60
    (tmp_path / "signalled_in_its_import.py").write_text(
        "import signal, sys\n"
        "signal.getsignal(signal.SIGINT)(signal.SIGINT, sys._getframe())\n"
        "DONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "signalled_in_its_import", raising=False)
    with handling_signals() as scope:
        assert importlib.import_module("signalled_in_its_import").DONE
        assert scope.signum == signal.SIGINT and scope.lost
        with pytest.raises(Interrupted):
            interrupts.raise_if_interrupted()
    sys.modules.pop("signalled_in_its_import", None)


def test_a_signal_the_caller_ignores_stays_ignored():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with handling_signals():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_files_of_an_interrupted_command_are_removed(tmp_path):
    kept, ours = tmp_path / "kept.npy", tmp_path / "ours.npy"
    kept.write_bytes(b"x")
    with pytest.raises(SystemExit) as stop:
        with handling_signals():
            ours.write_bytes(b"x")
            interrupts.note_files(ours, tmp_path / "never-created.tmp")
            with pytest.raises(Interrupted):
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            interrupts.exit_if_interrupted()
    assert stop.value.code == 130 and _files(tmp_path) == ["kept.npy"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_kde_interrupted_in_a_gc_callback_exits_130_or_143_without_output(
        data, monkeypatch, signum):
    # on main the KeyboardInterrupt raised in the callback was printed and dropped: the command
    # went on, wrote both files and exited 0 (and SIGTERM's default could not be called at all)
    fit = kde_command._Model.fit

    def fit_then_lose_an_interrupt(self, x):
        fit(self, x)
        lose_in_a_gc_callback(signum)

    monkeypatch.setattr(kde_command._Model, "fit", fit_then_lose_an_interrupt)
    result = runner.invoke(app, ["kde", str(data / "x.npy"), "--bandwidth", "scott", "--out",
                                 str(data / "logp.npy"), "--sample", "5", "--sample-out",
                                 str(data / "draws.csv")])
    assert result.exit_code == 128 + signum, result.output
    assert _files(data) == ["x.npy", "y.npy"]


def test_gp_fit_interrupted_in_del_writes_no_model(data, monkeypatch):
    # the model is put in place after the fit: a Ctrl-C lost in __del__ during the fit now
    # stops the command there (on main: exit 0 and the model written)
    fit = gp_command._fit_with_progress

    def fit_then_lose_an_interrupt(*args):
        seconds = fit(*args)
        garbage = _DeletedDuringASignal(signal.SIGINT)
        del garbage
        return seconds

    monkeypatch.setattr(gp_command, "_fit_with_progress", fit_then_lose_an_interrupt)
    result = runner.invoke(app, ["gp", "fit", str(data / "x.npy"), "--y", str(data / "y.npy"),
                                 "--model", str(data / "gp.npz"), "--quiet", *FAST])
    assert result.exit_code == 130, result.output
    assert _files(data) == ["x.npy", "y.npy"]


# The executable (`scalegp.cli.app.main`, with the watcher) in a subprocess, with one step
# replaced; it prints "ready" when the test should send its signal.
DRIVER = """
import gc, os, signal, sys, time
import numpy as np
from scalegp.cli import gp
from scalegp.cli.app import main
{patch}
sys.argv = ["scalegp", *sys.argv[1:]]
main()
"""

# Ctrl-C during a collection; the handler runs in the callback (in the loop), where the
# KeyboardInterrupt is lost; then a fit that takes a while
LOST_IN_GC = """
fit = gp._fit_with_progress
def fit_after_a_lost_interrupt(*args):
    fired = []
    def callback(phase, info):
        if not fired:
            fired.append(phase)
            signal.raise_signal(signal.SIGINT)
            for _ in range(10**6):
                pass
    gc.callbacks.append(callback)
    gc.collect()
    gc.callbacks.remove(callback)
    time.sleep(20)
    return fit(*args)
gp._fit_with_progress = fit_after_a_lost_interrupt
"""

# the model half written (the temporary file and scalegp.persistence's own beside it), and a
# step that swallows every interrupt and never returns, as a long XLA call would not
STUCK_IN_THE_WRITE = """
def stuck(*args):
    while True:
        try:
            print("ready", flush=True)
            time.sleep(60)
        except BaseException:
            pass
os.replace = stuck
"""

# the model is in place; the summary is not printed yet
AFTER_THE_WRITE = """
def summary(*args):
    print("ready", flush=True)
    time.sleep(60)
gp.print_summary = summary
"""


def _run_driver(data, patch, signum=None, timeout=120):
    """``scalegp gp fit`` on ``data`` with ``patch`` applied; ``signum`` is sent once the
    driver prints "ready". Returns the exit code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(patch=textwrap.dedent(patch)), "gp", "fit",
         str(data / "x.npy"), "--y", str(data / "y.npy"), "--model", str(data / "gp.npz"),
         "--quiet", *FAST], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if signum is not None:
            assert proc.stdout.readline() == "ready\n", proc.stderr.read()
            proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        proc.communicate()
    return proc.returncode, stderr


def test_ctrl_c_lost_in_a_gc_callback_still_stops_the_executable(data):
    # the issue: "Exception ignored in: <function _xla_gc_callback>", then exit 0 and the model
    # written; the watcher raises the lost interrupt again at once
    code, stderr = _run_driver(data, LOST_IN_GC)
    assert code == 130, stderr
    assert "Exception ignored" not in stderr
    assert _files(data) == ["x.npy", "y.npy"]


def test_a_command_that_does_not_come_back_is_ended_at_the_deadline(data):
    # on main SIGTERM raised SystemExit here, which the step swallowed: it ran forever
    code, stderr = _run_driver(data, STUCK_IN_THE_WRITE, signal.SIGTERM, timeout=60)
    assert code == 143, stderr
    assert _files(data) == ["x.npy", "y.npy"]  # no temporary file either


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                    signal.SIGTERM])
def test_a_signal_after_the_write_removes_the_output(data, signum):
    # on main SIGTERM killed the process (-15) with the model in place
    code, stderr = _run_driver(data, AFTER_THE_WRITE, signum)
    assert code == 128 + signum, stderr
    assert _files(data) == ["x.npy", "y.npy"]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_at_any_moment_of_a_real_run(data, signum):
    """A real `scalegp gp fit` (no step replaced) signalled at moments over its run: exit 130
    or 143 and no files, or (signalled after its end) exit 0 and the model."""
    import time

    command = [sys.executable, "-m", "scalegp", "gp", "fit", str(data / "x.npy"), "--y",
               str(data / "y.npy"), "--model", str(data / "gp.npz"), "--quiet",
               "--max-iter", "20"]
    for delay in np.arange(0.2, 8.0, 0.6):
        (data / "gp.npz").unlink(missing_ok=True)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(delay)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
        files = _files(data)
        if proc.returncode == 0:
            assert files == ["gp.npz", "x.npy", "y.npy"], delay
        else:
            # -signum: killed by it while Python started, before the command set its handlers
            assert proc.returncode in (128 + signum, -signum), (delay, stderr)
            assert files == ["x.npy", "y.npy"], delay
