"""grad_ratio.py on tiny configurations: one row per (impl, shape), ratios from paired rounds."""

import json

from benchmarks import grad_ratio


def test_writes_one_row_per_impl_and_shape(tmp_path):
    out = tmp_path / "ratio.json"
    argv = ["--impls", "xla", "numpy_chunked", "--sizes", "40", "--dims", "2", "--outs", "1", "3",
            "--rounds", "3", "--out", str(out)]
    assert grad_ratio.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["device"]["backend"] == "cpu"
    assert doc["config"]["command"].endswith(" ".join(argv))
    rows = doc["results"]
    assert [(r["impl"], r["out"]) for r in rows] == [
        ("xla", 1), ("xla", 3), ("numpy_chunked", 1), ("numpy_chunked", 3)
    ]
    for r in rows:
        assert r["n"] == r["m"] == 40 and r["dim"] == 2 and r["rounds"] == 3
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert r["ratio_q1"] <= r["ratio"] <= r["ratio_q3"]


def test_kde_family_skips_peers_without_a_gradient(tmp_path):
    out = tmp_path / "ratio.json"
    argv = ["--family", "kde_density", "--impls", "xla", "scipy_kde", "--sizes", "40", "--dims",
            "2", "--outs", "1", "3", "--rounds", "2", "--out", str(out)]
    assert grad_ratio.main(argv) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    assert row["family"] == "kde_density" and row["impl"] == "xla" and row["out"] == 1
    assert doc["config"]["skipped"] == ["scipy_kde: has no fwd_bwd kde_density on the CPU"]
