"""ScalableGPRegressor(kernel=...): scikit-learn kernel objects on the engine, checked against
scikit-learn's GaussianProcessRegressor with the same kernel."""

import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import (
    RBF,
    ConstantKernel,
    DotProduct,
    ExpSineSquared,
    Matern,
    RationalQuadratic,
    WhiteKernel,
)

from scalegp import ScalableGPRegressor, gp
from scalegp.estimators._gpr_kernels import KernelSpec

from ..conftest import rel_err

CO2 = Path(__file__).resolve().parents[2] / "examples" / "data" / "co2_weekly.csv"


def _data(n, d, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, size=(n, d)) + 10.0  # offset: nothing may rely on centred inputs
    y = np.sin(x @ np.linspace(1.0, 0.5, d)) + 0.3 * np.cos(2 * x[:, 0]) + 0.1 * rng.normal(
        size=n)
    return x, y


def mauna_loa_kernel():
    """scikit-learn's CO2 example kernel, at its starting values."""
    return (50.0**2 * RBF(50.0)
            + 2.0**2 * RBF(100.0) * ExpSineSquared(1.0, 1.0, periodicity_bounds="fixed")
            + 0.5**2 * RationalQuadratic(1.0, 1.0)
            + 0.1**2 * RBF(0.1) + WhiteKernel(0.1**2, noise_level_bounds=(1e-5, 1e5)))


def _co2_subset():
    table = np.loadtxt(CO2, delimiter=",", skiprows=1)[::12]
    return table[:, :1], table[:, 1] - table[:, 1].mean()


KERNELS = {
    "rbf_ard": lambda d: ConstantKernel(1.5) * RBF(np.linspace(0.8, 2.0, d)) + WhiteKernel(0.05),
    "matern12": lambda d: ConstantKernel(1.0) * Matern(1.3, nu=0.5) + WhiteKernel(0.05),
    "matern32_ard": lambda d: ConstantKernel(1.0) * Matern(np.linspace(0.7, 1.5, d), nu=1.5)
    + WhiteKernel(0.05),
    "matern52": lambda d: 2.0 * Matern(1.1, nu=2.5) + WhiteKernel(0.05),
    "rq": lambda d: ConstantKernel(0.8) * RationalQuadratic(1.2, 0.7) + WhiteKernel(0.05),
    "periodic": lambda d: ConstantKernel(1.0) * ExpSineSquared(1.0, 3.0) + WhiteKernel(0.05),
    "sum_product": lambda d: (ConstantKernel(1.0) * RBF(2.0) * ExpSineSquared(0.8, 2.5)
                             + ConstantKernel(0.5) * Matern(1.0, nu=1.5) + 0.5 * WhiteKernel(0.1)),
}


PERIODIC = ("periodic", "sum_product")


def _fixed_pair(kernel, x, y, **ours):
    ref = GaussianProcessRegressor(kernel, optimizer=None).fit(x, y)
    model = ScalableGPRegressor(kernel=kernel, optimizer=None, mean=0.0, **ours).fit(x, y)
    return model, ref


def _assert_same_model(model, ref, kernel, x_test, tol):
    theta = kernel.theta
    value, grad = model.log_marginal_likelihood(theta, eval_gradient=True)
    ref_value, ref_grad = ref.log_marginal_likelihood(theta, eval_gradient=True)
    assert abs(value - ref_value) <= tol * abs(ref_value)
    assert rel_err(grad, ref_grad) <= tol
    mean, std = model.predict(x_test, return_std=True)
    ref_mean, ref_std = ref.predict(x_test, return_std=True)
    assert rel_err(mean, ref_mean) <= tol
    assert rel_err(std, ref_std) <= tol


@pytest.mark.x64
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_fixed_hyperparameters_match_scikit_learn(name):
    """Log marginal likelihood, its gradient, predictive mean and std equal scikit-learn's
    within 1e-6 relative in float64, for every profile, ARD and sums and products."""
    d = 1 if name in PERIODIC else 3  # ExpSineSquared is positive definite in one dimension
    x, y = _data(60, d)
    kernel = KERNELS[name](d)
    model, ref = _fixed_pair(kernel, x, y, dtype="float64")
    _assert_same_model(model, ref, kernel, _data(25, d, seed=1)[0], 1e-6)


@pytest.mark.x64
def test_mauna_loa_kernel_matches_scikit_learn():
    x, y = _co2_subset()
    kernel = mauna_loa_kernel()
    model, ref = _fixed_pair(kernel, x, y, dtype="float64")
    _assert_same_model(model, ref, kernel, x[::3] + 0.01, 1e-6)


