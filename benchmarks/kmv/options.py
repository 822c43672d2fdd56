"""Command line of benchmarks/kernel_mv.py and its per-device presets.

Every option left unset takes its value from the preset for (--device, --preset):
  cpu/quick  the default: a bit of every section, under 15 minutes on a 2-core machine (and never
             longer: --max-total-s 840 stops it; whatever did not run is recorded as skipped)
  cpu/full   the run whose results are committed: the grid at 1,024 to 65,536 points, dims 2, 8,
             32, outs 1 and 16, every peer; ladders up to 262,144 points at 10 minutes a rung
  gpu/quick  the RTX 3090 benchmark's sections on one GPU (benchmarks/gpu/gpu_check.sh sets
             budgets per section)
  gpu/full   the same without a run budget
  tpu/quick  the same sections on one TPU chip (impl "pallas" is the Mosaic backend there), ours
             only: the TPU machine has no torch or pykeops (a peer asked for by --impls is
             skipped). Each child opens the chip anew (10 to 15 s), so the configurations of a
             section share one child there (--isolate section; runner.py)
  tpu/full   the same
The kernels section (RBF, Matérn-3/2 and a composite kernel at the same shapes) is in no preset's
default --sections; its own options (--kernel-*) have defaults in every preset.
"""

from __future__ import annotations

import argparse
import os

from benchmarks import harness
from benchmarks.kmv import catalog
from benchmarks.kmv.sections import DEFAULT_SECTIONS, SECTIONS

#: The (block_q, block_k, block_o) tiles of the RTX 3090 benchmark's tile sweep.
RTX3090_TILES = ["64,64,64", "64,64,16", "128,64,16", "64,128,16", "128,128,16", "32,64,16"]
XLA_TILES = ["256,256", "512,512", "1024,1024", "2048,2048", "512,2048", "2048,512"]
CPU_IMPLS = ["dense", "xla", "numpy_dense", "numpy_chunked", "torch_dense", "torch_chunked",
             "pykeops", "scipy_kde", "sklearn_kde"]
# on the GPU, children run one per implementation in this order, so a run budget that ends early
# cuts the peers' rows before ours
GPU_IMPLS = ["pallas", "xla", "dense", "torch_dense", "torch_chunked", "pykeops"]
# the Mosaic kernels need block_q and block_k multiples of 128 (the TPU's lanes)
TPU_TILES = ["256,1024,64", "512,1024,64", "512,2048,64", "1024,1024,64", "1024,2048,64"]
TPU_IMPLS = ["pallas", "xla", "dense"]
CROSS_SHAPES = ["8x1", "8x16", "32x16"]
# the kernels section: scalegp's paths (auto = xla on the CPU above a million kernel entries; dense
# until the memory limit stops it) and the one peer that has a Matérn-3/2 row
KERNEL_OPTIONS_CPU = {
    "kernel_sizes": [4096, 16384], "kernel_dims": [4], "kernel_outs": [1, 16],
    "kernel_modes": ["fwd", "fwd_bwd"], "kernel_families": list(catalog.KERNEL_FAMILIES),
    "kernel_impls": ["auto", "xla", "dense", "torch_chunked"],
}
KERNEL_OPTIONS_GPU = {**KERNEL_OPTIONS_CPU, "kernel_sizes": [4096, 16384, 65536],
                      "kernel_impls": ["auto", "pallas", "xla", "dense", "torch_chunked"]}
KERNEL_OPTIONS_TPU = {**KERNEL_OPTIONS_GPU, "kernel_impls": ["auto", "pallas", "xla", "dense"]}


def _memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


