import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from scalegp import ScalableKernelDensity
from scalegp.cli import kde as kde_command
from scalegp.cli.app import app
from scalegp.kde import FittedKDE

runner = CliRunner()
MACRO = Path(__file__).parents[2] / "examples" / "data" / "us_macro_quarterly.csv"


def invoke(*args):
    return runner.invoke(app, ["kde", *map(str, args)])


@pytest.fixture
def points(tmp_path):
    x = np.random.default_rng(0).normal(size=(150, 2)) * [1.0, 3.0] + [0.0, 10.0]
    path = tmp_path / "points.npy"
    np.save(path, x)
    return path, x


def test_summary_and_log_densities_match_the_estimator(points, tmp_path):
    path, x = points
    out = tmp_path / "logp.csv"
    result = invoke(path, "--bandwidth", "scott", "--out", out)
    assert result.exit_code == 0, result.output
    assert "150 points x 2 dimensions" in result.stdout
    assert "by scott" in result.stdout and f"wrote log_density: {out}" in result.stdout
    want = ScalableKernelDensity(bandwidth="scott", scale="standardize").fit(x).score_samples(x)
    written = np.loadtxt(out, delimiter=",", skiprows=1)
    np.testing.assert_allclose(written, want, rtol=1e-6)
    assert f"mean log-likelihood of the data: {np.mean(want):.4f}" in result.stdout


def test_json_summary_with_cv_bandwidth_on_bundled_data():
    result = invoke(MACRO, "--columns", "unemp,infl", "--json", "--scale", "none")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["points"] == 203 and summary["columns"] == ["unemp", "infl"]
    assert summary["bandwidth_rule"] == "cv" and summary["cv_converged"] is True
    assert 0.1 < summary["bandwidth"] < 3.0
    # leave-one-out likelihood is below the in-sample one
    assert summary["loo_mean_log_likelihood"] < summary["mean_log_likelihood"] < 0