@pytest.mark.x64
def test_fit_reaches_scikit_learn_optimum_and_keeps_fixed_values():
    x, y = _data(80, 2)
    kernel = (ConstantKernel(1.0) * Matern([1.0, 1.0], nu=2.5)
              + ConstantKernel(0.1, constant_value_bounds="fixed") * RBF(0.3)
              + WhiteKernel(0.1))
    ref = GaussianProcessRegressor(kernel).fit(x, y)
    model = ScalableGPRegressor(kernel=kernel, mean=0.0, dtype="float64").fit(x, y)
    assert model.log_marginal_likelihood_value_ >= ref.log_marginal_likelihood_value_ - 1e-3 * abs(
        ref.log_marginal_likelihood_value_)
    assert type(model.kernel_) is type(kernel)
    assert model.kernel_.k1.k2.k1.constant_value == 0.1  # fixed stays
    assert model.kernel_.theta.shape == kernel.theta.shape
    assert "Matern(length_scale=[" in str(model.kernel_)


def test_fit_respects_bounds_float32():
    x, y = _data(60, 1)
    kernel = ConstantKernel(1.0) * RBF(1.0, length_scale_bounds=(2.0, 5.0)) + WhiteKernel(0.1)
    model = ScalableGPRegressor(kernel=kernel, mean=0.0).fit(x, y)
    length_scale = model.kernel_.k1.k2.length_scale
    assert 2.0 - 1e-9 <= length_scale <= 5.0 + 1e-9
    assert np.all(np.isfinite(model.predict(x)))


def test_restarts_start_inside_the_bounds():
    x, y = _data(40, 1)
    kernel = ConstantKernel(1.0, (0.1, 10.0)) * RBF(1.0, (0.5, 3.0)) + WhiteKernel(0.1, (1e-3, 1.0))
    model = ScalableGPRegressor(kernel=kernel, n_restarts_optimizer=3, random_state=0,
                                max_iter=5).fit(x, y)
    bounds = kernel.bounds
    theta = model.kernel_.theta
    assert np.all(theta >= bounds[:, 0] - 1e-9) and np.all(theta <= bounds[:, 1] + 1e-9)
    with pytest.raises(ValueError, match="finite bounds"):
        ScalableGPRegressor(kernel=ConstantKernel(1.0, (0.1, 10.0)) * RBF(1.0, (1e-5, np.inf)),
                            n_restarts_optimizer=1).fit(x, y)


def test_default_model_reports_its_kernel():
    x, y = _data(40, 2)
    model = ScalableGPRegressor(max_iter=5).fit(x, y)
    assert isinstance(model.kernel_.k1.k2, RBF) and isinstance(model.kernel_.k2, WhiteKernel)
    np.testing.assert_allclose(model.kernel_.k1.k2.length_scale, model.lengthscale_)


@pytest.mark.parametrize("kernel, match", [
    (DotProduct(), "not supported.*ConstantKernel, RBF, Matern"),
    (RBF() * WhiteKernel(), "WhiteKernel times a kernel other than ConstantKernel"),
    (Matern(nu=2.0), "nu=2.0"),
    (WhiteKernel(), "no covariance term"),
    (RBF([1.0, 2.0, 3.0]), "3 lengthscales but X has 2 features"),
])
def test_unsupported_kernels_are_refused(kernel, match):
    x, y = _data(20, 2)
    with pytest.raises(ValueError, match=match):
        ScalableGPRegressor(kernel=kernel).fit(x, y)


def test_theta_layout_is_scikit_learns():
    kernel = mauna_loa_kernel()
    spec = KernelSpec.from_sklearn(kernel)
    built, noise = spec.build(jnp.asarray(kernel.theta))
    x, _ = _co2_subset()
    np.testing.assert_allclose(
        np.asarray(gp._exact.kernel_matrix(built, x[:30], x[:30])) + float(noise) * np.eye(30),
        kernel(x[:30]), rtol=1e-5, atol=1e-3)


@pytest.mark.x64
def test_bbmm_gradient_matches_exact_for_matern():
    """The BBMM objective and gradient for a kernel expression (n = 500)."""
    x, y = _data(500, 3)
    kernel = ConstantKernel(1.0) * Matern([1.0, 1.5, 2.0], nu=1.5) + WhiteKernel(0.05)
    _check_bbmm_gradient(x, y, kernel, tol=0.05, rank=256)


