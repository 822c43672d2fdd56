"""ScalableGPRegressor(kernel=..., alpha=...): scikit-learn's alpha, a fixed value added to the
training points' diagonal, scalar or one per point, on the exact and the iterative solver; never
part of the predictive std at new points."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, Matern, WhiteKernel

from scalegp import ScalableGPRegressor, gp
from scalegp.estimators._gpr_kernels import KernelSpec

from ..conftest import rel_err

ROOT = Path(__file__).resolve().parents[2]


def _data(n, d=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, size=(n, d))
    y = np.sin(x @ np.linspace(1.0, 0.5, d)) + 0.1 * rng.normal(size=n)
    alpha = rng.uniform(0.01, 0.3, size=n) ** 2  # known measurement variances
    return x, y, alpha


@pytest.mark.x64
@pytest.mark.parametrize("white", [True, False])
def test_per_point_alpha_matches_scikit_learn(white):
    """Fixed hyperparameters: the log marginal likelihood, its gradient, mean, std and covariance
    equal scikit-learn's with the same per-point alpha (1e-7 relative, float64); alpha is left
    out of the std and covariance, a WhiteKernel term is not."""
    x, y, alpha = _data(80)
    kernel = ConstantKernel(1.2) * RBF([1.0, 1.5])
    if white:
        kernel = kernel + WhiteKernel(0.02)
    ours = ScalableGPRegressor(kernel=kernel, alpha=alpha, mean=0.0, optimizer=None).fit(x, y)
    ref = GaussianProcessRegressor(kernel=kernel, alpha=alpha, optimizer=None).fit(x, y)
    value, grad = ours.log_marginal_likelihood(kernel.theta, eval_gradient=True)
    ref_value, ref_grad = ref.log_marginal_likelihood(kernel.theta, eval_gradient=True)
    assert value == pytest.approx(ref_value, rel=1e-9)
    assert rel_err(grad, ref_grad) <= 1e-7
    x_test = np.vstack([_data(20, seed=1)[0], x[:5]])  # training points too: alpha not added
    for kw in ({"return_std": True}, {"return_cov": True}):
        for got, want in zip(ours.predict(x_test, **kw), ref.predict(x_test, **kw)):
            np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-10)
    assert ours.noise_ == pytest.approx(0.02 if white else 0.0, rel=1e-12)


@pytest.mark.x64
def test_per_point_alpha_fit_reaches_scikit_learns_optimum():
    x, y, alpha = _data(60, seed=2)
    kernel = ConstantKernel(1.0) * Matern([1.0, 1.0], nu=2.5) + WhiteKernel(0.01)
    ours = ScalableGPRegressor(kernel=kernel, alpha=alpha, mean=0.0).fit(x, y)
    ref = GaussianProcessRegressor(kernel=kernel, alpha=alpha).fit(x, y)
    assert ours.log_marginal_likelihood_value_ >= ref.log_marginal_likelihood_value_ - 1e-6 * abs(
        ref.log_marginal_likelihood_value_)
    np.testing.assert_allclose(ours.predict(x[:10]), ref.predict(x[:10]), rtol=1e-4, atol=1e-6)


def _kernel_params(kernel, alpha):
    return gp.KernelParams(mean=jnp.zeros(1), theta=jnp.asarray(kernel.theta),
                           spec=KernelSpec.from_sklearn(kernel), fixed_noise=jnp.asarray(alpha))


@pytest.mark.x64
@pytest.mark.parametrize("control_variate", [True, False])
@pytest.mark.slow
def test_bbmm_takes_a_per_point_noise(control_variate):
    """BBMM with a per-point diagonal (operator diag(σ²_i), preconditioner LLᵀ + diag(σ²_i), the
    control variate's exact trace Σ ∂A_ii/σ²_i) against Cholesky, n = 500: with a preconditioner
    of full rank (P = A) the value, and with the control variate the gradient, are exact to
    rounding, which checks the per-point formulas; at rank 300 with 200 probes, stochastic
    estimates within 2% (value) and 5% (gradient, norm-wise); the prediction solve, at a
    predict_tol of 1e-7 (the default, 1e-4, bounds the mean's change, not α's), to 1e-5."""
    x, y, alpha = _data(500, d=3)
    kernel = ConstantKernel(1.0) * Matern([1.0, 1.5, 2.0], nu=1.5) + WhiteKernel(0.01)
    params = _kernel_params(kernel, alpha)
    xj, yj = jnp.asarray(x), jnp.asarray((y - y.mean())[:, None])
    exact = gp.CholeskySolver().value_and_grad(params, xj, yj)
    full = gp.BBMMSolver(preconditioner_rank=500, control_variate=control_variate)
    result = full.value_and_grad(params, xj, yj)
    assert float(result.value) == pytest.approx(float(exact.value), rel=1e-10)
    assert rel_err(result.grad.theta, exact.grad.theta) <= (1e-8 if control_variate else 0.05)
    low = gp.BBMMSolver(preconditioner_rank=300, num_probes=200,
                        control_variate=control_variate, predict_tol=1e-7)
    result = low.value_and_grad(params, xj, yj)
    assert float(result.value) == pytest.approx(float(exact.value), rel=0.02)
    assert rel_err(result.grad.theta, exact.grad.theta) <= 0.05
    alpha_bbmm = low.posterior(params, xj, yj).alpha
    assert rel_err(alpha_bbmm, gp.CholeskySolver().posterior(params, xj, yj).alpha) <= 1e-5


@pytest.mark.slow
def test_estimator_bbmm_path_with_per_point_alpha_agrees_with_exact():
    """The iterative path end to end (subset fit with the subset's alpha, BBMM steps on all data,
    prediction solve, variance cache of full rank) against the Cholesky path, float32."""
    x, y, alpha = _data(300, d=1, seed=3)
    kernel = ConstantKernel(1.0) * Matern(1.0, nu=1.5) + WhiteKernel(0.01)
    settings = dict(kernel=kernel, alpha=alpha, mean=0.0, optimizer=None)
    exact = ScalableGPRegressor(solver="exact", **settings).fit(x, y)
    bbmm = ScalableGPRegressor(solver="bbmm", love_rank=300, **settings).fit(x, y)
    x_test = _data(50, d=1, seed=4)[0]
    mean, std = exact.predict(x_test, return_std=True)
    bbmm_mean, bbmm_std = bbmm.predict(x_test, return_std=True)
    assert rel_err(bbmm_mean, mean) <= 1e-3 and rel_err(bbmm_std, std) <= 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # 2 full-data steps only
        fitted = ScalableGPRegressor(kernel=kernel, alpha=alpha, mean=0.0, solver="bbmm",
                                     subset_size=100, max_iter=20, max_iter_full=2,
                                     preconditioner_rank=100, random_state=0).fit(x, y)
    assert np.all(np.isfinite(fitted.predict(x_test, return_std=True)))


def test_alpha_is_checked_against_the_training_points():
    x, y, _ = _data(30)
    kernel = RBF(1.0)
    with pytest.raises(ValueError, match=r"alpha must be a scalar or an array with same number "
                                         r"of entries as y. \(29 != 30\)"):
        ScalableGPRegressor(kernel=kernel, alpha=np.ones(29)).fit(x, y)
    for bad in (-1.0, np.ones((30, 1)), np.r_[np.ones(29), np.nan], "1e-3"):
        with pytest.raises(ValueError, match="alpha must be a non-negative number"):
            ScalableGPRegressor(kernel=kernel, alpha=bad).fit(x, y)
    # one value in an array is a scalar, as in scikit-learn; alpha itself is left as given
    model = ScalableGPRegressor(kernel=kernel, alpha=np.array([0.1]), optimizer=None).fit(x, y)
    assert model._fixed_noise == 0.1 and model.alpha.shape == (1,)


def test_the_default_model_warns_that_it_does_not_use_alpha():
    x, y, alpha = _data(30)
    with pytest.warns(UserWarning, match="alpha is not used by the default model"):
        ScalableGPRegressor(alpha=alpha, max_iter=2).fit(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("ignore", ConvergenceWarning)
        ScalableGPRegressor(max_iter=2).fit(x, y)


_SHARDED_CHILD = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel
    from scalegp import gp
    from scalegp.estimators._gpr_kernels import KernelSpec
    from scalegp.ops import Engine

    rng = np.random.default_rng(0)
    n = 256
    x = rng.uniform(-3, 3, size=(n, 2))
    y = np.sin(x[:, 0]) + 0.1 * rng.normal(size=n)
    kernel = ConstantKernel(1.0) * RBF([1.0, 1.5]) + WhiteKernel(0.01)  # sharded: c * RBF
    params = gp.KernelParams(mean=jnp.zeros(1), theta=jnp.asarray(kernel.theta),
                             spec=KernelSpec.from_sklearn(kernel),
                             fixed_noise=jnp.asarray(rng.uniform(0.01, 0.3, n) ** 2))
    xj, yj = jnp.asarray(x), jnp.asarray(y[:, None])
    out = {"devices": jax.device_count()}
    results = {}
    for name, engine in (("one", Engine()), ("four", Engine.create("auto", "all"))):
        # 8 probes: with the default 30 the 4-device CPU run hangs in an all-reduce (XLA's
        # CPU collectives; the default model and main's code alike)
        solver = gp.BBMMSolver(num_probes=8, cg_tol=1e-10, preconditioner_rank=64,
                               love_rank=64, engine=engine)
        res = solver.value_and_grad(params, xj, yj)
        post = solver.love(params, xj, solver.posterior(params, xj, yj))
        results[name] = (float(res.value), np.asarray(res.grad.theta),
                         np.asarray(post.alpha), np.asarray(post.love_factor))
    one, four = results["one"], results["four"]
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    out.update(value=abs(four[0] / one[0] - 1), grad=rel(four[1], one[1]),
               alpha=rel(four[2], one[2]),
               love=rel(four[3] @ four[3].T, one[3] @ one[3].T))
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_per_point_noise_on_four_devices_matches_one():
    """The sharded BBMM path (preconditioner built shard-wise, the noise split by rows like the
    points) with a per-point noise: value, gradient, prediction solve and variance cache equal
    the one-device ones (float64, to CG tolerance)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _SHARDED_CHILD], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert result["devices"] == 4
    assert result["value"] <= 1e-6 and result["grad"] <= 1e-4, result
    assert result["alpha"] <= 1e-6 and result["love"] <= 1e-6, result