def test_the_command_imports_neither_scikit_learn_nor_scipy(tmp_path):
    # these imports would be most of a run whose programs come from the compilation cache
    # (docs/decisions.md #33): the command fits through scalegp.kde, not the estimator, a scalar
    # cv bandwidth needs no L-BFGS-B, and the command bounds no LAPACK
    # main() ends the process (cli.interrupts.run_executable): the report runs at exit
    code = textwrap.dedent(f"""
        import atexit, sys
        from scalegp.cli.app import main

        def report():
            heavy = ("sklearn", "scipy.linalg", "scipy.optimize", "scipy.stats")
            print("imported:", [m for m in heavy if m in sys.modules])

        atexit.register(report)
        sys.argv = ["scalegp", "kde", {str(MACRO)!r}, "--columns", "unemp,infl", "--quiet"]
        main()
    """)
    env = {**os.environ, "SCALEGP_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "imported: []" in result.stdout


def test_the_backends_start_before_the_library_is_imported_and_the_data_read(
        points, monkeypatch):
    # decisions #67: a TPU client's start (seconds) overlaps the command's own work
    path, _ = points
    calls = []
    read_table = kde_command.read_table
    monkeypatch.setattr(kde_command, "start_backends_early", lambda: calls.append("start"))
    monkeypatch.setattr(kde_command, "_parse_bandwidth", lambda text: calls.append(text) or text)
    monkeypatch.setattr(kde_command, "read_table",
                        lambda *args, **kw: calls.append("read") or read_table(*args, **kw))
    result = invoke(path, "--bandwidth", "scott", "--quiet")
    assert result.exit_code == 0, result.output
    assert calls == ["start", "scott", "read"]


def test_cv_bandwidth_and_draws_match_the_estimator(tmp_path):
    draws = tmp_path / "draws.npy"
    result = invoke(MACRO, "--columns", "unemp,infl", "--json", "--seed", 4, "--sample", 9,
                    "--sample-out", draws)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    table = np.genfromtxt(MACRO, delimiter=",", names=True)
    x = np.column_stack([table["unemp"], table["infl"]])
    want = ScalableKernelDensity(bandwidth="cv", scale="standardize", random_state=4,
                                 dtype="float32").fit(x)
    assert summary["bandwidth"] == pytest.approx(want.bandwidth_, rel=1e-6)
    np.testing.assert_allclose(np.load(draws), want.sample(9, random_state=4), rtol=1e-6)


def test_query_sample_and_per_column_bandwidth(points, tmp_path):
    path, x = points
    query = tmp_path / "query.npy"
    np.save(query, x[:7] + 0.5)
    out, draws = tmp_path / "q.npy", tmp_path / "draws.csv"
    result = invoke(path, "--bandwidth", "0.3,0.9", "--scale", "none", "--query", query,
                    "--out", out, "--sample", 25, "--sample-out", draws, "--seed", 3, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # --quiet
    kde = ScalableKernelDensity(bandwidth=np.array([0.3, 0.9])).fit(x)
    np.testing.assert_allclose(np.load(out), kde.score_samples(x[:7] + 0.5), rtol=1e-6)
    sample = np.loadtxt(draws, delimiter=",", skiprows=1)
    assert sample.shape == (25, 2)
    np.testing.assert_allclose(sample, kde.sample(25, random_state=3))
    assert draws.read_text().splitlines()[0] == "0,1"


def test_plot_1d_and_2d(tmp_path):
    pytest.importorskip("matplotlib")
    for columns in ("unemp", "unemp,infl"):
        png = tmp_path / f"{len(columns)}.png"
        result = invoke(MACRO, "--columns", columns, "--bandwidth", "silverman", "--plot", png)
        assert result.exit_code == 0, result.output
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_refuses_three_dimensions_before_any_work(tmp_path):
    result = invoke(MACRO, "--columns", "unemp,infl,realint", "--plot", tmp_path / "p.png")
    assert result.exit_code == 2
    assert "--plot draws 1-D or 2-D data; this data has 3 columns" in result.stderr
    assert not (tmp_path / "p.png").exists()


def write_bad(tmp_path, kind):
    if kind == "non-numeric":
        path = tmp_path / "bad.csv"
        path.write_text("x,name\n1,a\n2,b\n")
    elif kind == "nan rows":
        path = tmp_path / "bad.csv"
        path.write_text("x,y\n1,2\n3,nan\n")
    elif kind == "3-d":
        path = tmp_path / "bad.npy"
        np.save(path, np.zeros((2, 2, 2)))
    elif kind == "empty":
        path = tmp_path / "bad.csv"
        path.write_text("")
    elif kind == "missing path":
        path = tmp_path / "nowhere.npy"
    elif kind == "directory":
        path = tmp_path / "folder.npy"
        path.mkdir()
    return path


BAD = {
    "non-numeric": "column 'name' is not numeric",
    "nan rows": "1 of 2 rows have missing values",
    "3-d": "has 3 dimensions",
    "empty": "is empty",
    "missing path": "does not exist",
    "directory": "is a directory",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, kind):
    path = write_bad(tmp_path, kind)
    out = tmp_path / "out.npy"
    result = invoke(path, "--out", out, "--bandwidth", "scott")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and BAD[kind] in result.stderr
    assert str(path) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not out.exists()


def test_debug_shows_the_traceback(tmp_path):
    result = invoke(write_bad(tmp_path, "3-d"), "--debug")
    assert result.exit_code != 0 and result.exception is not None
    assert "has 3 dimensions" in str(result.exception)


def test_existing_output_needs_force_and_input_is_never_overwritten(points, tmp_path):
    path, _ = points
    out = tmp_path / "logp.npy"
    out.write_bytes(b"keep me")
    result = invoke(path, "--bandwidth", "scott", "--out", out)
    assert result.exit_code == 2 and "exists; pass --force" in result.stderr
    assert out.read_bytes() == b"keep me"
    result = invoke(path, "--bandwidth", "scott", "--out", path, "--force")
    assert result.exit_code == 2 and "is an input file" in result.stderr
    result = invoke(path, "--bandwidth", "scott", "--out", out, "--force")
    assert result.exit_code == 0 and np.load(out).shape == (150,)


@pytest.mark.parametrize("args, message", [
    (["--bandwidth", "wide"], "--bandwidth 'wide'"),
    (["--bandwidth", "-1"], "must be positive"),
    (["--scale", "minmax"], "--scale must be one of"),
    (["--sample", "5"], "--sample needs --sample-out"),
    (["--out", "x.txt"], "ending in .npy or .csv"),
    (["--missing", "zero"], "--missing must be one of"),
])
def test_bad_options(points, args, message):
    result = invoke(points[0], *args)
    assert result.exit_code == 2 and message in result.stderr, result.output


def unwritable_folders(tmp_path):
    """Destinations whose folder takes no new file, for root too (permission bits alone do not
    stop root)."""
    (tmp_path / "a-file").write_text("")
    cases = {"parent is a file": (tmp_path / "a-file" / "s.csv", "is not a folder"),
             "missing folder": (tmp_path / "nowhere" / "s.csv", "does not exist"),
             "name too long": (tmp_path / ("s" * 300 + ".csv"), "cannot create a file")}
    if Path("/proc/self").is_dir():  # Linux: a folder that os.access calls writable for root
        cases["/proc"] = (Path("/proc/scalegp-test.csv"), "cannot create a file")
    if os.geteuid() != 0:
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        cases["read-only folder"] = (read_only / "s.csv", "cannot create a file")
    return cases


def test_every_destination_is_checked_before_the_fit(points, tmp_path, monkeypatch):
    path, _ = points
    monkeypatch.setattr(kde_command._Model, "fit", lambda *a: pytest.fail("fit ran"))
    cases = unwritable_folders(tmp_path)
    before = sorted(tmp_path.iterdir())
    for case, (sample_out, message) in cases.items():
        result = invoke(path, "--bandwidth", "scott", "--out", tmp_path / "o.npy",
                        "--sample", 5, "--sample-out", sample_out)
        assert result.exit_code == 2, (case, result.output)
        assert f"--sample-out {str(sample_out)!r}" in result.stderr and message in result.stderr
        assert sorted(tmp_path.iterdir()) == before, case


@pytest.mark.parametrize("suffix", [".npy", ".csv"])
def test_samples_beyond_memory_are_refused_before_the_fit(points, tmp_path, monkeypatch,
                                                          suffix):
    # once "internal error (MemoryError)", exit 1, after the fit
    path, _ = points
    monkeypatch.setattr(kde_command._Model, "fit", lambda *a: pytest.fail("fit ran"))
    result = invoke(path, "--bandwidth", "scott", "--sample", 10**12, "--sample-out",
                    tmp_path / f"s{suffix}")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --sample 1000000000000: 1,000,000,000,000 draws of "
                                    "2 features need about ")
    assert len(result.stderr.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["points.npy"]

def test_a_failure_after_the_fit_leaves_no_output(points, tmp_path, monkeypatch):
    path, _ = points

    def fail(*args, **kwargs):
        raise RuntimeError("no draws")

    monkeypatch.setattr(FittedKDE, "sample", fail)
    result = invoke(path, "--bandwidth", "scott", "--out", tmp_path / "o.npy", "--sample", 5,
                    "--sample-out", tmp_path / "s.csv")
    assert result.exit_code == 1 and "no draws" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["points.npy"]


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_file_written_meanwhile_is_not_replaced_without_force(points, tmp_path, monkeypatch,
                                                                hard_links):
    path, _ = points
    out = tmp_path / "o.npy"
    fit = kde_command._Model.fit

    def another_run_writes_out(self, *args):
        out.write_bytes(b"the other run's result")
        return fit(self, *args)

    monkeypatch.setattr(kde_command._Model, "fit", another_run_writes_out)
    if not hard_links:  # e.g. FAT: the name is then claimed with an exclusive create
        def no_link(*args):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    result = invoke(path, "--bandwidth", "scott", "--out", out, "--sample", 5,
                    "--sample-out", tmp_path / "s.csv")
    assert result.exit_code == 2 and f"--out {str(out)!r} exists; pass --force" in result.stderr
    assert out.read_bytes() == b"the other run's result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.npy", "points.npy"]
    result = invoke(path, "--bandwidth", "scott", "--out", out, "--force")
    assert result.exit_code == 0 and np.load(out).shape == (150,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.npy", "points.npy"]


def test_prune_option_reaches_the_estimator(points, tmp_path):
    path, x = points
    out = tmp_path / "logp.npy"
    result = invoke(path, "--bandwidth", "0.3", "--prune", "on", "--prune-tol", "1e-6",
                    "--out", out, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prune"] == "on"
    want = ScalableKernelDensity(bandwidth=0.3, scale="standardize", prune=False).fit(x)
    np.testing.assert_allclose(np.load(out), want.score_samples(x), rtol=1e-5, atol=1e-5)
    result = invoke(path, "--prune", "sometimes")
    assert result.exit_code != 0 and "--prune must be one of auto, on, off" in result.output


def test_wide_data_summary_lists_a_few_columns(tmp_path):
    # 10 points in 5,000 features: the summary named every column, the cv bandwidth compiled for
    # minutes (tests/kde/test_cv.py::test_cv_on_wide_data_completes_and_matches_float64)
    path = tmp_path / "wide.npy"
    np.save(path, np.random.default_rng(3).normal(size=(10, 300)))
    result = invoke(path, "--bandwidth", "scott")
    assert result.exit_code == 0, result.output
    data_line = result.stdout.splitlines()[0]
    assert data_line.endswith("(10 points x 300 dimensions: 0, 1, 2, 3, 4, 5, ..., 298, 299)")


def test_float64_without_the_global_switch(points, tmp_path):
    """--float64 computes in float64 (the estimator's dtype) and leaves JAX's x64 mode off."""
    import jax

    path, x = points
    out = tmp_path / "logp.npy"
    result = invoke(path, "--bandwidth", "scott", "--float64", "--out", out)
    assert result.exit_code == 0, result.output
    assert not jax.config.jax_enable_x64
    written = np.load(out)
    want = ScalableKernelDensity(bandwidth="scott", scale="standardize",
                                 dtype="float64").fit(x).score_samples(x)
    assert want.dtype == np.float64
    np.testing.assert_allclose(written, want, rtol=1e-12)
    single = ScalableKernelDensity(bandwidth="scott", scale="standardize").fit(x)
    assert np.max(np.abs(single.score_samples(x) - want)) > 1e-12  # float32 is not float64


@pytest.mark.parametrize("args", [[MACRO, "--columns", "unemp,infl"],
                                  [MACRO, "--columns", "unemp,infl", "--scale", "none"],
                                  [MACRO.with_name("co2_weekly.csv")]])
def test_the_bundled_data_raise_no_data_warning(args):
    """The quick start's KDE (also unscaled) and the other bundled file: the cross-validation
    finds no far rows, flat layout or stacks there (issue 58)."""
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "warning:" not in result.stderr, result.stderr


def test_out_scores_stacked_copies_as_one_key_each(tmp_path, monkeypatch):
    """--out on rows holding three distinct values (issue 58: at 10^6 rows it compared every row
    with every other and ran past 360 s) scores the three, and writes the float64 definition's
    log-densities of every row."""
    from scalegp.kde import _fitted

    x = np.repeat([[0.0], [1.0], [5.0]], 10_000, axis=0)
    data, out = tmp_path / "d.npy", tmp_path / "o.npy"
    np.save(data, x)
    sums = []
    score = _fitted.engine_log_density
    monkeypatch.setattr(_fitted, "engine_log_density", lambda engine, queries, keys, *args,
                        **kwargs: sums.append((len(queries), len(keys)))
                        or score(engine, queries, keys, *args, **kwargs))
    result = invoke(data, "--bandwidth", "cv", "--out", out, "--json")
    assert result.exit_code == 0, result.output
    assert sums == [(3, 3)] and "warning:" not in result.stderr
    h = json.loads(result.stdout)["bandwidth"]
    values = np.array([0.0, 1.0, 5.0])
    z = (values - x.mean()) / x.std(ddof=1)
    sq = ((z[:, None] - z[None, :]) / h) ** 2
    reference = (np.log(np.exp(-0.5 * sq).sum(axis=1) / 3) - 0.5 * np.log(2 * np.pi) - np.log(h)
                 - np.log(x.std(ddof=1)))
    np.testing.assert_allclose(np.load(out), np.repeat(reference, 10_000), rtol=1e-6)
