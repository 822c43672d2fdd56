"""ScalableGPRegressor's scikit-learn surface beyond what scikit-learn's own GPR tests check
(test_sklearn_gpr_suite.py): the default model's prior, dtypes as numpy reads them, the mean
with normalize_y, one target in a 2-D y, copy_X_train."""

import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning, NotFittedError
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from scalegp import ScalableGPRegressor
from scalegp.estimators._gpr_inputs import compute_dtype


def _data(n=40, d=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, size=(n, d))
    return x, 3.0 + np.sin(x[:, 0]) + 0.1 * rng.normal(size=n)


def test_the_default_model_predicts_its_prior_before_fit():
    """kernel=None before fit: mean ``mean`` (0 when None), std sqrt(outputscale + noise), the
    covariance of ConstantKernel * RBF + WhiteKernel at the starting values, n_targets wide."""
    x, _ = _data(7)
    model = ScalableGPRegressor(lengthscale=[0.5, 2.0], outputscale=2.0, noise=0.3, mean=1.5,
                                n_targets=3)
    mean, std = model.predict(x, return_std=True)
    assert mean.shape == std.shape == (7, 3)
    np.testing.assert_allclose(mean, 1.5)
    np.testing.assert_allclose(std, np.sqrt(2.3), rtol=1e-6)
    _, cov = model.predict(x, return_cov=True)
    want = (ConstantKernel(2.0) * RBF([0.5, 2.0]) + WhiteKernel(0.3))(x)
    for j in range(3):
        np.testing.assert_allclose(cov[..., j], want, rtol=1e-5, atol=1e-6)
    assert model.sample_y(x, n_samples=4).shape == (7, 3, 4)
    assert not hasattr(model, "n_features_in_")  # predicting fits nothing
    with pytest.raises(NotFittedError):
        model.log_marginal_likelihood()


@pytest.mark.parametrize("dtype", ["float32", np.float32, np.dtype("float32"), "f4"])
def test_dtype_is_anything_numpy_reads_as_float32_or_float64(dtype):
    x, y = _data()
    model = ScalableGPRegressor(dtype=dtype, max_iter=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x, y)
    assert model.predict(x[:2]).shape == (2,)


@pytest.mark.x64
def test_dtype_float64_as_numpy_type():
    x, y = _data()
    model = ScalableGPRegressor(kernel=RBF(1.0) + WhiteKernel(0.1), dtype=np.float64,
                                optimizer=None).fit(x, y)
    assert compute_dtype(model) == np.float64


@pytest.mark.parametrize("dtype", ["int32", np.float16, "complex64", "nonsense", [1, 2]])
def test_other_dtypes_are_refused(dtype):
    x, y = _data()
    with pytest.raises(ValueError, match="dtype must be None, float32 or float64"):
        ScalableGPRegressor(dtype=dtype).fit(x, y)


@pytest.mark.x64
def test_a_fixed_mean_is_in_normalised_units_with_normalize_y():
    """mean=0.0 with normalize_y=True is scikit-learn's model: the prior mean sits at the
    training mean of y (0 in normalised units)."""
    x, y = _data()
    kernel = ConstantKernel(1.0) * RBF(1.0) + WhiteKernel(0.1)
    ours = ScalableGPRegressor(kernel=kernel, mean=0.0, normalize_y=True, optimizer=None)
    ours.fit(x, y)
    ref = GaussianProcessRegressor(kernel=kernel, normalize_y=True, optimizer=None).fit(x, y)
    np.testing.assert_allclose(ours.mean_, [y.mean()])
    far = np.array([[50.0, 50.0]])  # the prior mean, far from the data
    np.testing.assert_allclose(ours.predict(far), [y.mean()])
    x_test = _data(9, seed=1)[0]
    np.testing.assert_allclose(ours.predict(x_test), ref.predict(x_test), rtol=1e-9)


def test_one_target_in_a_2d_y_predicts_1d_as_scikit_learn():
    x, y = _data()
    model = ScalableGPRegressor(max_iter=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x, y[:, None])
    mean, std = model.predict(x[:4], return_std=True)
    assert mean.shape == std.shape == (4,)
    assert model.predict(x[:4], return_cov=True)[1].shape == (4, 4)
    assert model.sample_y(x[:4], 3).shape == (4, 3)
    assert model.alpha_.shape == (40, 1) and model.y_train_.shape == (40, 1)


def test_copy_x_train_and_n_targets():
    x, y = _data()
    kernel = RBF(1.0) + WhiteKernel(0.1)
    copied = ScalableGPRegressor(kernel=kernel, optimizer=None).fit(x, y)
    shared = ScalableGPRegressor(kernel=kernel, optimizer=None, copy_X_train=False).fit(x, y)
    assert not np.shares_memory(copied.X_train_, x) and np.shares_memory(shared.X_train_, x)
    with pytest.raises(ValueError, match=r"The number of targets seen in `y` is different from "
                                         r"the parameter `n_targets`. Got 2 != 3."):
        ScalableGPRegressor(n_targets=3).fit(x, np.c_[y, y])
    with pytest.raises(ValueError, match="n_targets must be"):
        ScalableGPRegressor(n_targets=0).fit(x, y)
    with pytest.raises(ValueError, match="copy_X_train must be True or False"):
        ScalableGPRegressor(copy_X_train="yes").fit(x, y)


def test_log_marginal_likelihood_without_cloning_sets_kernel_but_not_predictions():
    x, y = _data()
    model = ScalableGPRegressor(kernel=RBF(1.0) + WhiteKernel(0.1), optimizer=None).fit(x, y)
    before = model.predict(x[:3])
    model.log_marginal_likelihood(np.log([2.0, 0.5]), clone_kernel=False)
    np.testing.assert_allclose(model.kernel_.theta, np.log([2.0, 0.5]))
    np.testing.assert_array_equal(model.predict(x[:3]), before)
    default = ScalableGPRegressor(optimizer=None).fit(x, y)
    theta = default.theta_.copy()
    theta[-1] += 1.0
    default.log_marginal_likelihood(theta, clone_kernel=False)
    assert default.kernel_.k2.noise_level > default.noise_


def test_a_constant_target_is_fine_with_a_bounded_kernel():
    """The default model refuses a constant y (its unbounded hyperparameters run off); a kernel's
    bounded ones stop at their bounds, as in scikit-learn."""
    x, _ = _data()
    y = np.full(len(x), 2.0)
    with pytest.raises(ValueError, match="is constant"):
        ScalableGPRegressor().fit(x, y)
    model = ScalableGPRegressor(kernel=ConstantKernel() * RBF(), mean=0.0, normalize_y=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # values at the bounds
        model.fit(x, y)
    np.testing.assert_allclose(model.predict(x[:5]), 2.0)
