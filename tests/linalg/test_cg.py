"""Tests for scalegp.linalg.cg: accuracy against dense solves, masking, Lanczos coefficients,
reporting, jit and batching."""

import linecache
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.linalg import LowRankPreconditioner, cg, pivoted_cholesky
from scalegp.linalg import warn_if_not_converged
from scalegp.linalg._preconditioners import DiagonalPreconditioner

from ..conftest import rel_err
from .problems import (
    dense_matvec,
    lanczos_tridiagonal,
    random_spd,
    rbf_column,
    rbf_preconditioner,
    rbf_system,
)

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)

# (dtype, CG tolerance, required relative error against the float64 dense solve)
FLOAT32 = (jnp.float32, 1e-6, 1e-4)
FLOAT64 = (jnp.float64, 1e-11, 1e-9)


def _solve_rbf(n, noise, precision, rank, seed=0):
    """CG on K + noise I (RBF, d = 3, lengthscale 1) against numpy; returns (error, result)."""
    dtype, tol, _ = precision
    x, a = rbf_system(n, 3, noise, seed=seed)
    b = np.random.default_rng(seed + 1).standard_normal((n, 2))
    reference = np.linalg.solve(a, b)

    @jax.jit
    def run(x, b):
        preconditioner = rbf_preconditioner(x, noise, rank, dtype) if rank else None
        return cg(dense_matvec(a, dtype), b, preconditioner=preconditioner, tol=tol, max_iter=3000)

    result = run(jnp.asarray(x, dtype), jnp.asarray(b, dtype))
    return rel_err(result.solution, reference, axis=0), result


# Condition numbers of K + noise I for n = 500: ~1.2e2, 1.2e4, 1.2e6 for noise 1, 1e-2, 1e-4.
# float32 stops at ~1e4: at 1e6 even LAPACK's float32 solve is only ~1.5e-3 accurate
# (κ · eps_32 ≈ 0.1 worst case), so 1e-4 is out of reach of any float32-only method there.
RBF_CASES = [
    pytest.param(500, 1.0, FLOAT32, 0, id="n500-noise1-f32"),
    pytest.param(500, 1e-2, FLOAT32, 0, id="n500-noise1e-2-f32"),
    pytest.param(500, 1.0, FLOAT64, 0, id="n500-noise1-f64"),
    pytest.param(500, 1e-2, FLOAT64, 0, id="n500-noise1e-2-f64"),
    pytest.param(500, 1e-4, FLOAT64, 100, id="n500-noise1e-4-f64-precond"),
]


@pytest.mark.parametrize("n, noise, precision, rank", RBF_CASES)
def test_cg_matches_dense_solve_on_rbf(n, noise, precision, rank):
    error, result = _solve_rbf(n, noise, precision, rank)
    assert np.all(np.asarray(result.converged))
    assert np.all(error <= precision[2]), error


SLOW_RBF_CASES = [
    pytest.param(2000, 1e-2, FLOAT32, 0, id="n2000-noise1e-2-f32"),  # κ ≈ 4.7e4
    pytest.param(4000, 1.0, FLOAT32, 0, id="n4000-noise1-f32"),
    pytest.param(4000, 1e-1, FLOAT32, 100, id="n4000-noise1e-1-f32-precond"),  # κ ≈ 9e3
    pytest.param(2000, 1e-4, FLOAT64, 200, id="n2000-noise1e-4-f64-precond"),  # κ ≈ 4.7e6
    pytest.param(4000, 1e-2, FLOAT64, 0, id="n4000-noise1e-2-f64"),
    pytest.param(4000, 1e-4, FLOAT64, 200, id="n4000-noise1e-4-f64-precond"),
]


