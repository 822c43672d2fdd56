"""ScalableKernelDensity: scikit-learn's estimator checks, agreement with KernelDensity and
gaussian_kde, Pipeline / GridSearchCV / clone / pickle, dtypes, sampling and input errors."""

import pickle

import jax
import numpy as np
import pytest
import scipy.special
import scipy.stats
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import GridSearchCV
from sklearn.neighbors import KernelDensity
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

from scalegp import kde
from scalegp.estimators import ScalableKernelDensity


def blobs(n, d=2, seed=0, draw=None):
    """n draws (seeded by ``draw``) from a fixed (by ``seed``) correlated two-blob mixture."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=2.0, size=(2, d))
    mixing = np.eye(d) + 0.5 * rng.normal(size=(d, d))
    rng = rng if draw is None else np.random.default_rng([seed, draw])
    labels = rng.integers(0, 2, size=n)
    return (centres[labels] + (0.4 + 0.6 * labels)[:, None] * rng.normal(size=(n, d))) @ mixing


@parametrize_with_checks(
    [
        ScalableKernelDensity(),
        ScalableKernelDensity(bandwidth="scott", scale="standardize"),
        ScalableKernelDensity(bandwidth="cv", random_state=0),
    ]
)
def test_sklearn_compatible(estimator, check):
    check(estimator)


@pytest.mark.parametrize("dtype", [np.float32, pytest.param(np.float64, marks=pytest.mark.x64)])
def test_score_samples_matches_kernel_density(dtype):
    X = blobs(500, d=3, seed=1)
    Q = blobs(80, d=3, seed=1, draw=2)
    w = np.random.default_rng(3).integers(0, 4, size=500)
    ours = ScalableKernelDensity(bandwidth=0.6).fit(X.astype(dtype), sample_weight=w)
    reference = KernelDensity(bandwidth=0.6).fit(X, sample_weight=w)
    got = ours.score_samples(Q.astype(dtype))
    assert got.dtype == dtype and ours.data_.dtype == dtype
    tol = {np.float32: 1e-4, np.float64: 1e-9}[dtype]
    np.testing.assert_allclose(got, reference.score_samples(Q), rtol=0, atol=tol)
    assert ours.score(Q.astype(dtype)) == pytest.approx(reference.score(Q), abs=80 * tol)


@pytest.mark.x64  # float64 reference, compared at 1e-9
def test_covariance_scale_with_scott_matches_gaussian_kde():
    X = blobs(400, d=3, seed=4)
    Q = blobs(60, d=3, seed=4, draw=5)
    ours = ScalableKernelDensity(bandwidth="scott", scale="covariance").fit(X)
    reference = scipy.stats.gaussian_kde(X.T)
    assert ours.bandwidth_ == pytest.approx(reference.factor, rel=1e-12)
    np.testing.assert_allclose(ours.score_samples(Q), reference.logpdf(Q.T), rtol=0, atol=1e-9)
    np.testing.assert_allclose(ours.scaling_.inverse.T @ ours.scaling_.inverse, reference.covariance
                               / reference.factor**2, rtol=1e-10)


def test_float32_by_default_without_x64():
    """Without JAX's x64 mode even float64 input is computed in float32 (documented)."""
    X = blobs(300, seed=6)
    Q = blobs(40, seed=6, draw=7)
    exact = ScalableKernelDensity(bandwidth=0.5).fit(X).score_samples(Q)
    with jax.enable_x64(False):
        model = ScalableKernelDensity(bandwidth=0.5).fit(X)
        got = model.score_samples(Q)
    assert model.data_.dtype == np.float32 and got.dtype == np.float32
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4)


def test_bandwidth_options():
    X = blobs(400, seed=8)
    scott = ScalableKernelDensity(bandwidth="scott").fit(X)
    assert scott.bandwidth_.shape == (2,)  # per feature on raw features
    np.testing.assert_allclose(scott.bandwidth_, 400 ** (-1 / 6) * X.std(axis=0, ddof=1))
    silverman = ScalableKernelDensity(bandwidth="silverman", scale="standardize").fit(X)
    assert silverman.bandwidth_ == pytest.approx(400 ** (-1 / 6))  # (n (d+2)/4)^(-1/(d+4)), d=2
    fixed = ScalableKernelDensity(bandwidth=[0.3, 0.5]).fit(X)
    np.testing.assert_array_equal(fixed.bandwidth_, [0.3, 0.5])
    cv = ScalableKernelDensity(bandwidth="cv", random_state=0).fit(X)
    assert isinstance(cv.bandwidth_, float) and cv.cv_result_.converged
    assert scott.cv_result_ is None
    cv_diag = ScalableKernelDensity(bandwidth="cv-diag", scale="standardize").fit(X)
    assert cv_diag.bandwidth_.shape == (2,) and cv_diag.cv_result_.n_unique == 400
    Q = blobs(400, seed=8, draw=9)
    # the cross-validated bandwidths fit held-out data better than Scott's oversmoothed rule
    assert cv.score(Q) > scott.score(Q) and cv_diag.score(Q) > scott.score(Q)