PRESETS = {
    ("cpu", "quick"): dict(
        sections=list(DEFAULT_SECTIONS), sizes=[1024, 4096, 16384], dims=[8], outs=[16],
        modes=["fwd", "fwd_bwd"], impls=CPU_IMPLS, repeats=5, sample_budget_s=3.0,
        kde_sizes=[1024, 4096], kde_dims=[2, 8],
        peak_sizes=[16384, 65536], peak_modes=["fwd"], peak_impls=CPU_IMPLS,
        ladder=[16384, 32768, 65536], ladder_impls=["dense", "xla"], ladder_timeout=180,
        tile_sizes=[4096], tile_outs=[16], tiles=XLA_TILES, tile_impl="xla",
        cross_sizes=[512, 1024, 1448, 2048], cross_shapes=CROSS_SHAPES,
        cross_impls=["dense", "xla"], cross_rounds=3,
        timeout=300, max_total_s=840, isolate="config", ref_max_n=16384,
        section_budget=["grid=330", "kde=150", "peak=120", "max_n=120", "tiles=40",
                        "crossover=70"],
        **KERNEL_OPTIONS_CPU,
    ),
    ("cpu", "full"): dict(
        sections=list(DEFAULT_SECTIONS), sizes=[1024, 4096, 16384, 65536], dims=[2, 8, 32],
        outs=[1, 16],
        modes=["fwd", "fwd_bwd"], impls=CPU_IMPLS, repeats=5, sample_budget_s=5.0,
        kde_sizes=[1024, 4096, 16384, 65536], kde_dims=[2, 8],
        peak_sizes=[4096, 16384, 65536], peak_modes=["fwd", "fwd_bwd"], peak_impls=CPU_IMPLS,
        ladder=[16384, 32768, 65536, 131072, 262144],
        ladder_impls=["dense", "xla", "numpy_chunked", "torch_chunked", "pykeops"],
        ladder_timeout=600,
        tile_sizes=[4096, 16384], tile_outs=[1, 16], tiles=XLA_TILES, tile_impl="xla",
        cross_sizes=[512, 1024, 1448, 2048], cross_shapes=CROSS_SHAPES,
        cross_impls=["dense", "xla"], cross_rounds=3,
        timeout=900, max_total_s=None, isolate="config", ref_max_n=16384, section_budget=[],
        **KERNEL_OPTIONS_CPU,
    ),
    ("gpu", "quick"): dict(
        sections=list(DEFAULT_SECTIONS), sizes=[1024, 4096, 16384, 65536], dims=[2, 8, 32],
        outs=[1, 16],
        modes=["fwd", "fwd_bwd"], impls=GPU_IMPLS, repeats=5, sample_budget_s=1.0,
        kde_sizes=[1024, 4096, 16384, 65536], kde_dims=[2, 8],
        peak_sizes=[4096, 16384, 65536], peak_modes=["fwd", "fwd_bwd"],
        peak_impls=["pallas", "xla", "dense"],
        ladder=[16384, 32768, 65536, 131072, 262144, 524288, 1048576],
        ladder_impls=["pallas", "xla", "dense"], ladder_timeout=90,
        tile_sizes=[4096, 65536], tile_outs=[1, 16], tiles=RTX3090_TILES, tile_impl="pallas",
        cross_sizes=[512, 1024, 1448, 2048], cross_shapes=CROSS_SHAPES,
        cross_impls=["xla", "pallas"], cross_rounds=3,
        timeout=120, max_total_s=None, isolate="group", ref_max_n=65536, section_budget=[],
        **KERNEL_OPTIONS_GPU,
    ),
}
PRESETS[("gpu", "full")] = dict(PRESETS[("gpu", "quick")])
PRESETS[("tpu", "quick")] = dict(
    PRESETS[("gpu", "quick")], impls=TPU_IMPLS, kde_sizes=[16384, 65536], kde_dims=[8, 2],
    peak_sizes=[16384, 65536], peak_impls=TPU_IMPLS, ladder_impls=TPU_IMPLS, tiles=TPU_TILES,
    cross_sizes=[1024, 2048], isolate="section",
    # the float64 references run on the host's CPU (child.py): up to 16,384 points, as there
    ref_max_n=16384,
    **KERNEL_OPTIONS_TPU,
)
PRESETS[("tpu", "full")] = dict(PRESETS[("tpu", "quick")])


def _words(values):
    """Accepts both ``--x a b`` and ``--x a,b``."""
    out = []
    for v in values or []:
        out.extend(w for w in str(v).replace(",", " ").split() if w)
    return out


def _ints(values):
    return [int(w) for w in _words(values)]


def _tile(text):
    parts = [int(p) for p in str(text).split(",") if p]
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"a tile is 'block_q,block_k[,block_o]', got {text!r}")
    return tuple(parts)


