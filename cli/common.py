"""What every command shares: the options for output and errors, one-line error reporting, Ctrl-C
and SIGTERM (exit 130 or 143, no output: `.interrupts`), and a progress display that shows only
on a terminal."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import warnings
from enum import StrEnum
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from scalegp._runtime import bounded_host_blas, quiet_repeated_cache_warnings
from scalegp._validation import MemoryLimitError

from .interrupts import exit_code, exit_if_interrupted, handling_signals, raise_if_interrupted

#: Exit code for bad input (a file, a setting): as argparse and click use for usage errors.
EXIT_BAD_INPUT = 2


class CLIError(Exception):
    """A problem with the user's input: reported as one line, exit code 2."""


Force = Annotated[bool, typer.Option("--force", help="Overwrite existing output files.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress display, no summary.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors.")]
Json = Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")]
Key = Annotated[Optional[str], typer.Option(help="Array name inside an .npz file.")]
Delimiter = Annotated[Optional[str], typer.Option(
    help="CSV delimiter (default: guessed from the header line; 'tab' for tabs).")]
Missing = Annotated[str, typer.Option(help="Rows with missing values: 'error' or 'drop'.")]


def reports_errors(command=None, *, lapack: bool = True):
    """Turns exceptions into one line on stderr and a non-zero exit (2 for bad input, 1 for an
    internal failure); with ``--debug`` the exception propagates with its traceback. The
    command runs with the host BLAS bounded (`scalegp._runtime.bounded_host_blas`: its LAPACK
    beside XLA's threads; ``lapack=False`` for a command that runs none, which then does not
    import scipy for it) and shows JAX's warnings about compilation-cache entries once. Use as
    ``@reports_errors`` or ``@reports_errors(lapack=False)``."""
    if command is None:
        return functools.partial(reports_errors, lapack=lapack)

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    bounded_host_blas(lapack=lapack):
                warnings.simplefilter("default")
                quiet_repeated_cache_warnings()
                result = command(*args, **kwargs)
            _show_warnings(caught, kwargs.get("quiet", False))
            return result
        except (typer.Exit, typer.Abort, BrokenPipeError):
            raise  # a closed pipe is not bad input: the root command stops quietly
        except Exception as error:  # noqa: BLE001 - the point is to catch everything
            raise_if_interrupted()  # e.g. an XLA error for a KeyboardInterrupt in a callback
            if kwargs.get("debug"):
                raise
            # MemoryLimitError: a request refused before any work as too large for memory
            bad_input = isinstance(error, (CLIError, ValueError, TypeError, OSError,
                                           MemoryLimitError))
            message = " ".join(str(error).split()) or type(error).__name__
            unavailable = _device_unavailable(error, message)
            out_of_memory = _device_out_of_memory(message)
            if unavailable:
                message = unavailable
            elif out_of_memory:
                message, bad_input = out_of_memory, True
            elif not bad_input:
                message = f"internal error ({type(error).__name__}): {message}"
            typer.echo(f"error: {message}" + ("" if bad_input or unavailable
                                              else " (--debug shows where)"), err=True)
            raise typer.Exit(EXIT_BAD_INPUT if bad_input else 1) from None

    return wrapper


def _device_unavailable(error: Exception, message: str) -> str | None:
    """The line for JAX failing to open its device, else None. A TPU serves one process at a
    time, and a second one gets libtpu's own advice (remove a lock file), which is wrong while
    the first still runs: this says what is going on and what to do instead."""
    if not (isinstance(error, RuntimeError) and "Unable to initialize backend" in message):
        return None
    cause = message.split(". ")[0]
    return (f"JAX could not open the accelerator ({cause}). A TPU serves one process at a "
            "time: wait for the one using it to finish, or run this command on the CPU with "
            "JAX_PLATFORMS=cpu")


