"""The k-d order of the pruned products (`scalegp.ops.pruning._order`)."""

import jax.numpy as jnp
import numpy as np

from scalegp.ops.pruning import _bounds as bounds
from scalegp.ops.pruning import _order as order


def test_kd_order_is_a_permutation_with_compact_tiles():
    rng = np.random.default_rng(9)
    x = rng.uniform(size=(1000, 2)).astype(np.float32)
    perm = np.asarray(order.kd_order(jnp.asarray(x), 1.0, 64))
    assert perm.shape == (1024,)
    np.testing.assert_array_equal(np.sort(perm), np.arange(1024))
    assert np.all(perm[1000:] >= 1000)  # padding last
    lo, hi = bounds.boxes(
        order.ordered_tiles(jnp.asarray(x), jnp.asarray(perm), 64))
    area = float(jnp.sum(jnp.prod(hi - lo, axis=1)))
    assert area < 2.0  # 16 leaves tile the unit square; random tiles would each cover most of it


def _tile_extents(x, perm, block):
    tiles = np.asarray(order.ordered_tiles(jnp.asarray(x), jnp.asarray(perm), block))
    return tiles.max(axis=1) - tiles.min(axis=1)


def test_every_row_stays_in_its_segment():
    """At every level a segment's farthest row sorts last in its own segment: the quantised
    key is clamped below the next segment's range (float32 rounded it up into it, which moved
    one row per segment into a far segment and left a tile spanning both). 512 tiles of 4 rows
    on a uniform square: no tile is wider than a few leaves (a moved row made one ~the whole
    square wide)."""
    rng = np.random.default_rng(10)
    x = rng.uniform(size=(2048, 2)).astype(np.float32)
    for perm in (np.asarray(order.kd_order(jnp.asarray(x), 1.0, 4)),
                 order.host_kd_order(x, 1.0, 4)):
        assert np.max(_tile_extents(x, perm, 4).sum(axis=1)) < 0.3


def test_host_order_matches_the_compiled_one():
    """The host k-d order has kd_order's splits: the same permutation up to ties, so the same
    tiles; padding last; for a scale per feature and a count that is not a whole number of
    tiles."""
    rng = np.random.default_rng(11)
    x = (rng.normal(size=(3001, 3)) * [1.0, 4.0, 0.5]).astype(np.float32)
    scale = np.float32([1.0, 2.0, 0.5])
    host = order.host_kd_order(x, scale, 32)
    compiled = np.asarray(order.kd_order(jnp.asarray(x), jnp.asarray(scale), 32))
    assert host.shape == compiled.shape == (3008,) and host.dtype == np.int32
    np.testing.assert_array_equal(np.sort(host), np.arange(3008))
    assert np.all(host[3001:] >= 3001)
    same_tiles = [set(a) == set(b) for a, b in zip(host.reshape(-1, 32), compiled.reshape(-1, 32))]
    assert np.mean(same_tiles) > 0.95


def test_the_host_order_in_threads_is_as_tight_as_in_one(monkeypatch):
    """Past `PARALLEL_ROWS` the top levels split all rows and each part is ordered in a thread:
    a permutation with the padding last, whose tiles are as tight as those of the order in one
    thread (the same splits; only the parts' keys are quantised finer)."""
    rng = np.random.default_rng(12)
    x = (rng.normal(size=(6001, 2)) * [1.0, 3.0]).astype(np.float32)
    one = order.host_kd_order(x, 1.0, 16)
    monkeypatch.setattr(order, "PARALLEL_ROWS", 1000)
    monkeypatch.setattr(order, "usable_cores", lambda: 5)  # 8 parts after 3 levels, 5 threads
    calls = []
    real = order._host_order

    def counted(points, block, parallel):
        calls.append(parallel)
        return real(points, block, parallel)

    monkeypatch.setattr(order, "_host_order", counted)
    threaded = order.host_kd_order(x, 1.0, 16)
    assert calls[0] and calls[1:] == [False] * 8
    assert threaded.shape == one.shape == (6016,) and threaded.dtype == np.int32
    np.testing.assert_array_equal(np.sort(threaded), np.arange(6016))
    assert np.all(threaded[6001:] >= 6001)
    ours, theirs = (_tile_extents(x, p, 16).sum() for p in (threaded, one))
    assert abs(ours - theirs) <= 0.01 * theirs
