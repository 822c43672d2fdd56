"""Progress of a fit for ``verbose``: a sequence of phases, each reported with its elapsed time,
so that a long fit never looks hung.

A phase is iterative (optimiser iterations, with an iteration cap ``total``) or one-shot (a
final solve, a variance cache). What is reported, when ``verbose > 0``:

- to logger "scalegp.gp" at INFO level, always: one record per iteration,
  ``"{phase} iter {k}: NLML {value}, CG iterations {n}, {s} s, at most ~{eta} s left (fit so far
  {t} s)"``, and a record at the start and at the end of each one-shot phase. An iterative phase
  logs its iterations only, so that a reader may count them by the phase's name
  (benchmarks/gp_scale.py does).
- on screen: a tqdm bar per iterative phase when stderr is a terminal and tqdm is installed
  (tqdm shows the elapsed and remaining time itself); otherwise the records' lines, plus a
  line at the start and at the end of each iterative phase. Lines go to stderr when it is a
  terminal (stdout may be redirected and carry results), to stdout otherwise (captured output,
  notebooks, where stderr reads as errors).

With ``verbose == 0`` nothing is reported and an update costs a counter increment.
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("scalegp.gp")

#: The clock of every elapsed time here (a test replaces it).
_now = time.perf_counter


def _terminal():
    """``sys.stderr`` when it is a terminal, else None."""
    stderr = sys.stderr
    isatty = getattr(stderr, "isatty", None)
    try:
        return stderr if isatty is not None and isatty() else None
    except (ValueError, OSError):  # a closed or detached stream
        return None


def _bar_class():
    """tqdm's bar class, or None without the optional extra "progress"."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class FitProgress:
    """Progress of one fit: a sequence of phases, each reported with its elapsed time.

    Create one when the fit starts and open each phase with :meth:`phase`::

        progress = FitProgress(verbose)
        for i, start in enumerate(starts):
            with progress.phase(f"exact fit (start {i})", total=max_iter) as phase:
                ...  # phase.update(value, cg_iterations) after each iteration
        with progress.phase("final solve"):
            ...
    """

    def __init__(self, verbose: int):
        self.verbose = verbose
        self._start = _now()
        self._open_bar = None

    def phase(self, name: str, total: int | None = None) -> PhaseProgress:
        """Context manager for one phase. ``total``: the iteration cap of an iterative phase
        (optimiser iterations), None for a one-shot phase (e.g. "final solve", "variance
        cache")."""
        return PhaseProgress(self, name, total)

    @property
    def elapsed(self) -> float:
        """Seconds since the FitProgress was created."""
        return _now() - self._start

    def report(self, message: str) -> None:
        """One line of what the fit decided (when ``verbose``), with the time so far."""
        if self.verbose:
            self._say(message + self._fit_time())

    def _fit_time(self) -> str:
        return f" (fit so far {self.elapsed:.1f} s)"

    def _say(self, message: str, log: bool = True) -> None:
        """``message`` as an INFO record (when ``log``) and as a line on screen."""
        if log:
            logger.info(message)
        terminal = _terminal()
        stream = terminal if terminal is not None else sys.stdout
        if stream is None:  # no console at all (pythonw)
            return
        if self._open_bar is not None:  # above the bar, not through it
            self._open_bar.write(message, file=stream)
        else:
            print(message, file=stream, flush=True)


class PhaseProgress:
    """One phase of a `FitProgress`: a context manager; call :meth:`update` after each
    iteration of an iterative phase."""

    def __init__(self, fit: FitProgress, name: str, total: int | None = None):
        self.fit, self.name, self.total = fit, name, total
        self.verbose = fit.verbose
        self.iteration = 0
        self.bar = None
        self._start = _now()

    @property
    def iterative(self) -> bool:
        return self.total is not None

    @property
    def elapsed(self) -> float:
        """Seconds since the phase started."""
        return _now() - self._start

    def update(self, value: float, cg_iterations: int | None = None) -> None:
        """One iteration done (objective value, CG iterations of that evaluation if any)."""
        self.iteration += 1
        if not self.verbose:
            return
        k, spent = self.iteration, self.elapsed
        message = f"{self.name} iter {k}: NLML {value:.6g}"
        if cg_iterations is not None:
            message += f", CG iterations {cg_iterations}"
        message += f", {spent:.1f} s"
        if self.total is not None and k < self.total:
            # The mean time per iteration (compilation included) times the iterations left
            # before the cap: an upper bound, as an optimiser usually stops before its cap.
            message += f", at most ~{spent / k * (self.total - k):.0f} s left"
        message += self.fit._fit_time()
        if self.bar is None:
            self.fit._say(message)
            return
        logger.info(message)
        postfix = {"NLML": f"{value:.6g}"}
        if cg_iterations is not None:
            postfix["CG"] = cg_iterations
        postfix["fit"] = f"{self.fit.elapsed:.0f}s"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def __enter__(self):
        self._start = _now()
        if not self.verbose:
            return self
        if not self.iterative:
            self.fit._say(f"{self.name} ...")
            return self
        terminal = _terminal()
        bar_class = _bar_class() if terminal is not None else None
        if bar_class is not None:
            self.bar = bar_class(total=self.total, desc=self.name, file=terminal, leave=True)
            self.fit._open_bar = self.bar
        else:  # on screen only: the log has one record per iteration of the phase
            self.fit._say(f"{self.name}: at most {self.total} iterations ...", log=False)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.bar is not None:
            self.bar.close()
            self.fit._open_bar = self.bar = None
            return None
        if not self.verbose or exc_type is not None:
            return None
        if self.iterative:
            iterations = f"{self.iteration} iteration" + ("" if self.iteration == 1 else "s")
            self.fit._say(f"{self.name}: {iterations} in {self.elapsed:.1f} s"
                          f"{self.fit._fit_time()}", log=False)
        else:
            self.fit._say(f"{self.name}: done in {self.elapsed:.1f} s{self.fit._fit_time()}")
        return None
