"""The Mosaic backend on a TPU chip: correctness compiled (every product and gradient against
float64 on the host), the chip's own arithmetic (exp, log, the split bfloat16 products), and
the speeds issue 60 sets targets for (K v and the KDE at 65,536², forward and backward, a tile
sweep, the 1,048,576² forward, the pruned products), each beside the xla backend in the same
run, and the products' device memory (XLA's compiled memory analysis).

    PYTHONPATH=. python benchmarks/tpu/mosaic_check.py --out OUT/mosaic_check.json
    PYTHONPATH=. python benchmarks/tpu/mosaic_check.py --quick --out /tmp/m.json   # CPU,
        interpret mode, tiny shapes: the script's own test
    PYTHONPATH=. python benchmarks/tpu/mosaic_check.py --compile-only --sections memory \
        --out OUT/memory.json      # no chip: compiled for a v5e by libtpu (compile_only_device)

The JSON is rewritten after every case, so a run cut short keeps what it measured. Exit status
1 if a correctness case fails its bound.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np

from scalegp.ops import (
    RBF,
    ExpSineSquared,
    Matern,
    kernel_mv,
    rbf_kde_density,
    rbf_kernel_mv,
)
from scalegp.ops.backends.mosaic import _blocks
from scalegp.ops.backends.mosaic._blocks import MosaicParams

#: Norm-wise bounds against float64 (issue 60): K v and its gradients, the KDE's absolute
#: log-density error.
MV_BOUND, GRAD_BOUND, LOG_BOUND = 1e-5, 1e-5, 2e-5


def _timed(fn, *args, repeats):
    out = jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def _sq_dist_f64(q, x):
    """(p, m) squared distances by the coordinate differences, in float64."""
    out = np.zeros((q.shape[0], x.shape[0]))
    for f in range(q.shape[1]):
        out += (q[:, f][:, None] - x[:, f][None, :]) ** 2
    return out


def _mv_f64(x1, x2, v, ls):
    return np.concatenate([np.exp(-0.5 * _sq_dist_f64(c / ls, x2 / ls)) @ v
                           for c in np.array_split(x1, max(1, len(x1) // 32))])


def _log_kde_f64(q, x, h):
    d = x.shape[1]
    rows = []
    for c in np.array_split(q, max(1, len(q) // 32)):
        e = -0.5 * _sq_dist_f64(c / h, x / h)
        top = e.max(1, keepdims=True)
        rows.append(top[:, 0] + np.log(np.exp(e - top).sum(1)))
    return (np.concatenate(rows) - np.log(x.shape[0]) - d * np.log(h)
            - 0.5 * d * np.log(2 * np.pi))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@contextlib.contextmanager
def _host_float64():
    """float64 on the host's CPU for the references (the chip has no float64)."""
    with jax.default_device(jax.devices("cpu")[0]):
        jax.config.update("jax_enable_x64", True)
        try:
            yield
        finally:
            jax.config.update("jax_enable_x64", False)


class Report:
    def __init__(self, path):
        self.path = Path(path)
        self.data = {"device": str(jax.devices()[0].device_kind),
                     "platform": jax.default_backend(),
                     "jax": jax.__version__, "python": platform.python_version(),
                     "command": " ".join(sys.argv), "sections": {}}
        self.failed = []

    @contextlib.contextmanager
    def case(self, section, row, checked=False):
        """Runs the body, which fills ``row``, then adds the row to ``section``: an exception
        is recorded in it and the run goes on; a ``checked`` row counts as failed unless the
        body set its "ok" true."""
        try:
            yield row
        except Exception as exc:  # noqa: BLE001 -- recorded, the run goes on
            row.update(error=f"{type(exc).__name__}: {exc}"[:1500])
            traceback.print_exc()
        if checked and not row.get("ok"):
            row["ok"] = False
            self.failed.append(row)
        self.add(section, row)

    def add(self, section, row):
        self.data["sections"].setdefault(section, []).append(row)
        print(section, json.dumps(row), flush=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))