@pytest.mark.slow
@pytest.mark.parametrize("n, noise, precision, rank", SLOW_RBF_CASES)
def test_cg_matches_dense_solve_on_rbf_large(n, noise, precision, rank):
    error, result = _solve_rbf(n, noise, precision, rank)
    assert np.all(np.asarray(result.converged))
    print(f"n={n} noise={noise} rank={rank}: iterations {result.iterations}, rel. error {error}")
    # A solve in working precision is accurate to about κ·eps, not better (float32 CG reaches
    # 0.2 κ·eps at κ ≈ 9e3 and 4.7e4, where LAPACK's float32 solve reaches 0.01-0.1 κ·eps): the
    # required error is that floor where it is above the fixed one.
    floor = np.linalg.cond(rbf_system(n, 3, noise)[1]) * float(jnp.finfo(precision[0]).eps)
    assert np.all(error <= max(precision[2], floor)), (error, floor)


@pytest.mark.slow
@pytest.mark.parametrize(
    "n, noise, factor, floor", [(500, 1e-4, 5.0, 0.0), (4000, 1e-2, 0.0, 1e-3)]
)
def test_float32_cg_when_ill_conditioned(n, noise, factor, floor):
    """Beyond κ ≈ 1e4 no float32 solver reaches 1e-4 (LAPACK's float32 Cholesky gets 1.5e-3 at
    n = 500, noise 1e-4, κ ≈ 1.2e6), so the bound is relative to LAPACK or, where the matvec
    limits CG, absolute: at n = 4000, noise 1e-2 (κ ≈ 9e4) the float32 product K x sums terms
    ~100× larger than its result (|x| ~ |b|/σ²), which floors CG's true residual near
    eps · ‖|K||x|‖; LAPACK's factorisation does not meet that cancellation (error 4.6e-5 vs 3.8e-4
    for CG when this was written)."""
    error, result = _solve_rbf(n, noise, FLOAT32, 100)
    x, a = rbf_system(n, 3, noise, seed=0)
    b = np.random.default_rng(1).standard_normal((n, 2))
    lapack32 = np.linalg.solve(a.astype(np.float32), b.astype(np.float32))
    lapack_error = rel_err(lapack32, np.linalg.solve(a, b), axis=0)
    print(f"n={n} noise={noise}: CG f32 error {error}, LAPACK f32 error {lapack_error}")
    assert np.all(np.asarray(result.converged))
    assert np.all(error <= max(factor * lapack_error.max(), floor))


@pytest.mark.parametrize(
    "condition, precision",
    [(1e2, FLOAT32), (1e4, FLOAT32), (1e2, FLOAT64), (1e4, FLOAT64), (1e6, FLOAT64)],
)
def test_cg_matches_dense_solve_on_random_spd(condition, precision):
    dtype, tol, bound = precision
    n = 300
    a = random_spd(n, condition, seed=3)
    b = np.random.default_rng(4).standard_normal((n, 3))
    # Log-spaced spectra have no clusters: CG needs ~6000 iterations at κ = 1e6 (n = 300).
    result = jax.jit(lambda b: cg(dense_matvec(a, dtype), b, tol=tol, max_iter=10_000))(
        jnp.asarray(b, dtype)
    )
    assert np.all(np.asarray(result.converged))
    assert np.all(rel_err(result.solution, np.linalg.solve(a, b), axis=0) <= bound)


def test_each_column_is_an_independent_cg_run():
    """A converged column stops changing while the others iterate; each column follows its
    lone run (up to the rounding of different matmul shapes)."""
    n = 200
    a = random_spd(n, 1e3, seed=0)
    rng = np.random.default_rng(1)
    # An eigenvector converges in one step, random vectors take hundreds.
    eigenvalues, eigenvectors = np.linalg.eigh(a)
    easy = eigenvectors[:, [5]]
    b = np.concatenate([easy, rng.standard_normal((n, 2))], axis=1)
    solve = jax.jit(lambda b: cg(dense_matvec(a), b, tol=1e-10))
    together = solve(jnp.asarray(b))
    iterations = np.asarray(together.iterations)
    assert iterations[0] == 1 and np.all(iterations[1:] > 100)
    # Frozen after one step: still the exact solution after the others' 200+ iterations.
    np.testing.assert_allclose(together.solution[:, 0], easy[:, 0] / eigenvalues[5], rtol=1e-12)
    for j in range(3):
        alone = solve(jnp.asarray(b[:, [j]]))
        assert abs(int(alone.iterations[0]) - iterations[j]) <= 2
        np.testing.assert_allclose(alone.solution[:, 0], together.solution[:, j], rtol=1e-8)


