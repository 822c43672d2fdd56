"""The `scalegp` command line: thin commands over scalegp's public API.

    scalegp kde DATA          fit a KDE, summarise, write densities / samples / a plot
    scalegp gp fit DATA       fit a GP, report hyperparameters and held-out error, save a model
    scalegp gp predict M DATA predict with a saved model
    scalegp gp sample M DATA  draw samples from a saved model's posterior
    scalegp bench ...         the benchmark runner (from a source checkout)
    scalegp info              versions, backend, devices, what `auto` picks
"""

from __future__ import annotations

import platform
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Optional

import typer

from scalegp._runtime import configure_command_line

from . import gp
from .common import EXIT_BAD_INPUT, OneLineErrors
from .interrupts import run_executable
from .kde import kde_command

app = typer.Typer(
    cls=OneLineErrors,
    help="Gaussian processes and kernel density estimation at scale.",
    no_args_is_help=True,
    add_completion=False,
)
gp_app = typer.Typer(help="Gaussian-process regression: fit a model, predict with it.",
                     no_args_is_help=True, add_completion=False)


def _version_callback(value: bool):
    if value:
        import scalegp

        typer.echo(f"scalegp {scalegp.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True,
                     help="Print the version and exit."),
    ] = False,
):
    """Gaussian processes and kernel density estimation at scale."""


def info(
    n: Annotated[int, typer.Option(
        help="Number of keys (fitted points) for which to show the auto choice; it does not "
             "depend on the number of queries.")] = 16384,
    d: Annotated[int, typer.Option(help="Dimensions for the auto choice.")] = 8,
):
    """Versions, JAX backend and devices, which kernel implementations run here, what auto picks.

    Example: scalegp info --n 65536
    """
    import jax

    import scalegp
    from scalegp.ops import auto_config, available_implementations

    # Versions from the installed metadata: importing scikit-learn only for its version took
    # seconds. Nothing here compiles.
    numpy, scipy, sklearn = (version(name) for name in ("numpy", "scipy", "scikit-learn"))
    typer.echo(f"scalegp {scalegp.__version__}, python {platform.python_version()}")
    typer.echo(f"jax {jax.__version__}, numpy {numpy}, scipy {scipy}, scikit-learn {sklearn}")
    devices = ", ".join(str(device) for device in jax.devices())
    typer.echo(f"backend: {jax.default_backend()}; devices: {devices}")
    for impl, how in available_implementations().items():
        typer.echo(f"  {impl:7s} {how}")
    impl, tiles = auto_config(n, d)  # the choice depends on the keys alone
    typer.echo(f"auto for {n} keys of d = {d}: {impl} ({tiles})")


def find_benchmark_runner(package_dir: Path = Path(__file__).resolve().parent) -> Path | None:
    """benchmarks/kernel_mv.py of the source checkout this package runs from, else None.

    Only the checkout itself counts (the folder above cli/, as an editable install maps it):
    its pyproject.toml must name this project and its scalegp/ must be the package imported.
    Folders further up are never searched, so a benchmarks/ planted in a parent folder of an
    installed package is not run.
    """
    import scalegp

    root = package_dir.parent
    script = root / "benchmarks" / "kernel_mv.py"
    imported = Path(scalegp.__file__).resolve().parent
    if not script.is_file() or (root / "scalegp").resolve() != imported:
        return None
    try:
        name = tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return None
    return script if name == "scalegp" else None


def bench(
    ctx: typer.Context,
    help_runner: Annotated[bool, typer.Option("--help-runner", help="Show the runner's options.")
                           ] = False,
    runner: Annotated[Optional[Path], typer.Option(
        help="Path to benchmarks/kernel_mv.py (default: found in the source checkout).")] = None,
):
    """Run the kernel-product benchmark (benchmarks/kernel_mv.py) with its own options.

    The runner lives in the source checkout, not in the installed package; every option after
    `bench` is passed to it (see `scalegp bench --help-runner`). Results are JSON in the schema of
    the RTX 3090 benchmark the project started from; `python benchmarks/report.py tables
    RESULT.json` turns them into tables.

    Examples:

      scalegp bench --device cpu

      scalegp bench --sections grid --sizes 1024 --dims 8 --outs 16 --out grid.json

      scalegp bench --device cpu --preset full --out benchmarks/results/kernel_mv_cpu.json
    """
    if runner is not None and not runner.is_file():
        problem = "does not exist" if not runner.exists() else "is not a file"
        typer.echo(f"error: --runner {str(runner)!r} {problem}; give the path of "
                   "benchmarks/kernel_mv.py in a clone of the scalegp repository", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    script = runner or find_benchmark_runner()
    if script is None:
        typer.echo(
            "error: the benchmark runner ships with the source repository, not the installed "
            "package; in a clone of the scalegp repository run: python benchmarks/kernel_mv.py "
            "--device cpu (or pass --runner PATH)",
            err=True,
        )
        raise typer.Exit(EXIT_BAD_INPUT)
    args = ["--help"] if help_runner else list(ctx.args)
    raise typer.Exit(subprocess.call([sys.executable, str(script), *args]))


# Every command, in the order --help lists them; each one's help is its docstring, examples
# included.
app.command("info")(info)
app.command("bench", context_settings={"allow_extra_args": True,
                                       "ignore_unknown_options": True})(bench)
app.command("kde")(kde_command)
gp_app.command("fit")(gp.fit)
gp_app.command("predict")(gp.predict)
gp_app.command("sample")(gp.sample)
app.add_typer(gp_app, name="gp")


def main():
    """The ``scalegp`` executable: JAX's persistent compilation cache on (in
    ``$SCALEGP_CACHE_DIR``, ``off`` to disable; see `scalegp._runtime`), then the command.

    Ctrl-C or SIGTERM ends it within seconds (`.interrupts.DEADLINE`), whatever it is doing (a
    lost KeyboardInterrupt, a long XLA call), with exit code 130 or 143 and none of its files.
    The process ends in `.interrupts.run_executable`, without the interpreter's finalization:
    code after ``main()`` does not run; atexit functions do."""
    run_executable(_command)


def _command():
    problem = configure_command_line()
    if problem:
        typer.echo(f"warning: {problem}", err=True)
    app()
