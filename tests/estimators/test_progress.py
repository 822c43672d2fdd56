"""scalegp.estimators._progress: a fit's phases with their elapsed time and an estimate of what
remains (on a clock the tests move), to the log and on screen."""

import io
import re
import sys
import types

import numpy as np
import pytest

from scalegp.estimators import _progress
from scalegp.estimators._progress import FitProgress


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(_progress, "_now", clock)
    return clock


@pytest.fixture
def records(caplog):
    caplog.set_level("INFO", logger="scalegp.gp")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "scalegp.gp"]


def fake_terminal(monkeypatch):
    """stderr becomes a terminal; called in the test itself, since pytest sets its capturing
    stderr when the test's call starts, after the fixtures."""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    return terminal


def fake_tqdm(monkeypatch):
    """A stand-in for tqdm that records its calls; returns the list of bars made."""
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.calls = kwargs, []
            bars.append(self)

        def set_postfix(self, postfix, refresh=True):
            self.calls.append(("postfix", dict(postfix)))

        def update(self, n):
            self.calls.append(("update", n))

        def close(self):
            self.calls.append(("close",))

        @classmethod
        def write(cls, message, file=None):
            file.write(f"[above the bar] {message}\n")

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    return bars


def test_iterations_report_elapsed_time_and_what_remains(clock, records, capsys):
    fit = FitProgress(verbose=1)
    clock.t += 1.5  # checks before the first phase
    assert fit.elapsed == 1.5
    with fit.phase("exact fit (start 0)", total=10) as phase:
        clock.t += 2
        phase.update(-551.5764, 0)
        clock.t += 2
        phase.update(-552.0, 3)
    assert records() == [
        # today's text first (a benchmark reads it), then the phase's time, the estimate of
        # what remains before the cap, and the fit's time
        "exact fit (start 0) iter 1: NLML -551.576, CG iterations 0, 2.0 s, at most ~18 s left "
        "(fit so far 3.5 s)",
        "exact fit (start 0) iter 2: NLML -552, CG iterations 3, 4.0 s, at most ~16 s left "
        "(fit so far 5.5 s)",
    ]
    # Not a terminal: printed lines on stdout as before, with the phase's start and end.
    out, err = capsys.readouterr()
    assert out.splitlines() == ["exact fit (start 0): at most 10 iterations ...", *records(),
                                "exact fit (start 0): 2 iterations in 4.0 s (fit so far 5.5 s)"]
    assert err == ""


def test_what_remains_is_an_upper_bound_up_to_the_cap(clock, records):
    fit = FitProgress(verbose=1)
    with fit.phase("BBMM fit on all data", total=4) as phase:
        clock.t += 10  # the first iteration compiles
        phase.update(1.0, 40)
        clock.t += 1
        phase.update(0.9, 30)
        clock.t += 1
        phase.update(0.8, 30)
        clock.t += 1
        phase.update(0.7, 30)
    left = [re.search(r"at most ~(\d+) s left", m) for m in records()]
    # the mean so far times the iterations before the cap: never below the time one more
    # iteration at the latest rate takes
    assert [int(m.group(1)) for m in left[:3]] == [30, 11, 4]
    assert left[3] is None  # the cap is reached: nothing left to estimate
    with fit.phase("unbounded") as phase:  # no cap, no estimate
        phase.update(0.5)
    assert "unbounded iter 1: NLML 0.5, 0.0 s (fit so far 13.0 s)" in records()


def test_one_shot_phases_report_start_and_duration(clock, records, capsys):
    fit = FitProgress(verbose=1)
    clock.t += 7
    with fit.phase("final solve"):
        clock.t += 3.25
    with fit.phase("variance cache"):
        clock.t += 1
    with pytest.raises(RuntimeError), fit.phase("broken"):
        raise RuntimeError("no done line for a phase that failed")
    expected = ["final solve ...",
                "final solve: done in 3.2 s (fit so far 10.2 s)",
                "variance cache ...",
                "variance cache: done in 1.0 s (fit so far 11.2 s)",
                "broken ..."]
    assert records() == expected
    assert capsys.readouterr().out.splitlines() == expected


