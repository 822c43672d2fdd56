import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from scalegp.cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("scalegp ")


def test_info_reports_backend_and_auto_choice():
    result = runner.invoke(app, ["info", "--n", "65536", "--d", "4"])
    assert result.exit_code == 0, result.output
    assert "backend: cpu" in result.output
    assert "triton  interpret mode" in result.output
    assert "pallas  triton: interpret mode" in result.output  # what "pallas" means here
    assert "auto for 65536 keys of d = 4: xla" in result.output


def test_info_compiles_nothing(caplog):
    jax.clear_caches()  # a program compiled by an earlier test would not show
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        result = runner.invoke(app, ["info"])
        jax.jit(lambda x: x + 1)(1.0)  # the control: a compilation is seen
    assert result.exit_code == 0, result.output
    compiled = [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
    assert compiled and all("<lambda>" in message for message in compiled), compiled


def test_help_imports_no_jax_and_sets_up_the_cache(tmp_path):
    # main() ends the process (cli.interrupts.run_executable): the report runs at exit
    code = textwrap.dedent("""
        import atexit, os, sys
        from scalegp.cli.app import main

        def report():
            heavy = sorted(m for m in ("jax", "jaxlib", "scipy", "sklearn") if m in sys.modules)
            print("heavy:", heavy, "cache:", os.environ.get("JAX_COMPILATION_CACHE_DIR"))

        atexit.register(report)
        sys.argv = ["scalegp", "--help"]
        main()
    """)
    env = {**os.environ, "SCALEGP_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
    assert f"heavy: [] cache: {tmp_path / 'cache'}" in result.stdout


def test_every_command_has_help_with_examples():
    for command in (["kde"], ["gp", "fit"], ["gp", "predict"], ["bench"]):
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0, result.output
        assert "Examples" in result.output and "scalegp " in result.output


def test_bench_passes_options_to_the_runner():
    result = subprocess.run(
        [sys.executable, "-m", "scalegp", "bench", "--sections", "grid", "--sizes", "256",
         "--dims", "2", "--outs", "1", "--list"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "grid: " in result.stdout and "configurations" in result.stdout


def test_bench_without_a_runner_names_the_command(monkeypatch):
    from scalegp.cli import app as app_module

    monkeypatch.setattr(app_module, "find_benchmark_runner", lambda: None)  # an installed package
    result = runner.invoke(app, ["bench"])
    assert result.exit_code == 2
    assert "python benchmarks/kernel_mv.py --device cpu" in result.stderr


def test_bench_with_a_runner_that_is_not_there_says_so(tmp_path):
    # it once answered "(or pass --runner PATH)" to a --runner PATH
    for path, problem in ((tmp_path / "missing.py", "does not exist"),
                          (tmp_path, "is not a file")):
        result = runner.invoke(app, ["bench", "--runner", str(path)])
        assert result.exit_code == 2
        assert result.stderr == (f"error: --runner {str(path)!r} {problem}; give the path of "
                                 "benchmarks/kernel_mv.py in a clone of the scalegp "
                                 "repository\n")


def test_installed_entry_point_and_python_m_agree():
    entry = shutil.which("scalegp")
    assert entry is not None, "the scalegp console script is not installed (pip install -e .)"
    outputs = [
        subprocess.run(command, capture_output=True, text=True, timeout=120)
        for command in ([entry, "--version"], [sys.executable, "-m", "scalegp", "--version"])
    ]
    assert all(o.returncode == 0 for o in outputs)
    assert outputs[0].stdout == outputs[1].stdout and outputs[0].stdout.startswith("scalegp ")


def test_errors_from_the_installed_command_are_one_line(tmp_path):
    bad = tmp_path / "cube.npy"
    np.save(bad, np.zeros((2, 2, 2)))
    result = subprocess.run([sys.executable, "-m", "scalegp", "kde", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {bad} has 3 dimensions, shape (2, 2, 2); expected a table of shape (points, "
        "features) or a 1-D array of points"
    ]


def test_bench_runs_only_the_runner_of_this_checkout(tmp_path):
    from scalegp.cli.app import find_benchmark_runner

    # an installed package (site-packages/scalegp/cli) under a folder with a planted runner
    planted = tmp_path / "benchmarks" / "kernel_mv.py"
    planted.parent.mkdir()
    planted.write_text("raise SystemExit('planted runner ran')\n")
    installed = tmp_path / "site-packages" / "scalegp" / "cli"
    installed.mkdir(parents=True)
    assert find_benchmark_runner(installed) is None
    # a look-alike checkout whose scalegp/ is not the package imported
    fake = tmp_path / "other"
    (fake / "cli").mkdir(parents=True)
    (fake / "scalegp").mkdir()
    (fake / "pyproject.toml").write_text('[project]\nname = "scalegp"\n')
    (fake / "benchmarks").mkdir()
    (fake / "benchmarks" / "kernel_mv.py").write_text("raise SystemExit(1)\n")
    assert find_benchmark_runner(fake / "cli") is None
    assert find_benchmark_runner() == ROOT / "benchmarks" / "kernel_mv.py"


@pytest.mark.parametrize("args, option", [
    (["kde", "x.csv", "--sample", "many"], "--sample"),
    (["kde", "x.csv", "--sample", "-1"], "--sample"),
    (["gp", "fit", "x.csv", "--max-iter", "1.5"], "--max-iter"),
    (["gp", "fit", "x.csv", "--subset-size", "1"], "--subset-size"),
    (["gp", "fit", "x.csv", "--solver", "svd"], "--solver must be one of auto, exact, bbmm"),
    (["kde", "x.csv", "--scale", "minmax"], "--scale must be one of none, standardize, covariance"),
    (["info", "--n", "big"], "--n"),
    (["kde", "x.csv", "--no-such-option"], "--no-such-option"),
])
def test_option_errors_are_one_line_exit_2_with_a_pointer_to_help(args, option):
    result = runner.invoke(app, args, prog_name="scalegp")
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    command = " ".join(a for a in args[:2] if not a.endswith(".csv") and not a.startswith("-"))
    assert line.startswith("error: ") and option in line
    assert line.endswith(f"(see 'scalegp {command} --help')")


def test_no_arguments_still_show_the_help():
    result = runner.invoke(app, ["gp"], prog_name="scalegp")
    assert "Usage: scalegp gp" in result.output and "predict" in result.output
