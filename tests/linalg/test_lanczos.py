"""Tests for scalegp.linalg's Lanczos quadrature, SLQ log-determinants and Hutchinson traces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.linalg import LowRankPreconditioner, cg, solve_and_logdet
from scalegp.linalg._lanczos import hutchinson_trace, lanczos_quadrature
from scalegp.linalg._preconditioners import DiagonalPreconditioner

from ..conftest import rel_err
from .problems import dense_matvec, random_spd, rbf_preconditioner, rbf_system

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


def _spectral(a, fn):
    evals, evecs = np.linalg.eigh(a)
    return (evecs * fn(evals)) @ evecs.T


# --------------------------------------------------------------------------------------------
# Quadrature


def test_quadrature_from_a_complete_cg_run_is_exact():
    """Once the Krylov space is the whole space (n small, CG run to convergence), Gauss
    quadrature is exact: ‖b‖² e₁ᵀ f(T) e₁ = bᵀ f(A) b for every column, with and without
    preconditioner. (In floating point CG takes a few more than n steps; the extra Ritz values
    are copies of converged ones and do not spoil the quadrature.)"""
    n = 12
    a = random_spd(n, 50.0, seed=0)
    b = np.random.default_rng(1).standard_normal((n, 3))
    solve = jax.jit(
        lambda b, pre: cg(dense_matvec(a), b, preconditioner=pre, tol=1e-14, max_iter=40,
                          return_lanczos=True)
    )
    result = solve(jnp.asarray(b), None)
    assert np.all(np.asarray(result.lanczos.num_steps) >= n)
    for fn in (np.log, np.sqrt, lambda t: 1.0 / t):
        expected = np.einsum("ij,ik,kj->j", b, _spectral(a, fn), b)
        for method in ("host", "dense"):
            quadrature = lanczos_quadrature(result.lanczos, fn, method=method)
            np.testing.assert_allclose(quadrature, expected, rtol=1e-9)

    # With P: quadrature of P^{-1/2} A P^{-1/2} from P^{-1/2} b.
    p_diag = np.linspace(0.5, 3.0, n)
    result = solve(jnp.asarray(b), DiagonalPreconditioner(jnp.asarray(p_diag)))
    scale = 1.0 / np.sqrt(p_diag)
    whitened = scale[:, None] * b
    log_whitened = _spectral(scale[:, None] * a * scale, np.log)
    expected = np.einsum("ij,ik,kj->j", whitened, log_whitened, whitened)
    np.testing.assert_allclose(lanczos_quadrature(result.lanczos, jnp.log), expected, rtol=1e-9)


def test_quadrature_ignores_padding_and_unconverged_lengths():
    """Columns that stop at different steps (and one that needs no step) give the quadrature of
    their own valid block only."""
    n = 50
    a = random_spd(n, 10.0, seed=2)
    eigenvector = np.linalg.eigh(a)[1][:, [0]]
    b = np.concatenate([eigenvector, np.zeros((n, 1)), np.ones((n, 1))], axis=1)
    solve = jax.jit(lambda b: cg(dense_matvec(a), b, tol=1e-12, max_iter=60, return_lanczos=True))
    result = solve(jnp.asarray(b))
    steps = np.asarray(result.lanczos.num_steps)
    assert steps[0] == 1 and steps[1] == 0 and steps[2] > 5
    expected = np.einsum("ij,ik,kj->j", b, _spectral(a, np.log), b)
    for method in ("host", "dense"):
        quadrature = jax.jit(lambda t: lanczos_quadrature(t, jnp.log, method=method))
        np.testing.assert_allclose(quadrature(result.lanczos), expected, rtol=1e-6, atol=1e-12)


# --------------------------------------------------------------------------------------------
# SLQ log-determinant and Hutchinson traces


def _slq_errors(n, num_probes, seeds, noise=1e-2, rank=100, d=3, control_variate=False):
    """Relative errors over seeds of log|A|, tr(A⁻¹) and tr(A⁻¹ ∂K/∂l) from one mBCG run each
    (the traces with the preconditioner as control variate when asked)."""
    x, a = rbf_system(n, d, noise, seed=10)
    kernel = a - noise * np.eye(n)
    sq_dist = np.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)
    dk_dl = kernel * sq_dist  # ∂K/∂l at l = 1
    a_inv = np.linalg.inv(a)
    true_logdet = np.linalg.slogdet(a)[1]
    true_trace_inv = np.trace(a_inv)
    true_trace_grad = np.sum(a_inv * dk_dl.T)
    y = jnp.asarray(np.random.default_rng(11).standard_normal((n, 1)))

    @jax.jit
    def estimate(x, key):
        pre = rbf_preconditioner(x, noise, rank)
        r = solve_and_logdet(dense_matvec(a), y, key, num_probes=num_probes, preconditioner=pre,
                             tol=1e-8, max_iter=300)
        ones, zeros = (jnp.full((n,), c, jnp.float64) for c in (1.0, 0.0))
        trace_inv = hutchinson_trace(lambda v: v, r.probes, r.probe_solutions, pre,
                                     diag_b=ones if control_variate else None)
        trace_grad = hutchinson_trace(dense_matvec(dk_dl), r.probes, r.probe_solutions, pre,
                                      diag_b=zeros if control_variate else None)
        return r, trace_inv, trace_grad

    errors = []
    for seed in seeds:
        r, trace_inv, trace_grad = estimate(jnp.asarray(x), jax.random.PRNGKey(seed))
        assert np.all(np.asarray(r.cg.converged))
        exact = np.linalg.solve(a, np.asarray(y))
        assert rel_err(r.solution, exact) <= 1e-6
        errors.append([
            float(r.logdet) / true_logdet - 1,
            float(trace_inv) / true_trace_inv - 1,
            float(trace_grad) / true_trace_grad - 1,
        ])
    return np.array(errors)


def test_slq_logdet_and_traces_small():
    # Relative standard deviations grow as n shrinks (~1/√n): 1% / 3% / 10% at n = 500.
    errors = _slq_errors(n=500, num_probes=30, seeds=range(4), rank=100)
    assert np.all(np.abs(errors[:, 0]) < 0.01), errors
    assert np.all(np.abs(errors[:, 1]) < 0.03), errors
    assert np.all(np.abs(errors[:, 2]) < 0.1), errors


@pytest.mark.slow
def test_slq_logdet_and_traces_n2000():
    """The issue's acceptance check: 30 probes, n = 2000, 10 seeds.

    log|A| and tr(A⁻¹) (the noise derivative): within 1% per seed, mean within 0.2%.
    tr(A⁻¹ ∂K/∂l) cannot meet 1% per seed with 30 Hutchinson probes: the spread of its estimate
    over seeds is ~3.5% here (the estimator's variance, 2‖sym M‖²_F/t with
    M = P^{1/2} A⁻¹ ∂K P^{-1/2}, not a defect), so it is held to 10% per seed and its mean to
    three standard errors, which still catches a bias of a few percent."""
    errors = _slq_errors(n=2000, num_probes=30, seeds=range(10))
    print("relative errors [logdet, tr(A^-1), tr(A^-1 dK/dl)] per seed:\n", errors)
    print("mean:", errors.mean(axis=0), "std over seeds:", errors.std(axis=0, ddof=1))
    assert np.all(np.abs(errors[:, :2]) < 0.01)
    assert np.all(np.abs(errors[:, :2].mean(axis=0)) < 0.002)
    grad = errors[:, 2]
    assert np.all(np.abs(grad) < 0.1)
    assert abs(grad.mean()) < 3 * grad.std(ddof=1) / np.sqrt(len(grad))


@pytest.mark.slow
def test_traces_with_control_variate_n2000():
    """The trace half of the issue's check, met with the preconditioner as control variate: with
    rank 400 (preconditioned CG then converges in a few iterations) both traces are within 1% per
    seed and 0.2% on average, 30 probes, n = 2000, 10 seeds."""
    errors = _slq_errors(n=2000, num_probes=30, seeds=range(10), rank=400, control_variate=True)
    print("relative errors [logdet, tr(A^-1), tr(A^-1 dK/dl)] per seed:\n", errors)
    assert np.all(np.abs(errors) < 0.01), errors
    assert np.all(np.abs(errors.mean(axis=0)) < 0.002), errors


def test_control_variate_trace_is_exact_when_the_preconditioner_is_the_operator():
    """With A = P the correction term vanishes and the estimate is tr(P⁻¹ B) computed from the
    basis, diag(B) and heteroscedastic noise, whatever the probes; with A ≠ P it is unbiased."""
    n, k, num_probes = 40, 5, 3
    rng = np.random.default_rng(6)
    factor, noise = rng.standard_normal((n, k)), rng.uniform(0.2, 1.0, n)
    b = rng.standard_normal((n, n))
    pre = LowRankPreconditioner.from_factor(jnp.asarray(factor), jnp.asarray(noise))
    p_dense = factor @ factor.T + np.diag(noise)
    probes = pre.sample(jax.random.PRNGKey(1), num_probes)
    solutions = jnp.asarray(np.linalg.solve(p_dense, np.asarray(probes)))
    estimate = hutchinson_trace(dense_matvec(b), probes, solutions, pre, diag_b=jnp.diag(b))
    np.testing.assert_allclose(float(estimate), np.trace(np.linalg.solve(p_dense, b)), rtol=1e-10)

    a = p_dense + np.diag(rng.uniform(0.0, 0.5, n))
    probes = pre.sample(jax.random.PRNGKey(2), 4000)
    solutions = jnp.asarray(np.linalg.solve(a, np.asarray(probes)))
    whitened = pre.solve(probes)
    per_probe = np.asarray(jnp.sum((solutions - whitened) * (jnp.asarray(b) @ whitened), axis=0))
    estimate = float(hutchinson_trace(dense_matvec(b), probes, solutions, pre, diag_b=jnp.diag(b)))
    exact = np.trace(np.linalg.solve(a, b))
    assert abs(estimate - exact) < 4 * per_probe.std() / np.sqrt(per_probe.size)

    with pytest.raises(TypeError, match="LowRankPreconditioner"):
        hutchinson_trace(dense_matvec(b), probes, solutions, None, diag_b=jnp.diag(b))


def test_hutchinson_is_unbiased_for_non_symmetric_b():
    """Mean of many probes of tr(A⁻¹ B) within 4 standard errors, for probes from N(0, P)."""
    n, num_probes = 30, 4000
    a = random_spd(n, 100.0, seed=3)
    b = np.random.default_rng(4).standard_normal((n, n))
    factor = np.random.default_rng(5).standard_normal((n, 3))
    pre = LowRankPreconditioner.from_factor(jnp.asarray(factor), 0.5)
    probes = pre.sample(jax.random.PRNGKey(0), num_probes)
    solutions = jnp.asarray(np.linalg.solve(a, np.asarray(probes)))
    per_probe = np.asarray(
        jnp.sum(solutions * (jnp.asarray(b) @ pre.solve(probes)), axis=0)
    )
    estimate = float(hutchinson_trace(dense_matvec(b), probes, solutions, pre))
    np.testing.assert_allclose(estimate, per_probe.mean(), rtol=1e-10)
    standard_error = per_probe.std() / np.sqrt(num_probes)
    assert abs(estimate - np.trace(np.linalg.solve(a, b))) < 4 * standard_error


def test_solve_and_logdet_batches_and_jits():
    n, batch = 100, 2
    mats = np.stack([rbf_system(n, 2, noise, seed=i)[1] for i, noise in enumerate([0.1, 1.0])])
    y = jnp.asarray(np.random.default_rng(6).standard_normal((batch, n, 1)))
    run = jax.jit(
        lambda m, y, key: solve_and_logdet(
            lambda v: m @ v, y, key, num_probes=40, tol=1e-10, max_iter=300
        )
    )
    batched = run(jnp.asarray(mats), y, jax.random.PRNGKey(0))
    mapped = jax.vmap(run, in_axes=(0, 0, None))(jnp.asarray(mats), y, jax.random.PRNGKey(0))
    for result in (batched, mapped):
        assert result.logdet.shape == (batch,) and result.probes.shape == (batch, n, 40)
        np.testing.assert_allclose(result.solution, np.linalg.solve(mats, np.asarray(y)), rtol=1e-7)
        np.testing.assert_allclose(result.logdet, np.linalg.slogdet(mats)[1], rtol=0.05)
