"""scalegp.persistence._kernels: scikit-learn kernels (ScalableGPRegressor(kernel=...)) as JSON
trees of allow-listed classes: round trips, and hostile trees refused with a reason."""

import re

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, ExpSineSquared, Matern, RationalQuadratic, \
    WhiteKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from scalegp import ScalableGPRegressor
from scalegp.persistence import ModelFileError, load_model, save_model
from tests.persistence.helpers import crafted, gp_description, nest, wave


def assert_same_gp(loaded, gp, xq):
    """Predictions (bitwise), the likelihood at and off the optimum, kernel_ and the settings."""
    for want, got in zip(gp.predict(xq, return_std=True), loaded.predict(xq, return_std=True)):
        np.testing.assert_array_equal(got, want)
    assert loaded.kernel_ == gp.kernel_ and repr(loaded.kernel_) == repr(gp.kernel_)
    assert loaded.get_params(deep=False) == gp.get_params(deep=False)
    assert loaded._spec == gp._spec and loaded._spec is not None
    np.testing.assert_array_equal(loaded.theta_, gp.theta_)
    theta = gp.kernel_.theta
    for t in (theta, theta + 0.1):
        assert loaded.log_marginal_likelihood(t) == gp.log_marginal_likelihood(t)
    _, grad = loaded.log_marginal_likelihood(theta, eval_gradient=True)
    np.testing.assert_array_equal(grad, gp.log_marginal_likelihood(theta, eval_gradient=True)[1])
    assert not hasattr(loaded, "lengthscale_") and not hasattr(loaded, "outputscale_")


def test_composite_kernel_round_trip(tmp_path):
    x, y = wave()
    kernel = (C(1.0) * RBF(1.0) + C(0.5) * RBF(2.0) * ExpSineSquared(1.0, 3.0,
                                                                      periodicity_bounds="fixed")
              + C(0.3) * RationalQuadratic(alpha=2.0) + WhiteKernel(0.1))
    gp = ScalableGPRegressor(kernel, max_iter=15, random_state=0).fit(x, y)
    loaded = load_model(save_model(gp, tmp_path / "k.npz"))
    assert_same_gp(loaded, gp, wave(9, seed=1)[0])
    assert loaded.kernel_.k1.k1.k2.k2.periodicity == 3.0  # fixed: kept as given


def test_matern_ard_with_fixed_and_per_feature_bounds_round_trip(tmp_path):
    x, y = wave(d=2)
    kernel = C(2.0, "fixed") * Matern([1.0, 3.0], [(1e-2, 1e2), (0.5, 50.0)], nu=1.5) \
        + WhiteKernel(0.1, (1e-4, 1.0))
    gp = ScalableGPRegressor(kernel, alpha=1e-6, mean=0.0, normalize_y=True, max_iter=15,
                             random_state=0)
    model = make_pipeline(StandardScaler(), gp).fit(x, y)
    loaded = load_model(save_model(model, tmp_path / "m.npz"))
    xq = wave(9, d=2, seed=1)[0]
    np.testing.assert_array_equal(loaded.predict(xq), model.predict(xq))
    assert_same_gp(loaded[-1], model[-1], StandardScaler().fit(x).transform(xq))
    assert loaded[-1].alpha == 1e-6 and loaded[-1].kernel_.k1.k1.constant_value == 2.0
    assert loaded[-1].theta_.shape == (3,)  # the fixed mean and constant are not optimised


def test_iterative_solver_kernel_model_round_trip(tmp_path):
    x, y = wave(d=2)
    gp = ScalableGPRegressor(C(1.0) * Matern([1.0, 2.0], nu=0.5) + WhiteKernel(0.1),
                             solver="bbmm", optimizer=None, preconditioner_rank=10, love_rank=20,
                             random_state=0).fit(x, y)
    want = gp.predict(x[:5], return_std=True)
    loaded = load_model(save_model(gp, tmp_path / "bbmm.npz"))
    mean, std = loaded.predict(x[:5], return_std=True)
    np.testing.assert_array_equal(mean, want[0])
    np.testing.assert_allclose(std, want[1], rtol=1e-6)
    assert loaded.kernel_ == gp.kernel_ and loaded._spec == gp._spec


def tree(depth):
    if depth == 0:
        return {"class": "WhiteKernel", "noise_level": 1.0, "noise_level_bounds": "fixed"}
    return {"class": "Sum", "k1": tree(depth - 1), "k2": tree(depth - 1)}


def kernel_json(header, key="kernel"):
    described = gp_description(header)
    return described["params"][key] if key == "kernel" else described["attributes"][key]


def rbf_node(header, key="kernel"):
    return kernel_json(header, key)["k1"]["k1"]["k2"]  # RBF([1, 2])


def matern_node(header, key="kernel"):
    return kernel_json(header, key)["k1"]["k2"]["k2"]


def both(edit):
    """The same edit to ``kernel`` and ``kernel_`` (so only the rule under test fails)."""
    return lambda h: (edit(h, "kernel"), edit(h, "kernel_"))


