"""scalegp.kde._density: log-densities against scikit-learn and the definition, far queries,
weights as repeated rows, batches, per-feature bandwidths and a given data order.

float64 references run under the x64 marker (tests/conftest.py); float32 paths get float32 arrays.
"""

import numpy as np
import pytest
from sklearn.neighbors import KernelDensity

from scalegp import kde
from tests.kde.references import TOL, brute_log_density, mixture

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_log_density_matches_sklearn(dtype, weighted):
    """Equal bandwidth: scikit-learn's KernelDensity(kernel="gaussian") log-density within 1e-4
    (float32) / 1e-9 (float64), and the float64 definition within the same tolerances.

    Queries come from the data's distribution: far out (log-density below about -25) scikit-learn's
    tree itself drifts by ~1e-5 relative, even with atol = rtol = 0."""
    X = mixture(400, d=3, seed=1) + 50.0  # offset: the engine must centre
    Q = mixture(64, d=3, seed=1, draw=2) + 50.0
    w = np.random.default_rng(3).uniform(0.1, 3.0, 400) if weighted else None
    reference = KernelDensity(bandwidth=0.7).fit(X, sample_weight=w).score_samples(Q)
    ours = kde.log_density(Q.astype(dtype), X.astype(dtype), 0.7, w)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, reference, rtol=0, atol=TOL[dtype])
    np.testing.assert_allclose(ours, brute_log_density(Q, X, 0.7, w), rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log_density_of_distant_queries_matches_the_definition(dtype):
    X = mixture(300, d=3, seed=1)
    Q = mixture(40, d=3, seed=4) * 3.0  # another mixture: log-densities down to about -1e3
    expected = brute_log_density(Q, X, 0.5)
    assert expected.min() < -200
    got = kde.log_density(Q.astype(dtype), X.astype(dtype), 0.5)
    np.testing.assert_allclose(got, expected, rtol={np.float32: 1e-5, np.float64: 1e-12}[dtype])


def test_integer_weights_equal_repeated_rows():
    X = mixture(120, seed=7)
    counts = np.random.default_rng(8).integers(0, 4, size=120)
    repeated = np.repeat(X, counts, axis=0)
    Q = mixture(40, seed=9)
    np.testing.assert_allclose(
        kde.log_density(Q, X, 0.5, counts), kde.log_density(Q, repeated, 0.5), rtol=0, atol=1e-12
    )
    # cross-validation sees the same collapsed, weighted points either way
    by_weight = kde.cross_validate_bandwidth(X, counts, diagonal=True)
    by_rows = kde.cross_validate_bandwidth(repeated, diagonal=True)
    np.testing.assert_allclose(by_weight.bandwidth, by_rows.bandwidth, rtol=1e-9)


def test_far_queries_have_finite_exact_log_density():
    data = np.zeros((1, 2))
    queries = np.array([[1e3, 0.0], [0.0, -3e3]])
    exact = -0.5 * np.sum(queries**2, axis=1) - np.log(2 * np.pi)
    for dtype in (np.float32, np.float64):
        out = kde.log_density(queries.astype(dtype), data.astype(dtype), 1.0)
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, exact, rtol=1e-6)


def test_batches_give_the_same_result_as_one_call():
    X = mixture(300, seed=10)
    Q = mixture(1000, seed=11)
    whole = kde.log_density(Q, X, 0.4)
    np.testing.assert_allclose(kde.log_density(Q, X, 0.4, batch_size=37), whole, rtol=0, atol=1e-12)
    assert kde.log_density(Q[:0], X, 0.4).shape == (0,)


def test_per_feature_bandwidth_is_a_diagonal_kernel():
    X = mixture(200, seed=12)
    Q = mixture(20, seed=13)
    h = np.array([0.3, 0.8])
    # a diagonal bandwidth equals a unit bandwidth on features divided by h, with the Jacobian
    np.testing.assert_allclose(
        kde.log_density(Q, X, h),
        kde.log_density(Q / h, X / h, 1.0) - np.log(h).sum(),
        rtol=0,
        atol=1e-10,
    )


def test_log_density_checks_a_given_data_order():
    X = np.random.default_rng(2).standard_normal((40, 2))
    with pytest.raises(ValueError, match=r"data_order must be an integer array of shape \(40,\)"):
        kde.log_density(X[:3], X, 0.5, prune=True, data_order=np.arange(39))
    with pytest.raises(ValueError, match="permutation"):
        kde.log_density(X[:3], X, 0.5, prune=True, data_order=np.r_[np.arange(39), 0])