# ----------------------------------------------------------------------------------------------


def _elementwise_rows(report, where, exp_rel_err, log_abs_err):
    for what, err in (("exp, rel err", exp_rel_err), ("log, abs err", log_abs_err)):
        report.add("probe", {"what": f"{where} {what} max / mean",
                             "max": float(np.max(np.abs(err))), "mean": float(np.mean(err))})


def probe(report, quick):
    """The chip's exp and log against float64, in XLA and in a Mosaic kernel; the split
    products (`_blocks.split_dot`, `piece_operands`) against float64."""
    rng = np.random.default_rng(0)
    x = -np.sort(rng.uniform(0, 30, 4096 if quick else 1 << 16)).astype(np.float32)
    e_ref = np.exp(x.astype(np.float64))
    e_xla = np.asarray(jax.jit(jnp.exp)(x), np.float64)
    y = np.exp(rng.uniform(0, 12, x.size)).astype(np.float32)
    l_ref = np.log(y.astype(np.float64))
    l_xla = np.asarray(jax.jit(jnp.log)(y), np.float64)
    _elementwise_rows(report, "xla", e_xla / e_ref - 1, l_xla - l_ref)

    from jax.experimental import pallas as pl

    def kern(x_ref, y_ref, ex_ref, ly_ref):
        ex_ref[...] = jnp.exp(x_ref[...])
        ly_ref[...] = jnp.log(y_ref[...])

    shape = (x.size // 128, 128)
    ex, ly = pl.pallas_call(kern, out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32)] * 2,
                            interpret=jax.default_backend() == "cpu")(
        x.reshape(shape), y.reshape(shape))
    ex, ly = np.asarray(ex, np.float64).ravel(), np.asarray(ly, np.float64).ravel()
    _elementwise_rows(report, "mosaic", ex / e_ref - 1, ly - l_ref)

    t = rng.uniform(0, 1, (256, 1024)).astype(np.float32)
    v = rng.standard_normal((1024, 16)).astype(np.float32)
    ref = t.astype(np.float64) @ v.astype(np.float64)
    out = jax.jit(lambda t, v: _blocks.fold(_blocks.split_dot(t, _blocks.split_thin(v)), 16))(
        t, v)
    default = jax.jit(lambda t, v: jnp.dot(t, v))(t, v)
    report.add("probe", {"what": "split_dot (tile @ thin)", "rel_err": _rel(out, ref),
                         "default_precision_rel_err": _rel(default, ref)})
    a = (rng.standard_normal((256, 10)) * 3 + 5).astype(np.float32)
    b = (rng.standard_normal((512, 10)) * 3 + 5).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    out = jax.jit(lambda a, b: jnp.dot(*_blocks.piece_operands(a, b),
                                       preferred_element_type=jnp.float32))(a, b)
    report.add("probe", {"what": "piece_operands (thin @ thin)", "rel_err": _rel(out, ref)})