def test_initial_guess_zero_rhs_and_reporting():
    n = 100
    a = random_spd(n, 1e3, seed=2)
    rng = np.random.default_rng(3)
    b = rng.standard_normal((n, 2))
    b[:, 1] = 0.0
    exact = np.linalg.solve(a, b)
    matvec = dense_matvec(a)

    solve = jax.jit(lambda b, x0: cg(matvec, b, x0=x0, tol=1e-8))
    cold = solve(jnp.asarray(b), None)
    assert int(cold.iterations[1]) == 0 and np.all(np.asarray(cold.solution[:, 1]) == 0)
    warm = solve(jnp.asarray(b), jnp.asarray(exact + 1e-6 * rng.standard_normal(b.shape)))
    assert int(warm.iterations[0]) < int(cold.iterations[0])
    assert np.all(np.asarray(warm.converged))
    np.testing.assert_allclose(warm.solution, exact, atol=1e-6)

    # Too few iterations: reported in the result and by warn_if_not_converged, never raised.
    short = jax.jit(lambda b: cg(matvec, b, tol=1e-8, max_iter=5))(jnp.asarray(b))
    assert not bool(short.converged[0]) and bool(short.converged[1])
    assert float(short.relative_residual[0]) > 1e-8
    assert int(short.iterations[0]) == 5
    with pytest.warns(RuntimeWarning, match="max_iter"):
        warn_if_not_converged(short)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_not_converged(cold)


def test_warning_names_the_callers_setting_category_and_line():
    """A wrapper (the GP) names its own iteration cap and warning class, and the warning points
    at the wrapper's caller."""

    class SolverWarning(UserWarning):
        pass

    a = random_spd(50, 1e3, seed=2)
    short = cg(dense_matvec(a), jnp.ones((50, 2)), tol=1e-8, max_iter=3)

    def wrapper():
        warn_if_not_converged(short, "training solve", setting="max_cg_iter",
                              category=SolverWarning, stacklevel=3)

    with pytest.warns(SolverWarning, match=r"training solve: 2 of 2 .* Raise max_cg_iter") as caught:
        wrapper()
    assert linecache.getline(caught[0].filename, caught[0].lineno).strip() == "wrapper()"


def test_warning_tells_a_breakdown_from_too_few_iterations():
    # An indefinite "A" stops CG at its first non-positive curvature, long before max_iter: the
    # message blames the arithmetic (positive definiteness lost), not the iteration cap.
    a = jnp.diag(jnp.asarray([2.0, 1.0, -1.0]))
    broken = cg(dense_matvec(a), jnp.ones((3, 1)), tol=1e-8, max_iter=50)
    assert not bool(broken.converged[0]) and int(broken.iterations[0]) < 50
    with pytest.warns(RuntimeWarning, match="no longer positive definite") as caught:
        warn_if_not_converged(broken, max_iter=50)
    assert "Raise" not in str(caught[0].message)


def test_per_column_tolerance():
    n = 150
    a = random_spd(n, 1e4, seed=5)
    b = np.repeat(np.random.default_rng(6).standard_normal((n, 1)), 2, axis=1)
    result = jax.jit(lambda b, tol: cg(dense_matvec(a), b, tol=tol))(
        jnp.asarray(b), jnp.array([1e-2, 1e-10])
    )
    residual = np.asarray(result.relative_residual)
    assert residual[0] <= 1e-2 and residual[1] <= 1e-10
    assert int(result.iterations[0]) < int(result.iterations[1])


