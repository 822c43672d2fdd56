"""GPU pre-flight on any machine: every Pallas kernel lowered for CUDA and, where Triton is
installed, compiled for a GPU architecture, without a GPU.

    PYTHONPATH=. python benchmarks/gpu/pallas_lowering.py              # gpu_check.sh's tiles
    PYTHONPATH=. python benchmarks/gpu/pallas_lowering.py --tiles 128,128,16 --shapes 32x16 \\
        --arch 90 --ttir-dir /tmp/ttir --out /tmp/lowering.json

Stage 1 (jax only). The forward and the backward of `pallas.kernel_mv`,
`pallas.kernel_logsumexp` and `pallas.kernel_logsumexp_differences`, of
`pallas_expression.expression_mv` for two kernel expressions (`EXPRESSIONS`: an ARD
Matérn-3/2, and ``c·RBF + c·RBF·ExpSineSquared + c·RationalQuadratic + Matern(1/2)``; their
backward includes every hyperparameter's gradient), and of the pruned
kernels `pallas_pruning.pruned_kernel_mv` and `pallas_pruning.pruned_kernel_logsumexp`
(`PRUNED_OPS`: visit lists read inside the kernels; one tile height for queries and keys, so
only tiles with block_q = block_k are tried for them), are lowered with
``lowering_platforms=("cuda",)``: JAX runs the same
Pallas-to-Triton lowering as on a GPU host and embeds each kernel as Triton IR in a custom call.
The IR is taken from there and checked by the MLIR verifier. This catches what the interpret-mode
unit tests cannot: a Pallas primitive or a block shape that Triton does not take.

Stage 2 (with ``pip install triton``, optional; skipped with a note otherwise). Each module's text
is compiled by Triton for ``--arch`` (default 90: the H200 lent to this project) down to PTX and a
cubin; ``cuobjdump`` reports registers and stack/local memory, ptxas's own report the spill
stores and loads (a stack frame is not always a spill: libdevice's sinf keeps a table there).
Triton's shared memory per block is checked against the architecture's limit: a kernel over it
would compile here and fail at launch there. With the library's default tiles (``default``) and
d <= `SPILL_FREE_MAX_D`, a kernel that spills is a failure too.

What this cannot tell: speed, and whether the GPU machine's own Triton (bundled in its jaxlib,
not the pip package) agrees. A jaxlib newer than 0.10.2 calls Triton's compiler while lowering,
through the CUDA plugin, and embeds no IR; stage 1 needs jaxlib 0.10.2 or older.
Exit status 1 if any kernel fails to lower, to verify, to compile or to fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Largest dynamic shared memory one block may opt into, bytes (CUDA programming guide, compute
# capabilities table).
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
TRITON_CALL = "__gpu$xla.gpu.triton"
# The library's default for each d, then gpu_check.sh's tile sweep (warps from the default).
DEFAULT_TILES = ["default", "64,64,16", "128,64,16", "64,128,16", "128,128,16", "32,64,16"]
# d x o of gpu_check.sh's grid (d = 8, 32; o = 1, 16), plus odd ones that exercise padding.
DEFAULT_SHAPES = ["8x16", "8x1", "32x16", "32x1", "3x5", "17x33"]
# The KDE twice: from the distance expansion, and from the coordinate differences (the choice
# for data spread over many bandwidths, `pallas.kernel_logsumexp_differences`).
RBF_OPS = ("kernel_mv", "kernel_logsumexp", "kernel_logsumexp_differences")
# The expression kernels checked, by op name: (d -> kernel). Their hyperparameters are inputs of
# the Pallas kernels, so only the kernel's structure (and d, for ARD) matters here.
EXPRESSIONS = {
    "matern32_ard": lambda d: _kernels().Matern(_ones(d), nu=1.5),
    "composite": lambda d: (
        2.0 * _kernels().RBF(1.0) + 0.5 * _kernels().RBF(1.3) * _kernels().ExpSineSquared(
            1.0, period=1.7) + 0.7 * _kernels().RationalQuadratic(1.1, alpha=1.5)
        + _kernels().Matern(0.8, nu=0.5)),
}
# The pruned kernels (`scalegp.ops.backends.triton._pruned`), on tiled inputs in k-d order.
PRUNED_OPS = ("pruned_kernel_mv", "pruned_kernel_logsumexp")
# Ops whose kernels do not depend on o (KDE weights instead of values): once per (tiles, d).
LSE_OPS = ("kernel_logsumexp", "kernel_logsumexp_differences", "pruned_kernel_logsumexp")
OPS = RBF_OPS + tuple(EXPRESSIONS) + PRUNED_OPS
# With the library's default tiles, kernels for up to this many features must not spill.
SPILL_FREE_MAX_D = 16


@dataclasses.dataclass
class Kernel:
    """One Triton module: its kernel name, tiles, launch parameters and IR."""

    name: str
    tiles: tuple[int, ...]
    num_warps: int
    num_stages: int
    ttir: str


def _shape_arg(text: str) -> tuple[int, int]:
    d, o = (int(t) for t in text.lower().split("x"))
    return d, o


def _tiles_arg(text: str) -> tuple[int, ...] | None:
    if text == "default":
        return None
    parts = tuple(int(t) for t in text.split(","))
    if not 3 <= len(parts) <= 5:
        raise argparse.ArgumentTypeError(
            f"tiles are block_q,block_k,block_o[,num_warps[,num_stages]], got {text!r}")
    return parts


def _kernels():
    from scalegp.ops import _kernels

    return _kernels


def _ones(d):
    import numpy as np

    return np.ones(d, np.float32)


def stage1_supported() -> tuple[bool, str]:
    """Whether this jaxlib embeds Triton IR when lowering for CUDA (and why not)."""
    from jax._src.lib import version as jaxlib_version

    if tuple(jaxlib_version[:3]) <= (0, 10, 2):
        return True, ""
    return False, (f"jaxlib {'.'.join(map(str, jaxlib_version[:3]))} compiles Triton kernels "
                   "while lowering, through the CUDA plugin; stage 1 needs jaxlib <= 0.10.2")


def triton_modules(fn, *args) -> list[tuple[str, str]]:
    """(kernel name, verified Triton IR text) of every Pallas kernel in ``jit(fn)(*args)``, lowered
    for CUDA on whatever host this runs. ``args`` may be ``jax.ShapeDtypeStruct``s."""
    import jax
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call":
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        if target == TRITON_CALL:
                            calls.append(child)
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    modules = []
    for call in calls:
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        name = ir.StringAttr(config["name"]).value
        with ir.Context() as ctx:
            tt_dialect.register_dialect(ctx)
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            if not module.operation.verify():
                raise ValueError(f"Triton module {name} does not verify")
            modules.append((name, module.operation.get_asm()))
    return modules


def with_tiles(default, tiles):
    """``default`` BlockSizes with ``tiles`` (block_q, block_k, block_o[, num_warps[,
    num_stages]]) over it, the launch parameters in its Triton ``launch``; None: ``default``."""
    from scalegp.ops.backends.triton import TritonLaunch

    tiles = tuple(tiles or ())
    launch = default.launch or TritonLaunch()
    if len(tiles) > 3:
        launch = dataclasses.replace(launch, **dict(zip(("num_warps", "num_stages"), tiles[3:])))
    return dataclasses.replace(default, **dict(zip(("block_q", "block_k", "block_o"), tiles[:3])),
                               launch=launch)


def pallas_kernels(op: str, d: int, o: int, tiles, n: int, m: int) -> list[Kernel]:
    """The three Triton kernels of one op for one shape: its forward and its two backward passes.

    ``op`` is "kernel_mv", "kernel_logsumexp" or "kernel_logsumexp_differences" (the KDE; ``o``
    is ignored), a name in `EXPRESSIONS` (`pallas_expression.expression_mv` of that kernel; the
    backward with respect to the kernel's hyperparameters too) or in `PRUNED_OPS` (the pruned
    kernels: forward, query pass and key pass). ``tiles`` is (block_q, block_k,
    block_o[, num_warps[, num_stages]]), the rest from the op's Pallas default for ``d``, or None
    for that default."""
    import jax
    import jax.numpy as jnp

    from scalegp.ops.backends.triton import _rbf as pallas
    from scalegp.ops.backends.triton import _expression as pallas_expression

    if op in PRUNED_OPS:
        return _pruned_kernels(op, d, o, tiles, n, m)
    module = pallas_expression if op in EXPRESSIONS else pallas
    bs = with_tiles(module.default_block_sizes(d), tiles)
    values = (m,) if op in LSE_OPS else (m, o)  # the KDE weights w, or v
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((n, d), (m, d), values)]
    if op in EXPRESSIONS:
        kernel = jax.tree_util.tree_map(lambda t: jnp.asarray(t, jnp.float32),
                                        EXPRESSIONS[op](d))
        args.insert(0, kernel)  # traced: the hyperparameters are inputs, as in the library

        def core(*a):
            return pallas_expression.expression_mv(*a, bs, False)
    else:
        core_fn = getattr(pallas, op)

        def core(*a):
            return core_fn(*a, bs, False)

    def value_and_grads(*x):  # returns the forward too, so lowering keeps all three kernels
        out, vjp = jax.vjp(core, *x)
        return out, vjp(jnp.ones_like(out))

    def blocks(name):  # the differences' backward tiles are capped (`backward_block_sizes`)
        direct = op == "kernel_logsumexp_differences" and "_bwd" in name
        b = pallas.backward_block_sizes(bs, d, direct)
        return b.block_q, b.block_k, b.block_o

    return [Kernel(name, blocks(name), bs.launch.num_warps, bs.launch.num_stages, ttir)
            for name, ttir in triton_modules(value_and_grads, *args)]


def _pruned_kernels(op: str, d: int, o: int, tiles, n: int, m: int) -> list[Kernel]:
    """`pallas_kernels` for an op of `PRUNED_OPS`: the pruned core on n queries and m keys in
    tiles of the one height block_q = block_k, at the default tolerance (a constant in the
    KDE's kernel)."""
    import jax
    import jax.numpy as jnp

    from scalegp.ops.backends.triton import _pruned as triton_pruned
    from scalegp.ops.backends.triton import _pruned_lse as triton_pruned_lse
    from scalegp.ops.backends.triton import _pruned_mv as triton_pruned_mv
    from scalegp.ops.pruning import _rules as rules

    bs = with_tiles(triton_pruned.default_block_sizes(d), tiles)
    block = triton_pruned.check_block_sizes(bs)
    tq, tk = -(-n // block), -(-m // block)
    kde = op == "pruned_kernel_logsumexp"
    values = (tk, block) if kde else (tk, block, o)
    args = [jax.ShapeDtypeStruct(shape, jnp.float32)
            for shape in ((tq, block, d), (tk, block, d), values, (d,))]
    core_fn = (triton_pruned_lse.pruned_kernel_logsumexp if kde
               else triton_pruned_mv.pruned_kernel_mv)
    tol = rules.default_tolerance(jnp.float32)

    def value_and_grads(*x):
        out, vjp = jax.vjp(lambda *a: core_fn(*a, tol, bs, False), *x)
        return out, vjp(jnp.ones_like(out))

    blocks = (bs.block_q, bs.block_k, bs.block_o)
    return [Kernel(name, blocks, bs.launch.num_warps, bs.launch.num_stages, ttir)
            for name, ttir in triton_modules(value_and_grads, *args)]


def applies(op: str, tiles) -> bool:
    """Whether ``op`` is tried with ``tiles``: the pruned kernels only with block_q = block_k."""
    return op not in PRUNED_OPS or tiles is None or tiles[0] == tiles[1]


def _cuobjdump() -> str | None:
    try:
        import triton.backends.nvidia as nvidia

        bundled = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def _ptxas_spills(ptx: str, arch: int, stem: Path) -> dict:
    """Spill stores and loads (bytes) of one PTX module, from ptxas's report (``-v``), with
    Triton's own ptxas and flags: ``stack_bytes`` alone does not tell a spill from a stack
    frame (libdevice's sinf keeps a 28-byte table on it for huge arguments)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        ptxas = get_ptxas(arch).path
    except (ImportError, AttributeError):
        return {}
    src, out = stem.with_suffix(".ptx"), stem.with_suffix(".o")
    src.write_text(ptx)
    report = subprocess.run(
        [ptxas, "-v", "-lineinfo", "--regAllocOptLevel=2",
         f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(out)],
        capture_output=True, text=True, check=True).stderr
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if found is None:
        return {}
    return {"spill_stores": int(found.group(1)), "spill_loads": int(found.group(2))}


def compile_kernel(kernel: Kernel, arch: int, workdir: Path) -> dict:
    """Triton-compile one module for ``sm_<arch>``: shared memory, registers, local memory (spills),
    and whether its dots use tensor cores (they should not: the kernels ask for IEEE float32)."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = workdir / f"{kernel.name}.ttir"
    src.write_text(kernel.ttir)
    compiled = triton.compile(
        str(src), target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
    )
    ptx = compiled.asm["ptx"]
    row = {"shared_bytes": int(compiled.metadata.shared),
           "tensor_core_ops": len(re.findall(r"\b(?:wgmma|mma)\.", ptx))}
    limit = SHARED_LIMIT.get(arch)
    row["fits"] = limit is None or row["shared_bytes"] <= limit
    row.update(_ptxas_spills(ptx, arch, workdir / f"{kernel.name}"))
    cuobjdump = _cuobjdump()
    if cuobjdump is not None:
        cubin = workdir / f"{kernel.name}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        fields = (("registers", "REG"), ("local_bytes", "LOCAL"), ("stack_bytes", "STACK"))
        for key, field in fields:
            found = re.search(rf"\b{field}:(\d+)", usage)
            row[key] = int(found.group(1)) if found else None
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles", nargs="+", type=_tiles_arg,
                   default=[_tiles_arg(t) for t in DEFAULT_TILES],
                   help="block_q,block_k,block_o[,num_warps[,num_stages]] (blocks: powers of two "
                   ">= 16), or 'default' for the library's choice per d")
    p.add_argument("--shapes", nargs="+", type=_shape_arg,
                   help=f"DxO: feature and value dimensions (default {' '.join(DEFAULT_SHAPES)}; "
                   "with --render: the rows to show)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS),
                   help="which ops (default: all): the RBF kernel product and KDE, and the "
                   f"kernel expressions {', '.join(EXPRESSIONS)}")
    p.add_argument("--n", type=int, default=65536,
                   help="points per set (only loop bounds depend on it)")
    p.add_argument("--arch", type=int, default=90, help="compute capability for stage 2, e.g. 90, 86")
    p.add_argument("--no-compile", action="store_true",
                   help="stage 1 only, even if triton is installed")
    p.add_argument("--ttir-dir", help="also write every Triton module here as text")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--render", metavar="JSON",
                   help="print a result file as a markdown table, run nothing")
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text()), args.shapes))
        return 0
    args.shapes = args.shapes or [_shape_arg(s) for s in DEFAULT_SHAPES]

    import jax

    supported, why = stage1_supported()
    if not supported:
        print(f"error: {why}", file=sys.stderr)
        return 2
    # Fused multiply-add on, as XLA compiles; set explicitly because Triton 3.9 warns when unset.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        import triton
    except ImportError:
        triton = None
    compile_note = ("skipped: --no-compile" if args.no_compile else
                    None if triton is not None else "skipped: `triton` is not installed")
    print(f"jax {jax.__version__}; stage 2: "
          + (compile_note or f"triton {triton.__version__}, sm_{args.arch}"), flush=True)
    configs = [(op, t, d, o) for op in args.ops if op not in LSE_OPS
               for t in args.tiles if applies(op, t) for d, o in args.shapes]
    # The KDE kernels do not depend on o: once per (tiles, d).
    for op in (op for op in LSE_OPS if op in args.ops):
        configs += list(dict.fromkeys((op, t, d, 0) for t in args.tiles if applies(op, t)
                                      for d, _ in args.shapes))
    t0 = time.perf_counter()
    rows = check_kernels(configs, args, compile_note)
    ok = all(r["ok"] for r in rows)
    from benchmarks import harness

    doc = {"device": harness.machine_info("cpu"), "command": harness.command_line(__file__, argv),
           "triton": getattr(triton, "__version__", None), "arch": args.arch,
           "stage2": compile_note or "compiled", "shared_limit_bytes": SHARED_LIMIT.get(args.arch),
           "n": args.n, "ok": ok, "seconds": round(time.perf_counter() - t0, 1), "kernels": rows}
    if args.out:
        harness.write_json(args.out, doc)
    print(f"pallas lowering: {'all passed' if ok else 'FAILED'} ({len(rows)} kernels, "
          f"{doc['seconds']} s)", flush=True)
    return 0 if ok else 1


