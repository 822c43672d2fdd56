"""scalegp.kde: densities against scikit-learn and scipy, the leave-one-out objective against
brute force, bandwidth cross-validation against a brute-force grid and statsmodels, duplicates,
scaling, sampling, and input errors.

float64 runs use the session-wide x64 mode (tests/conftest.py); float32 paths get float32 arrays.
"""

import functools
import warnings

import numpy as np
import pytest
import scipy.stats
from scipy.special import logsumexp
from sklearn.exceptions import ConvergenceWarning
from sklearn.neighbors import KernelDensity

from scalegp import kde
from scalegp.kde import _loo as kde_loo
from scalegp.kde._loo import loo_problem, neg_mean_loo_value_and_grad
from scalegp.ops import Engine

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)

TOL = {np.float32: 1e-4, np.float64: 1e-9}


def mixture(n, d=2, seed=0, draw=None):
    """n draws (seeded by ``draw``, default ``seed``) from a correlated, unequally spread
    three-component Gaussian mixture in d dimensions (fixed by ``seed``)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(3, d))
    mixing = np.eye(d) + 0.4 * rng.normal(size=(d, d))
    scales = np.array([0.3, 1.0, 0.6])
    rng = rng if draw is None else np.random.default_rng([seed, draw])
    labels = rng.choice(3, size=n, p=[0.5, 0.3, 0.2])
    return (centres[labels] + scales[labels, None] * rng.normal(size=(n, d))) @ mixing


def brute_log_density(Q, X, h, w=None):
    """The Gaussian KDE's log-density by the definition, in float64."""
    Q, X = np.asarray(Q, np.float64), np.asarray(X, np.float64)
    d = X.shape[1]
    w = np.ones(X.shape[0]) if w is None else np.asarray(w, np.float64)
    h = np.broadcast_to(np.asarray(h, np.float64), (d,))
    e = -0.5 * np.sum(((Q[:, None, :] - X[None, :, :]) / h) ** 2, axis=-1)
    return (
        logsumexp(e, b=w[None, :], axis=1) - np.log(w.sum()) - 0.5 * d * np.log(2 * np.pi)
        - np.log(h).sum()
    )


def brute_loo(X, h, w=None):
    """Leave-one-out log-densities by the definition, with every exact copy of x_i left out."""
    X = np.asarray(X, np.float64)
    n, d = X.shape
    w = np.ones(n) if w is None else np.asarray(w, np.float64)
    h = np.broadcast_to(np.asarray(h, np.float64), (d,))
    diff = (X[:, None, :] - X[None, :, :]) / h
    e = -0.5 * np.sum(diff**2, axis=-1)
    copy = np.all(X[:, None, :] == X[None, :, :], axis=-1)
    terms = np.where(copy | (w[None, :] == 0), -np.inf, e + np.log(np.where(w > 0, w, 1))[None, :])
    left = w.sum() - (copy * w[None, :]).sum(axis=1)
    return logsumexp(terms, axis=1) - np.log(left) - 0.5 * d * np.log(2 * np.pi) - np.log(h).sum()


# ----------------------------------------------------------------------------------------------
# densities


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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", ["scott", "silverman"])
@pytest.mark.parametrize("weighted", [False, True])
def test_covariance_scaling_matches_scipy(dtype, rule, weighted):
    X = mixture(300, d=3, seed=4)
    Q = mixture(50, d=3, seed=5)
    w = np.random.default_rng(6).uniform(0.1, 3.0, 300) if weighted else None
    reference = scipy.stats.gaussian_kde(X.T, bw_method=rule, weights=w)
    model = kde.fit_kde(X.astype(dtype), w, bandwidth=rule, scale="covariance")
    assert model.bandwidth == pytest.approx(reference.factor, rel=1e-12)
    np.testing.assert_allclose(model.log_density(Q), reference.logpdf(Q.T), rtol=0, atol=TOL[dtype])


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


