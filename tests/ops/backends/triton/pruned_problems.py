"""Tiles and Pallas cores shared by the tests of the pruned Pallas kernels (tests/ops/
backends/triton/test_pruned*.py): small tiles (16 rows) and several groups of query tiles, interpret
mode."""

import jax.numpy as jnp
import numpy as np

from scalegp.ops._tiling import BlockSizes
from scalegp.ops.backends.triton import _pruned_lse as triton_pruned_lse
from scalegp.ops.backends.triton import _pruned_mv as triton_pruned_mv
from scalegp.ops.pruning import _order as order
from scalegp.ops.pruning import _rules as rules

BLOCK = 16
BS = BlockSizes(block_q=BLOCK, block_k=BLOCK)
GROUP = 3  # query tiles per pallas_call: several groups, the last one padded


def tiled(q, x, values, scale, block=BLOCK):
    """(query tiles, key tiles, value tiles, 1/scale) in k-d order, as the pruned cores take
    them, and the query permutation."""
    scale = jnp.asarray(scale, x.dtype)
    keys = rules.ordered_keys(jnp.asarray(x), scale, block)
    xt, perm, _ = rules.ordered_queries(jnp.asarray(q), keys, scale, False)
    vt = order.tile_values(jnp.asarray(values, x.dtype), keys.perm, block)
    return xt, keys.tiles, vt, jnp.broadcast_to(1 / scale, (x.shape[1],)), perm


def pallas_mv(tol, group=GROUP, bs=BS):
    """The Pallas core at ``tol`` (a tol passed after inv, as `rules.kernel_mv` does, is
    ignored)."""
    return lambda x, y, v, inv, *_: triton_pruned_mv.pruned_kernel_mv(
        x, y, v, inv, tol, bs, True, group)


def pallas_lse(tol, group=GROUP, bs=BS):
    return lambda x, y, w, inv, *_: triton_pruned_lse.pruned_kernel_logsumexp(
        x, y, w, inv, tol, bs, True, group)


def in_caller_order(out, perm, n):
    return np.asarray(order.unordered(out.reshape((-1,) + out.shape[2:]), perm, n))


def normalised(w):
    return (np.asarray(w, np.float64) / np.sum(w)).astype(np.float32)


def log_norm(h, d):
    return -0.5 * d * np.log(2 * np.pi) - np.sum(np.log(np.broadcast_to(h, (d,))))