@pytest.mark.parametrize("edit, message", [
    (lambda h: rbf_node(h).update({"class": "DotProduct"}),
     r"params.kernel.k1.k1.k2.class: kernel class 'DotProduct' is not one of ConstantKernel, RBF"),
    (lambda h: rbf_node(h).update({"class": "__import__"}),
     r"kernel.k1.k1.k2.class: kernel class '__import__' is not one of"),
    (lambda h: gp_description(h)["params"].update(kernel={"class": "os.system", "k1": "ls"}),
     r"params.kernel.class: kernel class 'os.system' is not one of"),
    (lambda h: rbf_node(h).pop("class"), r"k1.k1.k2.class: kernel class None is not one of"),
    (lambda h: rbf_node(h).update(sigma_0=1.0),
     r"k1.k1.k2: unknown key\(s\) 'sigma_0' for RBF; allowed: length_scale, length_scale_bou"),
    (lambda h: rbf_node(h).update(__class__="x"), r"unknown key\(s\) '__class__' for RBF"),
    (lambda h: rbf_node(h).pop("length_scale_bounds"),
     r"k1.k1.k2: missing key\(s\) length_scale_bounds of RBF"),
    (lambda h: rbf_node(h).update(length_scale=[1.0, -2.0]),
     r"k2.length_scale\[1\]: expected a positive finite number, got -2.0"),
    (lambda h: matern_node(h).update(length_scale=float("nan")),
     r"k2.length_scale: expected a positive finite number, got nan"),
    (lambda h: matern_node(h).update(length_scale=float("inf")),
     r"k2.length_scale: expected a positive finite number, got inf"),
    (lambda h: matern_node(h).update(length_scale=10**400), r"expected a positive finite number"),
    (lambda h: matern_node(h).update(length_scale=0), r"expected a positive finite number, got 0"),
    (lambda h: matern_node(h).update(length_scale="1.0"), r"positive finite number, got '1.0'"),
    (lambda h: matern_node(h).update(length_scale=True), r"positive finite number, got True"),
    (lambda h: rbf_node(h).update(length_scale=[]), r"non-empty list of them, got \[\]"),
    (lambda h: gp_description(h)["params"].update(kernel=nest(500)),
     r"params.kernel: kernels nested deeper than 64 levels"),
    (lambda h: gp_description(h)["params"].update(kernel=tree(9)),
     r"params.kernel: more than 256 kernel nodes"),
    (lambda h: matern_node(h).update(nu=2.0),
     r"k2.nu: Matern nu must be one of 0.5, 1.5, 2.5, got 2.0"),
    (lambda h: matern_node(h).update(nu="inf"), r"k2.nu: expected a positive finite number"),
    (lambda h: matern_node(h).update(length_scale_bounds=[1.0]),
     r"k2.length_scale_bounds: expected bounds \[low, high\] or \"fixed\", got \[1.0\]"),
    (lambda h: matern_node(h).update(length_scale_bounds=[1.0, 2.0, 3.0]),
     r"length_scale_bounds: expected bounds \[low, high\]"),
    (lambda h: matern_node(h).update(length_scale_bounds="free"),
     r"length_scale_bounds: expected bounds \[low, high\] or \"fixed\", got 'free'"),
    (lambda h: matern_node(h).update(length_scale_bounds={"low": 1}), r"expected bounds"),
    (lambda h: matern_node(h).update(length_scale_bounds=[2.0, 1.0]),
     r"length_scale_bounds: expected low <= high, got \[2.0, 1.0\]"),
    (lambda h: matern_node(h).update(length_scale_bounds=[-1.0, 1.0]),
     r"length_scale_bounds\[0\]: expected a positive finite number, got -1.0"),
    (lambda h: matern_node(h).update(length_scale_bounds=[[1.0, 2.0]]),
     r"length_scale_bounds: expected bounds \[low, high\]"),  # per-element: ARD values only
    (lambda h: rbf_node(h).update(length_scale_bounds=[[1.0, 2.0]] * 3),
     r"k2.length_scale_bounds: expected one pair per value \(2\), got 3 pairs"),
    (lambda h: gp_description(h)["params"].update(kernel=[1, 2]),
     r"params.kernel: expected a kernel \(an object with a 'class'\), got \[1, 2\]"),
    # well-formed trees that break the estimator's rules or disagree with the fitted state
    (both(lambda h, k: rbf_node(h, k).update(length_scale=[1.0, 2.0, 3.0])),
     r"params.kernel: RBF has 3 lengthscales but X has 2 features"),
    (both(lambda h, k: kernel_json(h, k)["k1"]["k1"].update(
        k1={"class": "WhiteKernel", "noise_level": 1.0, "noise_level_bounds": "fixed"})),
     r"params.kernel: kernel WhiteKernel.* is not supported: WhiteKernel times a kernel other"),
    (lambda h: gp_description(h)["params"].update(alpha=-1.0),
     r"params.kernel: alpha must be a non-negative number"),
    (lambda h: gp_description(h)["params"].update(alpha="1e-10"),
     r"params.alpha: expected a finite number, got '1e-10'"),
    (lambda h: matern_node(h, "kernel_").update(nu=0.5),
     r"attributes.kernel_.k1.k2.k2.nu: is 0.5 where the kernel has 2.5"),
    (lambda h: kernel_json(h, "kernel_").update(k2=kernel_json(h, "kernel_")["k1"]),
     r"attributes.kernel_.k2: is a Sum where the kernel has a WhiteKernel"),
    (lambda h: matern_node(h, "kernel_").update(length_scale=2.0),
     r"attributes.kernel_: does not hold the hyperparameters theta_ gives"),
    (both(lambda h, k: matern_node(h, k).update(length_scale_bounds="fixed")),
     r"arrays.theta_: expected 6 parameters for these sizes, got 7"),
    (lambda h: gp_description(h)["attributes"].update(outputscale_=1.0),
     r"attributes: outputscale_ belong to the default model \(kernel=None\)"),
    (lambda h: gp_description(h)["attributes"].update(kernel_=None),
     r"attributes.kernel_: expected a value, got null"),
    (lambda h: gp_description(h)["attributes"].pop("kernel_"), r"missing kernel_"),
    (lambda h: gp_description(h)["attributes"].update(_spec=None),
     r"unknown key\(s\) '_spec'"),
    (lambda h: h.update(version=2),
     r"params: unknown key\(s\) 'alpha', 'copy_X_train', 'full_data_tol', 'kernel', "
     r"'n_targets'"),
    (lambda h: h.update(version=3),
     r"params: unknown key\(s\) 'copy_X_train', 'full_data_tol', 'n_targets'"),
    (lambda h: h.update(version=6), r"params: unknown key\(s\) 'full_data_tol'; allowed"),
    (lambda h: h.update(version=True), r"format version True"),
    (lambda h: h.update(version=3.0), r"format version 3.0"),
])
def test_hostile_kernels_are_refused_with_a_reason(kernel_pipeline, tmp_path, edit, message):
    path = crafted(kernel_pipeline, tmp_path, lambda header, _: edit(header))
    with pytest.raises(ModelFileError, match=message):
        load_model(path)