@pytest.mark.parametrize("scale", [None, "standardize", "covariance"])
@pytest.mark.parametrize("rule", ["scott", "silverman"])
def test_rules_and_scalings_follow_the_data_scale(scale, rule):
    """Stretching features by c stretches rule bandwidths by c (unlike scikit-learn's rules), and
    the density transforms with the Jacobian: p_{cX}(c x) = p_X(x) / prod(c)."""
    X = mixture(300, seed=14)
    Q = mixture(30, seed=15)
    c = np.array([10.0, 0.05])
    base = kde.fit_kde(X, bandwidth=rule, scale=scale)
    stretched = kde.fit_kde(X * c, bandwidth=rule, scale=scale)
    if scale is None:
        np.testing.assert_allclose(stretched.bandwidth, base.bandwidth * c, rtol=1e-12)
    else:
        assert stretched.bandwidth == pytest.approx(base.bandwidth, rel=1e-12)
    np.testing.assert_allclose(
        stretched.log_density(Q * c), base.log_density(Q) - np.log(c).sum(), rtol=0, atol=1e-9
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_per_feature_spreads_take_memory_linear_in_the_features(weighted):
    """'standardize' and the rules read each feature's spread without the (d, d) covariance
    (800 MB at 10,000 features: a wide KDE's fit ran out of memory before its compilation
    did), and agree with that covariance's diagonal; the scaling maps rows one by one."""
    X = np.random.default_rng(40).normal(3.0, [0.5, 2.0, 7.0], size=(200, 3))
    w = np.random.default_rng(41).uniform(0.0, 2.0, 200) if weighted else None
    std = np.sqrt(np.diag(np.cov(X, rowvar=False, aweights=w)))
    np.testing.assert_allclose(kde.fit_scaling(X, w, "standardize").scale, std, rtol=1e-13)
    np.testing.assert_allclose(kde.rule_bandwidth(X, "scott", w),
                               kde.scott_factor(200 if w is None else w.sum() ** 2 / (w**2).sum(), 3) * std,
                               rtol=1e-13)
    wide = np.random.default_rng(42).normal(size=(10, 20_000))
    scaling = kde.fit_scaling(wide, None, "standardize")
    assert scaling.scale.shape == (20_000,) and scaling.whitening is None
    z = scaling.transform(wide)
    np.testing.assert_array_equal(scaling.transform(wide[3:4]), z[3:4])
    np.testing.assert_allclose(scaling.inverse_transform(z), wide, rtol=0, atol=1e-12)


def test_scott_rule_per_feature_and_standardize_agree():
    """'scott' on raw features is Scott's factor times each feature's spread, which is the same
    KDE as Scott's factor on standardised features."""
    X = mixture(250, seed=16)
    Q = mixture(25, seed=17)
    h = kde.rule_bandwidth(X, "scott")
    np.testing.assert_allclose(h, 250 ** (-1 / 6) * X.std(axis=0, ddof=1), rtol=1e-12)
    raw = kde.fit_kde(X, bandwidth="scott").log_density(Q)
    standardized = kde.fit_kde(X, bandwidth="scott", scale="standardize").log_density(Q)
    np.testing.assert_allclose(raw, standardized, rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------------------------
# leave-one-out


@pytest.mark.parametrize("path", ["dense", "grouped", "grouped-remat"])
def test_loo_matches_brute_force(path, monkeypatch):
    rng = np.random.default_rng(18)
    X = mixture(700, seed=19)
    X = np.concatenate([X, X[:80], X[:10]])  # exact duplicates, some in triplicate
    w = rng.uniform(0.2, 2.0, X.shape[0])
    w[5] = 0.0
    h = np.array([0.25, 0.4])
    if path != "dense":
        monkeypatch.setattr(kde_loo, "_DENSE_LOO_MAX_ENTRIES", 1000)
        monkeypatch.setattr(kde_loo, "_LOO_GROUP", 128)
    if path == "grouped-remat":
        monkeypatch.setattr(kde_loo, "_REMAT_MIN_ELEMENTS", 0)
    expected = brute_loo(X, h, w)
    np.testing.assert_allclose(kde.loo_log_density(X, h, w), expected, rtol=0, atol=1e-10)
    rows = np.array([3, 700, 5, 789])
    np.testing.assert_allclose(
        kde.loo_log_density(X, h, w, held_out=rows), expected[rows], rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("path", ["dense", *(pytest.param(p, marks=pytest.mark.slow)
                                           for p in ("grouped", "grouped-remat"))])
def test_loo_objective_gradient_in_float32(path, monkeypatch):
    """The objective's float32 gradient (what L-BFGS-B sees) matches float64 central differences,
    also at a bandwidth small enough that isolated points' LOO densities fall below e^-88: there a
    zero-weight (left-out) key next to the query would overflow the engine's backward pass."""
    import jax.numpy as jnp

    rng = np.random.default_rng(40)
    X = np.concatenate([mixture(600, seed=41), rng.uniform(-12, 12, size=(20, 2))])
    if path != "dense":
        monkeypatch.setattr(kde_loo, "_DENSE_LOO_MAX_ENTRIES", 1000)
        monkeypatch.setattr(kde_loo, "_LOO_GROUP", 128)
    if path == "grouped-remat":
        monkeypatch.setattr(kde_loo, "_REMAT_MIN_ELEMENTS", 0)
    held = np.arange(0, 620, 2)
    for log_h in (np.log(0.05), np.log([0.3, 0.15])):
        assert brute_loo(X, np.exp(log_h)).min() < -88
        grads = []
        for dtype in (np.float32, np.float64):
            arrays, static = loo_problem(X, np.ones(620), held, dtype, Engine())
            assert (static["group"] == 0) == (path == "dense")
            value, grad = neg_mean_loo_value_and_grad(
                jnp.asarray(log_h, dtype), *arrays, **static
            )
            assert np.isfinite(value) and np.all(np.isfinite(grad))
            grads.append(np.asarray(grad, np.float64))

        def objective(t):
            return -np.mean(brute_loo(X, np.exp(t))[held])

        step = 1e-5
        numeric = [
            (objective(log_h + step * e) - objective(log_h - step * e)) / (2 * step)
            for e in np.eye(np.size(log_h)).reshape(np.size(log_h), *np.shape(log_h))
        ]
        numeric = np.reshape(numeric, np.shape(log_h))
        np.testing.assert_allclose(grads[1], numeric, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(grads[0], grads[1], rtol=2e-3, atol=2e-4)


def test_loo_of_isolated_points_is_accurate_in_float32():
    """The self term is removed exactly, not subtracted: for an isolated point the self term is
    e^50 times the rest, so subtracting it from the full sum would leave float32 noise."""
    rng = np.random.default_rng(20)
    X = np.concatenate([rng.normal(size=(300, 2)) * 0.1, [[3.0, 0.0], [-2.5, 2.5]]])
    h = 0.3
    expected = brute_loo(X, h)
    got = kde.loo_log_density(X.astype(np.float32), h)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_loo_undefined_for_a_single_distinct_point():
    with pytest.raises(ValueError, match="at least 2 distinct points"):
        kde.loo_log_density(np.ones((5, 2)), 1.0)


def _equation_count(jaxpr):
    """Equations of a jaxpr, those of the jaxprs inside its equations (scan bodies, branches)
    included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    total += _equation_count(sub)
    return total


@pytest.mark.parametrize("path", ["dense", "grouped"])
@pytest.mark.parametrize("diagonal", [False, True])
def test_loo_objective_program_does_not_grow_with_the_number_of_features(
        path, diagonal, monkeypatch):
    """The objective and its gradient trace to the same program at d = 32 and d = 256 (both
    above the engine's coordinate-differences branch, d <= 16): the LOO exponents are a loop
    over features, not one unrolled step per feature (whose compilation took minutes for wide
    data)."""
    import jax
    import jax.numpy as jnp

    if path == "grouped":
        monkeypatch.setattr(kde_loo, "_DENSE_LOO_MAX_ENTRIES", 100)
        monkeypatch.setattr(kde_loo, "_LOO_GROUP", 8)
    counts = []
    for d in (32, 256):
        X = np.random.default_rng(d).normal(size=(24, d))
        arrays, static = loo_problem(X, np.ones(24), np.arange(24), np.float32, Engine())
        assert (static["group"] == 0) == (path == "dense")
        log_h = jnp.zeros((d,) if diagonal else (), jnp.float32)
        objective = functools.partial(kde_loo._neg_mean_loo, **static)
        counts.append(_equation_count(
            jax.make_jaxpr(jax.value_and_grad(objective))(log_h, *arrays).jaxpr))
    assert counts[0] == counts[1]


def test_loo_exponents_and_their_gradients_match_float64_at_many_features():
    """float32 exponents from the coordinate differences, and their VJP in both point sets and
    per-feature bandwidths, against float64 on data offset far from the origin (where the
    distance expansion would lose every digit) at short to long bandwidths, d = 40."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(36)
    d = 40
    x1 = (1e3 + rng.normal(size=(9, d))).astype(np.float32)
    x2 = (1e3 + rng.normal(size=(13, d))).astype(np.float32)
    g = rng.normal(size=(9, 13)).astype(np.float32)

    def reference(x1, x2, h):
        return -0.5 * jnp.sum(((x1[:, None, :] - x2[None, :, :]) / h) ** 2, axis=-1)

    for h in (np.float32(0.05), np.float32(3.0), rng.uniform(0.05, 30.0, d).astype(np.float32)):
        want, want_vjp = jax.vjp(reference, *(jnp.asarray(a, jnp.float64) for a in (x1, x2, h)))
        got, got_vjp = jax.vjp(kde_loo._log_kernel_block, *map(jnp.asarray, (x1, x2, h)))
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=2e-6)
        grads = zip(got_vjp(jnp.asarray(g)), want_vjp(jnp.asarray(g, jnp.float64)))
        for got_grad, want_grad in grads:
            assert got_grad.shape == want_grad.shape and got_grad.dtype == jnp.float32
            scale = np.max(np.abs(want_grad))
            np.testing.assert_allclose(got_grad, want_grad, rtol=0, atol=2e-5 * scale)


# ----------------------------------------------------------------------------------------------
# cross-validation


def brute_loo_mean(X, h, w=None):
    w = np.ones(X.shape[0]) if w is None else w
    return np.sum(w * brute_loo(X, h, w)) / np.sum(w)


@functools.lru_cache(maxsize=1)
def _grid_problem():
    """n = 2000 data and the maximiser of its brute-force LOO log-likelihood over a grid of
    scalar bandwidths (25 log-spaced values, refined twice around the best to 0.2% spacing)."""
    X = mixture(2000, seed=21)
    sq = np.sum((X[:, None, :] - X[None, :, :]) ** 2, axis=-1)
    np.fill_diagonal(sq, np.inf)
    sq -= sq.min(axis=1, keepdims=True)  # row shift: each row's largest term is exp(0)
    nearest = np.sort(np.sum((X[:, None, :] - X[None, :, :]) ** 2, axis=-1), axis=1)[:, 1]

    def loo_mean(log_h):
        h2 = np.exp(2 * log_h)
        lse = np.log(np.sum(np.exp(-0.5 * sq / h2), axis=1)) - 0.5 * nearest / h2
        return np.mean(lse) - np.log(1999) - 2 * log_h - np.log(2 * np.pi)

    grid = np.linspace(np.log(0.02), np.log(3.0), 25)  # spacing 0.21 in log h
    for half_width in (0.22, 0.022):  # refine twice, to a spacing of 0.2%
        centre = grid[np.argmax([loo_mean(t) for t in grid])]
        grid = centre + np.linspace(-half_width, half_width, 23)
    values = [loo_mean(t) for t in grid]
    best = int(np.argmax(values))
    assert 0 < best < 22, "grid maximiser lies on the finest grid's edge"
    return X, float(np.exp(grid[best])), float(values[best])


@pytest.mark.parametrize("dtype", [pytest.param(np.float64, marks=pytest.mark.slow), np.float32])
def test_scalar_cv_matches_brute_force_grid_maximiser(dtype):
    """n = 2000: the scalar 'cv' bandwidth is within 2% of the maximiser of a brute-force grid of
    leave-one-out log-likelihoods computed densely in numpy float64."""
    X, grid_best, grid_value = _grid_problem()
    result = kde.cross_validate_bandwidth(X.astype(dtype), cv_subsample=None)
    assert result.n_held_out == 2000 and not result.at_bound.any()
    assert result.bandwidth == pytest.approx(grid_best, rel=0.02)
    # its likelihood (recomputed in float64 by the definition) is the grid's best, up to the
    # grid's spacing
    assert brute_loo_mean(X, result.bandwidth) >= grid_value - 1e-5


def test_cv_optimum_is_stationary():
    """Moving the cv-diag bandwidth by 1% in any feature lowers the LOO likelihood."""
    X = mixture(600, seed=22)
    result = kde.cross_validate_bandwidth(X, diagonal=True)
    best = brute_loo_mean(X, result.bandwidth)
    assert best == pytest.approx(result.log_likelihood, abs=1e-9)
    for k in range(2):
        for factor in (0.99, 1.01):
            h = result.bandwidth.copy()
            h[k] *= factor
            assert brute_loo_mean(X, h) < best


def test_cv_diag_agrees_with_statsmodels_cv_ml():
    """n = 500: cv-diag reaches a LOO likelihood at least as high as statsmodels'
    KDEMultivariate(bw="cv_ml"), and the bandwidths agree within 10%."""
    statsmodels_kde = pytest.importorskip("statsmodels.nonparametric.kernel_density")
    X = mixture(500, seed=23)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = statsmodels_kde.KDEMultivariate(X, var_type="cc", bw="cv_ml").bw
    ours = kde.cross_validate_bandwidth(X, diagonal=True)
    assert brute_loo_mean(X, ours.bandwidth) >= brute_loo_mean(X, reference) - 1e-9
    np.testing.assert_allclose(ours.bandwidth, reference, rtol=0.10)


@pytest.mark.parametrize("diagonal", [False, True])
def test_duplicates_do_not_drive_the_bandwidth_to_zero(diagonal):
    """20% of the points are exact copies of others: the cross-validated bandwidth stays within
    2x of the one chosen on the de-duplicated data (naively it would collapse towards 0)."""
    rng = np.random.default_rng(24)
    unique = mixture(1600, seed=25)
    data = np.concatenate([unique, unique[rng.choice(1600, size=400, replace=False)]])
    rng.shuffle(data)
    on_unique = kde.cross_validate_bandwidth(unique, diagonal=diagonal)
    on_data = kde.cross_validate_bandwidth(data, diagonal=diagonal)
    assert on_data.n_unique == 1600
    ratio = np.asarray(on_data.bandwidth) / np.asarray(on_unique.bandwidth)
    assert np.all((ratio > 0.5) & (ratio < 2.0)), ratio


def test_cv_subsample_is_seeded_and_close_to_full():
    X = mixture(3000, seed=26)
    full = kde.cross_validate_bandwidth(X, cv_subsample=None)
    a = kde.cross_validate_bandwidth(X, cv_subsample=500, random_state=1)
    b = kde.cross_validate_bandwidth(X, cv_subsample=500, random_state=1)
    assert a.n_held_out == 500 and full.n_held_out == 3000
    assert a.bandwidth == b.bandwidth
    assert a.bandwidth == pytest.approx(full.bandwidth, rel=0.15)


def test_cv_warns_when_a_discrete_feature_hits_the_bound():
    """A feature with three distinct values: ties in that coordinate reward an ever smaller
    bandwidth, so cv-diag stops at the search bound and says so."""
    rng = np.random.default_rng(27)
    X = np.column_stack([rng.normal(size=400), rng.integers(0, 3, size=400).astype(float)])
    with pytest.warns(ConvergenceWarning, match="search bound"):
        result = kde.cross_validate_bandwidth(X, diagonal=True)
    assert result.at_bound.tolist() == [False, True]


def test_cv_needs_two_distinct_points_and_spread():
    with pytest.raises(ValueError, match="at least 2 distinct points"):
        kde.cross_validate_bandwidth(np.ones((10, 2)))
    with pytest.raises(ValueError, match=r"feature\(s\) \[1\] of the data are constant"):
        kde.cross_validate_bandwidth(np.column_stack([np.arange(10.0), np.ones(10)]))


# ----------------------------------------------------------------------------------------------
# sampling


@pytest.mark.parametrize(
    "scale,bandwidth,weighted",
    [(None, 0.5, False), (None, np.array([0.2, 0.7]), True), ("standardize", "scott", True),
     ("covariance", 0.4, False)],
)
def test_sample_moments_match_the_kde(scale, bandwidth, weighted):
    """Mean and covariance of 200,000 draws match the KDE's analytic moments within 6 standard
    errors (estimated from the draws' own fourth moments)."""
    X = mixture(500, seed=28)
    w = np.random.default_rng(29).uniform(0.0, 2.0, 500) if weighted else None
    model = kde.fit_kde(X, w, bandwidth=bandwidth, scale=scale)
    # analytic moments, written out independently of FittedKDE.moments
    p = np.full(500, 1 / 500) if w is None else w / w.sum()
    mean = p @ X
    h = np.broadcast_to(np.asarray(model.bandwidth, np.float64), (2,))
    kernel_cov = model.scaling.inverse.T @ np.diag(h**2) @ model.scaling.inverse
    cov = (X - mean).T @ ((X - mean) * p[:, None]) + kernel_cov
    got_mean, got_cov = model.moments()
    np.testing.assert_allclose(got_mean, mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got_cov, cov, rtol=1e-10, atol=1e-12)

    draws = model.sample(200_000, random_state=0)
    assert draws.shape == (200_000, 2)
    n = draws.shape[0]
    centred = draws - mean
    se_mean = np.sqrt(np.diag(cov) / n)
    assert np.all(np.abs(draws.mean(axis=0) - mean) < 6 * se_mean)
    products = centred[:, :, None] * centred[:, None, :]
    se_cov = products.std(axis=0) / np.sqrt(n)
    assert np.all(np.abs(products.mean(axis=0) - cov) < 6 * se_cov)


def test_sample_is_reproducible_and_respects_zero_weights():
    X = mixture(50, seed=30)
    w = np.zeros(50)
    w[7] = 1.0
    a = kde.sample(X, 0.1, 1000, w, random_state=3)
    b = kde.sample(X, 0.1, 1000, w, random_state=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, kde.sample(X, 0.1, 1000, w, random_state=4))
    # only row 7 can be picked
    assert np.abs(a.mean(axis=0) - X[7]).max() < 0.02


# ----------------------------------------------------------------------------------------------
# weights are relative, at any scale


def weights_at(scale, n):
    """(weights at ``scale``, the weights that must give the same results): uniform(0.5, 1.5)
    times the scale; weights of 5e-324, the smallest subnormal, are all equal."""
    if scale == 5e-324:
        return np.full(n, scale), np.ones(n)
    relative = np.random.default_rng(44).uniform(0.5, 1.5, n)
    return scale * relative, relative


@pytest.mark.parametrize("scale", [5e-324, 1e-300, 1e-40, 1e300, 1e308])
def test_functions_take_weights_at_any_scale(scale):
    """Every function that takes weights gives for c w what it gives for w, in float32 and in
    the float64 numpy parts (spread, scaling, sampling, moments)."""
    X, Q = mixture(300, seed=43), mixture(40, seed=43, draw=45)
    X32, Q32 = X.astype(np.float32), Q.astype(np.float32)
    w, reference = weights_at(scale, 300)

    def same(f, rtol=1e-12, atol=0.0):
        np.testing.assert_allclose(f(w), f(reference), rtol=rtol, atol=atol)

    same(lambda w: kde.log_density(Q32, X32, 0.4, w), rtol=0, atol=1e-5)
    same(lambda w: kde.density(Q32, X32, 0.4, w), rtol=1e-5)
    same(lambda w: kde.loo_log_density(X32, 0.4, w), rtol=0, atol=1e-5)
    same(lambda w: kde.sample(X, 0.4, 50, w, random_state=5))
    same(lambda w: kde.rule_bandwidth(X, "silverman", w))
    for scaling in ("standardize", "covariance"):
        same(lambda w: kde.fit_scaling(X, w, scaling).matrix)
        same(lambda w: kde.fit_scaling(X, w, scaling).location)
    same(lambda w: kde.fit_kde(X, w, bandwidth="scott", scale="covariance").moments()[1])
    same(lambda w: kde.cross_validate_bandwidth(X32, w).bandwidth, rtol=1e-5)
    same(lambda w: kde.cross_validate_bandwidth(X32, w, diagonal=True).bandwidth, rtol=1e-5)


@pytest.mark.skipif(np.finfo(np.longdouble).minexp >= np.finfo(np.float64).minexp,
                    reason="long double is float64 on this platform")
def test_long_double_weights_beyond_float64_keep_their_ratios():
    X, Q = mixture(50, seed=46), mixture(5, seed=46, draw=47)
    relative = np.random.default_rng(48).uniform(0.5, 1.5, 50)
    tiny = relative.astype(np.longdouble) * np.longdouble("1e-4000")
    np.testing.assert_allclose(kde.log_density(Q, X, 0.4, tiny),
                               kde.log_density(Q, X, 0.4, relative), rtol=1e-12)


def test_weights_beyond_the_compute_dtypes_ratios_warn():
    """A weight below float32's smallest normal (1.2e-38) times the largest would be flushed to
    zero by the engine: a warning says so, and float64 keeps it; below float64's range too."""
    X = np.array([[0.0, 0.0], [100.0, 0.0]])
    Q = X[1:]
    w = np.array([1.0, 1e-40])
    exact = np.log(1e-40) - np.log(2 * np.pi)  # the other point is 100 bandwidths away
    with pytest.warns(RuntimeWarning, match=r"1 weight\(s\) are below 1.18e-38 times the largest"):
        got = kde.log_density(Q.astype(np.float32), X.astype(np.float32), 1.0, w)
    assert got[0] < -4000  # the light point left out
    np.testing.assert_allclose(kde.log_density(Q, X, 1.0, w), [exact], rtol=1e-12)
    with pytest.warns(RuntimeWarning, match="1 positive weight.* below about 1e-323 times"):
        kde.log_density(Q, X, 1.0, np.array([1e300, 1e-300]))


# ----------------------------------------------------------------------------------------------
# errors


GOOD = np.random.default_rng(31).normal(size=(20, 2))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: kde.log_density(GOOD, np.full((20, 2), np.nan), 1.0), "contains NaN"),
        (lambda: kde.log_density(np.full((3, 2), np.inf), GOOD, 1.0), "contains infinity"),
        (lambda: kde.log_density(GOOD, GOOD[:0], 1.0), "at least 1 sample"),
        (lambda: kde.log_density(GOOD, GOOD[:, 0], 1.0), r"reshape\(-1, 1\)"),
        (lambda: kde.log_density(GOOD[:, :1], GOOD, 1.0), "queries have 1 features but data has 2"),
        (lambda: kde.log_density(GOOD, GOOD, 0.0), "must be > 0"),
        (lambda: kde.log_density(GOOD, GOOD, -1.0), "must be > 0"),
        (lambda: kde.log_density(GOOD, GOOD, np.array([1.0, 0.0])), "positive and finite"),
        (lambda: kde.log_density(GOOD, GOOD, np.ones(3)), "shape"),
        (lambda: kde.log_density(GOOD, GOOD, 1.0, -np.ones(20)), "non-negative"),
        (lambda: kde.log_density(GOOD, GOOD, 1.0, np.zeros(20)), "not be all zero"),
        (lambda: kde.log_density(GOOD, GOOD, 1.0, np.ones(19)), r"shape \(20,\)"),
        (lambda: kde.sample(GOOD, 1.0, 5, np.full(20, np.nan)), "must be finite"),
        (lambda: kde.sample(GOOD, 1.0, 5, np.r_[np.inf, np.ones(19)]), "must be finite"),
        (lambda: kde.loo_log_density(GOOD, 1.0, np.r_[-1e-300, np.ones(19)]), "non-negative"),
        (lambda: kde.rule_bandwidth(GOOD, "scott", np.zeros(20)), "not be all zero"),
        (lambda: kde.cross_validate_bandwidth(GOOD, np.zeros(20)), "not be all zero"),
        # weights are relative: one of 1e300 among 1e-300 leaves one point with weight
        (lambda: kde.rule_bandwidth(GOOD, "scott", np.r_[1e300, np.full(19, 1e-300)]),
         "at least 2 samples with positive weight"),
        (lambda: kde.fit_kde(GOOD, np.r_[1e300, np.full(19, 1e-300)], scale="standardize"),
         "at least 2 samples with positive weight"),
        (lambda: kde.cross_validate_bandwidth(GOOD, np.r_[1e300, np.full(19, 1e-300)]),
         "at least 2 distinct points with positive weight"),
        (lambda: kde.fit_kde(GOOD, scale="whiten"), "scale must be one of"),
        (lambda: kde.fit_kde(GOOD, bandwidth="cv-full"), "got the string 'cv-full'"),
        (lambda: kde.fit_kde(GOOD[:1], bandwidth="scott"), "n_samples=1"),
        (lambda: kde.fit_kde(GOOD[:2], scale="covariance", bandwidth=1.0), "singular"),
        (lambda: kde.fit_kde(np.column_stack([GOOD[:, 0], 2 * GOOD[:, 0]]), scale="covariance"),
         "singular"),
        (lambda: kde.cross_validate_bandwidth(GOOD, cv_subsample=1), "cv_subsample must be >= 2"),
    ],
)
@pytest.mark.filterwarnings("ignore:weights:RuntimeWarning")  # the 1e-300 weights count as zero
def test_bad_input_raises_a_clear_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------------------------
# larger checks (CI skips them: pytest -m slow)


@pytest.mark.slow
def test_cv_subsample_is_close_to_full_leave_one_out():
    """n = 30,000, d = 3, float32: with the default random subset of 8192 held-out points the
    scalar bandwidth is within 6% of the full leave-one-out optimum (observed: 0.7% to 3% over
    four seeds), and the full LOO likelihood it reaches is within 0.002 nats per point."""
    X = mixture(30_000, d=3, seed=50).astype(np.float32)
    full = kde.cross_validate_bandwidth(X, cv_subsample=None)
    assert full.converged and full.n_held_out == 30_000
    for seed in (0, 1):
        sub = kde.cross_validate_bandwidth(X, random_state=seed)
        assert sub.converged and sub.n_held_out == 8192
        assert sub.bandwidth == pytest.approx(full.bandwidth, rel=0.06)
        common = np.random.default_rng(9).choice(30_000, size=4096, replace=False)
        gap = (kde.loo_log_density(X, full.bandwidth, held_out=common).mean()
               - kde.loo_log_density(X, sub.bandwidth, held_out=common).mean())
        assert gap < 0.002


@pytest.mark.slow
@pytest.mark.parametrize("d", [5_000, 10_000])
def test_cv_on_wide_data_completes_and_matches_float64(d):
    """10 points of d features, float32, bandwidth="cv" (the CLI's default): the fit compiles a
    program that does not grow with d (it took over 20 minutes at d = 5,000 when the LOO
    exponents were unrolled over features), and its log-likelihood and log-densities match the
    definition in float64 at the bandwidth found."""
    from scalegp import ScalableKernelDensity

    X = np.random.default_rng(d).normal(size=(10, d)).astype(np.float32)
    model = ScalableKernelDensity(bandwidth="cv").fit(X)
    assert model.cv_result_.converged
    h = model.bandwidth_
    assert model.cv_result_.log_likelihood == pytest.approx(np.mean(brute_loo(X, h)), rel=1e-5)
    np.testing.assert_allclose(model.score_samples(X), brute_log_density(X, X, h), rtol=1e-5)


def test_log_density_checks_a_given_data_order():
    X = np.random.default_rng(2).standard_normal((40, 2))
    with pytest.raises(ValueError, match=r"data_order must be an integer array of shape \(40,\)"):
        kde.log_density(X[:3], X, 0.5, prune=True, data_order=np.arange(39))
    with pytest.raises(ValueError, match="permutation"):
        kde.log_density(X[:3], X, 0.5, prune=True, data_order=np.r_[np.arange(39), 0])

