"""ScalableGPRegressor at extreme target scales: with normalize_y the fit is scale-free; without
it, a target whose scale the compute dtype cannot hold is an error that says so."""

import functools
import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from scalegp import ScalableGPRegressor
from scalegp.estimators._gpr_fit import check_target

_SCALES = [1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e30]

# BBMM forced on small data, as in test_gpr.py: a subset fit, then two steps on all points.
_SOLVERS = {
    "exact": dict(solver="exact"),
    "bbmm": dict(solver="bbmm", subset_size=40, max_iter_full=2, preconditioner_rank=30),
}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 2))
    y = np.sin(x[:, 0]) + 0.5 * x[:, 1] + 0.1 * rng.normal(size=90)
    return x[:80], y[:80], x[80:]


@functools.cache
def _predictions(solver, scale):
    x, y, queries = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at any scale
        warnings.simplefilter("ignore", ConvergenceWarning)  # BBMM: two full-data steps only
        model = ScalableGPRegressor(normalize_y=True, random_state=0, **_SOLVERS[solver])
        model.fit(x, scale * y)
        return model.predict(queries, return_std=True)


@pytest.mark.parametrize("solver", sorted(_SOLVERS))
@pytest.mark.parametrize("scale", _SCALES)
def test_normalize_y_is_scale_free(solver, scale):
    # predictions of c·y are c times those of y, to float32 rounding (c = 1e-30 gave -2.2e-6)
    mean, std = _predictions(solver, scale)
    ref_mean, ref_std = _predictions(solver, 1.0)
    tol = 4 * np.finfo(np.float32).eps
    np.testing.assert_allclose(mean / scale, ref_mean, rtol=tol, atol=tol * np.abs(ref_mean).max())
    np.testing.assert_allclose(std / scale, ref_std, rtol=tol)


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_unrepresentable_scale_without_normalize_y_is_an_error(scale):
    # float32 squares of 1e30 overflow (the fit stayed at its start, one row 100x off) and
    # those of 1e-30 underflow (it predicted ~1e-6)
    x, y, _ = _data()
    message = r"(?s)(deviation|values up to) \d\.\d+e[+-]3\d.*float32.*normalize_y=True"
    with pytest.raises(ValueError, match=message):
        ScalableGPRegressor(random_state=0).fit(x, scale * y)
    kernel = ConstantKernel() * RBF([1.0, 1.0]) + WhiteKernel()
    with pytest.raises(ValueError, match=message):
        ScalableGPRegressor(kernel=kernel, random_state=0).fit(x, scale * y)


def test_the_scale_limits_are_the_compute_dtypes():
    # float64 holds targets of 1e-30 and 1e30 in y's units; the limits are float32's alone
    _, y, _ = _data()
    for scale in (1e-30, 1e30):
        y2 = (scale * y)[:, None]
        check_target(y2, 1e-6, False, False, np.float64)
        with pytest.raises(ValueError, match="float32"):
            check_target(y2, 1e-6, False, False, np.float32)
