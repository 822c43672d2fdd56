"""kde_auto_grid.py at --quick sizes: one row per layout, bandwidth and query count, each with
the three modes' times and auto's ratio to the faster of the other two; the summary counts
them."""

import json

import pytest

from benchmarks import kde_auto_grid


@pytest.mark.slow
def test_auto_grid_quick(tmp_path):
    out = tmp_path / "grid.json"
    argv = ["--quick", "--layouts", "clustered", "mixture", "--out", str(out)]
    kde_auto_grid.main(argv)
    doc = json.loads(out.read_text())
    assert doc["command"].endswith(" ".join(argv))
    rows = doc["results"]
    assert {(r["layout"], r["scott_factor"], r["queries"]) for r in rows} == {
        (layout, factor, n) for layout in ("clustered", "mixture")
        for factor in kde_auto_grid.FACTORS for n in (1, 2**10, 2**11)}
    for r in rows:
        assert r["dim"] == 2 and r["keys"] == 2**12
        assert set(r["seconds"]) == {"True", "False", "auto"}
        assert all(s > 0 for s in r["seconds"].values())
        best = min(r["seconds"]["True"], r["seconds"]["False"])
        assert r["auto_over_best"] == pytest.approx(r["seconds"]["auto"] / best)
    assert doc["summary"]["problems"] == len(rows)
    assert doc["summary"]["worst"] == max(r["auto_over_best"] for r in rows)


@pytest.mark.slow
def test_auto_grid_times_the_estimator(tmp_path):
    out = tmp_path / "grid.json"
    kde_auto_grid.main(["--quick", "--api", "estimator", "--layouts", "mixture",
                        "--query-counts", "1", "64", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["config"]["api"] == "estimator" and len(doc["results"]) == 6
    assert all(s > 0 for r in doc["results"] for s in r["seconds"].values())
