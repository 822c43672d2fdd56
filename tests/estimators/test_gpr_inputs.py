"""scalegp.estimators._gpr_inputs: ScalableGPRegressor at extreme target scales, the units it is
fitted in and the checks of its targets. With normalize_y the fit is scale-free; without it, a
target whose scale the compute dtype cannot hold is an error that says so."""

import functools
import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from scalegp import ScalableGPRegressor
from scalegp.estimators._gpr_inputs import check_target

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


# The default model without normalize_y is fitted in y / σ, σ a power of two near y's std:
# with settings in units of c (outputscale and noise c², noise_lower_bound c²), a fit of c·y is
# the fit of y in units of c (c = 1e6 gave a mean 16% and a std 87% off, silently).
def _scaled_fit(scale, solver="exact", targets=1):
    x, y, queries = _data()
    y = y if targets == 1 else np.column_stack([y, 3 * y[::-1]])
    variance = scale**2
    model = ScalableGPRegressor(outputscale=variance, noise=0.1 * variance,
                                noise_lower_bound=1e-6 * variance, random_state=0,
                                **_SOLVERS[solver])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # BBMM: two full-data steps only
        model.fit(x, scale * y)
    return model, model.predict(queries, return_std=True)


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1e3, 1e6])
def test_default_model_is_scale_free(scale):
    # c·y over σ_c and y over σ_1 differ by a factor up to 2 (σ a power of two), so each fit
    # starts from values up to 2x apart and stops within the float32 optimiser's tolerance,
    # where the likelihood is flat: predictions agree to 1e-2 (before: 7% off at 1e-6), the
    # log marginal likelihood of the fitted units to 0.05 nats
    model, (mean, std) = _scaled_fit(scale)
    ref, (ref_mean, ref_std) = _scaled_fit(1.0)
    tol = 1e-2
    np.testing.assert_allclose(mean / scale, ref_mean, rtol=tol, atol=tol * np.abs(ref_mean).max())
    np.testing.assert_allclose(std / scale, ref_std, rtol=tol)
    # the density of c·y is that of y over c per value
    n = model.y_train_.shape[0]
    np.testing.assert_allclose(model.log_marginal_likelihood_value_ + n * np.log(scale),
                               ref.log_marginal_likelihood_value_, atol=0.05)


@pytest.mark.parametrize("solver, targets", [("exact", 1), ("exact", 2), ("bbmm", 1)])
def test_default_model_power_of_two_scale_is_exact(solver, targets):
    # y and 2^20 y are the same numbers in the fitted units: the same fit, bit for bit
    scale = 2.0**20
    model, (mean, std) = _scaled_fit(scale, solver, targets)
    ref, (ref_mean, ref_std) = _scaled_fit(1.0, solver, targets)
    np.testing.assert_array_equal(mean, scale * ref_mean)
    np.testing.assert_array_equal(std, scale * ref_std)
    np.testing.assert_array_equal(model.theta_, ref.theta_)
    assert model.outputscale_ == scale**2 * ref.outputscale_
    assert model.noise_ == scale**2 * ref.noise_
    assert model.kernel_.k1.k1.constant_value == scale**2 * ref.kernel_.k1.k1.constant_value
    assert model.kernel_.k2.noise_level == scale**2 * ref.kernel_.k2.noise_level
    np.testing.assert_array_equal(model.lengthscale_, ref.lengthscale_)
    np.testing.assert_array_equal(model.mean_, scale * ref.mean_)
    n, o = model.y_train_.shape[0], targets
    np.testing.assert_allclose(model.log_marginal_likelihood_value_,
                               ref.log_marginal_likelihood_value_ - n * o * np.log(scale),
                               rtol=1e-12)


def test_default_model_log_marginal_likelihood_round_trip():
    # theta_ is in the fitted units; log_marginal_likelihood(theta_) is y's, as the value
    model, _ = _scaled_fit(1e6)
    value, grad = model.log_marginal_likelihood(model.theta_, eval_gradient=True)
    np.testing.assert_allclose(value, model.log_marginal_likelihood_value_, rtol=1e-6)
    assert grad.shape == model.theta_.shape
    model.log_marginal_likelihood(model.theta_, clone_kernel=False)
    np.testing.assert_allclose(model.kernel_.k1.k1.constant_value, model.outputscale_, rtol=1e-6)
    np.testing.assert_allclose(model.kernel_.k2.noise_level, model.noise_, rtol=1e-6)


def test_default_model_in_scaled_units_round_trips_a_model_file(tmp_path):
    # the scale is the stored _y_train_std (files before it hold 1 there: y's units)
    from scalegp.persistence import load_model, save_model

    model, (mean, std) = _scaled_fit(1e6)
    assert model._y_train_std[0] == 2.0**20  # the std of 1e6 y is about 8.8e5
    path = save_model(model, tmp_path / "gp.npz")
    loaded = load_model(path)
    _, _, queries = _data()
    loaded_mean, loaded_std = loaded.predict(queries, return_std=True)
    np.testing.assert_array_equal(loaded_mean, mean)
    np.testing.assert_allclose(loaded_std, std, rtol=1e-6)
    assert loaded.log_marginal_likelihood(loaded.theta_) == pytest.approx(
        model.log_marginal_likelihood_value_, rel=1e-6)


def test_default_start_far_from_y_scale_is_moved():
    # the default start (outputscale 1, noise 0.1) against targets of std 9e5: moved to y's
    # variance, the fit is that of y (before: 9% off; unmoved, 1e-12 of y's variance in the
    # fitted units, a std 6x off on other data)
    x, y, queries = _data()
    ref_mean, ref_std = ScalableGPRegressor(random_state=0).fit(x, y).predict(queries,
                                                                              return_std=True)
    model = ScalableGPRegressor(random_state=0).fit(x, 1e6 * y)
    mean, std = model.predict(queries, return_std=True)
    np.testing.assert_allclose(mean / 1e6, ref_mean, rtol=1e-2, atol=1e-2 * np.abs(ref_mean).max())
    np.testing.assert_allclose(std / 1e6, ref_std, rtol=1e-2)