def check_kernels(configs, args, compile_note) -> list[dict]:
    """One row per Triton kernel of each (op, tiles, d, o): lowered and verified, and compiled
    for ``args.arch`` unless ``compile_note`` says why not; a failure is a row, not the end."""
    rows, compiled = [], {}  # compiled: one Triton compile per distinct module and launch
    with tempfile.TemporaryDirectory() as tmp:
        for op, tiles, d, o in configs:
            head = dict(op=op, requested=list(tiles) if tiles else "default", d=d, o=o)
            try:
                kernels = pallas_kernels(op, d, o, tiles, args.n, args.n)
            except Exception as exc:  # one failing configuration must not hide the others
                rows.append({**head, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]})
                print(f"FAIL lowering {op} {tiles} d={d} o={o}: {rows[-1]['error']}", flush=True)
                continue
            for i, kernel in enumerate(kernels):
                row = {**head, "kernel": kernel.name, "index": i, "tiles": list(kernel.tiles),
                       "num_warps": kernel.num_warps, "num_stages": kernel.num_stages}
                if args.ttir_dir:
                    path = Path(args.ttir_dir) / f"{_label(row, '.')}.{i}.{_where(row, '.')}.ttir"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(kernel.ttir)
                if compile_note is None:
                    key = (kernel.ttir, kernel.num_warps, kernel.num_stages)
                    if key not in compiled:
                        try:
                            compiled[key] = compile_kernel(kernel, args.arch, Path(tmp))
                        except Exception as exc:
                            compiled[key] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                    row.update(compiled[key])
                row["spill_free_required"] = tiles is None and d <= SPILL_FREE_MAX_D
                row["ok"] = ("error" not in row and row.get("fits", True)
                             and not (row["spill_free_required"] and row.get("spill_stores")))
                rows.append(row)
                _print(row)
    return rows


