"""scalegp.gp._exact: the Cholesky marginal likelihood and its gradient against scikit-learn and
autodiff of dense objectives, the Fisher information, and jitter on a matrix not positive
definite.

References: scikit-learn's GaussianProcessRegressor with the same fixed hyperparameters
(ConstantKernel * RBF + WhiteKernel, optimizer=None, alpha=0), and autodiff of a naive dense
float64 objective (slogdet + solve).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from scalegp import gp
from scalegp.gp import _exact
from scalegp.gp._exact import covariance, exact_nlml
from tests.gp.problems import LENGTHSCALE, NOISE, OUTPUTSCALE, flatten, rbf_params, regression_data

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


def _naive_nlml(params, x, y):
    """Textbook dense objective (no Cholesky): slogdet and a linear solve."""
    hp = params.constrained()
    outputscale, rbf = hp.kernel.terms
    sq = jnp.sum(((x[:, None, :] - x[None, :, :]) / rbf.lengthscale) ** 2, -1)
    a = outputscale.value * jnp.exp(-0.5 * sq) + hp.noise * jnp.eye(x.shape[0])
    r = y - hp.mean
    n, o = y.shape
    return (0.5 * jnp.sum(r * jnp.linalg.solve(a, r)) + 0.5 * o * jnp.linalg.slogdet(a)[1]
            + 0.5 * n * o * jnp.log(2 * jnp.pi))


def test_exact_lml_and_gradient_match_sklearn_float64(data2000):
    x, y, _, ref = data2000
    params = rbf_params(jnp.float64)
    result = gp.CholeskySolver().value_and_grad(params, jnp.asarray(x), jnp.asarray(y[:, None]))
    lml, lml_grad = ref.log_marginal_likelihood(ref.kernel_.theta, eval_gradient=True)
    np.testing.assert_allclose(-float(result.value), lml, rtol=1e-6)
    # sklearn differentiates w.r.t. log(s), log(l), log(σ²); ours w.r.t. softplus⁻¹ of them:
    # ∂/∂log θ = θ ∂/∂θ = θ / sigmoid(raw) ∂/∂raw.
    g = result.grad
    ours = np.concatenate([
        [g.raw_outputscale / jax.nn.sigmoid(params.raw_outputscale) * OUTPUTSCALE],
        g.raw_lengthscale / jax.nn.sigmoid(params.raw_lengthscale) * LENGTHSCALE,
        [g.raw_noise / jax.nn.sigmoid(params.raw_noise) * (NOISE - params.noise_lower_bound)],
    ])
    # sklearn's noise derivative is w.r.t. log σ² of the whole σ² (lower bound included).
    ours[-1] *= NOISE / (NOISE - params.noise_lower_bound)
    np.testing.assert_allclose(-ours, lml_grad, rtol=1e-6)


def test_exact_gradient_matches_autodiff_of_dense_objective():
    x, y, _ = regression_data(400, seed=1)
    y2 = np.stack([y, np.cos(x[:, 0])], axis=1)  # two outputs sharing the kernel
    params = rbf_params(jnp.float64, mean=[0.1, -0.2])
    x, y2 = jnp.asarray(x), jnp.asarray(y2)
    result = gp.CholeskySolver().value_and_grad(params, x, y2)
    value, grad = jax.value_and_grad(_naive_nlml)(params, x, y2)
    np.testing.assert_allclose(float(result.value), float(value), rtol=1e-9)
    np.testing.assert_allclose(flatten(result.grad), flatten(grad), rtol=1e-6, atol=1e-9)


def _composite_params(n, seed=0, smooth=False):
    """A Matérn + rational-quadratic + periodic expression with a per-point fixed noise (with
    ``smooth``: ARD RBF + rational quadratic, twice differentiable at r = 0)."""
    from sklearn.gaussian_process.kernels import (
        ExpSineSquared,
        Matern,
        RationalQuadratic,
    )

    from scalegp.estimators._gpr_kernels import KernelSpec

    kernel = (ConstantKernel(1.5) * Matern([1.0, 2.0], nu=1.5) + RationalQuadratic(0.7, 2.0)
              + 0.3 * ExpSineSquared(1.2, 3.0) + WhiteKernel(0.05))
    if smooth:
        kernel = (ConstantKernel(1.5) * RBF([1.0, 2.0]) + RationalQuadratic(0.7, 2.0)
                  + WhiteKernel(0.05))
    noise = np.random.default_rng(seed).uniform(0.01, 0.05, n)
    return gp.KernelParams(mean=jnp.asarray([0.2]), theta=jnp.asarray(kernel.theta),
                           spec=KernelSpec.from_sklearn(kernel), fixed_noise=jnp.asarray(noise))


def test_exact_gradient_of_a_kernel_expression_matches_autodiff():
    # The analytic gradient (A⁻¹ by LAPACK, folded; one VJP through the kernel) against autodiff
    # through the Cholesky, on an expression with a per-point noise and an offset mean.
    x, y, _ = regression_data(300, d=2, seed=5)
    x, y = jnp.asarray(x + 10.0), jnp.asarray(y[:, None])
    params = _composite_params(300)
    result = gp.CholeskySolver().value_and_grad(params, x, y)
    value, grad = jax.value_and_grad(exact_nlml)(params, x, y)
    np.testing.assert_allclose(float(result.value), float(value), rtol=1e-10)
    np.testing.assert_allclose(result.grad.flatten(), grad.flatten(), rtol=1e-7, atol=1e-9)


@pytest.mark.slow
def test_fisher_information_is_the_curvature_of_the_kl_divergence():
    # F(θ) = ∇²_θ' KL(N(m, A) || N(m', A'))|θ'=θ, the closed-form Gaussian KL: exact, no sampling.
    x, _, _ = regression_data(120, d=2, seed=6)
    x = jnp.asarray(x)
    params = _composite_params(120, smooth=True)

    def unpack(free):
        return gp.KernelParams(mean=free[:1], theta=free[1:], spec=params.spec,
                               fixed_noise=params.fixed_noise)

    free = jnp.concatenate([params.mean, params.theta])
    a, m = covariance(params.constrained(), x), params.mean[0]

    def kl(other):
        hp = unpack(other).constrained()
        b = covariance(hp, x)
        diff = jnp.full((x.shape[0],), hp.mean[0] - m)
        return 0.5 * (jnp.trace(jnp.linalg.solve(b, a)) + diff @ jnp.linalg.solve(b, diff)
                      - x.shape[0] + jnp.linalg.slogdet(b)[1] - jnp.linalg.slogdet(a)[1])

    reference = np.asarray(jax.hessian(kl)(free))
    information = gp.fisher_information(unpack, free, x, 1)
    np.testing.assert_allclose(information, reference, rtol=1e-6, atol=1e-8 * np.abs(
        reference).max())


def test_not_positive_definite_jitter_then_error():
    x = np.repeat(np.random.default_rng(0).normal(size=(50, 2)), 4, axis=0).astype(np.float32)
    y = jnp.asarray(np.sin(x[:, :1]))
    params = gp.GPParams.from_constrained(0.0, 1.0, [1.0, 1.0], 1e-9, noise_lower_bound=1e-10,
                                          dtype=jnp.float32)
    with pytest.warns(RuntimeWarning, match="jitter"):
        posterior = gp.CholeskySolver().posterior(params, jnp.asarray(x), y)
    assert np.all(np.isfinite(np.asarray(posterior.alpha)))
    bad = gp.GPParams(params.mean, params.raw_outputscale, params.raw_lengthscale,
                      jnp.asarray(-jnp.inf, jnp.float32), noise_lower_bound=-1.0)
    with pytest.raises(ValueError, match="not positive definite"):
        gp.CholeskySolver().posterior(bad, jnp.asarray(x), y)



def test_host_lapack_runs_with_the_blas_bounded(monkeypatch):
    """potri in the objective (on the host, between its two programs) runs with OpenBLAS's
    threads bounded: beside XLA's, two pools on the same cores made the quick start's fit 3x
    slower on a loaded 2-core machine (benchmarks/results/busy_machine_cpu.json)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from scalegp import _runtime

    seen = []
    real_potri_lookup = _exact.scipy.linalg.lapack.get_lapack_funcs

    def recording_lookup(names, arrays):
        (potri,) = real_potri_lookup(names, arrays)

        def recorded(*args, **kwargs):
            seen.append({lib["num_threads"] for lib in threadpool_info()
                         if lib["user_api"] == "blas"})
            return potri(*args, **kwargs)

        return (recorded,)

    monkeypatch.setattr(_runtime, "host_blas_threads", lambda: 1)
    monkeypatch.setattr(_exact.scipy.linalg.lapack, "get_lapack_funcs", recording_lookup)
    a = np.eye(4) * 2.0
    with threadpool_limits(2, user_api="blas"):
        inverse = _exact._lapack_inverse(np.linalg.cholesky(a))
    np.testing.assert_allclose(np.tril(inverse), np.tril(np.linalg.inv(a)))
    assert seen == [{1}]


def test_exact_objective_compiles_without_a_host_callback():
    """JAX's persistent cache keeps no program with a host callback: the objective's programs
    hold none (potri runs on the host between them), so a second process loads them."""
    x, y, _ = regression_data(50, seed=2)
    params = rbf_params(jnp.float64)
    x, y = jnp.asarray(x), jnp.asarray(y[:, None])
    _, chol, alpha = _exact._nlml_parts(params, x, y, 0.0)
    programs = (jax.make_jaxpr(_exact._nlml_parts)(params, x, y, 0.0),
                jax.make_jaxpr(_exact._nlml_pullback)(params, x, 0.0, alpha, chol))
    for program in programs:
        assert "callback" not in str(program)
