"""Markdown tables from kernel_mv benchmark JSON files, comparisons, and merging.

    python benchmarks/report.py tables RESULT.json [MORE.json ...] [-o OUT.md]
    python benchmarks/report.py tables RESULT.json --update-readme benchmarks/README.md
    python benchmarks/report.py compare NEW.json OLD.json [--family kernel_mv] [--map auto=pallas]
    python benchmarks/report.py merge A.json B.json -o ALL.json

``tables`` renders the sections of the RTX 3090 benchmark's summary (../shared/seed/SUMMARY.md:
kernel_mv, kde_density, peak, max_n, tiles, crossover), an accuracy table, a table of our default
path against the fastest peer and, for the kernels section, the RBF, Matérn-3/2 and composite
kernels side by side with their ratios to the RBF. ``compare`` matches rows of two files by configuration and prints new/old ratios of
median_ms (of peak_mb and run_s for the peak and max_n families). Cells: the median ms per call,
"OOM" for out-of-memory errors, "timeout", "skip" (run budget spent), "err" for other errors,
blank where nothing ran.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

KMV, KDE = "kernel_mv", "kde_density"
PEAK, MAX_N = "kernel_mv_peak", "kernel_mv_max_n"
TILES, CROSS = "kernel_mv_tiles", "kernel_mv_crossover"
MATERN32, COMPOSITE = "kernel_mv_matern32", "kernel_mv_composite"
IMPL_ORDER = ("dense", "xla", "pallas", "auto", "numpy_dense", "numpy_chunked", "torch_dense",
              "torch_chunked", "pykeops", "scipy_kde", "sklearn_kde")
OURS = ("dense", "xla", "pallas", "auto")
MODE_ORDER = {"fwd": 0, "fwd_bwd": 1}
OOM = re.compile(r"RESOURCE_EXHAUSTED|out of memory|OutOfMemory|MemoryError|"
                 r"can't allocate memory|Cannot allocate memory|SIGKILL", re.I)
README_BEGIN = "<!-- tables:begin -->"
README_END = "<!-- tables:end -->"


# ----------------------------------------------------------------------------------------------
# loading and merging


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def merge(docs: list[dict]) -> dict:
    """One document from several: results concatenated, config.runs and auto choices united."""
    if not docs:
        raise ValueError("nothing to merge")
    out = {"device": docs[0].get("device", {}), "config": {"runs": {}}, "results": []}
    auto, skipped = [], {}
    for doc in docs:
        dev = doc.get("device", {})
        first = out["device"]
        if (dev.get("backend"), dev.get("device_kind")) != (first.get("backend"),
                                                            first.get("device_kind")):
            print(f"warning: merging results from {dev.get('device_kind')} into "
                  f"{first.get('device_kind')}", file=sys.stderr)
        cfg = doc.get("config", {})
        for key, value in cfg.items():
            if key == "runs":
                out["config"]["runs"].update(value)
            elif key == "auto":
                auto.extend(a for a in value if a not in auto)
            elif key == "skipped":
                skipped.update(value)
            else:
                out["config"].setdefault(key, value)
        out["results"].extend(doc.get("results", []))
    out["config"]["auto"] = auto
    out["config"]["skipped"] = skipped
    return out


# ----------------------------------------------------------------------------------------------
# cells


def g3(x) -> str:
    """Three significant digits, as in SUMMARY.md (0.0497, 5, 17.7, 100)."""
    return f"{x:.3g}"


def g4(x) -> str:
    return f"{x:.4g}"


def error_cell(text: str) -> str:
    if text.startswith("skipped"):
        return "skip"
    if text.startswith("timeout"):
        return "timeout"
    return "OOM" if OOM.search(text) else "err"


def impl_label(impl: str) -> str:
    return impl.split("@")[0]


def order_impls(impls) -> list[str]:
    known = [i for i in IMPL_ORDER if i in impls]
    return known + sorted(i for i in impls if i not in IMPL_ORDER)


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _by_key(records, key):
    """{key(record): {impl: [records]}}."""
    out: dict = {}
    for r in records:
        out.setdefault(key(r), {}).setdefault(r["impl"], []).append(r)
    return out


def _time_cell(recs) -> str:
    ok = [r["median_ms"] for r in recs if "median_ms" in r]
    if ok:
        return g3(statistics.median(ok))
    errs = [r["error"] for r in recs if "error" in r]
    return error_cell(errs[0]) if errs else ""


def _is_backend(doc, name) -> bool:
    return doc.get("device", {}).get("backend") == name


# ----------------------------------------------------------------------------------------------
# tables


def timing_table(records, family, title) -> list[str]:
    rows = [r for r in records if r["family"] == family]
    if not rows:
        return []
    impls = order_impls({r["impl"] for r in rows})
    groups = _by_key(rows, lambda r: (MODE_ORDER.get(r["mode"], 9), r["mode"], r["n"], r["dim"],
                                      r.get("out", 1)))
    body = [[mode, n, dim, out] + [_time_cell(cells.get(i, [])) for i in impls]
            for (_, mode, n, dim, out), cells in sorted(groups.items())]
    header = ["mode", "n=m", "dim", "out"] + [impl_label(i) for i in impls]
    return [f"## {title}", ""] + _table(header, body) + [""]


def peak_table(doc, records) -> list[str]:
    rows = [r for r in records if r["family"] == PEAK]
    if not rows:
        return []
    impls = order_impls({r["impl"] for r in rows})
    dims = sorted({(r["dim"], r["out"]) for r in rows})
    what = ("peak device memory" if _is_backend(doc, "gpu") or _is_backend(doc, "tpu")
            else "peak resident memory of the child process")
    shape = ", ".join(f"dim={d}, out={o}" for d, o in dims)
    groups = _by_key(rows, lambda r: (MODE_ORDER.get(r["mode"], 9), r["mode"], r["n"]))

    def cell(recs):
        if not recs:
            return ""
        r = recs[-1]
        return error_cell(r["error"]) if "error" in r else g4(r["peak_mb"])

    body = [[mode, n] + [cell(cells.get(i, [])) for i in impls]
            for (_, mode, n), cells in sorted(groups.items())]
    return ([f"## {what} (MB), n=m, {shape}", ""]
            + _table(["mode", "n"] + [impl_label(i) for i in impls], body) + [""])


def max_n_table(doc, records) -> list[str]:
    rows = [r for r in records if r["family"] == MAX_N]
    if not rows:
        return []
    impls = order_impls({r["impl"] for r in rows})
    dims = sorted({(r["mode"], r["dim"], r["out"]) for r in rows})
    shape = ", ".join(f"{m}, dim={d}, out={o}" for m, d, o in dims)
    groups = _by_key(rows, lambda r: r["n"])

    def cell(recs):
        if not recs:
            return ""
        r = recs[-1]
        if "error" in r:
            return r["error"] if r["error"].startswith("timeout") else error_cell(r["error"])
        return f"{g3(r['run_s'])} s / {g4(r['peak_mb'])} MB"

    body = [[n] + [cell(cells.get(i, [])) for i in impls] for n, cells in sorted(groups.items())]
    return ([f"## largest n, {shape} (wall seconds for one call incl. compile; peak MB)", ""]
            + _table(["n"] + [impl_label(i) for i in impls], body) + [""])


def _tile_key(r) -> str:
    return ",".join(str(r[k]) for k in ("block_q", "block_k", "block_o") if r.get(k) is not None)


def tiles_table(records) -> list[str]:
    rows = [r for r in records if r["family"] == TILES]
    if not rows:
        return []
    tiles = list(dict.fromkeys(_tile_key(r) for r in rows))
    impls = order_impls({r["impl"] for r in rows})
    several = len(impls) > 1
    dims = sorted({r["dim"] for r in rows})
    groups: dict = {}
    for r in rows:
        key = (r["impl"] if several else "", MODE_ORDER.get(r["mode"], 9), r["mode"], r["n"],
               r["out"])
        groups.setdefault(key, {}).setdefault(_tile_key(r), []).append(r)
    body = [([impl] if several else []) + [mode, n, out] + [_time_cell(c.get(t, [])) for t in tiles]
            for (impl, _, mode, n, out), c in sorted(groups.items())]
    header = (["impl"] if several else []) + ["mode", "n", "out"] + tiles
    label = ",".join(k for k in ("block_q", "block_k", "block_o")
                     if any(r.get(k) is not None for r in rows))
    title = f"## tile sweep{' (' + impls[0] + ')' if not several else ''}, " \
            f"dim={','.join(map(str, dims))} ({label} → median ms)"
    return [title, ""] + _table(header, body) + [""]


def crossover_table(records) -> list[str]:
    rows = [r for r in records if r["family"] == CROSS]
    if not rows:
        return []
    impls = order_impls({r["impl"] for r in rows})
    repeats = len({r.get("repeat", 0) for r in rows})
    groups = _by_key(rows, lambda r: (MODE_ORDER.get(r["mode"], 9), r["mode"], r["n"], r["dim"],
                                      r["out"]))
    body = [[mode, n, dim, out] + [_time_cell(cells.get(i, [])) for i in impls]
            for (_, mode, n, dim, out), cells in sorted(groups.items())]
    title = (f"## small-size crossover, {' vs '.join(impl_label(i) for i in impls)} "
             f"(median of {repeats} repeats, ms)")
    return [title, ""] + _table(["mode", "n", "dim", "out"] + [impl_label(i) for i in impls],
                                body) + [""]


def kernels_table(records) -> list[str]:
    """The kernels section: RBF (kernel_mv), Matérn-3/2 and composite ms per (mode, n, dim, out,
    impl) and the ratios to the RBF, at the shapes where a Matérn or composite row exists."""
    expr = [r for r in records if r["family"] in (MATERN32, COMPOSITE)]
    if not expr:
        return []
    shapes = {(r["n"], r["dim"], r.get("out", 1)) for r in expr}
    rows = [r for r in records if r["family"] in (KMV, MATERN32, COMPOSITE)
            and (r["n"], r["dim"], r.get("out", 1)) in shapes]
    groups: dict = {}
    for r in rows:
        rank = IMPL_ORDER.index(r["impl"]) if r["impl"] in IMPL_ORDER else 99
        key = (MODE_ORDER.get(r["mode"], 9), r["mode"], r["n"], r["dim"], r.get("out", 1), rank,
               r["impl"])
        groups.setdefault(key, {}).setdefault(r["family"], []).append(r)

    def ms(recs):
        ok = [r["median_ms"] for r in recs if "median_ms" in r]
        return statistics.median(ok) if ok else None

    body = []
    for (_, mode, n, dim, out, _, impl), fams in sorted(groups.items()):
        if MATERN32 not in fams and COMPOSITE not in fams:
            continue  # an RBF-only impl (a peer without Matérn rows)
        base = ms(fams.get(KMV, []))
        cells, ratios = [], []
        for fam in (KMV, MATERN32, COMPOSITE):
            cells.append(_time_cell(fams.get(fam, [])))
            if fam != KMV:
                mine = ms(fams.get(fam, []))
                ratios.append(f"{mine / base:.2f}" if mine is not None and base else "")
        body.append([mode, n, dim, out, impl_label(impl)] + cells + ratios)
    header = ["mode", "n=m", "dim", "out", "impl", "RBF", "Matérn-3/2", "composite",
              "Matérn/RBF", "composite/RBF"]
    title = ("## kernels: RBF, Matérn-3/2 (ARD) and the composite kernel (median ms; ratios "
             "to the RBF)")
    note = ("composite = 1.0·RBF(L) + 0.5·RBF(2L)·ExpSineSquared(1.0, period=L) + "
            "0.5·RationalQuadratic(L, α=1.5) + 0.25·Matern(L, ν=1/2), L = √d "
            "(benchmarks/kmv/problems.py).")
    return [title, "", note, ""] + _table(header, body) + [""]


def accuracy_table(records) -> list[str]:
    rows = [r for r in records if isinstance(r.get("rel_err"), (int, float, dict))]
    if not rows:
        return []
    cols = ["fwd", "dq", "dk", "dv", "dlengthscale", "dbandwidth", "dhyper", "dhyper_max"]
    worst: dict = {}
    for r in rows:
        errs = r["rel_err"] if isinstance(r["rel_err"], dict) else {"fwd": r["rel_err"]}
        slot = worst.setdefault((r["family"], r["impl"]), {})
        for k, v in errs.items():
            if isinstance(v, (int, float)):
                slot[k] = max(slot.get(k, 0.0), v) if not math.isnan(v) else math.nan
    used = [c for c in cols if any(c in s for s in worst.values())]
    fam_order = {KMV: 0, KDE: 1, MATERN32: 2, COMPOSITE: 3}

    def rank(item):
        (fam, impl), _ = item
        return (fam_order.get(fam, 9), IMPL_ORDER.index(impl) if impl in IMPL_ORDER else 99, impl)

    body = [[fam, impl_label(impl)] + [f"{s[c]:.1e}" if c in s else "" for c in used]
            for (fam, impl), s in sorted(worst.items(), key=rank)]
    return (["## accuracy: largest rel_err against the float64 reference, over all sizes", ""]
            + _table(["family", "impl"] + used, body) + [""])


def _default_impl(doc, family, n, dim, out):
    for a in doc.get("config", {}).get("auto", []):
        if (a["n"], a["dim"], a.get("out", 1)) == (n, dim, 1 if family == KDE else out):
            return a["impl"]
    return None


def ours_vs_peers_table(doc, records) -> list[str]:
    """Our default path (impl='auto', or what auto picks) against the fastest peer."""
    rows = [r for r in records
            if r["family"] in (KMV, KDE, MATERN32, COMPOSITE) and "median_ms" in r]
    groups = _by_key(rows, lambda r: (r["family"], MODE_ORDER.get(r["mode"], 9), r["mode"],
                                      r["n"], r["dim"], r.get("out", 1)))
    body, ours_ms = [], {}
    for (fam, _, mode, n, dim, out), cells in sorted(groups.items()):
        default = "auto" if "auto" in cells else _default_impl(doc, fam, n, dim, out)
        if default not in cells:
            continue
        mine = statistics.median(r["median_ms"] for r in cells[default])
        ours_ms[(fam, mode, n, dim, out)] = mine
        peers = {i: statistics.median(r["median_ms"] for r in rs)
                 for i, rs in cells.items() if i not in OURS and "@" not in i}
        if not peers:
            continue
        best = min(peers, key=peers.get)
        ratio = ""
        if mode == "fwd_bwd" and (fam, "fwd", n, dim, out) in ours_ms:
            ratio = g3(mine / ours_ms[(fam, "fwd", n, dim, out)])
        body.append([fam, mode, n, dim, out, default, g3(mine), best, g3(peers[best]),
                     f"{peers[best] / mine:.2f}x", ratio])
    if not body:
        return []
    header = ["family", "mode", "n=m", "dim", "out", "ours", "ms", "fastest peer", "ms",
              "speed-up", "ours fwd_bwd/fwd"]
    return (["## our default path against the fastest peer measured in the same run", "",
             "ours = impl 'auto' when measured, else the implementation auto picks at that size "
             "(config.auto); speed-up = peer ms / ours ms.", ""]
            + _table(header, body) + [""])


def render(doc: dict) -> str:
    dev = doc.get("device", {})
    records = doc.get("results", [])
    what = dev.get("gpu") or dev.get("device_kind")
    if dev.get("backend") == "cpu":
        what = f"{dev.get('cpu')}, {dev.get('cpu_count')} cores"
    head = [f"Device: {what}; jax {dev.get('jax')}, backend {dev.get('backend')}"
            + (f", torch {dev['torch']}" if dev.get("torch") else "")
            + (f", pykeops {dev['pykeops']}" if dev.get("pykeops") else "")
            + ". Times are median ms per call.", ""]
    skipped = doc.get("config", {}).get("skipped") or {}
    if skipped:
        head += ["Skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + ".", ""]
    parts = [
        head,
        timing_table(records, KMV, "kernel_mv"),
        timing_table(records, KDE, "kde_density"),
        ours_vs_peers_table(doc, records),
        kernels_table(records),
        peak_table(doc, records),
        max_n_table(doc, records),
        tiles_table(records),
        crossover_table(records),
        accuracy_table(records),
    ]
    return "\n".join(line for part in parts for line in part).rstrip() + "\n"


def update_readme(path, text: str) -> None:
    path = Path(path)
    readme = path.read_text()
    if README_BEGIN not in readme or README_END not in readme:
        raise SystemExit(f"{path} has no {README_BEGIN} ... {README_END} block")
    before, rest = readme.split(README_BEGIN, 1)
    _, after = rest.split(README_END, 1)
    path.write_text(f"{before}{README_BEGIN}\n{text}{README_END}{after}")


# ----------------------------------------------------------------------------------------------
# compare


def _key(r, impl_map):
    impl = impl_map.get(r["impl"], r["impl"])
    return (r["family"], impl, r["mode"], r["n"], r.get("m", r["n"]), r["dim"], r.get("out", 1),
            _tile_key(r))


def _values(recs) -> dict:
    out = {}
    for field in ("median_ms", "peak_mb", "run_s"):
        vals = [r[field] for r in recs if isinstance(r.get(field), (int, float))]
        if vals:
            out[field] = statistics.median(vals)
    return out


def compare(new: dict, old: dict, family=None, impl_map=None) -> str:
    impl_map = impl_map or {}
    groups = []
    for doc, mapping in ((new, {}), (old, impl_map)):
        g: dict = {}
        for r in doc.get("results", []):
            if family and r["family"] != family:
                continue
            g.setdefault(_key(r, mapping), []).append(r)
        groups.append(g)
    gnew, gold = groups
    field_of = {PEAK: "peak_mb", MAX_N: "run_s"}
    body, ratios = [], {}
    for key in sorted(set(gnew) & set(gold), key=lambda k: (k[0], k[1], MODE_ORDER.get(k[2], 9),
                                                           k[3:])):
        fam, impl, mode, n, m, dim, out, tiles = key
        field = field_of.get(fam, "median_ms")
        a, b = _values(gnew[key]).get(field), _values(gold[key]).get(field)
        cell = lambda v, recs: g3(v) if v is not None else error_cell(  # noqa: E731
            next((r["error"] for r in recs if "error" in r), "err"))
        ratio = ""
        if a is not None and b is not None and b > 0:
            ratio = f"{a / b:.3g}"
            ratios.setdefault((fam, impl, mode), []).append(a / b)
        body.append([fam, impl, mode, n, dim, out, tiles, field, cell(a, gnew[key]),
                     cell(b, gold[key]), ratio])
    lines = ["## new / old, row by row", ""]
    lines += _table(["family", "impl", "mode", "n", "dim", "out", "tiles", "value", "new", "old",
                     "new/old"], body)
    summary = [[fam, impl, mode, len(v), f"{math.exp(statistics.fmean(map(math.log, v))):.3g}"]
               for (fam, impl, mode), v in sorted(ratios.items())]
    lines += ["", "## geometric mean of new/old", ""]
    lines += _table(["family", "impl", "mode", "rows", "new/old"], summary)
    only_new, only_old = len(set(gnew) - set(gold)), len(set(gold) - set(gnew))
    lines += ["", f"{len(body)} rows matched; {only_new} only in new, {only_old} only in old."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/report.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tables", help="markdown tables of one or more result files (merged)")
    t.add_argument("files", nargs="+")
    t.add_argument("-o", "--out", help="write the markdown here instead of stdout")
    t.add_argument("--update-readme", metavar="README",
                   help=f"replace the {README_BEGIN} ... {README_END} block of this file")
    c = sub.add_parser("compare", help="ratios new/old of two result files, row by row")
    c.add_argument("new")
    c.add_argument("old")
    c.add_argument("--family", help="only this family (e.g. kernel_mv)")
    c.add_argument("--map", nargs="*", default=[], metavar="OLD=NEW",
                   help="compare old impl OLD against new impl NEW, e.g. "
                   "default@gpu-benchmarks=pallas")
    c.add_argument("-o", "--out")
    mg = sub.add_parser("merge", help="concatenate result files into one")
    mg.add_argument("files", nargs="+")
    mg.add_argument("-o", "--out", required=True)
    args = p.parse_args(argv)

    if args.command == "merge":
        doc = merge([load(f) for f in args.files])
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{args.out}: {len(doc['results'])} rows", file=sys.stderr)
        return 0
    if args.command == "tables":
        text = render(merge([load(f) for f in args.files]))
        if args.update_readme:
            update_readme(args.update_readme, text)
    else:
        mapping = dict(pair.split("=", 1) for pair in args.map)
        text = compare(load(args.new), load(args.old), args.family, mapping)
    if args.out:
        Path(args.out).write_text(text)
    elif not getattr(args, "update_readme", None):
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
