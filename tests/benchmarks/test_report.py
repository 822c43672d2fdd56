"""report.py reproduces the seed's SUMMARY.md tables from its JSON, and compares files."""

from pathlib import Path

import pytest

from benchmarks import report

SEED = Path(__file__).resolve().parents[3] / "shared" / "seed"
needs_seed = pytest.mark.skipif(not (SEED / "kmv_benchmark_rtx3090.json").exists(),
                                reason="../shared/seed is not here")


@needs_seed
def test_tables_reproduce_every_row_of_the_seed_summary():
    text = report.render(report.load(SEED / "kmv_benchmark_rtx3090.json"))
    rendered = set(text.splitlines())
    summary = [ln for ln in (SEED / "SUMMARY.md").read_text().splitlines() if ln.startswith("| ")]
    assert len(summary) > 100
    assert [ln for ln in summary if ln not in rendered] == []


@needs_seed
def test_compare_a_file_with_itself_gives_ratio_one():
    doc = report.load(SEED / "kmv_benchmark_rtx3090.json")
    text = report.compare(doc, doc, family="kernel_mv_tiles")
    assert "48 rows matched; 0 only in new, 0 only in old." in text
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