def test_cv_is_seeded_by_random_state():
    X = blobs(3000, seed=10)
    a = ScalableKernelDensity(bandwidth="cv", cv_subsample=300, random_state=5).fit(X)
    b = ScalableKernelDensity(bandwidth="cv", cv_subsample=300, random_state=5).fit(X)
    assert a.bandwidth_ == b.bandwidth_ and a.cv_result_.n_held_out == 300


@pytest.mark.x64  # float64 reference, compared at 1e-9
def test_pipeline_and_grid_search_pick_what_kernel_density_picks():
    X = blobs(300, seed=11)
    grid = {"kerneldensity__bandwidth": [0.1, 0.2, 0.3, 0.5, 0.8]}
    ours = GridSearchCV(
        make_pipeline(StandardScaler(), ScalableKernelDensity()),
        {"scalablekerneldensity__bandwidth": grid["kerneldensity__bandwidth"]},
        cv=4,
    ).fit(X)
    reference = GridSearchCV(make_pipeline(StandardScaler(), KernelDensity()), grid, cv=4).fit(X)
    assert (
        ours.best_params_["scalablekerneldensity__bandwidth"]
        == reference.best_params_["kerneldensity__bandwidth"]
    )
    np.testing.assert_allclose(
        ours.cv_results_["mean_test_score"], reference.cv_results_["mean_test_score"], rtol=1e-9
    )
    Q = blobs(20, seed=11, draw=12)
    np.testing.assert_allclose(
        ours.best_estimator_.score_samples(Q),
        reference.best_estimator_.score_samples(Q),
        rtol=0,
        atol=1e-9,
    )


@pytest.mark.parametrize("bandwidth,scale", [(0.4, None), ("cv-diag", "covariance")])
def test_clone_and_pickle_round_trip(bandwidth, scale):
    X = blobs(200, seed=13)
    Q = blobs(30, seed=13, draw=14)
    model = ScalableKernelDensity(bandwidth=bandwidth, scale=scale, random_state=0).fit(X)
    restored = pickle.loads(pickle.dumps(model))
    np.testing.assert_array_equal(restored.score_samples(Q), model.score_samples(Q))
    np.testing.assert_array_equal(
        restored.sample(10, random_state=1), model.sample(10, random_state=1)
    )
    fresh = clone(model)
    assert fresh.get_params() == model.get_params() and not hasattr(fresh, "bandwidth_")
    np.testing.assert_allclose(fresh.fit(X).score_samples(Q), model.score_samples(Q), atol=1e-12)


def test_sample_is_reproducible_and_in_raw_units():
    X = blobs(300, seed=15) * [100.0, 0.01] + [5e3, -2.0]
    model = ScalableKernelDensity(bandwidth="scott", scale="covariance").fit(X)
    a = model.sample(50_000, random_state=0)
    np.testing.assert_array_equal(a, model.sample(50_000, random_state=0))
    assert a.shape == (50_000, 2) and a.dtype == np.float64
    mean, cov = X.mean(axis=0), np.cov(X.T)
    np.testing.assert_allclose(a.mean(axis=0), mean, atol=0, rtol=1e-3)
    # kernel covariance (factor^2 * Sigma) adds to the data's (biased) covariance
    expected_cov = cov * (299 / 300 + model.bandwidth_**2)
    scale = np.sqrt(np.outer(np.diag(expected_cov), np.diag(expected_cov)))
    assert np.abs(np.cov(a.T) - expected_cov).max() / scale.max() < 0.03
    assert np.all(np.abs(np.cov(a.T) - expected_cov) / scale < 0.03)
    assert model.sample(0).shape == (0, 2)


def test_unfitted_raises_not_fitted():
    with pytest.raises(NotFittedError):
        ScalableKernelDensity().score_samples(np.zeros((2, 2)))
    with pytest.raises(NotFittedError):
        ScalableKernelDensity().sample()


