"""The host-planned pruned KDE (issue 41, points 1 and 2): plan, visits and speed on an
overlapping mixture, against the current ``prune=True`` path. (Not the issue's data: at
h = 0.006 these have ~1,600 neighbours within reach per point where the issue's had 13,400;
`kde_million.py` runs the user's command on its own mixture at the cv bandwidth.)

    python benchmarks/kde_plan.py --n 100000 --bandwidth 0.006 --block 256 --current 100000

Data: n 2-D points from an overlapping Gaussian mixture (60 clusters, centres uniform in the unit
square, log-normal spreads (median 0.04, σ 0.7 in log), Dirichlet(2) cluster weights; seeded),
standardised. The bandwidth is a number (standardised units; the issue's cv figure is 0.006)
or ``scott10``, Scott's factor ``n^(-1/6)`` over 10. Queries are the data (scoring the fitted
data, as the CLI's ``--out``) or, with ``--queries k``, the first k of a random permutation.

One JSON object on stdout: the fit (k-d order and tile tree, once), the host planning time
(near and rest plans), the two compiled passes (first call with compilation, then again), the
visited tile pairs and pair evaluations against the pairs within reach (``exp(-r²/2) >= tol``,
r = 5.78 bandwidths in float32, counted with scipy's cKDTree on ``--reach-rows`` queries and
scaled), the current path (``rbf_kde_density(q, x, h, log=True, prune=True)`` on ``--current``
queries, timed twice; with ``--inprogram`` also its kernel ``pruned_kernel_logsumexp``, whose
plan is made inside the program, on the same ordered tiles), accuracy against float64 on
``--check-rows`` random queries (the sum over keys within 40 bandwidths, everything beyond
underflows in float64), and the peak RSS (after scoring, and at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy.spatial import cKDTree

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from scalegp.ops import rbf_kde_density  # noqa: E402
from scalegp.ops.pruning._rules import default_tolerance  # noqa: E402
from scalegp.ops import gaussian_log_norm  # noqa: E402
from scalegp.ops.pruning._bounds import lse_log_tol  # noqa: E402
from scalegp.ops.backends.xla._pruned_lse import pruned_kernel_logsumexp  # noqa: E402
from scalegp.ops.backends.xla._planned import PlannedDensity, near_pass, rest_pass  # noqa: E402
from scalegp.ops.pruning import _tree  # noqa: E402
from scalegp.ops.pruning._tree import near_plan, rest_plan  # noqa: E402

#: (query tile, node) pairs the descents of the last plans tested, all depths
TESTED = {"near": 0, "rest": 0}


def _counting(descend, name):
    def counted_descend(tree, n_q, keep):
        def counted_keep(level, q, nodes):
            TESTED[name] += len(q)
            return keep(level, q, nodes)

        return descend(tree, n_q, counted_keep)

    return counted_descend


def mixture(n: int, seed: int = 0, clusters: int = 60) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.uniform(size=(clusters, 2))
    spread = 0.04 * np.exp(0.7 * rng.standard_normal(clusters))
    label = rng.choice(clusters, size=n, p=rng.dirichlet(np.full(clusters, 2.0)))
    x = centres[label] + spread[label, None] * rng.standard_normal((n, 2))
    return ((x - x.mean(axis=0)) / x.std(axis=0)).astype(np.float32)


def out_norm(h):
    """The log-norm `PlannedDensity.log_density` adds, in the same float32 operations."""
    return gaussian_log_norm(jnp.full((2,), h, jnp.float32), 2)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(f):
    t = time.perf_counter()
    out = jax.block_until_ready(f())
    return out, time.perf_counter() - t


def planned_parts(model: PlannedDensity, bandwidth: float, tol: float):
    """`planned_kernel_logsumexp` step by step on the data as queries, each step timed."""
    keys, w, tree = model.keys, model.weights, model.tree
    x = keys.tiles
    inv = jnp.full((2,), 1 / bandwidth, x.dtype)
    log_tol = lse_log_tol(tol, x.dtype)
    times = {}
    descend = _tree.descend
    _tree.descend = _counting(descend, "near")
    t = time.perf_counter()
    host = np.asarray(x)
    q_lo, q_hi = host.min(axis=1).astype(np.float64), host.max(axis=1).astype(np.float64)
    near = near_plan(tree, q_lo, q_hi, np.asarray(inv, np.float64), log_tol)
    _tree.descend = _counting(descend, "rest")
    times["near_plan_s"] = time.perf_counter() - t
    near_dev = tuple(jnp.asarray(a) for a in (near.tiles, near.start, near.count))
    for attempt in ("first", "again"):
        (state, top, level), times[f"near_pass_{attempt}_s"] = _timed(
            lambda: near_pass(x, keys.tiles, w, inv, *near_dev, log_tol))
    t = time.perf_counter()
    rest = rest_plan(tree, q_lo, q_hi, np.asarray(inv, np.float64), log_tol,
                     np.asarray(level, np.float64).min(axis=1),
                     np.asarray(top, np.float64).max(axis=1))
    times["rest_plan_s"] = time.perf_counter() - t
    _tree.descend = descend
    times.update({f"{k}_descent_pairs_tested": v for k, v in TESTED.items()})
    rest_dev = tuple(jnp.asarray(a) for a in (rest.tiles, rest.start, rest.count))
    for attempt in ("first", "again"):
        _, times[f"rest_pass_{attempt}_s"] = _timed(
            lambda: rest_pass(x, keys.tiles, w, inv, *rest_dev, state, top, level, log_tol))
    return times, near, rest


def exact_log_density(x, queries, bandwidth: float, tree: cKDTree) -> np.ndarray:
    """float64 log-densities at queries from the keys within 40 bandwidths (terms beyond are
    under exp(-800): 0 in float64)."""
    x64 = x.astype(np.float64)
    out = np.empty(len(queries))
    for i, near in enumerate(tree.query_ball_point(queries, 40 * bandwidth)):
        e = -0.5 * np.sum(((queries[i] - x64[near]) / bandwidth) ** 2, axis=1)
        top = e.max() if len(near) else -np.inf
        out[i] = top + np.log(np.sum(np.exp(e - top))) if len(near) else -np.inf
    return out - math.log(len(x)) - math.log(2 * math.pi * bandwidth ** 2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--bandwidth", default="0.006")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--current", type=int, default=0,
                        help="queries for the current prune=True path (0: not run)")
    parser.add_argument("--inprogram", action="store_true",
                        help="also time pruned_kernel_logsumexp (the plan made inside the "
                             "program) on the same ordered tiles")
    parser.add_argument("--reach-rows", type=int, default=5000)
    parser.add_argument("--check-rows", type=int, default=2000)
    args = parser.parse_args(argv)
    x = mixture(args.n)
    h = 0.1 * args.n ** (-1 / 6) if args.bandwidth == "scott10" else float(args.bandwidth)
    tol = default_tolerance(jnp.float32)
    result = {"command": harness.command_line(__file__, argv), "machine": harness.host(),
              "versions": harness.versions(["jax", "jaxlib", "numpy", "scipy"]),
              "scalegp_commit": harness.scalegp_commit(), "loadavg_start": harness.loadavg(),
              "n": args.n, "bandwidth": h, "block": args.block, "tol": tol}
    for attempt in ("first", "again"):  # the k-d order and the tree; first with compilation
        model, result[f"fit_{attempt}_s"] = _timed(lambda: PlannedDensity(x, block=args.block))
    times, near, rest = planned_parts(model, h, tol)
    result.update(times)
    for attempt in ("first", "again"):  # order, plans, passes, back to the caller's order
        out, result[f"log_density_{attempt}_s"] = _timed(lambda: model.log_density(h))
    result["peak_rss_scoring_mb"] = _peak_rss_mb()  # before the reference's own memory
    tiles = model.keys.tiles.shape[0]
    evaluations = (near.pairs + rest.pairs) * args.block ** 2
    rng = np.random.default_rng(1)
    kd = cKDTree(x)
    reach = math.sqrt(-2 * math.log(tol))
    rows = rng.choice(args.n, size=min(args.reach_rows, args.n), replace=False)
    within = kd.query_ball_point(x[rows], reach * h, return_length=True)
    result.update({
        "tiles": tiles, "near_pairs": near.pairs, "rest_pairs": rest.pairs,
        "tile_pairs_share": (near.pairs + rest.pairs) / tiles ** 2,
        "pair_evaluations": evaluations,
        "pairs_within_reach": float(np.mean(within)) * args.n, "reach_bandwidths": reach,
        "evaluations_per_s": evaluations / (result["near_pass_again_s"]
                                            + result["rest_pass_again_s"]),
    })
    if args.inprogram:
        keys = model.keys
        inv = jnp.full((2,), 1 / h, keys.tiles.dtype)
        program = jax.jit(pruned_kernel_logsumexp, static_argnums=4)
        for attempt in ("first", "again"):
            theirs, result[f"inprogram_{attempt}_s"] = _timed(
                lambda: program(keys.tiles, keys.tiles, model.weights, inv, tol))
        ours = np.asarray(out)[np.asarray(keys.perm)[:args.n]]
        result["inprogram_bitwise_equal"] = bool(np.array_equal(
            ours, np.asarray(theirs).reshape(-1)[:args.n] + np.asarray(out_norm(h))))
    check = rng.choice(args.n, size=min(args.check_rows, args.n), replace=False)
    exact = exact_log_density(x, x[check].astype(np.float64), h, kd)
    result["max_abs_err_vs_f64"] = float(np.max(np.abs(np.asarray(out)[check] - exact)))
    if args.current:
        q = x[rng.permutation(args.n)[:args.current]]
        for attempt in ("first", "again"):
            cur, result[f"current_{attempt}_s"] = _timed(
                lambda: rbf_kde_density(q, x, h, log=True, prune=True))
        planned_q = PlannedDensity(x, block=args.block)
        _timed(lambda: planned_q.log_density(h, q))
        mine, result["planned_queries_s"] = _timed(lambda: planned_q.log_density(h, q))
        result["current_queries"] = args.current
        result["planned_vs_current_max_abs"] = float(np.max(np.abs(np.asarray(mine)
                                                                   - np.asarray(cur))))
    result["peak_rss_mb"] = _peak_rss_mb()
    result["loadavg_end"] = harness.loadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
