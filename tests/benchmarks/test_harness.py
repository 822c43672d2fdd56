"""harness.py: the pieces every runner shares (child processes, timers, the results file)."""

import json
import math
import os
import time

import numpy as np
import pytest

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


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="samples /proc (Linux)")
def test_rss_sampler_sees_a_large_allocation_in_its_window():
    sampler = harness.RssSampler(interval=0.01)
    time.sleep(0.05)
    before = time.perf_counter()
    block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
    time.sleep(0.1)
    after = time.perf_counter()
    del block
    sampler.stop()
    assert sampler.peak_between(before, after) >= sampler.peak_between(0.0, before) + 48
    assert sampler.peak_between(after + 10, after + 20) is None