def render(doc: dict, shapes=None) -> str:
    """Markdown: one line per op, tiles and shape; per kernel "registers / stack B / shared KiB",
    and "/ spill stores B" where the file has them. ``shapes``: only these (d, o) (the KDE
    rows: only these d)."""
    groups: dict[tuple, list] = {}
    for row in doc["kernels"]:
        if shapes and (row["d"], row["o"]) not in shapes and not (
                row["op"] in LSE_OPS and row["d"] in {d for d, _ in shapes}):
            continue
        asked = row["requested"]
        asked = asked if isinstance(asked, str) else ",".join(map(str, asked))
        key = (row["op"], asked, row["d"], row["o"])
        groups.setdefault(key, []).append(row)
    lines = ["| op | tiles asked | d | o | block_q,k,o | warps | forward | backward 1 | backward 2 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (op, requested, d, o), rows in groups.items():
        first = rows[0]
        if "error" in first:
            lines.append(f"| {op} | {requested} | {d} | {o or ''} | | | {first['error'][:80]} | | |")
            continue
        cells = [f"{r['registers']} / {r['stack_bytes']} / {r['shared_bytes'] / 1024:.0f}"
                 + (f" / {r['spill_stores']}" if r.get("spill_stores") is not None else "")
                 if r.get("registers") is not None else ("ok" if r["ok"] else "FAIL") for r in rows]
        tiles = ",".join(map(str, first["tiles"]))
        lines.append(f"| {op} | {requested} | {d} | {o or ''} | "
                     f"{tiles} | {first['num_warps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(row, sep):
    """The kernel's name, after the op's for the expressions (whose kernels share names)."""
    return (row["kernel"] if row["op"] in RBF_OPS + PRUNED_OPS
            else f"{row['op']}{sep}{row['kernel']}")


def _where(row, sep):
    q, k, bo = row["tiles"]
    return sep.join([f"q{q}", f"k{k}", f"bo{bo}", f"w{row['num_warps']}", f"s{row['num_stages']}",
                     f"d{row['d']}", f"o{row['o']}"])


def _print(row):
    tag = "ok  " if row["ok"] else "FAIL"
    where = _where(row, " ")
    detail = ""
    if "shared_bytes" in row:
        detail = f": shared {row['shared_bytes'] / 1024:.1f} KiB"
        if row.get("registers") is not None:
            detail += (f", {row['registers']} registers, stack {row['stack_bytes']} B, "
                       f"local {row['local_bytes']} B")
        if row.get("spill_stores") is not None:
            detail += f", spills {row['spill_stores']} B"
        detail += f", {row['tensor_core_ops']} tensor-core ops"
    if "error" in row:
        detail = f": {row['error']}"
    print(f"{tag} {_label(row, '/')}#{row['index']} [{where}]{detail}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
