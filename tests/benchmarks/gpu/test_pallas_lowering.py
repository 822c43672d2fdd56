"""The Pallas kernels lowered for CUDA (Triton) on this CPU: what interpret mode cannot check.

Every kernel of the forward and the backward must come out as a verified Triton module whose
matrix products are IEEE float32 (Triton's default for float32 dots written in its own language is
TF32, which would cost about three digits against the float64 reference): the RBF kernels, and
the kernel-expression kernels for an ARD Matérn-3/2 and a composite kernel. Where `triton` is
installed, the expression kernels' default tiles must also compile without register spills.
"""

import json

import pytest

from benchmarks.gpu import pallas_lowering
from scalegp.ops.backends.triton import _expression as triton_expression
from scalegp.ops.backends.triton import _pruned as triton_pruned
from scalegp.ops.backends.triton._rbf import default_block_sizes

supported, why = pallas_lowering.stage1_supported()
pytestmark = pytest.mark.skipif(not supported, reason=why)

# (tiles, d, o): the default tiles and gpu_check.sh's smallest and largest, odd d and o.
CASES = [((64, 64, 64), 8, 16), ((32, 64, 16), 3, 5), ((128, 128, 16), 32, 1), ((64, 64, 64), 17, 33)]


@pytest.mark.parametrize("op, names", [
    ("kernel_mv", ["rbf_kernel_mv_fwd", "rbf_kernel_mv_bwd", "rbf_kernel_mv_bwd"]),
    ("kernel_logsumexp", ["rbf_logsumexp_fwd", "rbf_logsumexp_bwd_dq", "rbf_logsumexp_bwd_dk"]),
    ("kernel_logsumexp_differences", ["rbf_logsumexp_fwd_differences",
                                      "rbf_logsumexp_bwd_dq_differences",
                                      "rbf_logsumexp_bwd_dk_differences"]),
])
@pytest.mark.parametrize("tiles, d, o", CASES)
def test_forward_and_backward_lower_to_triton_with_ieee_float32_dots(op, names, tiles, d, o):
    kernels = pallas_lowering.pallas_kernels(op, d, o, tiles, n=1000, m=777)
    assert [k.name for k in kernels] == names
    for kernel in kernels:
        assert f"tt.func public @{kernel.name}" in kernel.ttir
        # the differences' kernels have no product: their exponents, and the backward passes'
        # sums of P (b - a), come from the coordinate differences (_xla_rbf.difference_sums)
        assert ("tt.dot" in kernel.ttir) != kernel.name.endswith("_differences")
        assert "inputPrecision = tf32" not in kernel.ttir
        capped = "_bwd_" in kernel.name and op.endswith("_differences") and d > 4
        assert kernel.tiles == ((min(tiles[0], 32), min(tiles[1], 32), tiles[2]) if capped
                                else tiles)
        assert kernel.num_warps == default_block_sizes(d).launch.num_warps  # launch from the default
    if op == "kernel_mv":  # the backward pass that also computes dv has one more product
        assert kernels[2].ttir.count("tt.dot") > kernels[1].ttir.count("tt.dot")


@pytest.mark.parametrize("op, names", [
    ("pruned_kernel_mv", ["rbf_pruned_kernel_mv_fwd", "rbf_pruned_kernel_mv_bwd_query",
                          "rbf_pruned_kernel_mv_bwd_key"]),
    # the KDE's forward runs twice: each row's near tiles, then the rest against their sum
    ("pruned_kernel_logsumexp", ["rbf_pruned_logsumexp_fwd", "rbf_pruned_logsumexp_fwd",
                                 "rbf_pruned_logsumexp_bwd_query",
                                 "rbf_pruned_logsumexp_bwd_key"]),
])
@pytest.mark.parametrize("tiles, d, o",
                         [(None, 8, 16), ((32, 32, 16), 3, 5), ((16, 16, 16), 17, 1)])
def test_pruned_kernels_lower_to_triton_with_ieee_float32_dots(op, names, tiles, d, o):
    """The pruned kernels (`_pallas_pruning`), forward and both backward passes: the visit
    lists are read inside the kernels (scalar loads) and the listed tiles loaded at dynamic
    starts; the K v products (``K v``, ``g vᵀ``, ``Kᵀ g``) are IEEE float32 (the KDE's kernels
    have no dot: distances one feature at a time)."""
    kernels = pallas_lowering.pallas_kernels(op, d, o, tiles, n=1000, m=777)
    assert [k.name for k in kernels] == names
    default = triton_pruned.default_block_sizes(d)
    for kernel in kernels:
        assert f"tt.func public @{kernel.name}" in kernel.ttir
        assert "inputPrecision = tf32" not in kernel.ttir
        assert ("tt.dot" in kernel.ttir) == (op == "pruned_kernel_mv")
        assert kernel.tiles == (tiles or (default.block_q, default.block_k, default.block_o))
        # the loop over a dynamic count of listed tiles (each row's rule decides inside it)
        assert "scf.for" in kernel.ttir
    assert pallas_lowering.applies(op, (64, 64, 16)) and not pallas_lowering.applies(
        op, (128, 64, 16))


EXPRESSION_NAMES = ["expression_mv_fwd", "expression_mv_bwd_query", "expression_mv_bwd_key"]


