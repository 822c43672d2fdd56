"""The profile bounds of the pruned products (`scalegp.ops._pruning_bounds`)."""

import jax.numpy as jnp
import numpy as np

from scalegp.ops import _pruning_bounds
from scalegp.ops._kernels import MATERN_NUS


def test_matern_reach_is_where_the_profile_falls_to_the_level():
    for nu in MATERN_NUS:
        for level in (1e-3, 6e-8):
            half_sq = _pruning_bounds.reach_half_sq(("matern", nu), np.log(level))
            at = float(_pruning_bounds.log_bound(
                ("matern", nu), jnp.asarray(half_sq, jnp.float32)))
            assert abs(at - np.log(level)) < 1e-3
            assert half_sq > _pruning_bounds.reach_half_sq(("matern", nu), np.log(level) + 1)
    assert _pruning_bounds.reach_half_sq(_pruning_bounds.RBF_PROFILE, -5.0) == 5.0
