"""harness.py: the pieces every runner shares (child processes, timers, the results file)."""

import json
import math
import time

from benchmarks import harness


def test_a_child_that_runs_past_its_timeout_becomes_an_error_row():
    row = harness.run_in_child(time.sleep, (60,), timeout=1, head={"n": 7})
    assert row["n"] == 7 and row["error"] == "timeout: not done after 1 s"
    assert 1 <= row["wall_s"] < 30


def test_an_exception_in_the_child_becomes_an_error_row():
    row = harness.run_in_child(math.sqrt, (-1.0,), timeout=60, head={"n": 3})
    assert row["n"] == 3 and row["error"] == "ValueError: math domain error"


def test_quartiles_and_command_line():
    assert harness.quartiles([4, 1, 3, 2, 5]) == (2.0, 3.0, 4.0)
    line = harness.command_line(harness.ROOT / "benchmarks" / "cg_solve.py", ["--n", "a b"])
    assert line == "python benchmarks/cg_solve.py --n 'a b'"


def test_results_are_written_atomically_without_nan(tmp_path):
    path = tmp_path / "sub" / "r.json"
    harness.write_json(path, {"x": math.nan, "y": [1.5, math.inf]})
    assert json.loads(path.read_text()) == {"x": "nan", "y": [1.5, "inf"]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]
