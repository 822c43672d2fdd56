"""The sections of a run, as lists of configuration specs, and the head fields of each record.

A spec is a plain dict (it travels to the child as JSON):
  kind      "time" (median of calibrated samples), "single" (one call incl. compile: peak, max_n),
            "reference" (float64 reference saved to ``ref``), "machine" (the device block)
  family, impl, mode, n, m, dim, out, batch, block_q/block_k/block_o (tiles), rounds (crossover)
  repeats, sample_budget_s, ref (path of the reference, or None), measure_peak, timeout, seed

Section -> family:
  grid      kernel_mv            sizes x dims x outs x modes x impls, n = m
  kde       kde_density          kde_sizes x kde_dims x modes x impls (kde-capable)
  peak      kernel_mv_peak       peak_sizes x peak_modes x peak_impls, dim/out = focus_dim/out
  max_n     kernel_mv_max_n      ladder x ladder_impls (each climbs until its first error), fwd_bwd
  tiles     kernel_mv_tiles      tile_sizes x tile_outs x modes x tiles, impl = tile_impl
  crossover kernel_mv_crossover  cross_sizes x cross_shapes x modes x cross_impls, rounds repeats
  kernels   kernel_mv, kernel_mv_matern32, kernel_mv_composite
                                 kernel_sizes x kernel_dims x kernel_outs x kernel_modes x
                                 kernel_families x kernel_impls, n = m (opt-in: not in any
                                 preset's default sections)
"""

from __future__ import annotations

import itertools

from benchmarks.kmv import catalog
from benchmarks.kmv.catalog import (
    COMPOSITE,
    CROSSOVER,
    KDE,
    KERNEL_FAMILIES,
    KMV,
    MATERN32,
    MAX_N,
    PEAK,
    TILES,
)

SECTIONS = ("grid", "kde", "peak", "max_n", "tiles", "crossover", "kernels")
#: What a preset runs when --sections is not given: every section but kernels, which is asked for.
DEFAULT_SECTIONS = SECTIONS[:-1]
FAMILY = {"grid": KMV, "kde": KDE, "peak": PEAK, "max_n": MAX_N, "tiles": TILES,
          "crossover": CROSSOVER}


def record_head(spec: dict) -> dict:
    """The identifying fields of a record, in the RTX 3090 benchmark's order for its family."""
    f, s = spec["family"], spec
    if f in (KMV, MATERN32, COMPOSITE):
        keys = ("family", "impl", "mode", "batch", "n", "m", "dim", "out")
    elif f == KDE:
        keys = ("family", "impl", "mode", "n", "m", "dim")
    elif f in (PEAK, MAX_N):
        keys = ("family", "impl", "mode", "n", "dim", "out")
    elif f == TILES:
        keys = ("family", "impl", "mode", "n", "m", "dim", "out", "block_q", "block_k", "block_o")
    elif f == CROSSOVER:
        keys = ("family", "impl", "mode", "repeat", "batch", "n", "m", "dim", "out")
    else:
        raise ValueError(f"unknown family {f!r}")
    return {k: s[k] for k in keys if s.get(k) is not None}


def describe(spec: dict) -> str:
    """One short line naming a configuration, for progress output."""
    parts = [spec.get("family", spec["kind"]), spec.get("impl", ""), spec.get("mode", "")]
    if "n" in spec:
        parts.append(f"n={spec['n']}" + (f" m={spec['m']}" if spec.get("m") != spec["n"] else ""))
        parts.append(f"d={spec['dim']}")
        if spec.get("family") != KDE:
            parts.append(f"o={spec['out']}")
    tiles = [str(spec[k]) for k in ("block_q", "block_k", "block_o") if spec.get(k) is not None]
    if tiles:
        parts.append("tiles=" + ",".join(tiles))
    return " ".join(p for p in parts if p)


