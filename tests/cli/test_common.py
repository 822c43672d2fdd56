"""cli.common: the options with a fixed set of values."""

import pytest

from scalegp.cli.common import Choice
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