GOOD = np.random.default_rng(16).normal(size=(30, 3))


@pytest.mark.parametrize(
    "params,fit_args,match",
    [
        ({}, (np.where(np.eye(30, 3) > 0, np.nan, GOOD),), "NaN"),
        ({}, (np.where(np.eye(30, 3) > 0, np.inf, GOOD),), "infinity"),
        ({}, (GOOD[:0],), "0 sample"),
        ({}, (GOOD[:, 0],), "Expected 2D array, got 1D array"),
        ({"bandwidth": 0.0}, (GOOD,), "must be > 0"),
        ({"bandwidth": -2.0}, (GOOD,), "must be > 0"),
        ({"bandwidth": [1.0, 2.0]}, (GOOD,), r"shape \(2,\) for data with 3 features"),
        ({"bandwidth": "auto"}, (GOOD,), "got the string 'auto'"),
        ({"bandwidth": None}, (GOOD,), "bandwidth must be a positive float"),
        ({"scale": "minmax"}, (GOOD,), "scale must be one of"),
        ({"cv_subsample": 1}, (GOOD,), "cv_subsample must be >= 2"),
        ({"batch_size": 0}, (GOOD,), "batch_size must be >= 1"),
        ({"impl": "cuda"}, (GOOD,), "impl must be one of"),
        ({}, (GOOD, None, -np.ones(30)), "sample_weight must be non-negative"),
        ({}, (GOOD, None, np.ones(29)), r"sample_weight must have shape \(30,\)"),
        ({}, (GOOD, None, np.full(30, np.nan)), "sample_weight must be finite"),
        ({"bandwidth": "cv"}, (np.ones((30, 3)),), "at least 2 distinct points"),
        ({"scale": "covariance"}, (GOOD[:3],), "singular"),
    ],
)
def test_fit_errors(params, fit_args, match):
    with pytest.raises(ValueError, match=match):
        ScalableKernelDensity(**params).fit(*fit_args)


def test_score_errors():
    model = ScalableKernelDensity().fit(GOOD)
    expected = "X has 2 features, but ScalableKernelDensity is expecting 3"
    with pytest.raises(ValueError, match=expected):
        model.score_samples(GOOD[:, :2])
    with pytest.raises(ValueError, match="NaN"):
        model.score_samples(np.full((2, 3), np.nan))
    with pytest.raises(ValueError, match="Expected 2D array, got 1D array"):
        model.score_samples(GOOD[0])
    with pytest.raises(ValueError, match="n_samples must be >= 0"):
        model.sample(-1)


@pytest.mark.slow
def test_cv_matches_grid_search_on_held_out_data():
    """n = 20,000, d = 2: one 'cv' fit scores held-out data at least as well as GridSearchCV over
    20 bandwidths with 5 folds (both on this estimator, so only the selection differs)."""
    X = blobs(20_000, seed=20)
    test = blobs(20_000, seed=20, draw=21)
    scaler = StandardScaler().fit(X)
    X, test = scaler.transform(X), scaler.transform(test)
    cv = ScalableKernelDensity(bandwidth="cv", random_state=0).fit(X)
    grid = 20_000 ** (-1 / 6) * np.logspace(-1.5, 0.2, 20)
    search = GridSearchCV(ScalableKernelDensity(), {"bandwidth": grid}, cv=5).fit(X)
    best = search.best_params_["bandwidth"]
    assert grid[0] < best < grid[-1]
    assert cv.score(test) / len(test) >= search.best_estimator_.score(test) / len(test) - 1e-3
    # and the two selections agree to within the grid's spacing (23%)
    assert cv.bandwidth_ == pytest.approx(best, rel=0.25)


# --------------------------------------------------------------------------------------------
# trust: row independence, far and overflowing rows, sampling as scikit-learn (issue 15)


@pytest.mark.parametrize("scale", [None, "covariance"])
def test_score_samples_rows_are_bitwise_independent(scale):
    X = blobs(900, d=3, seed=8) + 30.0
    Q = blobs(1100, d=3, seed=8, draw=9) + 30.0
    model = ScalableKernelDensity(bandwidth="scott", scale=scale).fit(X)
    full = model.score_samples(Q)
    rng = np.random.default_rng(2)
    for size in (1, 3, 1023, 1025):
        idx = rng.permutation(Q.shape[0])[:size]
        np.testing.assert_array_equal(model.score_samples(Q[idx]), full[idx])
    beside_far = np.vstack([Q[:3], np.full((1, 3), 1e30), Q[3:6]])
    got = model.score_samples(beside_far)
    np.testing.assert_array_equal(got[[0, 1, 2, 4, 5, 6]], full[:6])


