"""scalegp.kde's input errors: every public function raises a ValueError that names the problem."""

import numpy as np
import pytest

from scalegp import kde
from scalegp.kde._loo import loo_log_density
from scalegp.kde._sample import sample

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


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
        (lambda: sample(GOOD, 1.0, 5, np.full(20, np.nan)), "must be finite"),
        (lambda: sample(GOOD, 1.0, 5, np.r_[np.inf, np.ones(19)]), "must be finite"),
        (lambda: loo_log_density(GOOD, 1.0, np.r_[-1e-300, np.ones(19)]), "non-negative"),
        (lambda: kde.fit_kde(GOOD, np.zeros(20), bandwidth="scott"), "not be all zero"),
        (lambda: kde.cross_validate_bandwidth(GOOD, np.zeros(20)), "not be all zero"),
        # weights are relative: one of 1e300 among 1e-300 leaves one point with weight
        (lambda: kde.fit_kde(GOOD, np.r_[1e300, np.full(19, 1e-300)], bandwidth="scott"),
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

