"""The kernels section (RBF, Matérn-3/2, composite): plan, float64 reference, ours and the torch
peer against it, the runner end to end and the report's table. Tiny sizes throughout."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import report
from benchmarks.kmv import catalog, options, peers, problems, sections

ROOT = Path(__file__).resolve().parents[2]
MATERN32, COMPOSITE = catalog.MATERN32, catalog.COMPOSITE
HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="no torch")


def dense_expression64(family, inputs):
    """K @ v in float64 with numpy, written from the formulas of problems.py's docstring."""
    x1, x2, v = (np.asarray(inputs[k], np.float64) for k in ("x1", "x2", "v"))
    h = {k: np.asarray(val, np.float64) for k, val in inputs["hyper"].items()}
    diff = x1[:, None, :] - x2[None, :, :]
    if family == MATERN32:
        t = np.sqrt(3.0 * ((diff / h["lengthscale"]) ** 2).sum(-1))
        return ((1.0 + t) * np.exp(-t)) @ v
    rho2 = (diff**2).sum(-1)
    rho = np.sqrt(rho2)
    k = (h["rbf_scale"] * np.exp(-rho2 / (2 * h["rbf_lengthscale"] ** 2))
         + h["per_scale"] * np.exp(-rho2 / (2 * h["per_decay"] ** 2))
         * np.exp(-2 * np.sin(np.pi * rho / h["per_period"]) ** 2 / h["per_lengthscale"] ** 2)
         + h["rq_scale"] * (1 + rho2 / (2 * h["rq_alpha"] * h["rq_lengthscale"] ** 2))
         ** -h["rq_alpha"]
         + h["m12_scale"] * np.exp(-rho / h["m12_lengthscale"]))
    return k @ v


# ----------------------------------------------------------------------------------------------
# plan and options


def test_kernels_is_opt_in_with_its_own_defaults():
    quick = options.parse(["--device", "cpu"])
    assert "kernels" not in quick.sections and "kernels" in sections.SECTIONS
    assert quick.kernel_sizes == [4096, 16384] and quick.kernel_dims == [4]
    assert quick.kernel_outs == [1, 16] and quick.kernel_modes == ["fwd", "fwd_bwd"]
    assert quick.kernel_families == ["kernel_mv", MATERN32, COMPOSITE]
    assert quick.kernel_impls == ["auto", "xla", "dense", "torch_chunked"]
    assert options.parse(["--device", "gpu"]).kernel_impls[:2] == ["auto", "pallas"]
    with pytest.raises(SystemExit):
        options.parse(["--kernel-families", "kernel_mv_matern52"])


def test_kernel_configs_run_rbf_first_and_peers_only_where_they_apply():
    opts = options.parse(["--sections", "kernels", "--kernel-sizes", "64,32", "--kernel-outs",
                          "1", "--kernel-modes", "fwd_bwd"])
    configs = sections.kernel_configs(opts)
    assert configs == [(f, n, 4, 1, "fwd_bwd") for n in (32, 64)
                       for f in ("kernel_mv", MATERN32, COMPOSITE)]
    specs = sections.timed_specs(configs[:3], opts.kernel_impls, opts)
    by_family = {}
    for s in specs:
        by_family.setdefault(s["family"], []).append(s["impl"])
    assert by_family["kernel_mv"] == ["auto", "xla", "dense", "torch_chunked"]
    assert by_family[MATERN32] == ["auto", "xla", "dense", "torch_chunked"]
    assert by_family[COMPOSITE] == ["auto", "xla", "dense"]  # no peer has the composite
    assert list(sections.record_head(specs[-1])) == ["family", "impl", "mode", "batch", "n", "m",
                                                     "dim", "out"]


def test_families_share_the_inputs_and_name_their_hyperparameters():
    rbf = problems.make_inputs("kernel_mv", 12, 10, 3, 2)
    for family in (MATERN32, COMPOSITE):
        expr = problems.make_inputs(family, 12, 10, 3, 2)
        assert all(np.array_equal(rbf[k], expr[k]) for k in ("x1", "x2", "v", "G"))
        assert "lengthscale" not in expr
    assert catalog.MATERN32 == problems.MATERN32_FAMILY
    assert catalog.COMPOSITE == problems.COMPOSITE_FAMILY
    h = problems.hyperparameters(MATERN32, 4)
    np.testing.assert_array_equal(h["lengthscale"], np.full(4, 2.0, np.float32))
    h = problems.hyperparameters(COMPOSITE, 4)
    assert len(h) == 11 and h["per_period"] == 2.0 and h["per_decay"] == 4.0
    assert h["rq_alpha"] == 1.5 and h["m12_scale"] == 0.25