@pytest.mark.parametrize("d", [2, 3, 5])
def test_planned_scores_are_bitwise_independent_of_the_batch(d):
    """The host-planned path (prune=True) tiles each batch of queries in its own k-d order, at
    a height fixed per number of features: a row's log-density is the same in any batch."""
    X = blobs(2500, d=d, seed=14)
    Q = blobs(700, d=d, seed=14, draw=15)
    model = ScalableKernelDensity(bandwidth=0.05, prune=True).fit(X)
    assert model._fitted().planned is not None
    full = model.score_samples(Q)
    rng = np.random.default_rng(3)
    for size in (1, 7, 33, 301):
        idx = rng.permutation(Q.shape[0])[:size]
        np.testing.assert_array_equal(model.score_samples(Q[idx]), full[idx])
    halves = np.concatenate([model.score_samples(Q[:350]), model.score_samples(Q[350:])])
    np.testing.assert_array_equal(halves, full)


def test_far_query_log_density_is_finite_and_right():
    X = blobs(300, d=2, seed=10)
    model = ScalableKernelDensity(bandwidth=0.5).fit(X)
    far = np.array([[1e8, 1e8]])
    reference = KernelDensity(bandwidth=0.5).fit(X).score_samples(far)  # float64
    got = model.score_samples(far)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference, rtol=1e-6)


def test_offset_data_keep_their_digits_in_float32():
    """float64 data at 1e6 with unit spread, computed in float32: float32 spaces numbers there
    0.06 apart, so the data are centred in float64 (on their median: the estimator's
    `scaling_.location`, and inside `scalegp.kde.log_density` for float64 input) before the
    cast; uncentred, log-densities erred by 0.06. Draws come back in raw units."""
    X = blobs(400, d=2, seed=12) + 1e6
    queries = X[:20] + 0.1
    model = ScalableKernelDensity(bandwidth=0.5).fit(X)
    want = KernelDensity(bandwidth=0.5).fit(X).score_samples(queries)
    np.testing.assert_allclose(model.score_samples(queries), want, rtol=0, atol=1e-5)
    direct = kde.log_density(queries, X, 0.5)
    assert direct.dtype == np.float32
    np.testing.assert_allclose(direct, want, rtol=0, atol=1e-5)
    assert np.all(np.abs(model.sample(50, random_state=0) - 1e6) < 50)


@pytest.mark.parametrize("outlier", [1e10, 1e30])
def test_one_far_data_point_costs_the_others_no_digits(outlier):
    """A data point far from the rest, even beyond float32 squares, only adds its weight: the
    others keep their digits (a mean centre followed it, and log-densities erred by ~1)."""
    X = blobs(300, d=2, seed=11)
    queries = X[:20] + 0.1
    with_outlier = np.vstack([X, [[outlier, 0.0]]])
    got = ScalableKernelDensity(bandwidth=0.5).fit(with_outlier).score_samples(queries)
    want = KernelDensity(bandwidth=0.5).fit(X).score_samples(queries) + np.log(300 / 301)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_score_samples_refuses_rows_beyond_float32():
    model = ScalableKernelDensity().fit(blobs(50, seed=11))
    with pytest.raises(ValueError, match=r"beyond the range of float32.*first: row 1"):
        model.score_samples(np.array([[0.0, 0.0], [1e308, 0.0]]))


@pytest.mark.parametrize("d", [1, 2, 10])
def test_sample_weights_draw_as_scikit_learn(d):
    """scikit-learn's test_kde_sample_weights, for sampling: constant weights draw exactly as no
    weights, integer weights exactly as the rows repeated."""
    rng = np.random.RandomState(0)
    X = rng.rand(400, d)
    weights = 1 + (10 * X.sum(axis=1)).astype(np.int8)
    repeated = np.repeat(X, weights, axis=0)
    kde = ScalableKernelDensity()
    constant = kde.fit(X, sample_weight=np.full(400, 3.0)).sample(20, random_state=1234)
    np.testing.assert_array_equal(constant, kde.fit(X).sample(20, random_state=1234))
    weighted = kde.fit(X, sample_weight=weights).sample(20, random_state=1234)
    np.testing.assert_array_equal(weighted, kde.fit(repeated).sample(20, random_state=1234))
    reference = KernelDensity().fit(X, sample_weight=weights).sample(20, random_state=1234)
    np.testing.assert_allclose(weighted, reference, rtol=0, atol=1e-7)  # ours holds float32 data


