"""The runner end to end on tiny configurations: records, timeouts, crashes, out-of-memory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.kmv import options
from benchmarks.kmv.runner import Runner
from benchmarks.kmv.sections import record_head

ROOT = Path(__file__).resolve().parents[2]
TIME_FIELDS = ("compile_s", "inner", "median_ms", "q1_ms", "q3_ms", "peak_mb")


def spec(impl="numpy_dense", mode="fwd", n=64, timeout=60, **extra):
    return {"kind": "time", "family": "kernel_mv", "impl": impl, "mode": mode, "batch": 1,
            "n": n, "m": n, "dim": 2, "out": 3, "repeats": 2, "sample_budget_s": 0.2,
            "timeout": timeout, "seed": 0, "measure_peak": True, **extra}


@pytest.fixture
def runner(tmp_path):
    return Runner(options.parse(["--device", "cpu", "--mem-limit-gb", "2"]), tmp_path)


def test_cli_writes_records_in_the_rtx3090_schema(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "benchmarks/kernel_mv.py", "--sections", "grid", "--sizes", "48",
           "--dims", "2", "--outs", "3", "--impls", "xla", "numpy_dense", "--repeats", "2",
           "--sample-budget-s", "0.2", "--quiet", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=240)
    doc = json.loads(out.read_text())
    assert doc["device"]["backend"] == "cpu" and doc["device"]["cpu_count"] >= 1
    assert doc["config"]["runs"]["r.json"]["sizes"] == [48]
    rows = {(r["impl"], r["mode"]): r for r in doc["results"]}
    assert set(rows) == {(i, m) for i in ("xla", "numpy_dense") for m in ("fwd", "fwd_bwd")}
    xla = rows[("xla", "fwd_bwd")]
    assert list(xla)[:8] == ["family", "impl", "mode", "batch", "n", "m", "dim", "out"]
    assert all(k in xla for k in TIME_FIELDS + ("xla_temp_mb", "xla_arg_mb", "xla_out_mb"))
    assert set(xla["rel_err"]) == {"dq", "dk", "dv", "dlengthscale"}
    assert max(xla["rel_err"].values()) < 1e-4
    assert rows[("numpy_dense", "fwd")]["rel_err"] < 1e-5
    assert "| fwd_bwd | 48 | 2 | 3 |" in report.render(doc)


#: A child that starts its configuration and never finishes it, however fast the machine.
HANGING_CHILD = ("import sys, time\n"
                 "with open(sys.argv[1], 'a') as f:\n"
                 "    f.write('{\"start\": 0}\\n')\n"
                 "time.sleep(600)\n")


def test_timeout_becomes_an_error_row_and_the_group_goes_on(runner):
    commands = iter([lambda spec_path, out_path: [sys.executable, "-c", HANGING_CHILD,
                                                  str(out_path)],
                     runner.child_command])
    runner.child_command = lambda *paths: next(commands)(*paths)
    slow = spec(n=2048, mode="fwd_bwd", timeout=0.05)
    (first,), (second,) = runner.run([slow, spec()])
    assert first == {**record_head(slow), "error": "timeout>0.05s"}
    assert "median_ms" in second and "error" not in second


def test_out_of_memory_becomes_an_error_row(runner):
    (row,) = runner.run([spec(n=32768)])[0]  # a 4 GiB kernel matrix under a 2 GiB limit
    assert "MemoryError" in row["error"] or "allocate" in row["error"]
    assert report.error_cell(row["error"]) == "OOM"


def test_a_crashing_child_becomes_an_error_row(runner):
    runner.child_command = lambda *paths: [
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    (row,) = runner.run([spec()])[0]
    assert row["error"].startswith("child killed by SIGSEGV")
    assert row["impl"] == "numpy_dense"


def test_spent_budget_skips(tmp_path):
    r = Runner(options.parse(["--device", "cpu", "--max-total-s", "1e-9"]), tmp_path)
    (row,) = r.run([spec()])[0]
    assert row["error"].startswith("skipped")
    assert report.error_cell(row["error"]) == "skip"


def test_presets_and_overrides():
    quick = options.parse(["--device", "cpu"])
    assert "pallas" not in quick.impls and quick.max_total_s < 900
    gpu = options.parse(["--device", "gpu", "--sizes", "1024,4096", "--tiles", "64,64,16"])
    assert gpu.sizes == [1024, 4096] and gpu.tiles == [(64, 64, 16)]
    assert gpu.impls[0] == "pallas" and gpu.tile_impl == "pallas"
    with pytest.raises(SystemExit):
        options.parse(["--impls", "nonsense"])
