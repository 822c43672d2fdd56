"""scalegp.kde._trust, through cross-validation: a far row neither sets the bandwidth nor goes
unnamed, points on a line in more dimensions and heavy stacks of duplicates among untied values
warn, and ordinary data (clusters of different spreads, mild outliers, skewed, integer and
rounded data, a bootstrap resample, the bundled examples) do not."""

import warnings
from pathlib import Path

import numpy as np
import pytest

from scalegp import ScalableKernelDensity
from scalegp.kde._trust import far_candidates, flat_directions, heavy_stacks
from tests.kde.references import mixture

MACRO = Path(__file__).parents[2] / "examples" / "data" / "us_macro_quarterly.csv"


def fit_cv(X, **params):
    """The cv fit and the messages of its data warnings (not its ConvergenceWarnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ScalableKernelDensity(bandwidth="cv", random_state=0, **params).fit(X)
    return model, [str(w.message) for w in caught if "cross-validation:" in str(w.message)
                   or "interquartile" in str(w.message)]


@pytest.mark.parametrize("scale", [None, "standardize"])
def test_a_row_at_1e30_neither_sets_the_bandwidth_nor_goes_unnamed(scale):
    """One row at 1e30 among 4,000 normal points: the bandwidth is the one without it (it was
    2.6e28 with scale=None: the row's leave-one-out term decided it), and a warning names it."""
    rng = np.random.default_rng(0)
    X = np.insert(rng.normal(size=(4000, 2)), 1234, 1e30, axis=0)
    model, messages = fit_cv(X, scale=scale)
    without, _ = fit_cv(np.delete(X, 1234, axis=0), scale=scale)
    assert model.bandwidth_ == pytest.approx(without.bandwidth_, rel=1e-2)
    np.testing.assert_array_equal(model.cv_result_.far_rows, [1234])
    assert any("row(s) 1234 of the 4,001 lie so far" in m for m in messages), messages
    if scale is not None:  # nor does it set the scaling's spread
        np.testing.assert_array_equal(model.scaling_.far_rows, [1234])
        np.testing.assert_allclose(model.scaling_.scale, without.scaling_.scale, rtol=1e-12)


def test_points_on_a_line_in_8d_warn():
    """An isotropic 8-D kernel on a 1-D layout: 7 principal directions without spread."""
    rng = np.random.default_rng(1)
    direction = rng.normal(size=8)
    X = rng.normal(size=(1600, 1)) * (direction / np.linalg.norm(direction))
    model, messages = fit_cv(X)
    assert model.cv_result_.flat_directions == 7
    assert any("fewer dimensions than their 8 features" in m for m in messages), messages


def _stacks_in_noise(rng):
    """90% of the rows on three values, the rest continuous around them."""
    stacked = rng.random(3000) < 0.9
    return np.where(stacked[:, None], np.array([[0.0], [1.0], [5.0]])[rng.integers(0, 3, 3000)],
                    rng.normal(2.0, 2.0, (3000, 1))), 0.9


def _jittered_copies(rng):
    """Ten points with 75% of the rows on them, and copies 0.05 off them."""
    centres = rng.normal(size=(10, 2))
    exact = rng.random(3000) < 0.75
    X = centres[rng.integers(0, 10, 3000)] + ~exact[:, None] * 0.05 * rng.normal(size=(3000, 2))
    return X, 0.75


def _detection_limit(rng):
    """20% of a lognormal sample at 0."""
    return np.where(rng.random((3000, 1)) < 0.2, 0.0, rng.lognormal(size=(3000, 1))), 0.2


@pytest.mark.parametrize("layout", [_stacks_in_noise, _jittered_copies, _detection_limit])
def test_heavy_stacks_among_untied_values_warn(layout):
    X, share = layout(np.random.default_rng(2))
    model, messages = fit_cv(X)
    assert model.cv_result_.stacked_share == pytest.approx(share, abs=0.03)
    assert any("stack(s) of exact duplicate rows" in m for m in messages), messages


def _ordinary():
    rng = np.random.default_rng(3)
    mild = rng.normal(size=(1500, 2))
    mild[:3] = 8 + 0.3 * rng.normal(size=(3, 2))
    pool = rng.normal(size=(1500, 2))
    macro = np.genfromtxt(MACRO, delimiter=",", names=True)
    return {
        "clusters of different spreads": mixture(1500, seed=4),
        "tight clusters in a broad background": np.concatenate(
            [0.01 * rng.normal(size=(750, 2)), rng.uniform(-5, 5, (750, 2))]),
        "a few mild outliers": mild,
        "lognormal": rng.lognormal(size=(1500, 1)),
        "integer counts": rng.poisson(3, size=(2000, 2)).astype(float),
        "rounded to 0.1": np.round(rng.normal(size=(2000, 2)), 1),
        "a bootstrap resample": pool[rng.integers(0, 1500, 1500)],
        "50 points": rng.normal(size=(50, 2)),
        "unemployment and inflation": np.column_stack([macro["unemp"], macro["infl"]]),
    }


@pytest.mark.parametrize("name", list(_ordinary()))
def test_ordinary_data_raise_no_alarm(name):
    model, messages = fit_cv(_ordinary()[name])
    assert not messages
    result = model.cv_result_
    assert result.far_rows.size == 0 and result.flat_directions == 0
    assert result.stacked_share == 0.0 and result.findings == ()


def test_far_candidates_from_the_rows_pull():
    """An isolated row (slope R², curvature 2R² in log h) among rows at their optimum: its pull
    over the others' curvature makes it a candidate past a 4x move; two such rows, each hidden
    by the other's curvature, are candidates together; a term that underflowed is lost."""
    n = 1000
    values, slopes, curvatures = np.full(n, -2.0), np.zeros(n), np.full(n, 0.5)
    slopes[7], curvatures[7] = 1e4, 2e4  # pull 10 over the rest's 0.6: 17 in log h
    slopes[8], curvatures[8] = 50.0, 100.0  # 0.05 over 20.5: none
    values[9] = -2.38e38  # the engine's log 0
    candidates, lost = far_candidates(values, slopes, curvatures, np.ones(n))
    assert np.flatnonzero(candidates).tolist() == [7, 9]
    assert np.flatnonzero(lost).tolist() == [9]
    values[9], slopes[7], curvatures[7] = -2.0, 5e3, 1e4
    slopes[3], curvatures[3] = 5e3, 1e4  # alone 5 over 10.6 each; together 10 over 0.6
    candidates, lost = far_candidates(values, slopes, curvatures, np.ones(n))
    assert np.flatnonzero(candidates).tolist() == [3, 7] and not lost.any()


def test_flat_directions_count_the_spreads_below_half_the_bandwidth():
    rng = np.random.default_rng(5)
    z = rng.normal(size=(400, 3)) * [1.0, 0.2, 0.01]
    assert flat_directions(z, None, 0.5) == 2  # spreads 0.4 and 0.02 bandwidths
    assert flat_directions(z, None, np.array([0.5, 0.1, 0.01])) == 0  # per feature
    assert flat_directions(z[:20], None, 0.5) == 0  # too few points to tell


def test_heavy_stacks_are_not_the_resolution_of_the_data():
    """Stacks of 16 copies and more, among values no other row shares: reported; on integer
    data, whose every value other rows share, not; under 5% of the weight, not."""
    stacks = np.array([[0.0], [1.0]])
    noise = np.linspace(0.013, 3.1, 50)[:, None]
    raw = np.concatenate([stacks, noise])
    counts = np.concatenate([[100, 100], np.ones(50, int)])
    share, n_stacks, copies = heavy_stacks(raw, counts, counts.astype(float))
    assert share == pytest.approx(200 / 250) and (n_stacks, copies) == (2, 100)
    integers = np.concatenate([stacks, np.arange(2.0, 12.0)[:, None]])
    counts = np.concatenate([[100, 100], np.full(10, 3)])
    assert heavy_stacks(integers, counts, counts.astype(float)) == (0.0, 0, 0)
    counts = np.concatenate([[16, 1], np.full(50, 10)])
    assert heavy_stacks(raw, counts, counts.astype(float)) == (0.0, 0, 0)  # 16 of 517