def test_verbose_zero_is_silent(clock, records, capsys, monkeypatch):
    terminal = fake_terminal(monkeypatch)
    bars = fake_tqdm(monkeypatch)
    fit = FitProgress(verbose=0)
    with fit.phase("exact fit (start 0)", total=3) as phase:
        phase.update(1.0, 0)
        phase.update(0.5, 0)
    with fit.phase("final solve"):
        pass
    assert phase.iteration == 2
    assert records() == [] and bars == [] and terminal.getvalue() == ""
    assert capsys.readouterr() == ("", "")


def test_terminal_with_tqdm_draws_a_bar_per_iterative_phase(clock, records, capsys,
                                                            monkeypatch):
    terminal = fake_terminal(monkeypatch)
    bars = fake_tqdm(monkeypatch)
    fit = FitProgress(verbose=1)
    with fit.phase("exact fit (start 0)", total=5) as phase:
        clock.t += 1
        phase.update(2.5, 0)
        phase.update(2.25, None)
    with fit.phase("final solve"):
        clock.t += 2
    (bar,) = bars
    assert bar.kwargs == {"total": 5, "desc": "exact fit (start 0)", "file": terminal,
                          "leave": True}
    assert bar.calls == [("postfix", {"NLML": "2.5", "CG": 0, "fit": "1s"}), ("update", 1),
                         ("postfix", {"NLML": "2.25", "fit": "1s"}), ("update", 1), ("close",)]
    assert len(records()) == 4  # the log has every line all the same
    assert terminal.getvalue().splitlines() == ["final solve ...",
                                                "final solve: done in 2.0 s (fit so far 3.0 s)"]
    assert capsys.readouterr().out == ""


def test_a_line_while_a_bar_is_drawn_goes_above_it(clock, monkeypatch):
    terminal = fake_terminal(monkeypatch)
    fake_tqdm(monkeypatch)
    fit = FitProgress(verbose=1)
    with fit.phase("BBMM fit on all data", total=5), fit.phase("preconditioner"):
        pass
    assert terminal.getvalue().startswith("[above the bar] preconditioner ...\n")


def test_terminal_with_real_tqdm(capsys, monkeypatch):
    terminal = fake_terminal(monkeypatch)
    pytest.importorskip("tqdm")
    with FitProgress(1).phase("exact fit (start 0)", total=3) as progress:
        for value in (3.0, 2.0, 1.0):
            progress.update(value, 0)
    assert "exact fit (start 0)" in terminal.getvalue() and "3/3" in terminal.getvalue()
    assert capsys.readouterr().out == ""


def test_terminal_without_tqdm_prints_lines_to_stderr(clock, records, capsys, monkeypatch):
    terminal = fake_terminal(monkeypatch)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    fit = FitProgress(verbose=1)
    with fit.phase("exact fit (start 0)", total=2) as phase:
        clock.t += 4
        phase.update(1.0, 0)
    assert terminal.getvalue().splitlines() == [
        "exact fit (start 0): at most 2 iterations ...",
        "exact fit (start 0) iter 1: NLML 1, CG iterations 0, 4.0 s, at most ~4 s left "
        "(fit so far 4.0 s)",
        "exact fit (start 0): 1 iteration in 4.0 s (fit so far 4.0 s)"]
    assert capsys.readouterr().out == ""  # stdout may carry results


def test_a_fit_reports_time_per_iteration(records, capsys):
    from scalegp import ScalableGPRegressor

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2))
    y = np.sin(x[:, 0]) + 0.1 * rng.normal(size=40)
    ScalableGPRegressor(optimizer="adam", max_iter=3, verbose=1).fit(x, y)
    pattern = (r"exact fit \(start 0\) iter (\d): NLML \S+, CG iterations 0, \d+\.\d s"
               r"(, at most ~\d+ s left)? \(fit so far \d+\.\d s\)$")
    matches = [re.match(pattern, m) for m in records() if " iter " in m]
    assert all(matches) and len(matches) == 3, records()
    assert [bool(m.group(2)) for m in matches] == [True, True, False]
    assert capsys.readouterr().out.count("CG iterations") == 3
