"""The host plan of the pruned KDE (`scalegp.ops.pruning._tree`) and the passes over it
(`scalegp.ops.pruning._planned` on `scalegp.ops.backends.xla._planned`'s passes): every key
tile a row adds is listed (against each row's own rule on every key tile, on adversarial
layouts), results bitwise equal to `pruned_kernel_logsumexp`'s and within the bound of float64,
row independence, and a plan that grows sub-quadratically."""

import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops.pruning import _planned as host_planned
from scalegp.ops.backends.xla._planned import (
    PlannedDensity,
    near_pass,
    planned_kernel_logsumexp,
)
from scalegp.ops.backends.xla._pruned_lse import lse_forward, pruned_kernel_logsumexp
from scalegp.ops.pruning._bounds import lse_log_tol, lse_plan, lse_rest, lse_setup
from scalegp.ops.pruning._rules import default_tolerance
from scalegp.ops.pruning._tree import build_tree, near_plan, padded_length, rest_plan
from tests.ops.oracle import kde_log_density_f64
from tests.ops.pruning.problems import clustered

BLOCK = 16
TOL = default_tolerance(jnp.float32)


def layout(name, rng):
    """Adversarial point sets (m, d) float32."""
    if name == "duplicates":
        return np.repeat(rng.uniform(size=(7, 2)), 60, axis=0).astype(np.float32)
    if name == "far_cluster":
        x = clustered(rng, 400, 2, clusters=4, spread=0.01)
        x[:37] += 50.0
        return x
    if name == "line":
        t = rng.uniform(size=(420, 1))
        return np.concatenate([t, 2 * t], axis=1).astype(np.float32)
    if name == "grid":
        g = np.arange(21, dtype=np.float32) * 0.01
        return np.stack(np.meshgrid(g, g), axis=-1).reshape(-1, 2)
    if name == "d1":
        return clustered(rng, 450, 1, spread=0.02)
    return clustered(rng, 400, 8, spread=0.02)  # d8


def _boxes(x):
    host = np.asarray(x)
    return host.min(axis=1).astype(np.float64), host.max(axis=1).astype(np.float64)


def _listed(plan, tq, tk):
    out = np.zeros((tq, tk), bool)
    for i in range(tq):
        out[i, plan.tiles[plan.start[i]:plan.start[i] + plan.count[i]]] = True
    return out


@pytest.mark.parametrize("name", ["duplicates", "far_cluster", "line", "grid", "d1", "d8"])
@pytest.mark.parametrize("bandwidth, tol", [(0.003, TOL), (0.03, TOL), (0.01, 1e-3), (0.01, 0.0)])
def test_plans_list_every_tile_a_row_adds(name, bandwidth, tol):
    rng = np.random.default_rng(0)
    x = layout(name, rng)
    model = PlannedDensity(x, block=BLOCK)
    y, w = model.keys.tiles, model.weights
    tq = tk = y.shape[0]
    inv = jnp.full((x.shape[1],), 1 / bandwidth, jnp.float32)
    log_tol = lse_log_tol(tol, jnp.float32)
    lo, hi = _boxes(y)
    near = near_plan(model.tree, lo, hi, np.asarray(inv, np.float64), log_tol)
    near_dev = (jnp.asarray(near.tiles), jnp.asarray(near.start), jnp.asarray(near.count))
    _, top, level = near_pass(y, y, w, inv, *near_dev, log_tol)
    # the same rows' levels (to an ulp: the two programs fold the constant log(tol) apart)
    np.testing.assert_allclose(level, lse_forward(y, y, w, inv, tol)[2], rtol=1e-6)
    rest = rest_plan(model.tree, lo, hi, np.asarray(inv, np.float64), log_tol,
                     np.asarray(level, np.float64).min(axis=1),
                     np.asarray(top, np.float64).max(axis=1))
    setup = lse_setup(y, w)[0]
    positive = (setup[1] > 0)[None, :]
    for i in range(tq):  # each row's own rule against every key tile
        neg_half_sq, row_near = lse_plan(y[i], setup, inv, log_tol)
        row_rest = lse_rest(neg_half_sq, row_near, positive, level[i])
        assert not np.any(np.asarray(row_near).any(axis=0) & ~_listed(near, tq, tk)[i])
        assert not np.any(np.asarray(row_rest).any(axis=0) & ~_listed(rest, tq, tk)[i])


@pytest.mark.parametrize("name", ["duplicates", "far_cluster", "grid", "d1", "d8"])
def test_results_equal_the_in_program_plan_bitwise(name):
    rng = np.random.default_rng(1)
    x = layout(name, rng)
    model = PlannedDensity(x, block=BLOCK)
    y, w = model.keys.tiles, model.weights
    inv = jnp.full((x.shape[1],), 1 / 0.01, jnp.float32)
    ours = planned_kernel_logsumexp(y, y, w, inv, TOL, model.tree)[0]
    assert np.array_equal(ours, pruned_kernel_logsumexp(y, y, w, inv, TOL))


@pytest.mark.x64
@pytest.mark.parametrize("bandwidth", [0.004, 0.03])
def test_matches_float64_within_the_bound(bandwidth):
    rng = np.random.default_rng(2)
    x, q = clustered(rng, 900, 2, spread=0.02), clustered(rng, 300, 2, spread=0.05)
    q[:4] += 0.5  # queries far from the data
    model = PlannedDensity(jnp.asarray(x, jnp.float32), block=BLOCK)
    out = np.asarray(model.log_density(np.float32(bandwidth), jnp.asarray(q, jnp.float32)),
                     np.float64)
    ref = np.asarray(kde_log_density_f64(q, x, np.float32(bandwidth)))
    rounding = 2e-6 + 4e-7 * np.abs(ref)
    assert np.all(ref - out <= np.log1p(TOL) + rounding)
    assert np.all(out - ref <= rounding)


