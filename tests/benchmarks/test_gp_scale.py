"""gp_scale.py and gp_profile.py: the baseline comparison, phase parsing and objective counts on
tiny configurations."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gp_profile, gp_scale

ROOT = Path(__file__).resolve().parents[2]


def test_phases_ignore_text_after_the_message_start():
    records = [(1.0, 0.5, "exact fit (start 0) iter 1: NLML 3, CG iterations 0"),
               (2.0, 1.5, "exact fit (start 0) iter 2: NLML 2, CG iterations 0, 0.3 s"),
               (5.0, 4.0, ("BBMM fit on all data iter 1: NLML 1, CG iterations 12, 2.0 s, "
                           "at most ~4 s left (fit so far 5.0 s)")),
               (6.0, 5.0, "final solve ...")]
    subset_end, full_end = gp_scale.phase_split(records, (0.0, 0.0), (7.0, 6.0))
    assert subset_end[0] == 2.0 and full_end[0] == 5.0
    assert gp_scale.cg_iterations([m for *_, m in records]) == [0, 0, 12, None]
    assert gp_scale.phase_split([], (0.0, 0.0), (7.0, 6.0)) == ((0.0, 0.0), (0.0, 0.0))


def _row(total, fit, rmse=0.1, nll=-0.8):
    return {"n": 8, "total_s": total, "fit_s": fit, "rmse": rmse, "nll": nll,
            "log_marginal_likelihood": 10.0, "phases": {"subset_s": fit / 2, "full_s": fit / 2},
            "objective_evaluations": {"subset": {"calls": 4, "evaluations": 3}}}


def test_repeats_keep_the_median_run_and_compare_by_medians():
    row = gp_scale._median_row([_row(3.0, 2.0), _row(1.0, 0.5), _row(2.0, 1.0)])
    assert row["total_s"] == 2.0 and row["median_total_s"] == 2.0
    assert [r["total_s"] for r in row["repeats"]] == [3.0, 1.0, 2.0]
    c = gp_scale.compare(_row(1.0, 0.5, rmse=0.2, nll=-0.9), _row(4.0, 1.0))
    assert c["total_speedup"] == 4.0 and c["fit_speedup"] == 2.0
    assert c["rmse_ratio"] == 2.0 and c["nll_diff"] == pytest.approx(-0.1)
    assert c["phase_speedup"] == {"subset_s": 2.0, "full_s": 2.0}
    assert c["objective_evaluations"]["baseline"] == {"subset": 3}
    assert "error" in gp_scale.compare({"error": "timeout"}, _row(1.0, 1.0))
    failed = gp_scale._median_row([_row(1.0, 1.0), {"n": 8, "error": "boom"}])
    assert failed["error"] == "boom" and len(failed["repeats"]) == 2


def test_objective_counts_split_a_phase_by_its_numbers_of_points():
    counter = object.__new__(gp_scale.ObjectiveCounter)  # no patching of Objective here
    counter.note, counter.objectives = None, {}
    counter.calls = [("subset", 48, 0.5, None), ("subset", 48, 0.1, None),
                     ("subset", 96, 0.9, None), ("full", 96, 2.0, 12)]
    summary = counter.summary()
    assert summary["subset n=48"]["calls"] == 2 and summary["subset n=96"]["calls"] == 1
    assert summary["subset n=48"]["first_s"] == 0.5 and summary["full"]["n"] == 96


@pytest.mark.slow
def test_baseline_tree_is_imported_in_its_child(tmp_path):
    """The baseline row comes from a copy of scalegp elsewhere (no git there), on the exact
    path; both rows have the same settings and count the objective's evaluations."""
    tree = tmp_path / "old"
    shutil.copytree(ROOT / "scalegp", tree / "scalegp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "r.json"
    cmd = [sys.executable, "benchmarks/gp_scale.py", "--n", "96", "--num-test", "16",
           "--skip-peers", "--baseline-tree", str(tree), "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600, capture_output=True)
    doc = json.loads(out.read_text())
    current, baseline = doc["scalegp"], doc["baseline"]
    assert "error" not in current and "error" not in baseline
    assert current["scalegp_file"] == str(ROOT / "scalegp" / "__init__.py")
    assert baseline["scalegp_file"] == str((tree / "scalegp" / "__init__.py").resolve())
    assert baseline["scalegp_commit"] is None and current["scalegp_commit"]
    assert current["settings"] == baseline["settings"] and current["solver"] == "exact"
    assert current["rmse"] == pytest.approx(baseline["rmse"], rel=1e-4)
    evals = current["objective_evaluations"]["subset"]  # 96 <= subset_size: all data at once
    assert evals["n"] == 96 and 1 <= evals["evaluations"] <= evals["calls"]
    assert doc["speedup_vs_baseline"] == doc["baseline_comparison"]["total_speedup"] > 0
    assert "sklearn" not in doc and "gpytorch" not in doc
    assert doc["baseline"]["order"] == 0 and doc["scalegp"]["order"] == 1


@pytest.mark.slow
def test_profile_sections_and_error_entries(tmp_path, monkeypatch):
    """Two cheap sections at a tiny n; the BBMM sections run without error entries; a component
    whose internals are missing is an error entry, not a crash."""
    out = tmp_path / "p.json"
    argv = ["--n", "64", "--sections", "kernel_mv", "exact", "--columns", "1", "3",
            "--exact-sizes", "32", "--repeats", "1", "--out", str(out)]
    assert gp_profile.main(argv) == 0
    doc = json.loads(out.read_text())
    names = [c["component"] for c in doc["components"]]
    assert names == ["kernel_mv t=1", "kernel_mv t=3", "exact objective+grad m=32",
                     "jnp.linalg.cholesky m=32"]
    assert all(c["steady_s"] > 0 and c["first_s"] > 0 for c in doc["components"])
    assert doc["scalegp"]["scalegp_file"] == str(ROOT / "scalegp" / "__init__.py")
    assert doc["command"].endswith(" ".join(argv))

    def broken(args, x, y, params):
        yield "missing", lambda: params.no_such_attribute, lambda out: {}

    for section in ("objective", "alpha", "love"):  # the BBMM internals they call still exist
        assert "error" not in gp_profile.run_section(section, _tiny_args())["components"][0]
    monkeypatch.setitem(gp_profile.COMPONENTS, "love", broken)
    result = gp_profile.run_section("love", _tiny_args())
    assert result["components"][0]["error"].startswith("AttributeError")


def _tiny_args():
    return argparse.Namespace(n=32, d=2, outputscale=1.0, lengthscale=[1.0], noise=0.1,
                              repeats=1, budget_s=1.0)


def test_short_lengthscale_data_is_a_unit_variance_draw_on_the_unit_cube():
    x, y, x_test, y_test = gp_scale.make_short_data(3000, 2, 500, lengthscale=0.01)
    assert x.shape == (3000, 2) and x_test.shape == (500, 2) and y.shape == (3000,)
    assert x.min() >= 0 and x.max() <= 1
    assert 0.5 < y.var() < 1.6  # f has unit variance, the noise 0.01
    args = argparse.Namespace(data="short", d=2, num_test=500, data_lengthscale=0.01)
    again = gp_scale.data_for(3000, args)
    assert all((a == b).all() for a, b in zip((x, y, x_test, y_test), again))
