"""scalegp.gp._laplace: the dense Laplace approximation against scikit-learn's
GaussianProcessClassifier (mode, log marginal likelihood, gradient, latent moments,
probabilities), its gradient against finite differences, and the matrix-free solver against
the dense one."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.datasets import make_moons
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF, WhiteKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C

from scalegp import gp, linalg
from scalegp.estimators._gpr_kernels import KernelSpec
from scalegp.ops import Engine, kernel_matrix

KERNELS = [C(2.0) * RBF([0.7, 1.3]), C(1.5) * RBF(0.5) + WhiteKernel(0.1)]


def _problem(kernel, n=120, dtype=jnp.float64, seed=0):
    X, y = make_moons(n, noise=0.3, random_state=seed)
    params = gp.KernelParams(mean=jnp.zeros(1, dtype), theta=jnp.asarray(kernel.theta, dtype),
                             spec=KernelSpec.from_sklearn(kernel))
    return X, y, params, jnp.asarray(X, dtype), jnp.asarray(y, dtype)


@pytest.mark.x64
@pytest.mark.parametrize("kernel", KERNELS)
def test_dense_matches_scikit_learn(kernel):
    # The done-when: at fixed hyperparameters, scikit-learn's latent mode and log
    # marginal likelihood within 1e-6 relative in float64 (and its gradient, Algorithm 5.1).
    X, y, params, x, t = _problem(kernel)
    ref = GaussianProcessClassifier(kernel, optimizer=None).fit(X, y)
    mode = gp.LaplaceCholesky().mode(params, x, t, gradient=True)
    assert bool(mode.converged)
    f_ref = ref.base_estimator_.f_cached
    assert np.linalg.norm(np.asarray(mode.f) - f_ref) <= 1e-6 * np.linalg.norm(f_ref)
    value, grad = ref.log_marginal_likelihood(kernel.theta, eval_gradient=True)
    assert float(mode.value) == pytest.approx(value, rel=1e-6)
    np.testing.assert_allclose(np.asarray(mode.grad.theta), grad, rtol=1e-6)
    # latent moments through gp.predict, and probabilities
    X_test = np.random.default_rng(1).normal(size=(40, 2))
    posterior = gp.LaplaceCholesky().posterior(params, x, t, mode)
    mean, std = gp.predict(params, x, posterior, jnp.asarray(X_test), return_std=True,
                           include_noise=False)
    white = float(params.spec.build(params.theta)[1])
    mean_ref, var_ref = ref.latent_mean_and_variance(X_test)
    np.testing.assert_allclose(np.asarray(mean)[:, 0], mean_ref, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(np.asarray(std) ** 2 + white, var_ref, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(gp.averaged_sigmoid(mean_ref, var_ref),
                               ref.predict_proba(X_test)[:, 1], atol=1e-10)


@pytest.mark.x64
def test_dense_gradient_matches_finite_differences():
    kernel = KERNELS[1]
    _, _, params, x, t = _problem(kernel, n=60)
    mode = gp.LaplaceCholesky().mode(params, x, t, gradient=True)
    eps = 1e-5
    for j in range(kernel.n_dims):
        step = jnp.zeros(kernel.n_dims).at[j].set(eps)
        up = gp.LaplaceCholesky().mode(
            gp.KernelParams(params.mean, params.theta + step, params.spec), x, t).value
        down = gp.LaplaceCholesky().mode(
            gp.KernelParams(params.mean, params.theta - step, params.spec), x, t).value
        assert float(mode.grad.theta[j]) == pytest.approx(float(up - down) / (2 * eps),
                                                          rel=1e-6)


def test_averaged_sigmoid_limits():
    # zero variance: the logistic function itself (to the approximation's 1e-3; its
    # coefficients sum to 1 within 1e-8); a large variance pulls every probability towards
    # 1/2, monotone in the mean.
    z = np.linspace(-6, 6, 25)
    np.testing.assert_allclose(gp.averaged_sigmoid(z, 0.0), 1 / (1 + np.exp(-z)), atol=2e-3)
    wide = gp.averaged_sigmoid(z, 100.0)
    assert np.all(np.abs(wide - 0.5) <= np.abs(1 / (1 + np.exp(-z)) - 0.5) + 1e-8)
    assert np.all(np.diff(wide) > 0)


@pytest.mark.x64
def test_cg_matches_dense():
    # The matrix-free path: the same mode to the Newton solves' tolerance, log q by SLQ and
    # the gradient by Hutchinson within a few percent, the variance factor's latent variances
    # within 1e-4 of the prior's.
    kernel = KERNELS[1]
    _, _, params, x, t = _problem(kernel, n=200)
    dense = gp.LaplaceCholesky().mode(params, x, t, gradient=True)
    solver = gp.LaplaceCG(preconditioner_rank=64, num_probes=64)
    mode = solver.mode(params, x, t, gradient=True)
    assert mode.converged
    assert np.linalg.norm(mode.f - dense.f) <= 1e-4 * np.linalg.norm(dense.f)
    assert float(mode.value) == pytest.approx(float(dense.value), rel=1e-2)
    np.testing.assert_allclose(np.asarray(mode.grad.theta), np.asarray(dense.grad.theta),
                               rtol=0.1, atol=0.02 * np.linalg.norm(dense.grad.theta))
    X_test = jnp.asarray(np.random.default_rng(2).normal(size=(30, 2)))
    moments = [gp.predict(params, x, s.posterior(params, x, t, m), X_test, return_std=True,
                          include_noise=False)
               for s, m in ((gp.LaplaceCholesky(), dense), (solver, mode))]
    np.testing.assert_allclose(moments[1][0], moments[0][0], atol=1e-4)
    np.testing.assert_allclose(moments[1][1] ** 2, moments[0][1] ** 2, atol=1e-4 * 1.5)


@pytest.mark.x64
def test_cg_factor_takes_its_kernel_columns_from_its_engine(monkeypatch):
    # One door (issue 59): the pivoted Cholesky of K behind LaplaceCG's preconditioner takes
    # its columns from the solver's engine (`Engine.kernel_columns`), not from
    # `scalegp.ops.kernel_mv(impl="dense")` beside it; the factor is the dense matrix's.
    from scalegp.gp._laplace import _kernel_factor

    asked = []
    columns = Engine.kernel_columns
    monkeypatch.setattr(Engine, "kernel_columns",
                        lambda self, *args: asked.append(self) or columns(self, *args))
    _, _, params, x, _ = _problem(KERNELS[1])
    hp = params.constrained()
    engine = Engine(impl="xla")
    factor = _kernel_factor(hp, x, 16, engine)
    assert asked and all(e is engine for e in asked)
    kmat = kernel_matrix(hp.kernel, x, x)
    expected = linalg.pivoted_cholesky(jnp.diagonal(kmat), lambda i: kmat[:, i],
                                       max_rank=16).factor
    np.testing.assert_allclose(np.asarray(factor), np.asarray(expected), rtol=1e-10,
                               atol=1e-12)


def test_cg_float32_warm_start():
    # float32 (the default): the mode from a warm start near it takes fewer Newton steps and
    # lands on the same mode as from zero.
    _, _, params, x, t = _problem(KERNELS[0], n=150, dtype=jnp.float32)
    solver = gp.LaplaceCG(preconditioner_rank=32, num_probes=8)
    cold = solver.mode(params, x, t)
    warm = solver.mode(params, x, t, f0=cold.f * 0.9)
    assert cold.converged and warm.converged
    assert warm.iterations < cold.iterations
    np.testing.assert_allclose(warm.f, cold.f, atol=2e-3 * float(jnp.max(jnp.abs(cold.f))))
    dense = gp.LaplaceCholesky().mode(params, x, t)
    np.testing.assert_allclose(cold.f, dense.f, atol=2e-3 * float(jnp.max(jnp.abs(dense.f))))


def test_cg_newton_reports_a_failed_step_as_not_converged(monkeypatch):
    # A step that lowers Ψ however short it is made (here every step points downhill) ends
    # the run at the last iterate, which is not the mode.
    from scalegp.gp import _laplace

    _, _, params, x, t = _problem(KERNELS[0], n=60, dtype=jnp.float32)
    solver = gp.LaplaceCG(preconditioner_rank=8, num_probes=4)
    assert solver.mode(params, x, t).converged
    step = _laplace._cg_newton_step_jit

    def downhill(static, params, x, t, factor, f, a, first):
        f_new, a_new, psi, res = step(static, params, x, t, factor, f, a, first)
        if first:
            return f_new, a_new, psi, res
        f_bad, a_bad = f - 50.0 * (f_new - f) - 1.0, a - 50.0 * (a_new - a)
        return f_bad, a_bad, _laplace._psi(t, f_bad, a_bad), res

    monkeypatch.setattr(_laplace, "_cg_newton_step_jit", downhill)
    failed = solver.mode(params, x, t)
    assert not failed.converged and failed.iterations == 2


@pytest.mark.x64
def test_cg_newton_lands_on_the_mode_with_loose_solves():
    # Each Newton step solves for its correction to a, so the solve's error is relative to a
    # gradient that vanishes at the mode: loose solves still converge to it. (Solving for all
    # of a, the error stays relative to b = W f + ∇log p, and f = K a scales it by K's large
    # eigenvalues: a large outputscale left the iterates off the mode.)
    kernel = C(50.0) * RBF([0.7, 1.3])
    _, _, params, x, t = _problem(kernel, n=300)
    dense = gp.LaplaceCholesky().mode(params, x, t)
    solver = gp.LaplaceCG(preconditioner_rank=8, num_probes=8)
    loose = dataclasses.replace(solver, newton_cg_tol=1e-2)
    for mode in (solver.mode(params, x, t), loose.mode(params, x, t)):
        assert np.linalg.norm(mode.f - dense.f) <= 1e-5 * np.linalg.norm(dense.f)


@pytest.mark.x64
def test_dense_float32_newton_never_passes_off_garbage_as_the_mode():
    # At the bounds' corner (outputscale and lengthscales 1e5) K is almost 1e5·11ᵀ: f = K a
    # carries a's float32 rounding times λ_max(K) ≈ 1e7. Undamped, Newton's steps went
    # downhill and stopped "converged" at log q = -311 (float64: -135), and on 1,000 points
    # at -2.8e10 with a gradient as wrong, which stalled L-BFGS-B at its start. Now each
    # step is halved while it lowers Ψ (Ψ never drops below its start's, -n log 2), and one
    # that cannot gain is reported as failed; where it converges, it is on float64's log q.
    from sklearn.datasets import make_classification

    X, y = make_classification(200, n_features=4, n_informative=3, n_redundant=0, n_classes=3,
                               n_clusters_per_class=1, random_state=1)
    kernel = C(1e5) * RBF(np.full(4, 1e5))
    spec = KernelSpec.from_sklearn(kernel)
    x, t = X - np.median(X, axis=0), (y == 0).astype(float)
    modes = {}
    for dtype in (jnp.float32, jnp.float64):
        params = gp.KernelParams(mean=jnp.zeros(1, dtype), theta=jnp.asarray(kernel.theta, dtype),
                                 spec=spec)
        modes[dtype] = gp.LaplaceCholesky().mode(params, jnp.asarray(x, dtype),
                                                 jnp.asarray(t, dtype))
    exact, mode = modes[jnp.float64], modes[jnp.float32]
    assert bool(exact.converged)
    if bool(mode.converged):
        assert float(mode.value) == pytest.approx(float(exact.value), rel=1e-3)
    else:
        assert bool(mode.failed)
    psi = -0.5 * np.dot(np.asarray(mode.a, np.float64), np.asarray(mode.f, np.float64)) - np.sum(
        np.logaddexp(0.0, -(2 * t - 1) * np.asarray(mode.f, np.float64)))
    assert psi >= -len(t) * np.log(2.0) * (1 + 1e-5)


@pytest.mark.x64
@pytest.mark.parametrize("method", ["graph", "host"])
def test_projected_variances_match_the_dense_inverse(method, monkeypatch):
    """``diag(L (I + LᵀWL)⁻¹ Lᵀ)`` from the k × k eigendecomposition, in the graph and on the
    host (as on a TPU), against the dense inverse in float64, with a zero weight and a
    dependent column."""
    from scalegp.gp import _laplace

    rng = np.random.default_rng(4)
    factor = rng.normal(size=(300, 12))
    factor[:, 11] = factor[:, 3]
    w = rng.uniform(0.0, 0.25, 300)
    w[5] = 0.0
    real = linalg.small_eigh
    monkeypatch.setattr(linalg, "small_eigh", lambda a: real(a, method=method))
    got = np.asarray(_laplace.projected_variances(jnp.asarray(factor), jnp.asarray(w)))
    inner = np.eye(12) + factor.T @ (w[:, None] * factor)
    want = np.einsum("ij,jk,ik->i", factor, np.linalg.inv(inner), factor)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
