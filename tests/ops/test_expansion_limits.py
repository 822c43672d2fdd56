"""The expansion limits (`RBF_EXPANSION_MEAN_LIMIT`, `MATERN_EXPANSION_MEAN_LIMIT`) pinned by
the float32 error they promise: the distance expansion alone, K(x, x) v for keys whose mean
scaled squared norm is at the limit, stays within half of issue #17's norm-wise target (2e-5),
and at ten times the limit exceeds the whole target, so a limit raised far enough to matter
fails here. The error is about c · u · mean |b|² (u = 2^-24; c = 0.35-1.04 for the RBF,
0.18-0.98 and 0.12-0.33 for Matérn-3/2 and -5/2): docs/decisions.md #4.

The reference is float64 numpy on the same float32-rounded points, so only the expansion's
rounding is measured; no x64 needed.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops._matmul import MATERN_EXPANSION_MEAN_LIMIT, RBF_EXPANSION_MEAN_LIMIT
from scalegp.ops.backends.xla import _matern as xla_matern
from scalegp.ops.backends.xla import _rbf as xla_rbf
from scalegp.ops.backends.xla._blocks import block_sizes as xla_tiles

TARGET = 2e-5  # issue #17's float32 forward target, norm-wise
LIMITS = {None: RBF_EXPANSION_MEAN_LIMIT, **MATERN_EXPANSION_MEAN_LIMIT}


def profile64(nu, t2):
    """The RBF (nu None) or Matérn-ν profile of the squared distance, in float64."""
    if nu is None:
        return np.exp(-0.5 * t2)
    t = np.sqrt(t2)
    return np.exp(-t) * ((1 + t) if nu == 1.5 else (1 + t + t * t / 3))


def expansion_error(nu, d, data, mean_sq, n=1000, seed=0):
    """Norm-wise error of the expansion's float32 K(b, b) v, b scaled to the given mean |b|²."""
    rng = np.random.default_rng(seed)
    x = rng.random((n, d)) if data == "uniform" else rng.standard_normal((n, d))
    centred = x - x.mean(axis=0)
    b = jnp.asarray(centred * np.sqrt(mean_sq / np.mean(np.sum(centred**2, axis=1))), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, 1)), jnp.float32)
    block_sizes = xla_tiles("rbf", None, n, 0)
    got = (xla_rbf.kernel_mv(b, b, v, block_sizes) if nu is None
           else xla_matern.matern_mv(b, b, v, nu, block_sizes))
    b64, v64 = np.asarray(b, np.float64), np.asarray(v, np.float64)
    want = profile64(nu, ((b64[:, None, :] - b64[None, :, :]) ** 2).sum(-1)) @ v64
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


@pytest.mark.parametrize("nu", [None, 1.5, 2.5], ids=["rbf", "matern32", "matern52"])
@pytest.mark.parametrize("d, data", [(4, "uniform"), (4, "normal"), (16, "normal")])
def test_expansion_keeps_half_the_target_at_its_limit_and_misses_it_beyond(nu, d, data):
    limit = LIMITS[nu]
    assert expansion_error(nu, d, data, limit) < TARGET / 2
    assert expansion_error(nu, d, data, 10 * limit) > TARGET