def check(report, quick):
    """Forward and every gradient of impl="mosaic" against float64, offset data, several
    lengthscales, odd sizes; the bounds of issue 60."""
    rng = np.random.default_rng(1)
    n_big = 512 if quick else 4096
    cases = [(n_big, n_big + 77, 8, 16, 1.0), (n_big, n_big - 33, 2, 1, 0.3),
             (333, 1000, 17, 5, 2.0), (1, 700, 3, 4, 0.5), (n_big, n_big, 8, 16, 0.1)]
    for n, m, d, o, ls in cases:
        row = {"n": n, "m": m, "d": d, "o": o, "lengthscale": ls}
        with report.case("check_mv", row, checked=True):
            x1 = (rng.standard_normal((n, d)) + 3.0).astype(np.float32)
            x2 = (rng.standard_normal((m, d)) + 3.0).astype(np.float32)
            v = rng.standard_normal((m, o)).astype(np.float32)
            g = rng.standard_normal((n, o)).astype(np.float32)
            out = rbf_kernel_mv(x1, x2, v, ls, impl="mosaic")
            ref = _mv_f64(*(t.astype(np.float64) for t in (x1, x2, v)), ls)
            row["mv_rel_err"] = _rel(out, ref)
            grads = jax.grad(lambda *t, g=g: jnp.sum(rbf_kernel_mv(*t, impl="mosaic") * g),
                             (0, 1, 2, 3))(x1, x2, v, jnp.float32(ls))
            with _host_float64():
                g64 = jax.grad(lambda *t, g=g: jnp.sum(rbf_kernel_mv(*t, impl="dense") * g),
                               (0, 1, 2, 3))(*(np.asarray(t, np.float64) for t in (x1, x2, v)),
                                             np.float64(ls))
            for name, got, want in zip(("dx1", "dx2", "dv", "dlengthscale"), grads, g64):
                row[name + "_rel_err"] = _rel(got, want)
            ok = row["mv_rel_err"] <= MV_BOUND and all(
                row[k + "_rel_err"] <= GRAD_BOUND for k in ("dx1", "dx2", "dv", "dlengthscale"))
            row["ok"] = bool(ok)

    for n, m, d, h in [(n_big, n_big + 5, 2, 0.3), (n_big, n_big, 8, 1.0), (700, 300, 3, 0.05)]:
        row = {"n": n, "m": m, "d": d, "bandwidth": h}
        with report.case("check_kde", row, checked=True):
            q = (rng.standard_normal((n, d)) + 3.0).astype(np.float32)
            x = (rng.standard_normal((m, d)) + 3.0).astype(np.float32)
            out = rbf_kde_density(q, x, h, impl="mosaic", log=True, prune=False)
            ref = _log_kde_f64(q[:512].astype(np.float64), x.astype(np.float64), h)
            row["log_abs_err"] = float(np.max(np.abs(np.asarray(out[:512], np.float64) - ref)))
            xla = rbf_kde_density(q[:512], x, h, impl="xla", log=True, prune=False)
            # far queries' log-densities of -600 are float32 to 3e-5: the bound is relative there
            row["xla_log_abs_err"] = float(np.max(np.abs(np.asarray(xla, np.float64) - ref)))
            gq = rng.standard_normal(n).astype(np.float32)
            grads = jax.grad(lambda *t, gq=gq: jnp.sum(rbf_kde_density(
                *t, impl="mosaic", log=True, prune=False) * gq), (0, 1, 2))(q, x, jnp.float32(h))
            dense = jax.grad(lambda *t, gq=gq: jnp.sum(rbf_kde_density(
                *t, impl="xla", log=True, prune=False) * gq), (0, 1, 2))(q, x, jnp.float32(h))
            for name, got, want in zip(("dq", "dx", "dh"), grads, dense):
                row[name + "_rel_to_xla"] = _rel(got, want)
            row["ok"] = bool(row["log_abs_err"] <= max(LOG_BOUND, 2 * row["xla_log_abs_err"]))


#: The expressions checked and timed, each made for d features.
EXPRESSIONS = {
    "matern32": lambda d: Matern(1.0, 1.5),
    "rbf+periodic*rbf": lambda d: RBF(1.0) + ExpSineSquared(1.0, 2.0) * RBF(2.0),
    "matern52-ard": lambda d: Matern(jnp.linspace(0.6, 1.2, d), 2.5),
}