def test_indefinite_matrix_breaks_down_without_nans():
    a = np.diag(np.array([1.0, 2.0, -3.0, 4.0]))
    result = cg(dense_matvec(a), jnp.ones((4, 1)), tol=1e-10, max_iter=20)
    assert not bool(result.converged[0])
    assert np.all(np.isfinite(np.asarray(result.solution)))


@pytest.mark.parametrize("use_preconditioner", [False, True])
def test_lanczos_coefficients_match_explicit_lanczos(use_preconditioner):
    """T from the CG coefficients equals the tridiagonal of an explicit Lanczos run on
    P^{-1/2} A P^{-1/2} from P^{-1/2} b, and ‖b‖²_{P⁻¹} is the recorded start weight."""
    # Without reorthogonalisation the CG-implied Lanczos vectors lose orthogonality once a Ritz
    # value converges (Paige), after which both runs are "correct" but differ; compare the
    # first steps, before that happens.
    n, steps = 120, 10
    x, a = rbf_system(n, 2, 1e-1, seed=7)
    b = np.random.default_rng(8).standard_normal((n, 1))
    if use_preconditioner:
        chol = pivoted_cholesky(jnp.ones(n), rbf_column(x), max_rank=5)
        preconditioner = LowRankPreconditioner.from_factor(chol.factor, 1e-1)
        p = np.asarray(chol.factor) @ np.asarray(chol.factor).T + 1e-1 * np.eye(n)
    else:
        preconditioner = DiagonalPreconditioner(jnp.full((n,), 2.0))
        p = 2.0 * np.eye(n)
    evals, evecs = np.linalg.eigh(p)
    p_inv_sqrt = (evecs / np.sqrt(evals)) @ evecs.T

    result = jax.jit(
        lambda b, pre: cg(
            dense_matvec(a), b, preconditioner=pre, tol=1e-300, max_iter=steps, return_lanczos=True
        )
    )(jnp.asarray(b), preconditioner)
    tri = result.lanczos
    assert int(tri.num_steps[0]) == steps
    whitened = p_inv_sqrt @ a @ p_inv_sqrt
    diag, offdiag = lanczos_tridiagonal(whitened, p_inv_sqrt @ b[:, 0], steps)
    np.testing.assert_allclose(tri.diag[0], diag, rtol=1e-8)
    np.testing.assert_allclose(tri.offdiag[0, :-1], offdiag, rtol=1e-8)
    np.testing.assert_allclose(tri.start_norm_sq[0], b[:, 0] @ np.linalg.solve(p, b[:, 0]))


def test_jit_leading_batch_dims_and_vmap_agree():
    n, batch = 80, 3
    mats = np.stack([random_spd(n, 10.0 ** (2 + i), seed=i) for i in range(batch)])
    b = np.random.default_rng(9).standard_normal((batch, n, 2))
    exact = np.linalg.solve(mats, b)

    batched = jax.jit(lambda m, b: cg(lambda v: m @ v, b, tol=1e-10, return_lanczos=True))(
        jnp.asarray(mats), jnp.asarray(b)
    )
    mapped = jax.vmap(lambda m, b: cg(lambda v: m @ v, b, tol=1e-10, return_lanczos=True))(
        jnp.asarray(mats), jnp.asarray(b)
    )
    for result in (batched, mapped):
        assert result.iterations.shape == (batch, 2)
        assert result.lanczos.diag.shape == (batch, 2, 1000)
        assert np.all(np.asarray(result.converged))
        np.testing.assert_allclose(result.solution, exact, rtol=1e-7, atol=1e-9)
    # Harder systems take more iterations: columns and systems are independent.
    assert np.all(np.diff(np.asarray(batched.iterations[:, 0])) > 0)
    np.testing.assert_array_equal(batched.iterations, mapped.iterations)
