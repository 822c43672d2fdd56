"""report.py reproduces the RTX 3090 benchmark's SUMMARY.md tables from its JSON, and compares
files."""

from pathlib import Path

import pytest

from benchmarks import report

RTX3090 = Path(__file__).resolve().parents[3] / "shared" / "seed"  # the RTX 3090 benchmark
DATA = Path(__file__).resolve().parent / "data"
#: (results, the SUMMARY.md table rows they must reproduce, how many rows at least). The fixture
#: is the RTX 3090 benchmark cut to a few configurations per table (its rows as they are, and
#: SUMMARY.md's header and data lines for them), so these tests run everywhere; the whole
#: benchmark, where ../shared/seed is, checks every row.
SOURCES = [pytest.param(DATA / "rtx3090_subset.json", DATA / "rtx3090_subset_summary.md", 20,
                        id="fixture"),
           pytest.param(RTX3090 / "kmv_benchmark_rtx3090.json", RTX3090 / "SUMMARY.md", 100,
                        id="rtx3090",
                        marks=pytest.mark.skipif(not (RTX3090 / "SUMMARY.md").exists(),
                                                 reason="../shared/seed is not here"))]


@pytest.mark.parametrize("results, summary, at_least", SOURCES)
def test_tables_reproduce_every_row_of_the_rtx3090_summary(results, summary, at_least):
    rendered = set(report.render(report.load(results)).splitlines())
    rows = [ln for ln in summary.read_text().splitlines() if ln.startswith("| ")]
    assert len(rows) > at_least
    assert [ln for ln in rows if ln not in rendered] == []


@pytest.mark.parametrize("results, summary, at_least", SOURCES)
def test_compare_a_file_with_itself_gives_ratio_one(results, summary, at_least):
    doc = report.load(results)
    tiles = sum(r["family"] == "kernel_mv_tiles" for r in doc["results"])
    text = report.compare(doc, doc, family="kernel_mv_tiles")
    assert f"{tiles} rows matched; 0 only in new, 0 only in old." in text and tiles >= 24
    ratios = [ln.rsplit("|", 2)[1].strip() for ln in text.splitlines()
              if ln.startswith("| kernel_mv_tiles")]
    assert ratios and set(ratios) == {"1"}


def test_compare_maps_implementations_and_merge_keeps_runs():
    def doc(impl, ms, run):
        return {"device": {"backend": "gpu", "device_kind": "x"}, "config": {"runs": {run: {}}},
                "results": [{"family": "kernel_mv", "impl": impl, "mode": "fwd", "batch": 1,
                             "n": 8, "m": 8, "dim": 2, "out": 1, "median_ms": ms}]}

    new, old = doc("pallas", 1.0, "a.json"), doc("default@old", 4.0, "b.json")
    text = report.compare(new, old, impl_map={"default@old": "pallas"})
    assert "| 1 | 4 | 0.25 |" in text
    merged = report.merge([new, old])
    assert set(merged["config"]["runs"]) == {"a.json", "b.json"} and len(merged["results"]) == 2