def test_pruning_keeps_the_densities_and_the_cv_bandwidth():
    """prune=True (forced on small data) agrees with prune=False on the cross-validated
    bandwidth, to the optimiser's tolerance (the held-out subset is drawn after the points are
    put in spatial order), and its densities match float64 (more closely than the unpruned
    expansion at this narrow bandwidth, whose float32 error is ~1e-3 here)."""
    rng = np.random.default_rng(0)
    centres = rng.uniform(size=(20, 2))
    X = centres[rng.integers(20, size=3000)] + 0.01 * rng.standard_normal((3000, 2))
    X = X.astype(np.float32)  # the reference sees the same float32 points
    queries = X[:500] + np.float32(0.003)
    plain = ScalableKernelDensity(bandwidth="cv", prune=False, random_state=0).fit(X)
    pruned = ScalableKernelDensity(bandwidth="cv", prune=True, random_state=0).fit(X)
    np.testing.assert_allclose(pruned.bandwidth_, plain.bandwidth_, rtol=2e-2)
    pruned.set_params(bandwidth=plain.bandwidth_).fit(X)
    h = float(plain.bandwidth_)
    sq = np.sum((queries[:, None, :] - X[None, :, :].astype(np.float32)) ** 2, axis=-1)
    reference = (scipy.special.logsumexp(-0.5 * sq / h**2, axis=1) - np.log(len(X))
                 - np.log(2 * np.pi * h**2))
    np.testing.assert_allclose(pruned.score_samples(queries), reference, rtol=2e-6, atol=2e-6)
    # the data are ordered once, at fit, with their tile tree (the host-planned path)
    assert plain.data_order_ is None and plain.planned_density_ is None
    np.testing.assert_array_equal(pruned.data_order_, pruned.planned_density_.order)
    stored = pruned.score_samples(queries)
    del pruned.planned_density_  # as in a pickle from before it: the in-jit path, in data_order_
    in_jit = pruned.score_samples(queries)
    np.testing.assert_allclose(in_jit, stored, rtol=1e-6, atol=2e-6)
    del pruned.data_order_  # from before both: sorted per call, as data_order_ would be
    np.testing.assert_allclose(pruned.score_samples(queries), in_jit, rtol=1e-6, atol=2e-6)


def test_pruning_options_are_checked_at_fit():
    X = np.random.default_rng(1).standard_normal((50, 2))
    with pytest.raises(ValueError, match="prune must be"):
        ScalableKernelDensity(prune="always").fit(X)
    with pytest.raises(ValueError, match="prune_tol"):
        ScalableKernelDensity(prune_tol=2.0).fit(X)
    with pytest.raises(ValueError, match="one device"):
        ScalableKernelDensity(prune=True, mesh=1).fit(X)


# ----------------------------------------------------------------------------------------------
# weights are relative, at any scale

RELATIVE = np.random.default_rng(40).uniform(0.5, 1.5, 300)
HEAVY = 7
ONE_HEAVY = np.where(np.arange(300) == HEAVY, 1e300, 1e-300)


def weights_at(scale):
    """(RELATIVE times ``scale``, and the weights that must give the same model): weights of
    5e-324, the smallest subnormal, cannot hold ratios and are all equal."""
    if scale == 5e-324:
        return np.full(300, scale), np.ones(300)
    return scale * RELATIVE, RELATIVE


@pytest.mark.parametrize("scale", [5e-324, 1e-300, 1e-40, 1.0, 1e300, 1e308])
@pytest.mark.parametrize(
    "bandwidth,scaling", [(0.3, None), ("scott", None), ("scott", "covariance"),
                          ("silverman", "standardize"), ("cv", None)])