@pytest.mark.slow
@pytest.mark.x64
def test_bbmm_gradient_matches_exact_for_matern_at_4000():
    """Matérn-3/2 ARD at n = 4,000, d = 4: the BBMM gradient within 2% of the exact one."""
    x, y = _data(4000, 4)
    kernel = ConstantKernel(1.0) * Matern([1.0, 1.5, 2.0, 2.5], nu=1.5) + WhiteKernel(0.05)
    _check_bbmm_gradient(x, y, kernel, tol=0.02)


def _check_bbmm_gradient(x, y, kernel, tol, rank=768):
    """BBMM (default probes and preconditioner rank unless given) against Cholesky: the gradient
    within ``tol`` norm-wise; the value, whose log-determinant is a stochastic estimate (SLQ
    with 30 probes, a few nats off at n = 4,000), within 5%."""
    spec = KernelSpec.from_sklearn(kernel)
    yj = jnp.asarray((y - y.mean())[:, None])
    params = gp.KernelParams(mean=jnp.zeros(1), theta=jnp.asarray(kernel.theta), spec=spec)
    xc = jnp.asarray(x - x.mean(axis=0))
    exact = gp.CholeskySolver().value_and_grad(params, xc, yj)
    bbmm = gp.BBMMSolver(preconditioner_rank=rank).value_and_grad(params, xc, yj)
    assert abs(float(bbmm.value) - float(exact.value)) <= 0.05 * abs(float(exact.value))
    assert rel_err(bbmm.grad.flatten(), exact.grad.flatten()) <= tol


def test_bbmm_prediction_and_variance_cache_take_any_kernel():
    """The iterative path (CG solve, pivoted-Cholesky preconditioner, variance cache) with a sum
    of Matérn and periodic terms agrees with the Cholesky path (a cache of full rank is exact)."""
    x, y = _data(300, 1)
    kernel = (ConstantKernel(1.0) * Matern(1.0, nu=1.5)
              + ConstantKernel(0.5) * RBF(3.0) * ExpSineSquared(1.0, 2.0) + WhiteKernel(0.05))
    settings = dict(kernel=kernel, optimizer=None, mean=0.0)
    exact = ScalableGPRegressor(solver="exact", **settings).fit(x, y)
    bbmm = ScalableGPRegressor(solver="bbmm", love_rank=300, **settings).fit(x, y)
    x_test = _data(50, 1, seed=2)[0]
    mean, std = exact.predict(x_test, return_std=True)
    bbmm_mean, bbmm_std = bbmm.predict(x_test, return_std=True)
    assert rel_err(bbmm_mean, mean) <= 1e-3
    assert rel_err(bbmm_std, std) <= 1e-3


# ----------------------------------------------------------------------------------------------
# what is accepted: the kernel's size, its hyperparameters' shapes, bounds and types


def _combined(parts, op):
    """``parts`` joined by ``op`` in balanced parentheses (depth log2 of their number)."""
    if len(parts) == 1:
        return parts[0]
    half = (len(parts) + 1) // 2
    a, b = _combined(parts[:half], op), _combined(parts[half:], op)
    return a + b if op == "+" else a * b


def _chain(parts, op):
    """``parts`` joined left to right, as ``k1 + k2 + k3`` builds them (depth len - 1)."""
    kernel = parts[0]
    for part in parts[1:]:
        kernel = kernel + part if op == "+" else kernel * part
    return kernel


@pytest.mark.parametrize("kernel, match", [
    (_chain([ConstantKernel() * RBF()] * 11, "+"),
     r"nested 11 levels deep \(Sum and Product\); at most 10 are allowed"),
    (_combined([RBF()] * 17, "+"), r"a sum of 17 terms; at most 16 are allowed"),
    (_combined([RBF()] * 9, "*") + WhiteKernel(), r"a product of 9 factors; at most 8 are"),
    (_combined([_combined([RBF()] * 7, "*")] * 5, "+"), r"35 kernels; at most 32 are allowed"),
])
def test_kernel_size_is_bounded(kernel, match):
    # scikit-learn's Sum and Product evaluate each operand's bounds twice: 2^depth work in every
    # fit (a chain of 70 factors never finished); the compiled program grows with the leaves
    x, y = _data(20, 2)
    with pytest.raises(ValueError, match=match):
        ScalableGPRegressor(kernel=kernel).fit(x, y)


