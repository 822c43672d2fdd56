"""The k-d order of the pruned products (`scalegp.ops._pruning_order`)."""

import jax.numpy as jnp
import numpy as np

from scalegp.ops import _pruning_bounds, _pruning_order


def test_kd_order_is_a_permutation_with_compact_tiles():
    rng = np.random.default_rng(9)
    x = rng.uniform(size=(1000, 2)).astype(np.float32)
    perm = np.asarray(_pruning_order.kd_order(jnp.asarray(x), 1.0, 64))
    assert perm.shape == (1024,)
    np.testing.assert_array_equal(np.sort(perm), np.arange(1024))
    assert np.all(perm[1000:] >= 1000)  # padding last
    lo, hi = _pruning_bounds.boxes(
        _pruning_order.ordered_tiles(jnp.asarray(x), jnp.asarray(perm), 64))
    area = float(jnp.sum(jnp.prod(hi - lo, axis=1)))
    assert area < 2.0  # 16 leaves tile the unit square; random tiles would each cover most of it
