"""scalegp.kde._cv: the cross-validated bandwidth against a brute-force grid and statsmodels, its
stationarity, duplicates, subsampling, the search bound and its input errors."""

import functools
import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from scalegp import kde
from scalegp.kde._loo import loo_log_density
from tests.kde.references import brute_log_density, brute_loo, mixture

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


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
        gap = (loo_log_density(X, full.bandwidth, held_out=common).mean()
               - loo_log_density(X, sub.bandwidth, held_out=common).mean())
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



@pytest.mark.parametrize("diagonal", [False, True])
def test_planned_and_grouped_objectives_agree(diagonal, monkeypatch):
    """Above the dense size, pruning on one device takes the host-planned LOO (gradient from the
    forward pass's moments), prune=False the engine's grouped LOO (gradient by its VJP): the
    same held-out set, the same optimum."""
    from scalegp.kde import _cv

    rng = np.random.default_rng(12)
    X = (rng.uniform(size=(40, 2))[rng.integers(40, size=3000)]
         + 0.02 * rng.standard_normal((3000, 2))).astype(np.float32)
    taken = []
    planned_objective = _cv._planned_objective
    monkeypatch.setattr(_cv, "_planned_objective",
                        lambda *a: taken.append(1) or planned_objective(*a))
    runs = [kde.cross_validate_bandwidth(X, diagonal=diagonal, cv_subsample=2048,
                                         random_state=3, prune=prune) for prune in (True, False)]
    assert taken == [1]
    (planned, grouped) = runs
    assert planned.converged and grouped.converged and planned.n_held_out == 2048
    np.testing.assert_allclose(planned.bandwidth, grouped.bandwidth, rtol=2e-3)
    assert planned.log_likelihood == pytest.approx(grouped.log_likelihood, rel=1e-6)


def _neighbour_sums(sq, d):
    """The negated mean of ``log Σ_j exp(-sq_ij e^{-2t} / 2) - d t`` over rows i, with its first
    and second derivatives in t: the shape of the planned LOO objective in a scalar log h."""
    def objective(theta, with_grad, with_curvature=False):
        r2 = sq * np.exp(-2 * theta[0])
        e = -0.5 * r2
        top = e.max(axis=1, keepdims=True)
        p = np.exp(e - top)
        total = p.sum(axis=1)
        p /= total[:, None]
        value = -np.mean(top[:, 0] + np.log(total) - d * theta[0])
        mean = np.sum(p * r2, axis=1)
        grad = -np.mean(mean - d)
        second = -np.mean(np.sum(p * r2 * r2, axis=1) - mean * mean - 2 * mean)
        out = (value, np.array([grad]))
        return out + (second,) if with_curvature else out
    return objective


def test_newton_search_reaches_the_optimum_in_few_evaluations():
    """The safeguarded Newton search in s = h^-2 on a LOO-shaped objective: the optimum of a
    bounded scalar search to 1e-3 in log h, in far fewer evaluations than the scan alone."""
    import scipy.optimize

    from scalegp.kde import _cv

    rng = np.random.default_rng(30)
    points = rng.normal(size=(300, 2)) * rng.uniform(0.2, 1.0, size=(300, 1))
    sq = np.sum((points[:, None] - points[None]) ** 2, axis=-1)
    sq = sq[~np.eye(300, dtype=bool)].reshape(300, 299)
    objective = _neighbour_sums(sq, 2)
    theta0 = np.array([np.log(0.4)])
    search = _cv._NewtonSearch(objective, theta0, np.float64)
    result = search.run(100)
    best = scipy.optimize.minimize_scalar(lambda t: objective(np.array([t]), False)[0],
                                          bounds=(theta0[0] - 5, theta0[0] + 3),
                                          method="bounded", options={"xatol": 1e-9})
    assert result.success and search.evaluations <= 10
    assert abs(search.best_theta[0] - best.x) < 1e-3
    assert search.best_value == pytest.approx(best.fun, abs=1e-7)


def test_newton_search_stops_at_the_lower_bound():
    """Ties at distance 0 from every row (the likelihood grows as h shrinks): the search ends
    on the lower bound, as L-BFGS-B does, and says so."""
    from scalegp.kde import _cv

    sq = np.concatenate([np.zeros((50, 1)), np.full((50, 20), 4.0)], axis=1)
    theta0 = np.array([0.0])
    search = _cv._NewtonSearch(_neighbour_sums(sq, 1), theta0, np.float64)
    result = search.run(100)
    assert search.best_theta[0] == pytest.approx(search.lower[0])
    assert "bound" in result.message


@pytest.mark.parametrize("scale", [0.05, 0.4, 3.0])
def test_bracket_search_reaches_the_optimum_without_second_derivatives(scale):
    """The grouped objective's scalar search (value and gradient only): the optimum of a
    bounded scalar search, wherever the scan's best point falls (below, at and above Scott's
    rule: the start ``theta0`` is off by ``scale``), in as few evaluations as L-BFGS-B takes."""
    import scipy.optimize

    from scalegp.kde import _cv

    rng = np.random.default_rng(31)
    points = rng.normal(size=(300, 2)) * rng.uniform(0.2, 1.0, size=(300, 1))
    sq = np.sum((points[:, None] - points[None]) ** 2, axis=-1)
    sq = sq[~np.eye(300, dtype=bool)].reshape(300, 299)
    objective = _neighbour_sums(sq, 2)
    theta0 = np.array([np.log(scale)])
    search = _cv._BracketSearch(objective, theta0, np.float64)
    result = search.run(100)
    best = scipy.optimize.minimize_scalar(lambda t: objective(np.array([t]), False)[0],
                                          bounds=(search.lower[0], search.upper[0]),
                                          method="bounded", options={"xatol": 1e-10})
    assert result.success and search.evaluations <= 15, (result, search.evaluations)
    assert abs(search.best_theta[0] - best.x) < 1e-4
    assert search.best_value == pytest.approx(best.fun, abs=1e-9)


def test_bracket_search_stops_at_the_lower_bound_and_past_non_finite_points():
    from scalegp.kde import _cv

    sq = np.concatenate([np.zeros((50, 1)), np.full((50, 20), 4.0)], axis=1)
    search = _cv._BracketSearch(_neighbour_sums(sq, 1), np.array([0.0]), np.float64)
    result = search.run(100)
    assert search.best_theta[0] == pytest.approx(search.lower[0], abs=1e-5)
    assert "bound" in result.message

    rng = np.random.default_rng(32)
    points = rng.normal(size=(200, 1))
    sq = (points - points.T) ** 2
    sq = sq[~np.eye(200, dtype=bool)].reshape(200, 199)
    finite = _neighbour_sums(sq, 1)

    def underflows_below(theta, with_grad):  # as float32 does at tiny h
        if theta[0] < np.log(0.02):
            return np.inf, (np.array([np.nan]) if with_grad else None)
        return finite(theta, with_grad)

    search = _cv._BracketSearch(underflows_below, np.array([np.log(0.5)]), np.float64)
    result = search.run(100)
    reference = _cv._BracketSearch(finite, np.array([np.log(0.5)]), np.float64)
    reference.run(100)
    assert result.success and search.nonfinite >= 1
    assert search.best_theta[0] == pytest.approx(reference.best_theta[0], abs=1e-4)