def _shape(text):
    d, _, o = str(text).partition("x")
    try:
        return int(d), int(o)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is 'DIMxOUT' like 8x16, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/kernel_mv.py",
        description="Benchmark scalegp's kernel product and KDE against peers; each "
        "configuration runs in a child process with a timeout. Lists take spaces or commas. "
        "Unset options come from the preset for --device/--preset.",
    )
    a = p.add_argument
    a("--device", choices=("cpu", "gpu", "tpu"), default="cpu",
      help="where JAX runs: cpu, gpu (CUDA), tpu (one chip; JAX_PLATFORMS left to JAX)")
    a("--preset", choices=("quick", "full"), default="quick")
    a("--sections", nargs="+", help=f"of {', '.join(SECTIONS)}")
    a("--sizes", nargs="+", help="grid: n = m")
    a("--dims", nargs="+", help="grid: d")
    a("--outs", nargs="+", help="grid and tiles: o (columns of v)")
    a("--modes", nargs="+", help="fwd, fwd_bwd")
    a("--impls", nargs="+", help="ours (" + ", ".join(catalog.OURS) + ") and peers ("
      + ", ".join(catalog.PEERS) + "); each runs where it applies")
    a("--repeats", type=int, help="samples per configuration")
    a("--tiles", nargs="+", type=_tile, help="tiles section: block_q,block_k[,block_o] ...")
    a("--ladder", nargs="+", help="max_n section: n = m rungs")
    a("--timeout", type=float, help="seconds per configuration")
    a("--out", help="result JSON (default benchmarks/results/kernel_mv_<device>.json)")
    g = p.add_argument_group("per-section choices")
    g.add_argument("--kde-sizes", nargs="+")
    g.add_argument("--kde-dims", nargs="+")
    g.add_argument("--peak-sizes", nargs="+")
    g.add_argument("--peak-modes", nargs="+")
    g.add_argument("--peak-impls", nargs="+")
    g.add_argument("--ladder-impls", nargs="+")
    g.add_argument("--ladder-timeout", type=float, help="seconds per max_n rung")
    g.add_argument("--tile-sizes", nargs="+")
    g.add_argument("--tile-outs", nargs="+")
    g.add_argument("--tile-impl", choices=("xla", "pallas"))
    g.add_argument("--cross-sizes", nargs="+")
    g.add_argument("--cross-shapes", nargs="+", type=_shape, help="DIMxOUT ...")
    g.add_argument("--cross-impls", nargs="+")
    g.add_argument("--cross-rounds", type=int, help="crossover: records per configuration")
    g.add_argument("--kernel-sizes", nargs="+", help="kernels section: n = m")
    g.add_argument("--kernel-dims", nargs="+", help="kernels section: d")
    g.add_argument("--kernel-outs", nargs="+", help="kernels section: o")
    g.add_argument("--kernel-modes", nargs="+", help="kernels section: fwd, fwd_bwd")
    g.add_argument("--kernel-families", nargs="+",
                   help="kernels section: of " + ", ".join(catalog.KERNEL_FAMILIES))
    g.add_argument("--kernel-impls", nargs="+",
                   help="kernels section: ours and peers (each runs where it applies: torch "
                   "peers for kernel_mv and kernel_mv_matern32 only)")
    g.add_argument("--focus-dim", type=int, default=8, help="d of peak, max_n and tiles")
    g.add_argument("--focus-out", type=int, default=16, help="o of peak and max_n")
    r = p.add_argument_group("run control")
    r.add_argument("--max-total-s", type=float,
                   help="run budget in seconds (0: none); configurations past it are recorded "
                   "as skipped")
    r.add_argument("--section-budget", nargs="+", metavar="SECTION=SECONDS",
                   help="time budget of single sections (within --max-total-s), e.g. grid=300")
    r.add_argument("--sample-budget-s", type=float,
                   help="stop taking samples of one configuration after this long")
    r.add_argument("--isolate", choices=("config", "group", "section"),
                   help="grid/kde: a fresh child per configuration (peak_mb on every row), one "
                   "child per implementation (faster start-up; peak_mb only where resettable) or "
                   "one child per section (all implementations, and on a TPU peak and max_n "
                   "too: the fewest start-ups)")
    r.add_argument("--ref-max-n", type=int,
                   help="compute the float64 reference (rel_err) only up to n = m of this")
    r.add_argument("--mem-limit-gb", type=float,
                   help="CPU: address-space limit of each child, so a dense path fails with an "
                   "out-of-memory error instead of swapping or waking the OOM killer "
                   "(default half the machine's memory; 0: none)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, help="threads of the CPU peers (default: all cores)")
    r.add_argument("--keep-work", action="store_true", help="keep the temporary folder")
    r.add_argument("--list", action="store_true", help="print the plan and exit")
    r.add_argument("--quiet", action="store_true")
    return p


LIST_INTS = ("sizes", "dims", "outs", "ladder", "kde_sizes", "kde_dims", "peak_sizes",
             "tile_sizes", "tile_outs", "cross_sizes", "kernel_sizes", "kernel_dims",
             "kernel_outs")
LIST_WORDS = ("sections", "modes", "impls", "peak_modes", "peak_impls", "ladder_impls",
              "cross_impls", "section_budget", "kernel_modes", "kernel_families", "kernel_impls")


def parse(argv=None) -> argparse.Namespace:
    parser = build_parser()
    opts = parser.parse_args(argv)
    preset = PRESETS[(opts.device, opts.preset)]
    for key, value in preset.items():
        if getattr(opts, key, None) is None:
            setattr(opts, key, value)
    for key in LIST_INTS:
        setattr(opts, key, _ints(getattr(opts, key)))
    for key in LIST_WORDS:
        setattr(opts, key, _words(getattr(opts, key)))
    opts.tiles = [t if isinstance(t, tuple) else _tile(t) for t in opts.tiles]
    opts.cross_shapes = [s if isinstance(s, tuple) else _shape(s) for s in opts.cross_shapes]
    if opts.mem_limit_gb is None:
        opts.mem_limit_gb = round(_memory_gb() / 2, 1) if opts.device == "cpu" else 0
    if opts.threads is None:
        opts.threads = harness.core_count()
    if not opts.max_total_s:
        opts.max_total_s = None
    errors = []
    budgets = {}
    for item in opts.section_budget:
        name, _, value = item.partition("=")
        try:
            budgets[name] = float(value)
        except ValueError:
            errors.append(f"--section-budget takes SECTION=SECONDS, got {item!r}")
    opts.section_budget = budgets
    if opts.out is None:
        opts.out = os.path.join("benchmarks", "results", f"kernel_mv_{opts.device}.json")
    errors += [f"unknown section {s!r}" for s in list(opts.sections) + list(budgets)
               if s not in SECTIONS]
    errors += [f"unknown mode {m!r}" for m in opts.modes + opts.peak_modes + opts.kernel_modes
               if m not in catalog.MODES]
    errors += [f"unknown impl {i!r}" for i in opts.impls + opts.peak_impls + opts.ladder_impls
               + opts.cross_impls + opts.kernel_impls if i not in catalog.IMPLS]
    errors += [f"unknown kernel family {f!r}" for f in opts.kernel_families
               if f not in catalog.KERNEL_FAMILIES]
    if errors:
        parser.error("; ".join(errors))
    return opts


def runs_entry(opts) -> dict:
    """The options as the RTX 3090 benchmark's config.runs records them (plus the per-section
    ones)."""
    return {
        "device": opts.device, "preset": opts.preset, "sections": opts.sections,
        "sizes": opts.sizes, "dims": opts.dims, "outs": opts.outs, "modes": opts.modes,
        "impls": opts.impls, "repeats": opts.repeats,
        "tiles": [",".join(map(str, t)) for t in opts.tiles], "ladder": opts.ladder,
        "timeout": opts.timeout, "child": None,
        "kde_sizes": opts.kde_sizes, "kde_dims": opts.kde_dims, "peak_sizes": opts.peak_sizes,
        "peak_modes": opts.peak_modes, "peak_impls": opts.peak_impls,
        "ladder_impls": opts.ladder_impls, "ladder_timeout": opts.ladder_timeout,
        "tile_sizes": opts.tile_sizes, "tile_outs": opts.tile_outs,
        "tile_impl": opts.tile_impl, "cross_sizes": opts.cross_sizes,
        "cross_shapes": [f"{d}x{o}" for d, o in opts.cross_shapes],
        "cross_impls": opts.cross_impls, "cross_rounds": opts.cross_rounds,
        "focus_dim": opts.focus_dim, "focus_out": opts.focus_out,
        "kernel_sizes": opts.kernel_sizes, "kernel_dims": opts.kernel_dims,
        "kernel_outs": opts.kernel_outs, "kernel_modes": opts.kernel_modes,
        "kernel_families": opts.kernel_families, "kernel_impls": opts.kernel_impls,
        "max_total_s": opts.max_total_s, "section_budget": opts.section_budget,
        "sample_budget_s": opts.sample_budget_s,
        "isolate": opts.isolate, "ref_max_n": opts.ref_max_n, "mem_limit_gb": opts.mem_limit_gb,
        "threads": opts.threads, "seed": opts.seed,
    }