def with_theta(edit, rbf=(1.0, 2.0), matern=1.0, noise=0.1):
    """``edit(header)`` to ``kernel_``, and ``theta_`` made that of kernel_pipeline's kernel
    with these values, as the edit leaves ``kernel_``."""
    kernel = C(1.0) * RBF(list(rbf)) + C(0.5) * Matern(matern, nu=2.5) + WhiteKernel(noise)

    def edit_both(header, arrays):
        edit(header)
        arrays["1.theta_"][-kernel.n_dims:] = kernel.theta

    return edit_both


@pytest.mark.parametrize("edit, message", [
    (with_theta(lambda h: rbf_node(h, "kernel_").update(length_scale=[1e300, 2.0]),
                rbf=(1e300, 2.0)),
     r"attributes.kernel_.k1.k1.k2.length_scale\[0\]: expected a value from 1.18e-38 to "
     r"8.51e\+37 .*, got 1e\+300"),
    (with_theta(lambda h: matern_node(h, "kernel_").update(length_scale=1e-300), matern=1e-300),
     r"attributes.kernel_.k1.k2.k2.length_scale: expected a value from .*, got 1e-300"),
    (with_theta(lambda h: kernel_json(h, "kernel_")["k2"].update(noise_level=1e39), noise=1e39),
     r"attributes.kernel_.k2.noise_level: expected a value from .*, got 1e\+39"),
    (lambda h, _: rbf_node(h).update(length_scale=[1.0, 1e-40]),
     r"params.kernel.k1.k1.k2.length_scale\[1\]: expected a value from .*, got 1e-40"),
])
def test_hyperparameters_beyond_float32_are_refused(kernel_pipeline, tmp_path, edit, message):
    # a lengthscale of 1e300 or 1e-300 agreeing with theta_ loaded and failed at return_std
    path = crafted(kernel_pipeline, tmp_path, edit)
    with pytest.raises(ModelFileError, match=rf"^{re.escape(str(path))}: .*{message}"):
        load_model(path)


def test_kernels_outside_the_allow_list_are_not_saved(tmp_path):
    from sklearn.gaussian_process.kernels import DotProduct

    gp = ScalableGPRegressor(RBF(1.0) + WhiteKernel(0.1), optimizer=None).fit(*wave())
    gp.kernel_ = gp.kernel_ + DotProduct()  # as a scikit-learn GP's kernel_ could be
    with pytest.raises(TypeError, match="DotProduct is not one of the kernels model files hold"):
        save_model(gp, tmp_path / "m.npz")
    gp = ScalableGPRegressor(RBF(1.0, (0.0, 1e5)) + WhiteKernel(0.1), optimizer=None)
    gp.fit(*wave())
    with pytest.raises(ValueError, match=r"cannot save this model: .*length_scale_bounds\[0\]: "
                                         "expected a positive finite number, got 0.0"):
        save_model(gp, tmp_path / "m.npz")
    assert not any(tmp_path.iterdir())