def check_expressions(report, quick):
    """Kernel expressions on impl="mosaic": forward and every gradient against float64, at
    d = 4 (every distance by the differences) and d = 8 (the forward's shared distance by the
    expansion where the keys' spread allows)."""
    rng = np.random.default_rng(4)
    n = 256 if quick else 2048
    points = {}
    for d, (name, make) in itertools.product((4, 8), EXPRESSIONS.items()):
        if d not in points:  # one draw per d, the d = 4 one the same as before d = 8 was added
            points[d] = ((rng.standard_normal((n, d)) + 3.0).astype(np.float32),
                         (rng.standard_normal((n + 61, d)) + 3.0).astype(np.float32),
                         rng.standard_normal((n + 61, 8)).astype(np.float32),
                         rng.standard_normal((n, 8)).astype(np.float32))
        x1, x2, v, g = points[d]
        row = {"kernel": name, "n": n, "m": n + 61, "d": d, "o": 8}
        with report.case("check_expression", row, checked=True):
            kernel = make(d)
            out = kernel_mv(kernel, x1, x2, v, impl="mosaic")
            grads = jax.grad(lambda *t: jnp.sum(kernel_mv(*t, impl="mosaic") * g),
                             (0, 1, 2, 3))(kernel, x1, x2, v)
            with _host_float64():
                k64 = jax.tree_util.tree_map(lambda t: jnp.asarray(t, jnp.float64), kernel)
                a64 = [np.asarray(t, np.float64) for t in (x1, x2, v)]
                ref = kernel_mv(k64, *a64, impl="dense")
                g64 = jax.grad(lambda *t: jnp.sum(kernel_mv(*t, impl="dense") * g),
                               (0, 1, 2, 3))(k64, *a64)
                row["rel_err"] = _rel(out, ref)
                errs = [_rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(grads),
                                                   jax.tree_util.tree_leaves(g64))]
            row["grad_rel_errs"] = errs
            row["ok"] = bool(row["rel_err"] <= MV_BOUND and max(errs) <= 2 * GRAD_BOUND)


def speed_expressions(report, quick, repeats):
    """Matérn-3/2 and RBF + periodic * RBF against the RBF, K v at 65,536², d = 8, 16
    columns, forward and forward+backward, on pallas (mosaic)."""
    n = 1024 if quick else 65536
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((n, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, 16)), jnp.float32)
    kernels = {"rbf": lambda d: RBF(1.0), "matern32": EXPRESSIONS["matern32"],
               "rbf+periodic*rbf": EXPRESSIONS["rbf+periodic*rbf"]}
    for impl in ("pallas",):  # the issue's ratios are the fused kernels' own
        for name, make in kernels.items():
            row = {"kernel": name, "n": n, "d": 8, "o": 16, "impl": impl}
            with report.case("speed_expression", row):
                kernel = make(8)
                fwd = jax.jit(lambda k, x, v, impl=impl: kernel_mv(k, x, x, v, impl=impl,
                                                                   prune=False))
                _, row["fwd_s"] = _timed(fwd, kernel, x, v, repeats=repeats)
                both = jax.jit(jax.grad(lambda k, x, v, impl=impl: jnp.sum(kernel_mv(
                    k, x, x, v, impl=impl, prune=False) ** 2), (0, 1)))
                _, row["fwd_bwd_s"] = _timed(both, kernel, x, v, repeats=repeats)


def _blocks_of(tiles, differences_max_d):
    bq, bk, vmem = tiles
    return {"block_q": bq, "block_k": bk}, MosaicParams(vmem, differences_max_d)


