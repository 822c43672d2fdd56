"""benchmarks/gp_first_fit.py: both fits of one process timed and profiled."""

import json

from benchmarks import gp_first_fit


def test_both_fits_are_timed_with_their_profiles(tmp_path):
    out = tmp_path / "fit.json"
    gp_first_fit.main(["--n", "300", "--profile-rows", "5", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["solver"] == "exact" and record["backend"] == "cpu"
    assert record["first_s"] > 0 and record["second_s"] > 0
    assert record["first_rmse"] == record["second_rmse"] < 0.5
    assert len(record["first_profile"]) == 5 and record["first_profile"][0]["cumulative_s"] > 0
