"""The TPU probes' runners on a CPU: `backend_start.py` times its phases in a fresh process and
`dense_products.py` compares the products against float64 (the Mosaic kernels interpreted)."""

import functools
import json

from benchmarks.tpu import backend_start, dense_products


def test_backend_start_times_a_fresh_process(tmp_path):
    out = tmp_path / "start.json"
    backend_start.main(["--out", str(out), "--variants", "cpu", "--repeats", "1",
                        "--transfer-mib", "1"])
    (row,) = json.loads(out.read_text())["results"]
    assert row["variant"] == "cpu" and row["exit_code"] == 0 and row["platform"] == "cpu"
    phases = ("import_s", "devices_s", "first_program_s", "put_first_s", "get_second_s")
    assert all(row[name] >= 0 for name in phases) and row["wall_s"] > row["import_s"]
    assert row["transfer_mb"] == 1.0


def test_dense_products_compares_both_against_float64(tmp_path, monkeypatch):
    from scalegp.ops.backends.mosaic import _dense

    for name in ("matmul", "matmul_tn"):
        monkeypatch.setattr(_dense, name,
                            functools.partial(getattr(_dense, name), interpret=True))
    out = tmp_path / "dense.json"
    dense_products.main(["--out", str(out), "--cases", "tn:600:130:7", "nn:600:130:7",
                         "--repeats", "1"])
    rows = json.loads(out.read_text())["results"]
    assert [(r["form"], r["impl"]) for r in rows] == [
        ("tn", "xla_highest"), ("tn", "mosaic"), ("nn", "xla_highest"), ("nn", "mosaic")]
    assert all(r["rel_error"] < 1e-6 and r["run_s"] > 0 for r in rows)


def test_backend_start_reads_a_csv_before_or_beside_the_start(tmp_path):
    data = tmp_path / "points.csv"
    data.write_text("x,y\n" + "\n".join(f"{i},{i * 0.5}" for i in range(200)) + "\n")
    out = tmp_path / "start.json"
    backend_start.main(["--out", str(out), "--variants", "read_then_start", "start_beside_read",
                        "--repeats", "1", "--transfer-mib", "1", "--read-csv", str(data)])
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["read_then_start", "start_beside_read"]
    assert all(r["exit_code"] == 0 and r["read_seconds"] > 0 for r in rows), rows


def test_chip_limits_report_the_memory_and_the_gp_refusal_sections(tmp_path):
    from benchmarks.tpu import chip_limits

    out = tmp_path / "limits.json"
    chip_limits.main(["--out", str(out), "--sections", "memory", "gp_memory", "--memory-gib",
                      "0.001", "--gp-n", "300", "--timeout", "120"])
    memory, gp = json.loads(out.read_text())["results"]
    assert memory["backend"] == "cpu" and memory["allocated"] is True
    assert gp["n"] == 300 and gp["fitted"] is True and gp["seconds_to_outcome"] > 0


def test_paired_trees_times_each_tree_in_its_own_process(tmp_path):
    """The same tree twice: every call ends, the forward agrees with float64, and the second
    tree's outputs lie where the first's do."""
    from pathlib import Path

    from benchmarks.tpu import paired_trees

    root = Path(paired_trees.__file__).resolve().parents[2]
    out = tmp_path / "paired.json"
    paired_trees.main(["--trees", f"a={root}", f"b={root}", "--cases", "kv_d2", "kv_wide",
                       "expr_d8", "--n", "256", "--impl", "xla", "--rounds", "1", "--repeats",
                       "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tree"], r["case"]) for r in rows] == [
        ("a", "kv_d2"), ("b", "kv_d2"), ("a", "kv_wide"), ("b", "kv_wide"), ("a", "expr_d8"),
        ("b", "expr_d8")]
    assert all("error" not in r and r["fwd_rel_err_64_rows"] < 1e-5 for r in rows)
    assert rows[0]["ratio"] > 0 and rows[4]["ratio_to_rbf"] > 0
    assert set(rows[1]["distance_from_a"]) == set(rows[5]["distance_from_a"]) == {
        "out", "grad_x", "grad_v", "grad_parameters"}
    assert all(d < 1e-6 for r in rows[1::2] for d in r["distance_from_a"].values())
