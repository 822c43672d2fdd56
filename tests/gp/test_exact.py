"""scalegp.gp: exact and BBMM marginal likelihoods, gradients and predictions.

References: scikit-learn's GaussianProcessRegressor with the same fixed hyperparameters
(ConstantKernel * RBF + WhiteKernel, optimizer=None, alpha=0), and autodiff of a naive dense
float64 objective (slogdet + solve).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from scalegp import gp
from scalegp.gp._bbmm import _CONTROL_VARIATE_MAX_CG_ITER
from scalegp.gp._exact import covariance

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)

LENGTHSCALE = np.array([1.0, 1.5, 2.0, 0.8])
OUTPUTSCALE = 1.3
NOISE = 0.05


def _data(n, d=4, seed=0, num_test=200):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = np.sin(x @ np.linspace(0.5, 1.0, d)) + 0.2 * rng.normal(size=n)
    x_test = rng.normal(size=(num_test, d))
    return x, y, x_test


def _sklearn(x, y, lengthscale=LENGTHSCALE):
    kernel = ConstantKernel(OUTPUTSCALE) * RBF(lengthscale) + WhiteKernel(NOISE)
    return GaussianProcessRegressor(kernel, optimizer=None, alpha=0.0).fit(x, y)


def _params(dtype, lengthscale=LENGTHSCALE, mean=0.0):
    return gp.GPParams.from_constrained(mean, OUTPUTSCALE, lengthscale, NOISE, dtype=dtype)


def _flat(tree):
    return np.concatenate([np.asarray(leaf, np.float64).ravel() for leaf in jax.tree.leaves(tree)])


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


@pytest.fixture(scope="module")
def data2000():
    x, y, x_test = _data(2000)
    return x, y, x_test, _sklearn(x, y)


def test_exact_lml_and_gradient_match_sklearn_float64(data2000):
    x, y, _, ref = data2000
    params = _params(jnp.float64)
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
    x, y, _ = _data(400, seed=1)
    y2 = np.stack([y, np.cos(x[:, 0])], axis=1)  # two outputs sharing the kernel
    params = _params(jnp.float64, mean=[0.1, -0.2])
    x, y2 = jnp.asarray(x), jnp.asarray(y2)
    result = gp.CholeskySolver().value_and_grad(params, x, y2)
    value, grad = jax.value_and_grad(_naive_nlml)(params, x, y2)
    np.testing.assert_allclose(float(result.value), float(value), rtol=1e-9)
    np.testing.assert_allclose(_flat(result.grad), _flat(grad), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype, rtol", [pytest.param(np.float64, 1e-7, marks=pytest.mark.slow),
                                         (np.float32, 1e-3)])
def test_exact_prediction_matches_sklearn(data2000, dtype, rtol):
    x, y, x_test, ref = data2000
    params = _params(dtype)
    xj, yj = jnp.asarray(x, dtype), jnp.asarray(y[:, None], dtype)
    posterior = gp.CholeskySolver().posterior(params, xj, yj)
    mean, std = gp.predict(params, xj, posterior, jnp.asarray(x_test, dtype), return_std=True)
    assert mean.dtype == dtype and std.dtype == dtype
    ref_mean, ref_std = ref.predict(x_test, return_std=True)
    np.testing.assert_allclose(np.asarray(mean[:, 0]), ref_mean,
                               rtol=rtol, atol=rtol * np.abs(ref_mean).max())
    np.testing.assert_allclose(np.asarray(std), ref_std, rtol=rtol)
    _, cov = gp.predict(params, xj, posterior, jnp.asarray(x_test[:20], dtype), return_cov=True)
    _, ref_cov = ref.predict(x_test[:20], return_cov=True)
    np.testing.assert_allclose(np.asarray(cov), ref_cov, rtol=rtol, atol=rtol * ref_cov.max())


def _bbmm_check(n, tol, dtype=np.float64, **settings):
    x, y, _ = _data(n, seed=2)
    xj, yj = jnp.asarray(x, dtype), jnp.asarray(y[:, None], dtype)
    exact = gp.CholeskySolver().value_and_grad(_params(jnp.float64), jnp.asarray(x),
                                               jnp.asarray(y[:, None]))
    result = gp.BBMMSolver(**settings).value_and_grad(_params(dtype), xj, yj)
    assert bool(result.converged)
    np.testing.assert_allclose(float(result.value), float(exact.value), rtol=tol)
    np.testing.assert_allclose(_flat(result.grad), _flat(exact.grad), rtol=tol)
    return result


def test_bbmm_matches_exact_small():
    # n = 1,000, default settings: the preconditioner captures the spectrum above the noise,
    # so the control variate is selected ("auto") and the estimates are within 2%.
    result = _bbmm_check(1000, tol=0.02)
    assert int(result.cg_iterations) <= _CONTROL_VARIATE_MAX_CG_ITER


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bbmm_matches_exact_n4000(dtype, seed):
    # The target: value and every gradient entry within 2% at n = 4,000, d = 4 with
    # default settings (30 probes, rank 768), whichever probes. Measured worst: 0.6% (float32),
    # 0.2% (float64); rank 100 was 5-25% off.
    _bbmm_check(4000, tol=0.02, dtype=dtype, seed=seed)


@pytest.mark.slow
def test_bbmm_control_variate_auto_switch():
    # "auto" is the control variate when the probes converge within _CV_MAX_ITERS iterations,
    # the plain estimator otherwise: it must equal the matching explicit choice exactly.
    x, y, _ = _data(600, seed=3)
    params = _params(jnp.float64)
    xj, yj = jnp.asarray(x), jnp.asarray(y[:, None])
    for rank, chosen in ((20, False), (600, True)):
        solver = gp.BBMMSolver(preconditioner_rank=rank)
        auto = solver.value_and_grad(params, xj, yj)
        fixed = gp.BBMMSolver(preconditioner_rank=rank, control_variate=chosen).value_and_grad(
            params, xj, yj)
        assert (int(auto.cg_iterations) <= _CONTROL_VARIATE_MAX_CG_ITER) == chosen
        np.testing.assert_allclose(_flat(auto.grad), _flat(fixed.grad), rtol=1e-12)
        # traced, the choice is a lax.cond inside one jit (concrete calls choose on the host)
        traced = jax.jit(lambda p, x, y: gp.bbmm_value_and_grad(solver, p, x, y))(params, xj, yj)
        np.testing.assert_allclose(float(traced.value), float(auto.value), rtol=1e-10)
        np.testing.assert_allclose(_flat(traced.grad), _flat(auto.grad), rtol=1e-9)
    assert not np.allclose(_flat(auto.grad), _flat(gp.BBMMSolver(
        preconditioner_rank=600, control_variate=False).value_and_grad(params, xj, yj).grad),
        rtol=1e-6)


@pytest.mark.slow
def test_bbmm_plain_estimator_is_unbiased():
    # Weak preconditioner: the plain Hutchinson form is used; averaged over seeds it agrees.
    x, y, _ = _data(300, seed=3)
    params = _params(jnp.float64)
    xj, yj = jnp.asarray(x), jnp.asarray(y[:, None])
    exact = _flat(gp.CholeskySolver().value_and_grad(params, xj, yj).grad)
    grads = [
        _flat(gp.BBMMSolver(num_probes=200, preconditioner_rank=20, seed=s,
                            control_variate=False).value_and_grad(params, xj, yj).grad)
        for s in range(2)
    ]
    # Per-entry noise is a few % of the largest gradient entry at 400 probes.
    np.testing.assert_allclose(np.mean(grads, axis=0), exact, atol=0.03 * np.abs(exact).max())


def test_bbmm_seeds_share_one_compilation():
    """Another probe seed gives other probes but reuses the compiled programs: the seed is not
    part of the static solver (an estimator with random_state=None draws one per fit)."""
    from scalegp.gp import _bbmm

    x, y, _ = _data(64, seed=5)
    xj, yj = jnp.asarray(x, jnp.float32), jnp.asarray(y[:, None], jnp.float32)
    params = _params(jnp.float32)
    values = [gp.BBMMSolver(seed=0, preconditioner_rank=8).value_and_grad(params, xj, yj).value]
    compiled = _bbmm._bbmm_solve._cache_size()
    values.append(gp.BBMMSolver(seed=1, preconditioner_rank=8).value_and_grad(params, xj,
                                                                              yj).value)
    assert _bbmm._bbmm_solve._cache_size() == compiled
    assert values[0] != values[1]  # the probes did change


def test_bbmm_prediction_and_love_variance():
    # d = 2: a rank-256 LOVE cache covers the spectrum above the noise.
    x, y, x_test = _data(1500, d=2, seed=4)
    params = _params(jnp.float64, lengthscale=LENGTHSCALE[:2])
    xj, yj, xt = jnp.asarray(x), jnp.asarray(y[:, None]), jnp.asarray(x_test)
    solver = gp.BBMMSolver(preconditioner_rank=100, love_rank=256)
    posterior = solver.posterior(params, xj, yj)
    with pytest.raises(ValueError, match="love"):
        gp.predict(params, xj, posterior, xt, return_std=True)
    posterior = solver.love(params, xj, posterior)
    mean, std = gp.predict(params, xj, posterior, xt, return_std=True)
    exact = gp.CholeskySolver().posterior(params, xj, yj)
    ref_mean, ref_std = gp.predict(params, xj, exact, xt, return_std=True)
    np.testing.assert_allclose(np.asarray(mean), np.asarray(ref_mean), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(std), np.asarray(ref_std), rtol=1e-3)


def test_galerkin_factor_in_column_blocks():
    # R = Q (QᵀAQ)^{-1/2} formed block by block (k = 40 in blocks of 16: the last overlaps)
    # gives the dense formula's R Rᵀ = Q (QᵀAQ)⁻¹ Qᵀ (R itself is unique up to the signs of
    # the eigenvectors), and a block-wise build at n = 4,096 keeps its temporaries
    # under 1.5 (n, k) arrays (whole, AQ and AQ + σ²Q were two; the RBF product's branch
    # between expansion and differences, scalegp.ops._dispatch.rbf_expansion_ok, took it to 1.08).
    from scalegp.gp._bbmm import _galerkin_factor

    x, _, _ = _data(300, d=2, seed=5)
    params = _params(jnp.float64, lengthscale=LENGTHSCALE[:2])
    hp = params.constrained()
    basis, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(300, 40)))
    engine = gp.BBMMSolver().engine
    blocked = _galerkin_factor(hp, jnp.asarray(x), jnp.asarray(basis), engine, block=16)
    a = np.asarray(covariance(hp, jnp.asarray(x)))
    expected = basis @ np.linalg.solve(basis.T @ a @ basis, basis.T)
    blocked = np.asarray(blocked)
    np.testing.assert_allclose(blocked @ blocked.T, expected, rtol=1e-9, atol=1e-12)

    n, k = 4096, 256
    build = jax.jit(lambda p, x, q: _galerkin_factor(p.constrained(), x, q, engine, 64))
    compiled = build.lower(_params(jnp.float32, lengthscale=LENGTHSCALE[:2]),
                           jax.ShapeDtypeStruct((n, 2), jnp.float32),
                           jax.ShapeDtypeStruct((n, k), jnp.float32)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 1.5 * n * k * 4


def test_bbmm_posterior_with_variance_shares_the_factorisation():
    # posterior(variance=True) preconditions the solve with the rank-love_rank factor and builds
    # the variance factor on it: the same alpha and std as posterior() then love(), and a
    # warm start changes nothing but the iterations.
    x, y, x_test = _data(1500, d=2, seed=4)
    params = _params(jnp.float64, lengthscale=LENGTHSCALE[:2])
    xj, yj, xt = jnp.asarray(x), jnp.asarray(y[:, None]), jnp.asarray(x_test)
    solver = gp.BBMMSolver(preconditioner_rank=100, love_rank=256)
    separate = solver.love(params, xj, solver.posterior(params, xj, yj))
    together = solver.posterior(params, xj, yj, variance=True)
    warm = solver.posterior(params, xj, yj, initial=separate.alpha * (1 + 1e-3), variance=True)
    ref_mean, ref_std = gp.predict(params, xj, separate, xt, return_std=True)
    for posterior in (together, warm):
        mean, std = gp.predict(params, xj, posterior, xt, return_std=True)
        np.testing.assert_allclose(np.asarray(mean), np.asarray(ref_mean), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(std), np.asarray(ref_std), rtol=1e-6)


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
    x, y, _ = _data(300, d=2, seed=5)
    x, y = jnp.asarray(x + 10.0), jnp.asarray(y[:, None])
    params = _composite_params(300)
    result = gp.CholeskySolver().value_and_grad(params, x, y)
    value, grad = jax.value_and_grad(gp.exact_nlml)(params, x, y)
    np.testing.assert_allclose(float(result.value), float(value), rtol=1e-10)
    np.testing.assert_allclose(result.grad.flatten(), grad.flatten(), rtol=1e-7, atol=1e-9)


@pytest.mark.slow
def test_fisher_information_is_the_curvature_of_the_kl_divergence():
    # F(θ) = ∇²_θ' KL(N(m, A) || N(m', A'))|θ'=θ, the closed-form Gaussian KL: exact, no sampling.
    x, _, _ = _data(120, d=2, seed=6)
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


@pytest.mark.slow
def test_bbmm_variance_cache_at_d4():
    # d = 4 needs far more directions than d = 2: at n = 4,000 LOVE's Lanczos cache of rank 256
    # put the latent std off by a median 60%; the pivoted-Cholesky cache at the default rank
    # is within 1e-3 and, being a projection, never below the exact std.
    x, y, x_test = _data(3000, d=4, seed=8)
    params = _params(jnp.float64)
    xj, yj, xt = jnp.asarray(x), jnp.asarray(y[:, None]), jnp.asarray(x_test)
    solver = gp.BBMMSolver()
    posterior = solver.love(params, xj, solver.posterior(params, xj, yj))
    _, std = gp.predict(params, xj, posterior, xt, return_std=True, include_noise=False)
    exact = gp.CholeskySolver().posterior(params, xj, yj)
    _, ref = gp.predict(params, xj, exact, xt, return_std=True, include_noise=False)
    std, ref = np.asarray(std), np.asarray(ref)
    np.testing.assert_allclose(std, ref, rtol=1e-3)
    assert np.all(std >= ref - 1e-9)


def test_underranked_love_clips_with_warning():
    x, y, x_test = _data(800, d=4, seed=5)
    params = gp.GPParams.from_constrained(0.0, 1.0, [1.0] * 4, 1e-4, dtype=jnp.float64)
    solver = gp.BBMMSolver(love_rank=8, preconditioner_rank=50, max_cg_iter=2000)
    xj, yj = jnp.asarray(x), jnp.asarray(y[:, None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        posterior = solver.love(params, xj, solver.posterior(params, xj, yj))
    # Training points themselves: true latent variance ~ noise; a rank-8 cache can't know that,
    # so it overestimates (never negative): no clipping here...
    _, std = gp.predict(params, xj, posterior, xj[:50], return_std=True, include_noise=False)
    assert np.all(np.asarray(std) >= 0)
    # ...while a deliberately wrong factor (too large) must be clipped with a warning.
    bad = gp.Posterior(alpha=posterior.alpha, love_factor=posterior.love_factor * 10)
    with pytest.warns(RuntimeWarning, match="clipped"):
        _, std = gp.predict(params, xj, bad, xj[:50], return_std=True, include_noise=False)
    assert np.all(np.isfinite(np.asarray(std))) and np.all(np.asarray(std) >= 0)


def test_cg_nonconvergence_warns():
    x, y, _ = _data(500, seed=6)
    params = _params(jnp.float64)
    solver = gp.BBMMSolver(max_cg_iter=2, preconditioner_rank=5, cg_tol=1e-8)
    with pytest.warns(ConvergenceWarning, match="max_cg_iter"):
        solver.value_and_grad(params, jnp.asarray(x), jnp.asarray(y[:, None]))


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


def test_default_solver_switch():
    assert isinstance(gp.default_solver(gp.EXACT_MAX_N), gp.CholeskySolver)
    assert isinstance(gp.default_solver(gp.EXACT_MAX_N + 1, num_probes=7), gp.BBMMSolver)


def test_bbmm_memory_is_linear_at_n_50000():
    n, d, t = 50_000, 4, 30
    solver = gp.BBMMSolver(num_probes=t, preconditioner_rank=100, max_cg_iter=100)
    params = _params(jnp.float32)
    x = jax.ShapeDtypeStruct((n, d), jnp.float32)
    y = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    compiled = jax.jit(lambda p, a, b: gp.bbmm_value_and_grad(solver, p, a, b)).lower(
        params, x, y).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    # An n×n float32 array alone would be 10 GB; the linear terms are n × (max_cg_iter, rank, t).
    assert temp < 0.05 * n * n * 4, temp
    assert temp < 400 * 2**20, temp