def _device_out_of_memory(message: str) -> str | None:
    """The line for XLA's RESOURCE_EXHAUSTED (a program or an array larger than the
    accelerator's free memory, a size the command could not foresee), else None: the problem's
    size is the cause, so it is reported as bad input with what to do, not as an internal
    error."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    cause = message[message.index("RESOURCE_EXHAUSTED"):].split(". ")[0][:300]
    return (f"the accelerator's memory is too small for this problem ({cause}): give fewer "
            "points (or query rows), or run this command on the host CPU with "
            "JAX_PLATFORMS=cpu")


#: click's UsageError, from wherever this typer takes click (newer ones carry their own copy).
UsageError = typer.BadParameter.__base__


class Choice(StrEnum):
    """Base of the options with a fixed set of values (``--solver``, ``--scale``).

    A `StrEnum`, so that ``str(Prune.auto)`` is ``"auto"``: typer before 0.29 converts an
    option's value back to the enum by its ``str()``, and a ``(str, Enum)`` member's ``str()``
    is ``"Prune.auto"``: every such option, its default included, arrived as None.

    ``typer.Option(parser=Solver.parser("--solver"))`` reports an unknown value as the other
    option errors read, "--solver must be one of auto, exact, bbmm, got 'svd'", instead of
    typer's "Value error, 'svd' is not one of ...". The help still lists the values.
    """

    @classmethod
    def parser(cls, option: str):
        def parse(value):
            try:
                return cls(value)
            except ValueError:
                choices = ", ".join(choice.value for choice in cls)
                raise UsageError(f"{option} must be one of {choices}, got {value!r}") from None

        return parse


class OneLineErrors(TyperGroup):
    """The root command: usage errors (a wrong type, a value out of range, an unknown option) as
    one line with a pointer to ``--help`` instead of click's usage box, a quiet stop when
    the reader of stdout goes away (``scalegp gp predict ... | head -1``), and Ctrl-C or SIGTERM
    at any moment as exit code 130 or 143 with none of the command's files left
    (`.interrupts`)."""

    def main(self, *args, **kwargs):
        with handling_signals():
            try:
                return super().main(*args, **kwargs)
            finally:
                exit_if_interrupted()  # also after an interrupt that was lost

    def make_context(self, *args, **kwargs):
        with _one_line_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        # Subcommands parse their options inside this call, so their errors pass here too.
        with _one_line_errors():
            return super().invoke(ctx)


@contextlib.contextmanager
def _one_line_errors():
    try:
        yield
    except UsageError as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # no arguments: the help, as asked
            raise
        message = " ".join(error.format_message().split())
        if error.ctx is not None:
            message += f" (see '{error.ctx.command_path} --help')"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(error.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(exit_code()) from None  # quietly, as a shell command stops
    except BrokenPipeError:
        # The Python documentation's recipe: later writes (and the flush at exit) go to devnull,
        # so no second error is printed. A stdout without a file (a test's) needs nothing.
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stdout = sys.stdout.fileno()
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout)
        raise typer.Exit(1) from None


def _show_warnings(caught, quiet: bool) -> None:
    """Library warnings (e.g. an optimiser that hit its iteration limit) as one line each."""
    if quiet:
        return
    for message in dict.fromkeys(" ".join(str(w.message).split()) for w in caught):
        typer.echo(f"warning: {message}", err=True)


def shows_progress(quiet: bool) -> bool:
    """Progress goes to stderr, and only when it is a terminal and the user did not ask for
    quiet: piped or logged runs stay clean."""
    return not quiet and sys.stderr.isatty()


@contextlib.contextmanager
def status(message: str, quiet: bool):
    """A spinner with the elapsed time on stderr while a step runs (rich, which typer ships
    with); nothing when progress is off. A step's start is a safe point for a lost interrupt
    (`.interrupts`)."""
    raise_if_interrupted()
    if not shows_progress(quiet):
        yield
        return
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:  # typer-slim without rich: one line instead of a spinner
        typer.echo(f"{message} ...", err=True)
        yield
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        progress.add_task(message, total=None)
        yield


class Stopwatch:
    def __init__(self):
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


def print_summary(summary: dict, json_output: bool, quiet: bool, formatter) -> None:
    """The summary as JSON on stdout (``--json``), as text, or not at all (``--quiet``); not
    after an interrupt (`.interrupts`), whose exit removes the outputs it would name."""
    raise_if_interrupted()
    if json_output:
        typer.echo(json.dumps(summary, indent=2))
    elif not quiet:
        typer.echo(formatter(summary))


def parse_columns(text: str | None, option: str = "--columns") -> list[str] | None:
    """``"a,b,c"`` -> ``["a", "b", "c"]``; None stays None. ``option`` names the option in
    errors."""
    if text is None:
        return None
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise CLIError(f"{option} {text!r} has an empty name; give names or indices separated "
                       f"by commas, e.g. {option} x,y or {option} 0,2")
    return names