def speed(report, quick, repeats, sweep=False):
    """K v at 65,536² (d = 8, 16 columns) and the KDE at 65,536² (d = 2, 8), forward and
    forward+backward, mosaic beside xla; with a tile and distance-mode sweep."""
    n = 1024 if quick else 65536
    rng = np.random.default_rng(2)
    for d, o in [(8, 16)]:
        x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((n, o)), jnp.float32)
        sub = np.asarray(x[:256], np.float64)
        ref = _mv_f64(sub, np.asarray(x, np.float64), np.asarray(v, np.float64), 1.0)
        for impl, tiles, dmax in _sweep(quick, sweep):
            row = {"what": "K v", "n": n, "d": d, "o": o, "impl": impl}
            with report.case("speed_mv", row):
                kw = {}
                if impl == "mosaic":
                    kw, params = _blocks_of(tiles, dmax)
                    row.update(tiles=list(tiles), differences_max_d=dmax)
                    _blocks.DEFAULT_PARAMS = params
                    jax.clear_caches()
                fwd = jax.jit(lambda x, v, impl=impl, kw=kw: rbf_kernel_mv(
                    x, x, v, 1.0, impl=impl, prune=False, **kw))
                out, t = _timed(fwd, x, v, repeats=repeats)
                row["fwd_s"] = t
                row["rel_err"] = _rel(np.asarray(out[:256]), ref)
                both = jax.jit(jax.grad(lambda x, v, impl=impl, kw=kw: jnp.sum(rbf_kernel_mv(
                    x, x, v, 1.0, impl=impl, prune=False, **kw) ** 2), (0, 1)))
                _, row["fwd_bwd_s"] = _timed(both, x, v, repeats=repeats)
    _blocks.DEFAULT_PARAMS = MosaicParams()
    jax.clear_caches()
    for d in (2, 8):
        q = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
        ref = _log_kde_f64(np.asarray(q[:256], np.float64), np.asarray(q, np.float64), 0.3)
        for impl, dmax in [("pallas", 4), ("pallas", 1), ("xla", None)][:3 if d == 2 else 1]:
            row = {"what": "kde log-density", "n": n, "d": d, "impl": impl,
                   "differences_max_d": dmax}
            _blocks.DEFAULT_PARAMS = MosaicParams(differences_max_d=dmax or 4)
            jax.clear_caches()
            with report.case("speed_kde", row):
                fwd = jax.jit(lambda q, impl=impl: rbf_kde_density(q, q, 0.3, impl=impl, log=True,
                                                        prune=False))
                out, row["fwd_s"] = _timed(fwd, q, repeats=repeats)
                row["log_abs_err"] = float(np.max(np.abs(np.asarray(out[:256], np.float64)
                                                         - ref)))
                both = jax.jit(jax.grad(lambda q, h, impl=impl: jnp.sum(rbf_kde_density(
                    q, q, h, impl=impl, log=True, prune=False)), (0, 1)))
                _, row["fwd_bwd_s"] = _timed(both, q, jnp.float32(0.3), repeats=repeats)
    _blocks.DEFAULT_PARAMS = MosaicParams()
    jax.clear_caches()


def _sweep(quick, sweep):
    if quick:
        return [("mosaic", (128, 256, 64), 4), ("mosaic", (128, 128, 64), 8), ("xla", None, None)]
    out = [("xla", None, None), ("pallas", None, None)]
    if not sweep:
        return out
    for tiles in [(512, 1024, 64), (512, 2048, 96), (1024, 1024, 96), (256, 2048, 64),
                  (1024, 2048, 120)]:
        for dmax in (4, 8):
            out.append(("mosaic", tiles, dmax))
    return out


