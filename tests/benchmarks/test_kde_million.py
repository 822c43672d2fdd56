"""benchmarks/kde_million.py's data: the overlapping mixture, in two dimensions and more."""

import numpy as np
import pytest

from benchmarks.kde_million import overlapping_mixture


@pytest.mark.parametrize("dim", [2, 3, 8])
def test_mixture_is_deterministic_and_overlapping(dim):
    x = overlapping_mixture(20_000, dim=dim)
    assert x.shape == (20_000, dim) and np.all(np.isfinite(x))
    np.testing.assert_array_equal(x, overlapping_mixture(20_000, dim=dim))
    # clusters of different spreads that overlap: no feature is a few tight, separate spikes
    # (their nearest-neighbour distances span orders of magnitude, and the spread is wide)
    nearest = np.sort(np.abs(np.diff(np.sort(x[:, 0]))))
    assert np.median(nearest) < 1e-3 * np.ptp(x[:, 0])
    assert 0.1 < np.std(x[:, 0]) < 1.0


def test_two_dimensions_keep_the_points_runs_compared_against():
    """The 2-D draws are those of the committed results (benchmarks/results/kde_million_*):
    pinned from the generator before it took ``dim``."""
    x = overlapping_mixture(1000)
    np.testing.assert_allclose(x[:2], [[0.02662547842399285, 0.7494344483470775],
                                       [0.9534139281297249, 0.9841655687648923]], rtol=1e-14)
    np.testing.assert_allclose(x.sum(), 1144.2459238015651, rtol=1e-12)


def test_the_features_section_compares_the_device_with_the_host_cpu():
    # on a CPU both children run on the host: the same bandwidths and log-densities
    from benchmarks.kde_million import section_features

    (row,) = section_features({"features_n": 3000, "features_draws": 50, "cli_timeout": 300})
    assert row["cv_diag_rel_diff"] == 0 and row["weighted_rel_diff"] == 0
    assert row["max_abs_log_density_diff"] == 0
    for side in (row["default_device"], row["host_cpu"]):
        assert side["backend"] == "cpu" and side["sample_rows"] == 50
        assert len(side["cv_diag_bandwidth"]) == 2 and "scores" not in side