def test_weights_are_relative_at_any_scale(scale, bandwidth, scaling):
    """Weights w and c w give the same bandwidth, densities and draws: no -inf from weights
    that underflow float32 (1e-40, 5e-324) or sums that overflow (1e308 each)."""
    X, Q = blobs(300, seed=41), blobs(40, seed=41, draw=42)
    weights, reference_weights = weights_at(scale)
    params = dict(bandwidth=bandwidth, scale=scaling, random_state=0)
    model = ScalableKernelDensity(**params).fit(X, sample_weight=weights)
    reference = ScalableKernelDensity(**params).fit(X, sample_weight=reference_weights)
    np.testing.assert_allclose(model.bandwidth_, reference.bandwidth_, rtol=1e-5)
    np.testing.assert_allclose(model.score_samples(Q), reference.score_samples(Q), rtol=0,
                               atol=1e-5)
    assert model.score(Q) == pytest.approx(reference.score(Q), abs=1e-4)
    np.testing.assert_allclose(model.sample(50, random_state=3),
                               reference.sample(50, random_state=3), rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:sample_weight:RuntimeWarning")
def test_one_heavy_weight_gives_that_points_density():
    """A weight of 1e300 among weights of 1e-300 is the density of that one point; a bandwidth
    from the data's spread is then a clear error, not nan."""
    X, Q = blobs(300, seed=41), blobs(40, seed=41, draw=42)
    with pytest.warns(RuntimeWarning, match="299 positive weight.* count as zero"):
        model = ScalableKernelDensity(bandwidth=0.3).fit(X, sample_weight=ONE_HEAVY)
    expected = scipy.stats.multivariate_normal(X[HEAVY], 0.09 * np.eye(2)).logpdf(Q)
    np.testing.assert_allclose(model.score_samples(Q), expected, rtol=1e-6, atol=1e-5)
    only = np.where(np.arange(300) == HEAVY, 1.0, 0.0)
    np.testing.assert_array_equal(
        model.sample(50, random_state=3),
        ScalableKernelDensity(bandwidth=0.3).fit(X, sample_weight=only).sample(50, random_state=3))
    for bandwidth, scaling, match in [
        ("scott", None, "at least 2 samples with positive weight"),
        (0.3, "covariance", "at least 2 samples with positive weight"),
        ("cv", None, "at least 2 distinct points with positive weight"),
    ]:
        model = ScalableKernelDensity(bandwidth=bandwidth, scale=scaling)
        with pytest.raises(ValueError, match=match):
            model.fit(X, sample_weight=ONE_HEAVY)


def test_sample_beyond_memory_is_refused_before_any_work():
    # once numpy's "Unable to allocate 7.28 TiB for an array with shape (1000000000000,)"
    model = ScalableKernelDensity(bandwidth=0.5).fit(np.zeros((3, 2)))
    with pytest.raises(MemoryError, match=r"^1,000,000,000,000 draws of 2 features need about "
                                          r"64,000,000,000,000 bytes, more than the [0-9,]+ "):
        model.sample(10**12)


def test_a_cv_fit_checks_once_and_builds_one_engine_one_collapse_one_tree(monkeypatch):
    """Issue 59, straight walks: ScalableKernelDensity(bandwidth="cv").fit on the planned path
    checks the data once (scikit-learn's helpers), builds one Engine, collapses the duplicates
    once and builds one tile tree (the cross-validation's, which scoring reuses); a
    score_samples call checks its queries once and builds one Engine, and nothing else."""
    from scalegp.estimators import _kde as estimator_module
    from scalegp.kde import _cv, _density, _fitted, _loo, _sample, _spread
    from scalegp.ops import Engine

    calls = {}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return function(*args, **kwargs)
        return wrapper

    for module in (estimator_module, _cv, _density, _fitted, _loo, _sample, _spread):
        for name in ("validate_data", "check_points", "check_weights"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    monkeypatch.setattr(_loo, "_unique_rows", counted("collapse", _loo._unique_rows))
    create = Engine.create
    monkeypatch.setattr(Engine, "create", classmethod(
        lambda cls, *args, **kwargs: counted("engine", create)(*args, **kwargs)))
    planned_kind = Engine._planned  # the backend's PlannedKde: its density builds a tree

    def counted_kind(self, dtype):
        kind = planned_kind(self, dtype)
        return kind._replace(density=counted("tree", kind.density))

    monkeypatch.setattr(Engine, "_planned", counted_kind)
    rng = np.random.default_rng(59)
    x = (rng.uniform(size=(15, 2))[rng.integers(15, size=3000)]
         + 0.02 * rng.standard_normal((3000, 2))).astype(np.float32)
    x = np.concatenate([x, x[:40]])  # duplicates: one collapse for the cv and the keys
    est = ScalableKernelDensity(bandwidth="cv", prune=True, random_state=0).fit(x)
    assert est.planned_density_ is not None and est.distinct_data_.shape == (3000, 2)
    assert calls == {"validate_data": 1, "check_weights": 1, "engine": 1, "collapse": 1,
                     "tree": 1}
    calls.clear()
    est.score_samples(x[:100])
    assert calls == {"validate_data": 1, "engine": 1}