def pruned(report, quick, repeats):
    """Issue 60's pruning case: 2^17 keys in 300 clusters (sd 0.4 in a 100 x 100 square), 2^13
    queries, bandwidth 0.3: the KDE's log-density with prune=True, False and "auto" on mosaic
    and xla, with the keys as given and in `spatial_order` (``keys_in_order=True``: what a
    fitted KDE does), their differences, and the k-d ordering of keys and queries alone."""
    from scalegp.ops import spatial_order
    from scalegp.ops.pruning._rules import PRUNE_BLOCK, kd_order

    rng = np.random.default_rng(6)
    m, n = (1 << 12, 1 << 9) if quick else (1 << 17, 1 << 13)
    centres = rng.uniform(0, 100, (300, 2))
    x = (centres[rng.integers(300, size=m)] + 0.4 * rng.standard_normal((m, 2))).astype(
        np.float32)
    q = x[rng.choice(m, n, replace=False)] + np.float32(0.1)
    x, q = jnp.asarray(x), jnp.asarray(q)
    x_ordered = x[spatial_order(x, 0.3)]
    order = jax.jit(kd_order, static_argnums=2)
    for what, pts in (("keys", x), ("queries", q)):
        _, t = _timed(order, pts, jnp.float32(0.3), PRUNE_BLOCK, repeats=repeats)
        report.add("pruned", {"what": f"k-d order of the {what}", "points": pts.shape[0],
                              "s": t})
    outs = {}
    for impl in ("mosaic", "xla"):
        for in_order in (False, True) if impl == "mosaic" else (False,):
            keys = x_ordered if in_order else x
            for prune in (True, False, "auto"):
                row = {"what": "kde log-density", "m": m, "n": n, "impl": impl,
                       "prune": prune, "keys_in_order": in_order}
                with report.case("pruned", row):
                    fn = jax.jit(lambda q, x, impl=impl, prune=prune, o=in_order: rbf_kde_density(
                        q, x, 0.3, impl=impl, log=True, prune=prune, keys_in_order=o))
                    out, row["fwd_s"] = _timed(fn, q, keys, repeats=repeats)
                    both = jax.jit(jax.grad(
                        lambda q, x, h, impl=impl, prune=prune, o=in_order: jnp.sum(
                            rbf_kde_density(q, x, h, impl=impl, log=True, prune=prune,
                                            keys_in_order=o)), (0, 1, 2)))
                    _, row["fwd_bwd_s"] = _timed(both, q, keys, jnp.float32(0.3),
                                                 repeats=repeats)
                    if (impl, False) in outs:
                        row["max_abs_vs_unpruned"] = float(jnp.max(jnp.abs(
                            out - outs[impl, False])))
                    outs.setdefault((impl, prune), out)


def names(report):
    """What impl="auto" and "pallas" mean here."""
    from scalegp.ops import available_implementations
    from scalegp.ops._plan import backend_of

    report.add("names", {"auto": backend_of("auto").name, "pallas": backend_of("pallas").name,
                         "available": available_implementations()})


def million(report, quick, repeats):
    """1,048,576² K v forward, d = 8, 16 columns: time and accuracy (its memory: `memory`)."""
    n = 4096 if quick else 1 << 20
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((n, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, 16)), jnp.float32)
    row = {"what": "K v", "n": n, "d": 8, "o": 16, "impl": "pallas"}
    with report.case("million", row):
        fwd = jax.jit(lambda x, v: rbf_kernel_mv(x, x, v, 1.0, impl="pallas", prune=False))
        out, row["fwd_s"] = _timed(fwd, x, v, repeats=repeats)
        sub = np.asarray(x[:128], np.float64)
        row["rel_err_128_rows"] = _rel(np.asarray(out[:128]), _mv_f64(
            sub, np.asarray(x, np.float64), np.asarray(v, np.float64), 1.0))


def compile_only_device():
    """A TPU v5e of libtpu's compile-only topology, on a machine without a chip (``pip install
    "libtpu==0.0.42.*"``, the version jax[tpu] 0.10.2 pins), and the products planned for it
    (compiled, not interpreted): XLA's memory analysis there matched the chip's to the byte."""
    from jax.experimental import topologies

    from scalegp.ops import _plan

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1",
                                            chips_per_host_bounds=(1, 1, 1))
    _plan._platform = lambda backend: backend or "tpu"
    return topology.devices[0]