def _spec(family, impl, mode, n, d, o, opts, **extra):
    spec = {
        "kind": "time", "family": family, "impl": impl, "mode": mode, "batch": 1,
        "n": n, "m": n, "dim": d, "out": o if family != KDE else 1,
        "repeats": opts.repeats, "sample_budget_s": opts.sample_budget_s,
        "timeout": opts.timeout, "seed": opts.seed,
    }
    spec.update(extra)
    return spec


def impls_for(impls, family, mode, device):
    return [i for i in impls if catalog.applies(i, family, mode, device)]


def grid_configs(opts):
    """(family, n, d, o, mode) of the grid or kde section, smallest first."""
    out = []
    for n, d, o, mode in itertools.product(opts.sizes, opts.dims, opts.outs, opts.modes):
        out.append((KMV, n, d, o, mode))
    return sorted(out, key=lambda c: (c[1], c[2], c[3], c[4] != "fwd"))


def kde_configs(opts):
    out = [(KDE, n, d, 1, mode)
           for n, d, mode in itertools.product(opts.kde_sizes, opts.kde_dims, opts.modes)]
    return sorted(out, key=lambda c: (c[1], c[2], c[4] != "fwd"))


def kernel_configs(opts):
    """(family, n, d, o, mode) of the kernels section, smallest first, RBF first at each shape."""
    order = {f: i for i, f in enumerate(KERNEL_FAMILIES)}
    out = [(family, n, d, o, mode) for n, d, o, mode, family in itertools.product(
        opts.kernel_sizes, opts.kernel_dims, opts.kernel_outs, opts.kernel_modes,
        opts.kernel_families)]
    return sorted(out, key=lambda c: (c[1], c[2], c[3], c[4] != "fwd", order.get(c[0], 9)))


def timed_specs(configs, impls, opts):
    """Specs for grid/kde: one per (config, applicable impl), config-major."""
    specs = []
    for family, n, d, o, mode in configs:
        for impl in impls_for(impls, family, mode, opts.device):
            specs.append(_spec(family, impl, mode, n, d, o, opts))
    return specs


def peak_specs(opts):
    specs = []
    for n, mode in itertools.product(sorted(opts.peak_sizes), opts.peak_modes):
        for impl in impls_for(opts.peak_impls, PEAK, mode, opts.device):
            specs.append(_spec(PEAK, impl, mode, n, opts.focus_dim, opts.focus_out, opts,
                               kind="single", timeout=opts.timeout))
    return specs


def ladder_specs(opts):
    """{impl: specs in ascending n}: the runner climbs each until its first error."""
    out = {}
    for impl in impls_for(opts.ladder_impls, MAX_N, "fwd_bwd", opts.device):
        out[impl] = [
            _spec(MAX_N, impl, "fwd_bwd", n, opts.focus_dim, opts.focus_out, opts,
                  kind="single", timeout=opts.ladder_timeout)
            for n in sorted(opts.ladder)
        ]
    return out


def tile_specs(opts):
    specs = []
    for n, o, mode, tile in itertools.product(
        sorted(opts.tile_sizes), opts.tile_outs, opts.modes, opts.tiles
    ):
        blocks = dict(zip(("block_q", "block_k", "block_o"), tile))
        specs.append(_spec(TILES, opts.tile_impl, mode, n, opts.focus_dim, o, opts, **blocks))
    return specs


def crossover_specs(opts):
    """{impl: specs}: each spec yields ``cross_rounds`` records (field "repeat")."""
    out = {}
    configs = sorted(itertools.product(opts.cross_sizes, opts.cross_shapes, opts.modes))
    for impl in impls_for(opts.cross_impls, CROSSOVER, "fwd", opts.device):
        out[impl] = [
            _spec(CROSSOVER, impl, mode, n, d, o, opts, rounds=opts.cross_rounds)
            for n, (d, o), mode in configs
            if catalog.applies(impl, CROSSOVER, mode, opts.device)
        ]
    return out


def reference_spec(family, mode, n, d, o, path, opts):
    return {"kind": "reference", "family": family, "mode": mode, "n": n, "m": n, "dim": d,
            "out": o, "ref": path, "seed": opts.seed, "timeout": opts.timeout}