# ----------------------------------------------------------------------------------------------
# reference, ours and peers (float64 reference: x64)


@pytest.mark.x64
@pytest.mark.parametrize("family", [MATERN32, COMPOSITE])
def test_reference_matches_a_direct_dense_computation(family):
    inputs = problems.make_inputs(family, 33, 21, 3, 2)
    ref = problems.reference(family, "fwd", inputs, entries=64)  # several chunks
    np.testing.assert_allclose(ref["out"], dense_expression64(family, inputs), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.x64
@pytest.mark.parametrize("family, name, index", [(MATERN32, "lengthscale", 1),
                                                 (COMPOSITE, "per_period", 0),
                                                 (COMPOSITE, "rq_alpha", 0),
                                                 (COMPOSITE, "m12_lengthscale", 0)])
def test_reference_hyperparameter_gradient_matches_finite_differences(family, name, index):
    inputs = problems.make_inputs(family, 9, 8, 2, 2)
    grads = problems.reference(family, "fwd_bwd", inputs, entries=16)
    assert grads["dhyper"].shape == (2 if family == MATERN32 else 11,)
    order = list(inputs["hyper"])
    position = order.index(name) + index  # the Matérn lengthscale is the whole vector

    def loss(delta):
        h = {k: np.array(val, np.float64) for k, val in inputs["hyper"].items()}
        np.ravel(h[name])[index] += delta
        return float(np.sum(dense_expression64(family, {**inputs, "hyper": h}) * inputs["G"]))

    eps = 1e-6
    fd = (loss(eps) - loss(-eps)) / (2 * eps)
    assert math.isclose(float(grads["dhyper"][position]), fd, rel_tol=1e-6)


@pytest.mark.x64
@pytest.mark.parametrize("impl", ["xla", "dense"])
@pytest.mark.parametrize("family", [MATERN32, COMPOSITE])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_ours_agree_with_the_reference(impl, family, mode):
    from benchmarks.kmv.ours import JaxBench

    inputs = problems.make_inputs(family, 70, 50, 3, 4)
    ref = problems.reference(family, mode, inputs)
    bench = JaxBench(impl, family, mode, inputs)
    assert "compile_s" in bench.setup()
    err = problems.rel_err(bench.result(bench.sync(bench.call())), ref)
    if mode == "fwd":
        assert err < 1e-5
    else:
        assert set(err) == {"dq", "dk", "dv", "dhyper", "dhyper_max"}
        # rq_alpha's gradient is small (cancellation), so the worst single one is looser
        assert max(err[k] for k in ("dq", "dk", "dv", "dhyper")) < 1e-5
        assert err["dhyper_max"] < 1e-3


@pytest.mark.x64
@needs_torch
@pytest.mark.parametrize("impl", ["torch_dense", "torch_chunked"])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_torch_matern32_agrees_with_the_reference(impl, mode, monkeypatch):
    monkeypatch.setitem(peers.TORCH_BLOCK_ENTRIES, "cpu", 600)  # chunked: 6 blocks of 12 rows
    inputs = problems.make_inputs(MATERN32, 70, 50, 3, 4)
    ref = problems.reference(MATERN32, mode, inputs)
    peer = peers.make_peer(impl, MATERN32, mode, inputs, "cpu", 2)
    if impl == "torch_chunked":
        assert len(peer.blocks) == 6
    err = problems.rel_err(peer.result(peer.sync(peer.call())), ref)
    errs = [err] if mode == "fwd" else [err[k] for k in ("dq", "dk", "dv", "dhyper")]
    assert max(errs) < 1e-5


def test_no_peer_has_composite_rows():
    inputs = problems.make_inputs(COMPOSITE, 8, 8, 2, 1)
    with pytest.raises(ValueError, match="no kernel_mv_composite rows"):
        peers.make_peer("torch_chunked", COMPOSITE, "fwd", inputs, "cpu", 1)
    assert not any(catalog.applies(i, COMPOSITE, "fwd", "cpu") for i in catalog.PEERS)


# ----------------------------------------------------------------------------------------------
# end to end and the report


@pytest.mark.slow
def test_cli_kernels_section_rows_rel_err_and_table(tmp_path):
    out = tmp_path / "k.json"
    impls = ["xla"]  # dense and the torch peer are checked in-process above
    cmd = [sys.executable, "benchmarks/kernel_mv.py", "--sections", "kernels",
           "--kernel-sizes", "40", "--kernel-dims", "2", "--kernel-outs", "3",
           "--kernel-impls", *impls, "--repeats", "2", "--sample-budget-s", "0.1",
           "--isolate", "group", "--quiet", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=300)
    doc = json.loads(out.read_text())
    assert doc["config"]["runs"]["k.json"]["kernel_sizes"] == [40]
    assert "kernel_mv_composite" in doc["config"]["data"]
    assert any(a["n"] == 40 and a["dim"] == 2 and a["out"] == 3 for a in doc["config"]["auto"])
    rows = {(r["family"], r["impl"], r["mode"]): r for r in doc["results"]}
    expected = {(f, i, m) for f in ("kernel_mv", MATERN32, COMPOSITE) for i in impls
                for m in ("fwd", "fwd_bwd") if catalog.applies(i, f, m, "cpu")}
    assert set(rows) == expected
    for (family, impl, mode), row in rows.items():
        assert "error" not in row, row
        assert list(row)[:8] == ["family", "impl", "mode", "batch", "n", "m", "dim", "out"]
        assert row["n"] == row["m"] == 40 and row["dim"] == 2 and row["out"] == 3
        assert row["median_ms"] > 0
        if impl in catalog.OURS:
            assert "xla_temp_mb" in row
        err = row["rel_err"]
        if mode == "fwd":
            assert err < 1e-5
        elif family == "kernel_mv":
            assert set(err) == {"dq", "dk", "dv", "dlengthscale"}
        else:
            assert set(err) == {"dq", "dk", "dv", "dhyper", "dhyper_max"}
            assert err["dhyper"] < 1e-4
    text = report.render(doc)
    assert "## kernels: RBF, Matérn-3/2" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| fwd_bwd | 40 | 2 | 3 | xla |")]
    assert len(table) == 1 and table[0].count("|") == 11
    assert "| kernel_mv_composite | xla |" in text  # the accuracy table


def _row(family, impl, mode, ms=None, error=None, n=64, dim=4, out=1):
    rec = {"family": family, "impl": impl, "mode": mode, "batch": 1, "n": n, "m": n,
           "dim": dim, "out": out}
    rec.update({"median_ms": ms} if error is None else {"error": error})
    return rec


def test_kernels_table_ratios_errors_and_shapes():
    records = [
        _row("kernel_mv", "xla", "fwd", 2.0), _row(MATERN32, "xla", "fwd", 3.0),
        _row(COMPOSITE, "xla", "fwd", 10.0),
        _row("kernel_mv", "dense", "fwd", 1.0), _row(MATERN32, "dense", "fwd", 1.5),
        _row(COMPOSITE, "dense", "fwd", error="RESOURCE_EXHAUSTED: out of memory"),
        _row("kernel_mv", "torch_chunked", "fwd", 4.0), _row(MATERN32, "torch_chunked", "fwd", 6.0),
        _row("kernel_mv", "numpy_chunked", "fwd", 5.0),  # no Matérn row: left out
        _row("kernel_mv", "xla", "fwd", 7.0, dim=8, out=16),  # a grid shape: left out
    ]
    lines = report.kernels_table(records)
    body = [ln for ln in lines if ln.startswith("| fwd")]
    assert body == [
        "| fwd | 64 | 4 | 1 | dense | 1 | 1.5 | OOM | 1.50 |  |",
        "| fwd | 64 | 4 | 1 | xla | 2 | 3 | 10 | 1.50 | 5.00 |",
        "| fwd | 64 | 4 | 1 | torch_chunked | 4 | 6 |  | 1.50 |  |",
    ]
    assert report.kernels_table([_row("kernel_mv", "xla", "fwd", 2.0)]) == []
