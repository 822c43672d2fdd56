"""The `scalegp` command line. Thin commands over the public API; more commands land with the
estimators (see the README)."""

from __future__ import annotations

import platform
from typing import Annotated

import typer

app = typer.Typer(
    help="Gaussian processes and kernel density estimation at scale.",
    no_args_is_help=True,
    add_completion=False,
)


def _version_callback(value: bool):
    if value:
        import scalegp

        typer.echo(f"scalegp {scalegp.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
):
    """Gaussian processes and kernel density estimation at scale."""


@app.command()
def info(
    n: Annotated[int, typer.Option(help="Problem size (n = m) for which to show the auto choice.")] = 16384,
    d: Annotated[int, typer.Option(help="Dimensions for the auto choice.")] = 8,
):
    """Versions, JAX backend and devices, which kernel implementations run here, what auto picks.

    Example: scalegp info --n 65536
    """
    import jax
    import numpy as np
    import scipy
    import sklearn

    import scalegp
    from scalegp.ops import auto_config, available_implementations

    typer.echo(f"scalegp {scalegp.__version__}, python {platform.python_version()}")
    typer.echo(f"jax {jax.__version__}, numpy {np.__version__}, scipy {scipy.__version__}, scikit-learn {sklearn.__version__}")
    typer.echo(f"backend: {jax.default_backend()}; devices: {', '.join(str(x) for x in jax.devices())}")
    for impl, how in available_implementations().items():
        typer.echo(f"  {impl:7s} {how}")
    impl, tiles = auto_config(n, n, d)
    typer.echo(f"auto at n = m = {n}, d = {d}: {impl}" + (f" ({tiles})" if tiles else ""))


def main():
    app()
