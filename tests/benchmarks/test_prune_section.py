"""kde_speed.py's prune section at --quick sizes: every row of the three problems is written,
with its timings, its errors against float64 and the summary's ratios (peers that are not
installed are rows that say so)."""

import json
import math

import numpy as np
import pytest

from benchmarks import kde_speed


@pytest.mark.slow
def test_prune_section_quick(tmp_path):
    out = tmp_path / "prune.json"
    argv = ["--quick", "--sections", "prune", "--out", str(out)]
    kde_speed.main(argv)
    doc = json.loads(out.read_text())
    assert doc["command"].endswith(" ".join(argv))
    assert doc["loadavg_start"] is not None and doc["loadavg_end"] is not None
    assert "KDEpy" in doc["machine"]["versions"]
    rows = doc["results"]
    assert {r["section"] for r in rows} == {"prune"}
    by_problem = {}
    for r in rows:
        by_problem.setdefault(r["problem"], {})[r["method"]] = r
    assert set(by_problem) == {"kde_clustered_d2", "gp_kernel_mv_uniform_d2",
                               "gp_kernel_mv_composite_uniform_d2", "kde_no_locality_d32",
                               "kde_cv_check_d2"}

    kde = by_problem["kde_clustered_d2"]
    for prune in ("True", "'auto'", "False"):
        r = kde[f"scalegp rbf_kde_density(prune={prune}, float32)"]
        assert r["first_call_seconds"] > 0 and r["seconds"] > 0 and r["compile_seconds"] >= 0
        assert r["timed_queries"] == doc["config"]["prune_kde_queries"]
        assert r["error_queries"] == doc["config"]["prune_ref"]
        assert r["rel_density_err"] < 1e-2
    pruned = kde["scalegp rbf_kde_density(prune=True, float32)"]
    # against float64 on the same float32 inputs: rounding only, the skipped mass is below it
    assert pruned["max_abs_log_err"] < 1e-4 and pruned["rel_density_err"] < 1e-5
    assert pruned["vs_float64_inputs"]["error_queries"] == doc["config"]["prune_ref"]
    assert "rel_density_err" in pruned["input_rounding_errors"]
    # the cv fit saw all the points, and its fitted model is timed as users score
    assert pruned["bandwidth"] == pruned["cv_bandwidth_on_subsample"] > 0
    assert pruned["cv_subsample_points"] == doc["config"]["prune_kde_n"]
    assert pruned["cv_seconds"] > 0
    fitted = kde["scalegp ScalableKernelDensity(bandwidth='cv').score_samples (prune='auto', "
                 "float32)"]
    assert fitted["seconds"] > 0 and fitted["rel_density_err"] < 1e-5
    peers = [m for m in kde if not m.startswith("scalegp")]
    assert len(peers) == 3  # sklearn, scipy, KDEpy: measured or "skipped"
    for m in peers:
        assert "skipped" in kde[m] or (kde[m]["seconds"] > 0 and "rel_density_err" in kde[m])
    scipy_row = kde["scipy gaussian_kde.logpdf"]
    if "skipped" not in scipy_row:  # kernel covariance h² I, as every other row
        assert scipy_row["max_abs_log_err"] < 1e-9

    # the composite takes coordinate differences; the unpruned RBF the expansion, whose
    # rounding at this short lengthscale is ~1e-4 (issue #17)
    for problem, tol in (("gp_kernel_mv_uniform_d2", 1e-3),
                         ("gp_kernel_mv_composite_uniform_d2", 1e-5)):
        gp = by_problem[problem]
        assert len(gp) == 4
        for r in gp.values():
            assert r["rel_err"] < tol and r["lengthscale"] > 0
        assert sum("seconds_scaled_to_all_rows" in r for r in gp.values()) == 1
        assert doc["summary"]["prune"][problem]["speedup_pruned_vs_unpruned"] > 0

    check = by_problem["kde_cv_check_d2"]
    assert len(check) == 3
    exact = check["scalegp ScalableKernelDensity(bandwidth='cv', prune=False, float64)"]
    pruned_cv = check["scalegp ScalableKernelDensity(bandwidth='cv', prune=True, float32)"]
    assert math.isclose(pruned_cv["rel_diff_to_unpruned_float64"], abs(
        pruned_cv["heldout_mean_loglik"] / exact["heldout_mean_loglik"] - 1), rel_tol=1e-6)
    assert pruned_cv["rel_diff_to_unpruned_float64"] < 1e-5
    assert abs(pruned_cv["bandwidth"] / exact["bandwidth"] - 1) < 1e-3
    for r in check.values():
        assert r["n"] == doc["config"]["prune_cv_check_n"] and r["converged"]

    nl = by_problem["kde_no_locality_d32"]["scalegp rbf_kde_density(prune='auto', float32)"]
    assert len(nl["ratio_to_unpruned_per_round"]) == doc["config"]["prune_nl_repeats"]

    summary = doc["summary"]["prune"]
    assert summary["gp_kernel_mv_uniform_d2"]["speedup_pruned_vs_unpruned"] > 0
    assert math.isfinite(summary["kde_clustered_d2"]["speedup_pruned_vs_unpruned"])
    assert isinstance(summary["kde_no_locality_d32"]["within_10_percent"], bool)


def test_exact_reference_matches_a_dense_evaluation():
    rng = np.random.default_rng(0)
    X, Q, v = rng.uniform(size=(300, 3)), rng.uniform(size=(37, 3)), rng.standard_normal(300)
    e = -0.5 * np.sum((Q[:, None, :] - X[None, :, :]) ** 2, axis=-1) / 0.05**2
    np.testing.assert_allclose(kde_speed.exact_rbf_sums(Q, X, 0.05, v, chunk=8),
                               np.exp(e) @ v, rtol=1e-12, atol=1e-12)
    expected = (np.log(np.mean(np.exp(e), axis=1)) - 1.5 * np.log(2 * np.pi)
                - 3 * np.log(0.05))
    np.testing.assert_allclose(kde_speed.exact_kde_log_density(Q, X, 0.05, chunk=5), expected,
                               rtol=1e-12)
