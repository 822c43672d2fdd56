"""cli.common: the options with a fixed set of values, and errors reported as one line."""

import pytest
import typer

from scalegp.cli.common import Choice, reports_errors
from scalegp.cli.gp import Solver
from scalegp.cli.kde import Prune, Scale


@pytest.mark.parametrize("choice", [Prune, Scale, Solver])
def test_a_choice_reads_as_its_value(choice):
    # typer before 0.29 turns a parsed option back into the enum by its str(): with
    # str(Prune.auto) == "Prune.auto" every such option, its default too, arrived as None
    assert issubclass(choice, Choice)
    for member in choice:
        assert str(member) == member.value
        assert f"{member}" == member.value
        assert choice(str(member)) is member


def test_an_accelerator_held_by_another_process_is_reported_as_one_line(capsys):
    """What a second process gets from JAX when a TPU is taken (libtpu's words): one line
    that says so and what to do, not libtpu's advice to remove its lock file, exit code 1."""
    @reports_errors(lapack=False)
    def command(quiet=False, debug=False):
        raise RuntimeError(
            "Unable to initialize backend 'tpu': ABORTED: Internal error when accessing libtpu "
            "multi-process lockfile. Run \"$ sudo rm /tmp/libtpu_lockfile\". (set "
            "JAX_PLATFORMS='' to automatically choose an available backend)")

    with pytest.raises(typer.Exit) as stopped:
        command()
    assert stopped.value.exit_code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: JAX could not open the accelerator")
    assert "one process at a time" in err and "JAX_PLATFORMS=cpu" in err
    assert "sudo rm" not in err and "internal error" not in err


def test_an_accelerator_out_of_memory_is_reported_as_one_line_of_bad_input(capsys):
    """XLA's RESOURCE_EXHAUSTED (its words on a TPU v5e): the size as the cause and what to
    do, exit code 2 (the problem's size, as a refused request), not an internal error."""
    from jax.errors import JaxRuntimeError

    @reports_errors(lapack=False)
    def command(quiet=False, debug=False):
        raise JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (24.00G) exceeds available HBM (15.75G). More detail follows.")

    with pytest.raises(typer.Exit) as stopped:
        command()
    assert stopped.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the accelerator's memory is too small")
    assert "(24.00G) exceeds available HBM (15.75G)" in err and "JAX_PLATFORMS=cpu" in err
    assert "internal error" not in err and "More detail" not in err
