"""scalegp.gp._bbmm: the iterative marginal likelihood and gradient against the exact ones, the
control variate, probe seeds, the variance cache (LOVE) and its Galerkin factor, convergence
warnings, the default solver, and memory linear in n."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from scalegp import gp, linalg
from scalegp.gp._bbmm import _CONTROL_VARIATE_MAX_CG_ITER, bbmm_value_and_grad, default_solver
from scalegp.gp._exact import covariance
from scalegp.ops import Engine, kernel_matrix
from tests.gp.problems import LENGTHSCALE, flatten, rbf_params, regression_data

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


def _bbmm_check(n, tol, dtype=np.float64, **settings):
    x, y, _ = regression_data(n, seed=2)
    xj, yj = jnp.asarray(x, dtype), jnp.asarray(y[:, None], dtype)
    exact = gp.CholeskySolver().value_and_grad(rbf_params(jnp.float64), jnp.asarray(x),
                                               jnp.asarray(y[:, None]))
    result = gp.BBMMSolver(**settings).value_and_grad(rbf_params(dtype), xj, yj)
    assert bool(result.converged)
    np.testing.assert_allclose(float(result.value), float(exact.value), rtol=tol)
    np.testing.assert_allclose(flatten(result.grad), flatten(exact.grad), rtol=tol)
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
    x, y, _ = regression_data(600, seed=3)
    params = rbf_params(jnp.float64)
    xj, yj = jnp.asarray(x), jnp.asarray(y[:, None])
    for rank, chosen in ((20, False), (600, True)):
        solver = gp.BBMMSolver(preconditioner_rank=rank)
        auto = solver.value_and_grad(params, xj, yj)
        fixed = gp.BBMMSolver(preconditioner_rank=rank, control_variate=chosen).value_and_grad(
            params, xj, yj)
        assert (int(auto.cg_iterations) <= _CONTROL_VARIATE_MAX_CG_ITER) == chosen
        np.testing.assert_allclose(flatten(auto.grad), flatten(fixed.grad), rtol=1e-12)
        # traced, the choice is a lax.cond inside one jit (concrete calls choose on the host)
        traced = jax.jit(lambda p, x, y: bbmm_value_and_grad(solver, p, x, y))(params, xj, yj)
        np.testing.assert_allclose(float(traced.value), float(auto.value), rtol=1e-10)
        np.testing.assert_allclose(flatten(traced.grad), flatten(auto.grad), rtol=1e-9)
    assert not np.allclose(flatten(auto.grad), flatten(gp.BBMMSolver(
        preconditioner_rank=600, control_variate=False).value_and_grad(params, xj, yj).grad),
        rtol=1e-6)


@pytest.mark.slow
def test_bbmm_plain_estimator_is_unbiased():
    # Weak preconditioner: the plain Hutchinson form is used; averaged over seeds it agrees.
    x, y, _ = regression_data(300, seed=3)
    params = rbf_params(jnp.float64)
    xj, yj = jnp.asarray(x), jnp.asarray(y[:, None])
    exact = flatten(gp.CholeskySolver().value_and_grad(params, xj, yj).grad)
    grads = [
        flatten(gp.BBMMSolver(num_probes=200, preconditioner_rank=20, seed=s,
                              control_variate=False).value_and_grad(params, xj, yj).grad)
        for s in range(2)
    ]
    # Per-entry noise is a few % of the largest gradient entry at 400 probes.
    np.testing.assert_allclose(np.mean(grads, axis=0), exact, atol=0.03 * np.abs(exact).max())


def test_bbmm_seeds_share_one_compilation():
    """Another probe seed gives other probes but reuses the compiled programs: the seed is not
    part of the static solver (an estimator with random_state=None draws one per fit)."""
    from scalegp.gp import _bbmm

    x, y, _ = regression_data(64, seed=5)
    xj, yj = jnp.asarray(x, jnp.float32), jnp.asarray(y[:, None], jnp.float32)
    params = rbf_params(jnp.float32)
    values = [gp.BBMMSolver(seed=0, preconditioner_rank=8).value_and_grad(params, xj, yj).value]
    compiled = _bbmm._bbmm_solve._cache_size()
    values.append(gp.BBMMSolver(seed=1, preconditioner_rank=8).value_and_grad(params, xj,
                                                                              yj).value)
    assert _bbmm._bbmm_solve._cache_size() == compiled
    assert values[0] != values[1]  # the probes did change


def test_bbmm_programs_compiled_ahead_are_the_calls():
    """`BBMMSolver.compile_ahead` compiles, in the background, exactly the programs that the
    objective and the posterior with its variance cache then run: each once in all."""
    from tests.test_ahead import compiled_programs

    x, y, _ = regression_data(72, seed=7)  # a size no other test compiles for
    xj, yj = jnp.asarray(x, jnp.float32), jnp.asarray(y[:, None], jnp.float32)
    params = rbf_params(jnp.float32)
    solver = gp.BBMMSolver(preconditioner_rank=8, love_rank=16, control_variate=True)
    with jax.enable_x64(False), compiled_programs() as names:
        started = solver.compile_ahead(params, xj, yj)
        later = [f for future in started for f in (future.result() or [])]
        assert len(later) == 3 and all(f.result() is None for f in later)
        result = solver.value_and_grad(params, xj, yj)
        solver.posterior(params, xj, yj, initial=result.solution, variance=True)
    programs = ("jit(_solve)", "jit(_gradient_half)", "jit(_solve_with_variance_basis_impl)",
                "jit(_galerkin_impl)")
    # the gradient twice: with and without the control variate, both compiled ahead
    assert [names.count(p) for p in programs] == [1, 2, 1, 1], names


def test_bbmm_prediction_and_love_variance():
    # d = 2: a rank-256 LOVE cache covers the spectrum above the noise.
    x, y, x_test = regression_data(1500, d=2, seed=4)
    params = rbf_params(jnp.float64, lengthscale=LENGTHSCALE[:2])
    xj, yj, xt = jnp.asarray(x), jnp.asarray(y[:, None]), jnp.asarray(x_test)
    # predict_tol 1e-6: the mean to 1e-5 of the exact one (the default's bound is 1e-4 RMS).
    solver = gp.BBMMSolver(preconditioner_rank=100, love_rank=256, predict_tol=1e-6)
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
    # between expansion and differences, scalegp.ops._plan.rbf_expansion_ok, took it to 1.08).
    from scalegp.gp._bbmm import _galerkin_factor

    x, _, _ = regression_data(300, d=2, seed=5)
    params = rbf_params(jnp.float64, lengthscale=LENGTHSCALE[:2])
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
    compiled = build.lower(rbf_params(jnp.float32, lengthscale=LENGTHSCALE[:2]),
                           jax.ShapeDtypeStruct((n, 2), jnp.float32),
                           jax.ShapeDtypeStruct((n, k), jnp.float32)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 1.5 * n * k * 4


def test_the_preconditioner_takes_its_kernel_columns_from_its_engine(monkeypatch):
    # One door (issue 59): the pivoted Cholesky's kernel columns come from the engine the
    # preconditioner is given (`Engine.kernel_columns`, as every other product of the solver),
    # not from `scalegp.ops.kernel_mv(impl="dense")` beside it; and they are K's columns: the
    # preconditioner is the one built from the dense matrix's columns.
    from scalegp.gp._bbmm import _preconditioner

    asked = []
    columns = Engine.kernel_columns
    monkeypatch.setattr(Engine, "kernel_columns",
                        lambda self, *args: asked.append(self) or columns(self, *args))
    x, _, _ = regression_data(80, d=2, seed=3)
    x = jnp.asarray(x)
    hp = rbf_params(jnp.float64, lengthscale=LENGTHSCALE[:2]).constrained()
    engine = Engine(impl="xla")
    precond = _preconditioner(hp, x, 12, engine)
    assert asked and all(e is engine for e in asked)

    kmat = kernel_matrix(hp.kernel, x, x)
    factor = linalg.pivoted_cholesky(jnp.diagonal(kmat), lambda i: kmat[:, i], max_rank=12).factor
    expected = linalg.LowRankPreconditioner.from_factor(factor, hp.noise)
    v = jnp.asarray(np.random.default_rng(0).normal(size=(80, 3)))
    np.testing.assert_allclose(np.asarray(precond.solve(v)), np.asarray(expected.solve(v)),
                               rtol=1e-10)


def test_bbmm_posterior_with_variance_shares_the_factorisation():
    # posterior(variance=True) preconditions the solve with the rank-love_rank factor and builds
    # the variance factor on it: the same alpha and std as posterior() then love(), and a
    # warm start changes nothing but the iterations.
    x, y, x_test = regression_data(1500, d=2, seed=4)
    params = rbf_params(jnp.float64, lengthscale=LENGTHSCALE[:2])
    xj, yj, xt = jnp.asarray(x), jnp.asarray(y[:, None]), jnp.asarray(x_test)
    # predict_tol 1e-6: solves that differ in their preconditioner agree to 1e-5.
    solver = gp.BBMMSolver(preconditioner_rank=100, love_rank=256, predict_tol=1e-6)
    separate = solver.love(params, xj, solver.posterior(params, xj, yj))
    together = solver.posterior(params, xj, yj, variance=True)
    warm = solver.posterior(params, xj, yj, initial=separate.alpha * (1 + 1e-3), variance=True)
    ref_mean, ref_std = gp.predict(params, xj, separate, xt, return_std=True)
    for posterior in (together, warm):
        mean, std = gp.predict(params, xj, posterior, xt, return_std=True)
        np.testing.assert_allclose(np.asarray(mean), np.asarray(ref_mean), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(std), np.asarray(ref_std), rtol=1e-6)


def test_the_variance_cache_programs_hold_under_three_bases():
    # The prediction solve with the basis, then the Galerkin factor: as one program, XLA's
    # buffers came to four (n, love_rank) arrays, the largest part of a fit's peak memory
    # (2.1 and 2.7 apart at these sizes; 2.0 and 2.55 at n = 10^5).
    from scalegp.gp._bbmm import _galerkin, _solve_with_variance_basis, _static_part

    n, k = 20_000, 1024
    static = _static_part(gp.BBMMSolver(love_rank=k))
    params = rbf_params(jnp.float32)
    x = jax.ShapeDtypeStruct((n, 4), jnp.float32)
    y = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    basis = jax.ShapeDtypeStruct((n, k), jnp.float32)
    for program, args in ((_solve_with_variance_basis, (static, params, x, y, y)),
                          (_galerkin, (static, params, x, basis))):
        memory = program.lower(*args).compile().memory_analysis()
        held = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
                + memory.output_size_in_bytes)
        assert held < 3.0 * n * k * 4, (program, held / (n * k * 4))


@pytest.mark.slow
def test_bbmm_variance_cache_at_d4():
    # d = 4 needs far more directions than d = 2: at n = 4,000 LOVE's Lanczos cache of rank 256
    # put the latent std off by a median 60%; the pivoted-Cholesky cache at the default rank
    # is within 1e-3 and, being a projection, never below the exact std.
    x, y, x_test = regression_data(3000, d=4, seed=8)
    params = rbf_params(jnp.float64)
    xj, yj, xt = jnp.asarray(x), jnp.asarray(y[:, None]), jnp.asarray(x_test)
    solver = gp.BBMMSolver()
    posterior = solver.love(params, xj, solver.posterior(params, xj, yj))
    _, std = gp.predict(params, xj, posterior, xt, return_std=True, include_noise=False)
    exact = gp.CholeskySolver().posterior(params, xj, yj)
    _, ref = gp.predict(params, xj, exact, xt, return_std=True, include_noise=False)
    std, ref = np.asarray(std), np.asarray(ref)
    np.testing.assert_allclose(std, ref, rtol=1e-3)
    assert np.all(std >= ref - 1e-9)


def test_cg_nonconvergence_warns():
    x, y, _ = regression_data(500, seed=6)
    params = rbf_params(jnp.float64)
    solver = gp.BBMMSolver(max_cg_iter=2, preconditioner_rank=5, cg_tol=1e-8)
    with pytest.warns(ConvergenceWarning, match="max_cg_iter"):
        solver.value_and_grad(params, jnp.asarray(x), jnp.asarray(y[:, None]))


def test_default_solver_switch():
    assert isinstance(default_solver(gp.EXACT_MAX_N), gp.CholeskySolver)
    assert isinstance(default_solver(gp.EXACT_MAX_N + 1, num_probes=7), gp.BBMMSolver)


def test_bbmm_memory_is_linear_at_n_50000():
    n, d, t = 50_000, 4, 30
    solver = gp.BBMMSolver(num_probes=t, preconditioner_rank=100, max_cg_iter=100)
    params = rbf_params(jnp.float32)
    x = jax.ShapeDtypeStruct((n, d), jnp.float32)
    y = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    compiled = jax.jit(lambda p, a, b: bbmm_value_and_grad(solver, p, a, b)).lower(
        params, x, y).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    # An n×n float32 array alone would be 10 GB; the linear terms are n × (max_cg_iter, rank, t).
    assert temp < 0.05 * n * n * 4, temp
    assert temp < 400 * 2**20, temp