def test_rows_do_not_depend_on_their_batch():
    rng = np.random.default_rng(3)
    x = clustered(rng, 1500, 2, spread=0.02)
    q = clustered(rng, 200, 2, spread=0.05)
    model = PlannedDensity(x, block=BLOCK)
    alone = np.asarray(model.log_density(0.01, q[:50]))
    mixed = np.asarray(model.log_density(0.01, np.concatenate([q[150:], q[:50], x[:300]])))
    assert np.array_equal(alone, mixed[50:100])


def test_visited_pairs_grow_sub_quadratically():
    """While the kernel's reach spans few tiles the pairs within it grow about linearly with n;
    at a fixed bandwidth they turn quadratic as the tiles shrink below the reach, so the
    bandwidth is narrow enough to stay in the first regime at these sizes."""
    rng = np.random.default_rng(4)
    centres = rng.uniform(size=(64, 2)) * 8
    pairs = []
    for n in (4000, 8000, 16000):
        x = (centres[rng.integers(64, size=n)] + 0.05 * rng.standard_normal((n, 2)))
        model = PlannedDensity(x.astype(np.float32), block=BLOCK)
        model.log_density(0.005)
        pairs.append(sum(plan.pairs for plan in model.plans))
    assert pairs[1] / pairs[0] < 3 and pairs[2] / pairs[1] < 3  # quadratic: 4


def test_runs_in_threads_give_the_results_and_plans_of_one_run(monkeypatch):
    """Query tiles split into runs (one thread each, the last run padded) score, leave out and
    plan exactly as one run does: data, queries and the cross-validation's held-out rows."""
    rng = np.random.default_rng(6)
    x = clustered(rng, 3000, 2, spread=0.02)
    q = clustered(rng, 700, 2, spread=0.05)
    held = rng.choice(3000, size=900, replace=False)

    def scores(cores):
        monkeypatch.setattr(host_planned, "usable_cores", lambda: cores)
        model = PlannedDensity(x, block=BLOCK)
        own = model.log_density(0.01, chunk_rows=40 * BLOCK)
        pairs = [plan.pairs for plan in model.plans]
        loo = model.loo_log_density(0.01, held, moments=True, curvature=True)
        loo_pairs = [plan.pairs for plan in model.plans]
        return own, model.log_density(0.01, q), loo, pairs, loo_pairs

    one, three = scores(1), scores(3)
    assert host_planned.plan_threads(900 // 8) == 3  # the held-out rows' tiles: 3 runs
    for a, b in zip(one[:2], three[:2]):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(one[2], three[2]):
        assert np.array_equal(a, b)
    assert one[4] == three[4]  # the held-out rows' plans, whole in both
    assert sum(three[3]) > 0


def test_runs_in_threads_keep_the_callers_x64_mode(monkeypatch):
    """A float64 caller (x64 on in its thread only, as a float64 estimator's scope) gets float64
    from the threaded runs, equal to one run's: the worker threads enter the caller's mode."""
    from scalegp.ops import x64_mode

    x = clustered(np.random.default_rng(8), 3000, 2, spread=0.02).astype(np.float64)
    with x64_mode(True):
        results = []
        for cores in (1, 3):
            monkeypatch.setattr(host_planned, "usable_cores", lambda cores=cores: cores)
            model = PlannedDensity(jnp.asarray(x), block=BLOCK)
            results.append(np.asarray(model.log_density(0.01, chunk_rows=40 * BLOCK)))
    assert results[0].dtype == results[1].dtype == np.float64
    assert np.array_equal(results[0], results[1])


def test_an_error_in_one_run_ends_the_others(monkeypatch):
    """The data scored in two threaded pipelines: when one fails, the error reaches the caller
    and the other stops at its next chunk instead of scoring the rest."""
    import time

    monkeypatch.setattr(host_planned, "usable_cores", lambda: 2)
    model = PlannedDensity(clustered(np.random.default_rng(7), 3000, 2, spread=0.02),
                           block=BLOCK)
    real, calls = host_planned._rest_stage, []

    def rest(staged):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a run failed")
        time.sleep(0.02)
        return real(staged)

    monkeypatch.setattr(host_planned, "_rest_stage", rest)
    with pytest.raises(RuntimeError, match="a run failed"):
        model.log_density(0.01, chunk_rows=2 * BLOCK)  # 94 chunks, 47 per run
    assert len(calls) < 20


def test_tree_nodes_hold_their_tiles():
    rng = np.random.default_rng(5)
    y = jnp.asarray(clustered(rng, 37 * BLOCK, 2)).reshape(37, BLOCK, 2)
    tree = build_tree(y, jnp.ones((37, BLOCK)))
    for level in tree.levels:
        for s, e, lo, hi in zip(level.start, level.stop, level.lo, level.hi):
            assert np.all(lo <= tree.tile_lo[s:e]) and np.all(hi >= tree.tile_hi[s:e])
    assert np.array_equal(tree.levels[-1].start, np.arange(37))
    assert [padded_length(p) for p in (1, 8, 9, 17, 100, 128)] == [8, 8, 16, 32, 128, 128]

