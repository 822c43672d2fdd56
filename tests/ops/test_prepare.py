"""`scalegp.ops._prepare`: the keys' centre and the short feature sums, which replace XLA
reductions for speed and must give what those gave."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops._prepare import (
    CENTRE_SAMPLE,
    UNROLLED_FEATURES,
    centre_of,
    feature_sum,
)


def _sorted_median(keys):
    """The centre as `centre_of` defined it before: jnp.sort of the strided sample, with -0 and
    the subnormals (which XLA's CPU sort ties with 0) read as 0."""
    stride = -(-keys.shape[0] // CENTRE_SAMPLE)
    sample = jnp.sort(keys[::stride], axis=0)
    median = sample[(sample.shape[0] - 1) // 2]
    return jnp.where(jnp.abs(median) < jnp.finfo(keys.dtype).tiny, 0.0, median)


def _hostile_columns(rng, m, dtype):
    """Columns with ties, signed zeros, infinities, NaNs, subnormals and a wide range."""
    tiny = np.finfo(dtype).smallest_subnormal
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, tiny, -tiny, 1e30, -1e30],
                        dtype)
    columns = [
        rng.standard_normal(m),
        rng.choice(specials, m),
        np.where(rng.random(m) < 0.5, 0.0, -0.0),
        rng.integers(-3, 4, m).astype(np.float64),  # ties
        rng.standard_normal(m) * 10.0 ** rng.integers(-30, 30, m),
        np.concatenate([np.full(m // 2 + 1, np.nan), rng.standard_normal(m - m // 2 - 1)]),
    ]
    return np.stack(columns, axis=1).astype(dtype)


@pytest.mark.parametrize("m", [1, 2, 7, 1024, 5000])
def test_the_centre_is_the_sorted_samples_lower_median_float32(m):
    keys = jnp.asarray(_hostile_columns(np.random.default_rng(m), m, np.float32))
    got, want = jax.jit(centre_of)(keys), jax.jit(_sorted_median)(keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.dtype == jnp.float32


@pytest.mark.x64
@pytest.mark.parametrize("m", [3, 2048])
def test_the_centre_is_the_sorted_samples_lower_median_float64(m):
    keys = jnp.asarray(_hostile_columns(np.random.default_rng(m), m, np.float64))
    got, want = jax.jit(centre_of)(keys), jax.jit(_sorted_median)(keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.dtype == jnp.float64


@pytest.mark.parametrize("d", [1, 2, 3, UNROLLED_FEATURES, UNROLLED_FEATURES + 1])
def test_feature_sum_is_the_sum_over_the_last_axis(d):
    x = jnp.asarray(np.random.default_rng(d).standard_normal((5, 7, d)), jnp.float32)
    got = jax.jit(feature_sum)(x)
    assert got.shape == (5, 7)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x, np.float64).sum(-1), rtol=1e-6,
                               atol=1e-6)
    # left to right, one feature at a time (the bounds' rounding margin counts d - 1 additions)
    if d <= UNROLLED_FEATURES:
        left = np.asarray(x[..., 0])
        for i in range(1, d):
            left = left + np.asarray(x[..., i])
        np.testing.assert_array_equal(np.asarray(got), left)


def test_feature_sum_keeps_overflow_and_nan():
    x = jnp.asarray([[3e38, 3e38], [np.nan, 1.0], [1.0, 2.0]], jnp.float32)
    got = np.asarray(jax.jit(feature_sum)(x))
    assert np.isinf(got[0]) and np.isnan(got[1]) and got[2] == 3.0
