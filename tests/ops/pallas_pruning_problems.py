"""Tiles and Pallas cores shared by the tests of the pruned Pallas kernels (tests/ops/
test_pallas_pruning*.py): small tiles (16 rows) and several groups of query tiles, interpret
mode."""

import jax.numpy as jnp
import numpy as np

from scalegp.ops import _pallas_pruning_lse, _pallas_pruning_mv, _pruning, _pruning_order
from scalegp.ops._tiling import BlockSizes

BLOCK = 16
BS = BlockSizes(block_q=BLOCK, block_k=BLOCK)
GROUP = 3  # query tiles per pallas_call: several groups, the last one padded


def tiled(q, x, values, scale, block=BLOCK):
    """(query tiles, key tiles, value tiles, 1/scale) in k-d order, as the pruned cores take
    them, and the query permutation."""
    scale = jnp.asarray(scale, x.dtype)
    keys = _pruning.ordered_keys(jnp.asarray(x), scale, block)
    xt, perm, _ = _pruning.ordered_queries(jnp.asarray(q), keys, scale, False)
    vt = _pruning_order.tile_values(jnp.asarray(values, x.dtype), keys.perm, block)
    return xt, keys.tiles, vt, jnp.broadcast_to(1 / scale, (x.shape[1],)), perm


def pallas_mv(tol, group=GROUP, bs=BS):
    """The Pallas core at ``tol`` (a tol passed after inv, as `_pruning.kernel_mv` does, is
    ignored)."""
    return lambda x, y, v, inv, *_: _pallas_pruning_mv.pruned_kernel_mv(
        x, y, v, inv, tol, bs, True, group)


def pallas_lse(tol, group=GROUP, bs=BS):
    return lambda x, y, w, inv, *_: _pallas_pruning_lse.pruned_kernel_logsumexp(
        x, y, w, inv, tol, bs, True, group)


def in_caller_order(out, perm, n):
    return np.asarray(_pruning_order.unordered(out.reshape((-1,) + out.shape[2:]), perm, n))


def normalised(w):
    return (np.asarray(w, np.float64) / np.sum(w)).astype(np.float32)


def log_norm(h, d):
    return -0.5 * d * np.log(2 * np.pi) - np.sum(np.log(np.broadcast_to(h, (d,))))