def memory(report, quick, device=None):
    """The device memory of the 1,048,576² products (d = 8, 16 columns; the KDE at d = 2) by
    XLA's compiled memory analysis (arguments, outputs, temporaries), on the chip or, with a
    compile-only ``device``, for it. On the chip also what its layout makes of the arrays
    (`on_device_size_in_bytes`) and the allocator's peak after the forward and after a dense
    product whose kernel matrix alone is 1 GiB: the peak did not count a program's
    temporaries, so the compiled analysis is the measure."""
    n = 4096 if quick else 1 << 20
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)

    def shape(*dims):
        return jax.ShapeDtypeStruct(dims, jnp.float32, sharding=sharding)

    def kv(x, v):
        return rbf_kernel_mv(x, x, v, 1.0, impl="pallas", prune=False)

    cases = {
        "K v fwd": (kv, (shape(n, 8), shape(n, 16))),
        "K v fwd+bwd": (jax.grad(lambda x, v: jnp.sum(kv(x, v) ** 2), (0, 1)),
                        (shape(n, 8), shape(n, 16))),
        "K v fwd xla": (lambda x, v: rbf_kernel_mv(x, x, v, 1.0, impl="xla", prune=False),
                        (shape(n, 8), shape(n, 16))),
        "kde d2 fwd": (lambda q: rbf_kde_density(q, q, 0.3, impl="pallas", log=True,
                                                 prune=False), (shape(n, 2),)),
        "kde d2 fwd+bwd": (jax.grad(lambda q, h: jnp.sum(rbf_kde_density(
            q, q, h, impl="pallas", log=True, prune=False)), (0, 1)),
                           (shape(n, 2), shape())),
    }
    for what, (fn, args) in cases.items():
        row = {"what": what, "n": n, "compiled_for": "tpu v5e, compile-only"
               if device is not None else jax.devices()[0].device_kind}
        with report.case("memory", row):
            mem = jax.jit(fn).lower(*args).compile().memory_analysis()
            row.update({k: getattr(mem, k + "_size_in_bytes", None)
                        for k in ("argument", "output", "temp", "alias")})
    if device is not None or jax.default_backend() != "tpu":
        return
    for dims in [(n, 8), (8, n), (n, 16), (n, 2), (n,)]:
        arr = jnp.zeros(dims, jnp.float32)
        report.add("memory", {"what": "array", "shape": list(dims),
                              "on_device_bytes": arr.on_device_size_in_bytes()})
        del arr
    rng = np.random.default_rng(3)
    xs = jnp.asarray(rng.standard_normal((n, 8)), jnp.float32)
    vs = jnp.asarray(rng.standard_normal((n, 16)), jnp.float32)
    jax.block_until_ready(jax.jit(kv)(xs, vs))
    report.add("memory", {"what": "allocator peak after the K v forward",
                          "peak_bytes_in_use": jax.devices()[0].memory_stats()[
                              "peak_bytes_in_use"]})
    k = 16384
    jax.block_until_ready(jax.jit(lambda x, v: rbf_kernel_mv(x, x, v, 1.0, impl="dense"))(
        xs[:k], vs[:k]))
    report.add("memory", {"what": f"allocator peak after a dense K v at {k} (K alone: "
                                  f"{k * k * 4} bytes)",
                          "peak_bytes_in_use": jax.devices()[0].memory_stats()[
                              "peak_bytes_in_use"]})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", nargs="+",
                        default=["names", "probe", "check", "check_expression", "speed",
                                 "speed_expression", "million"])
    parser.add_argument("--sweep", action="store_true", help="the tile and distance sweep")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile-only", action="store_true",
                        help="the memory section for a TPU v5e without one (libtpu's "
                             "compile-only topology)")
    args = parser.parse_args(argv)
    device = compile_only_device() if args.compile_only else None
    report = Report(args.out)
    if device is not None:
        from importlib.metadata import version

        report.data["compiled_for"] = (f"{device.device_kind}, libtpu {version('libtpu')}'s "
                                       "compile-only topology v5e:1x1 (no chip)")
    sections = {"probe": lambda: probe(report, args.quick),
                "check": lambda: check(report, args.quick),
                "speed": lambda: speed(report, args.quick, args.repeats, args.sweep),
                "names": lambda: names(report),
                "pruned": lambda: pruned(report, args.quick, min(args.repeats, 3)),
                "check_expression": lambda: check_expressions(report, args.quick),
                "speed_expression": lambda: speed_expressions(report, args.quick, args.repeats),
                "million": lambda: million(report, args.quick, min(args.repeats, 2)),
                "memory": lambda: memory(report, args.quick, device)}
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            sections[name]()
        except Exception as exc:  # noqa: BLE001
            report.add("errors", {"section": name, "error": f"{type(exc).__name__}: {exc}"})
            traceback.print_exc()
        print(f"== {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    print("failed:", json.dumps(report.failed))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
