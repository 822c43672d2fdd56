"""scalegp.gp._predict: predictions from the exact posterior against scikit-learn, and a variance
cache that overshoots clipped with a warning."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from scalegp import gp
from scalegp.gp._predict import SHORT_PREDICT_ROWS
from tests.gp.problems import rbf_params, regression_data

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


@pytest.mark.parametrize("dtype, rtol", [pytest.param(np.float64, 1e-7, marks=pytest.mark.slow),
                                         (np.float32, 1e-3)])
def test_exact_prediction_matches_sklearn(data2000, dtype, rtol):
    x, y, x_test, ref = data2000
    params = rbf_params(dtype)
    xj, yj = jnp.asarray(x, dtype), jnp.asarray(y[:, None], dtype)
    posterior = gp.CholeskySolver().posterior(params, xj, yj)
    mean, std = gp.predict(params, xj, posterior, jnp.asarray(x_test, dtype), return_std=True)
    assert mean.dtype == dtype and std.dtype == dtype
    ref_mean, ref_std = ref.predict(x_test, return_std=True)
    np.testing.assert_allclose(np.asarray(mean[:, 0]), ref_mean,
                               rtol=rtol, atol=rtol * np.abs(ref_mean).max())
    np.testing.assert_allclose(np.asarray(std), ref_std, rtol=rtol)
    _, cov = gp.predict(params, xj, posterior, jnp.asarray(x_test[:20], dtype), return_cov=True)
    _, ref_cov = ref.predict(x_test[:20], return_cov=True)
    np.testing.assert_allclose(np.asarray(cov), ref_cov, rtol=rtol, atol=rtol * ref_cov.max())


def test_underranked_love_clips_with_warning():
    x, y, x_test = regression_data(800, d=4, seed=5)
    params = gp.GPParams.from_constrained(0.0, 1.0, [1.0] * 4, 1e-4, dtype=jnp.float64)
    solver = gp.BBMMSolver(love_rank=8, preconditioner_rank=50, max_cg_iter=2000)
    xj, yj = jnp.asarray(x), jnp.asarray(y[:, None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        posterior = solver.love(params, xj, solver.posterior(params, xj, yj))
    # Training points themselves: true latent variance ~ noise; a rank-8 cache can't know that,
    # so it overestimates (never negative): no clipping here...
    _, std = gp.predict(params, xj, posterior, xj[:50], return_std=True, include_noise=False)
    assert np.all(np.asarray(std) >= 0)
    # ...while a deliberately wrong factor (too large) must be clipped with a warning.
    bad = gp.Posterior(alpha=posterior.alpha, love_factor=posterior.love_factor * 10)
    with pytest.warns(RuntimeWarning, match="clipped"):
        _, std = gp.predict(params, xj, bad, xj[:50], return_std=True, include_noise=False)
    assert np.all(np.isfinite(np.asarray(std))) and np.all(np.asarray(std) >= 0)



@pytest.mark.parametrize("targets", [1, 2])
def test_a_few_means_take_short_blocks_and_keep_their_bits(targets):
    """Up to `SHORT_PREDICT_ROWS` means alone run in blocks of `SHORT_PREDICT_BLOCK` rows (one
    query does not pay for 1,024): each row's mean is bitwise the one it gets among 1,100, with
    one target (short engine tiles) and two (the engine's full tile inside a short block)."""
    x, y, x_test = regression_data(1500, d=4, seed=4, num_test=1100)
    dtype = np.float32
    params = rbf_params(dtype)
    xj = jnp.asarray(x, dtype)
    yj = jnp.asarray(np.stack([y, -2.0 * y], axis=1)[:, :targets], dtype)
    posterior = gp.CholeskySolver().posterior(params, xj, yj)
    queries = jnp.asarray(x_test, dtype)
    full = np.asarray(gp.predict(params, xj, posterior, queries))
    rng = np.random.default_rng(0)
    for size in (1, 7, 8, SHORT_PREDICT_ROWS, SHORT_PREDICT_ROWS + 1):
        idx = rng.permutation(queries.shape[0])[:size]
        got = np.asarray(gp.predict(params, xj, posterior, queries[idx]))
        np.testing.assert_array_equal(got, full[idx], err_msg=f"{size} rows")