@pytest.mark.parametrize("op", list(pallas_lowering.EXPRESSIONS))
@pytest.mark.parametrize("tiles, d, o", [(None, 8, 16), ((32, 16, 16), 3, 5), (None, 17, 1)])
def test_expression_kernels_lower_to_triton_with_ieee_float32_dots(op, tiles, d, o):
    """The expression kernels, forward and backward (hyperparameter gradients included), with
    the default tiles or others, d = 3, 8 (feature-loop distances) and 17 (matrix-product
    distances), o = 1, 5, 16."""
    kernels = pallas_lowering.pallas_kernels(op, d, o, tiles, n=1000, m=777)
    assert [k.name for k in kernels] == EXPRESSION_NAMES
    default = triton_expression.default_block_sizes(d)
    for kernel in kernels:
        assert f"tt.func public @{kernel.name}" in kernel.ttir
        assert "tt.dot" in kernel.ttir  # K v, G = g vᵀ; at d = 17 the distances too
        assert "inputPrecision = tf32" not in kernel.ttir
        assert kernel.tiles == (tiles or (default.block_q, default.block_k, default.block_o))
        assert kernel.num_warps == default.launch.num_warps


def test_tf32_would_be_visible_in_the_module():
    """The IEEE assertion above can fail: a default-precision dot lowers to TF32."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], x_ref[...])

    def fn(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                              compiler_params=plgpu.CompilerParams())(x)

    [(_, ttir)] = pallas_lowering.triton_modules(fn, jax.ShapeDtypeStruct((16, 16), jnp.float32))
    assert "inputPrecision = tf32" in ttir


def test_runner_writes_rows_and_records_a_bad_tile_as_a_failure(tmp_path, capsys):
    out = tmp_path / "lowering.json"
    argv = ["--tiles", "64,64,64", "48,64,16", "--shapes", "3x5", "--n", "200", "--no-compile",
            "--ttir-dir", str(tmp_path / "ttir"), "--out", str(out)]
    assert pallas_lowering.main(argv) == 1
    doc = json.loads(out.read_text())
    assert doc["stage2"] == "skipped: --no-compile" and doc["ok"] is False
    good = [r for r in doc["kernels"] if r["requested"] == [64, 64, 64]]
    bad = [r for r in doc["kernels"] if r["requested"] == [48, 64, 16]]
    ops = set(pallas_lowering.OPS)
    unpruned = ops - set(pallas_lowering.PRUNED_OPS)  # the pruned ones need block_q = block_k
    n_kernels = 3 * len(ops) + 1  # the pruned KDE's forward is two kernels
    assert len(good) == n_kernels and all(r["ok"] for r in good)
    assert {r["op"] for r in good} == ops and {r["op"] for r in bad} == unpruned
    assert all(not r["ok"] and "power of two" in r["error"] for r in bad)
    assert len(list((tmp_path / "ttir").glob("*.ttir"))) == n_kernels
    assert "FAIL lowering kernel_mv (48, 64, 16)" in capsys.readouterr().out
    table = pallas_lowering.render(doc).splitlines()
    assert len(table) == 2 + len(ops) + len(unpruned)  # header, rule; each op x tile request
    assert table[2] == "| kernel_mv | 64,64,64 | 3 | 5 | 64,64,64 | 4 | ok | ok | ok |"
    assert table[3].startswith("| kernel_mv | 48,64,16 | 3 | 5 | | | ValueError: pallas needs block_q")
    # --ops picks the ops
    argv = ["--tiles", "default", "--shapes", "3x5", "--n", "200", "--no-compile", "--ops",
            "composite", "--out", str(out)]
    assert pallas_lowering.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [r["kernel"] for r in doc["kernels"]] == EXPRESSION_NAMES
    assert all(r["spill_free_required"] for r in doc["kernels"])


def test_compiles_for_hopper_when_triton_is_installed(tmp_path):
    pytest.importorskip("triton")
    kernel = pallas_lowering.pallas_kernels("kernel_mv", 8, 16, (64, 64, 64), n=512, m=512)[2]
    row = pallas_lowering.compile_kernel(kernel, 90, tmp_path)
    assert 0 < row["shared_bytes"] <= pallas_lowering.SHARED_LIMIT[90] and row["fits"]
    assert row["tensor_core_ops"] == 0  # IEEE float32: FMA, not TF32 tensor cores
    if row.get("registers") is not None:
        assert 0 < row["registers"] <= 255


def test_default_tiles_compile_without_spills(tmp_path):
    """The expression kernels' default tiles (`triton_expression.default_block_sizes`) and the
    KDE's differences kernels' (`default_block_sizes`; the path of d <= 16 only) for d <= 16:
    no spill stores in any of the three kernels of each (ptxas's report)."""
    pytest.importorskip("triton")
    out = tmp_path / "lowering.json"
    ops = [*pallas_lowering.EXPRESSIONS, "kernel_logsumexp_differences"]
    argv = ["--tiles", "default", "--shapes", "16x16", "3x1", "--n", "512", "--ops", *ops,
            "--out", str(out)]
    assert pallas_lowering.main(argv) == 0
    rows = json.loads(out.read_text())["kernels"]
    assert len(rows) == 3 * 2 * len(ops)
    for row in rows:
        assert row["ok"] and row["spill_free_required"], row
        assert row["spill_stores"] == 0 and row["tensor_core_ops"] == 0, row