def test_a_deep_kernel_with_restarts_is_refused_before_its_bounds_are_read():
    # the restarts' finite-bounds check reads kernel.bounds, 2^depth work: 70 levels never end
    x, y = _data(20, 2)
    with pytest.raises(ValueError, match="nested 70 levels deep"):
        ScalableGPRegressor(kernel=_chain([RBF()] * 71, "*"), n_restarts_optimizer=1).fit(x, y)


def test_kernels_within_the_limits_are_read():
    assert KernelSpec.from_sklearn(mauna_loa_kernel()).n_theta == len(mauna_loa_kernel().theta)
    at_limit = _combined([_combined([RBF(), RBF(), ConstantKernel()], "*")] * 10, "+") \
        + _chain([RBF()] * 2, "*")  # 32 leaves
    assert KernelSpec.from_sklearn(at_limit).n_theta == 32
    assert KernelSpec.from_sklearn(_chain([RBF()] * 11, "+")).n_theta == 11  # depth 10


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_a_kernel_at_the_limits_fits():
    x, y = _data(60, 2)
    kernel = _combined([ConstantKernel() * _combined([RBF() for _ in range(3)], "*")
                        for _ in range(7)], "+") \
        + _chain([Matern(nu=1.5) for _ in range(3)], "*") + WhiteKernel()  # 32 leaves, depth 6
    for solver in ("exact", "bbmm"):
        model = ScalableGPRegressor(kernel=kernel, solver=solver, max_iter=5).fit(x, y)
        assert np.all(np.isfinite(model.predict(x[:5])))
    deep = _chain([ConstantKernel() * RBF() for _ in range(9)], "+") + WhiteKernel()  # depth 10
    assert np.all(np.isfinite(ScalableGPRegressor(kernel=deep, max_iter=5).fit(x, y).predict(x)))


@pytest.mark.parametrize("kernel, match", [
    (RBF(1.0, length_scale_bounds=(-1, 10)),
     r"RBF.length_scale_bounds must be \(low, high\) with 0 <= low <= high.*got \(-1, 10\)"),
    (RBF(1.0, length_scale_bounds=(np.nan, 10)), r"length_scale_bounds must be .*got \(nan, 10\)"),
    (Matern(1.0, length_scale_bounds=(10.0, 1.0)), r"Matern.length_scale_bounds .*\(10.0, 1.0\)"),
    (RationalQuadratic(alpha_bounds=(1.0, np.nan)), r"RationalQuadratic.alpha_bounds must be"),
    (RBF(np.ones((2, 2))), r"RBF.length_scale must be a number or a 1-D array of one per "
                           r"feature, got an array of shape \(2, 2\)"),
    (RationalQuadratic(alpha=np.array([1.0, 2.0])),
     r"RationalQuadratic.alpha must be a number, got an array of shape \(2,\)"),
    (RBF(1.0 + 1.0j), r"RBF.length_scale must be real"),
    (RBF(1.0, length_scale_bounds=(1e-5 + 1j, 10)), r"RBF.length_scale_bounds must be"),
])
def test_hyperparameter_errors_name_the_parameter(kernel, match):
    x, y = _data(20, 2)
    with pytest.raises(ValueError, match=match):
        ScalableGPRegressor(kernel=kernel + WhiteKernel()).fit(x, y)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # scikit-learn's log(0)
@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_unbounded_bounds_are_accepted():
    # 0 and inf: no bound on that side (log bounds of -inf and inf, as L-BFGS-B takes them)
    x, y = _data(20, 2)
    ScalableGPRegressor(kernel=RBF(1.0, (0.0, np.inf)) + WhiteKernel(), max_iter=3).fit(x, y)


@pytest.mark.parametrize("settings, match", [
    ({"alpha": np.full(20, 1e-3 + 1e-3j)}, r"alpha must be a non-negative number.*got array"),
    ({"alpha": 1e-3 + 0j}, r"alpha must be a non-negative number"),
    ({"prune_tol": np.array([0.1, 0.1])},
     r"prune_tol must be in \[0, 1\) \(None for the default\), got an array of shape \(2,\); "
     "give one number"),
    ({"prune_tol": 0.1 + 0j}, r"prune_tol must be in \[0, 1\) \(None for the default\), got "
                              r"\(0.1\+0j\)"),
])
def test_complex_and_array_settings_are_refused(settings, match):
    x, y = _data(20, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning: an error instead
        with pytest.raises(ValueError, match=match):
            ScalableGPRegressor(kernel=RBF() + WhiteKernel(), **settings).fit(x, y)
