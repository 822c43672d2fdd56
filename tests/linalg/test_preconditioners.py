"""Tests for scalegp.linalg's preconditioners: pivoted Cholesky, low-rank and diagonal
preconditioners (solve, logdet, sample), jitter reporting, and the effect on CG."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.linalg import LowRankPreconditioner, cg, pivoted_cholesky
from scalegp.linalg._preconditioners import DiagonalPreconditioner

from ..conftest import rel_err
from .problems import dense_matvec, rbf_column, rbf_preconditioner, rbf_system

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


def test_pivoted_cholesky_of_full_rank_is_exact_and_pivots_greedily():
    n = 40
    x, a = rbf_system(n, 3, 0.0, lengthscale=0.5, seed=0)
    factorise = jax.jit(
        lambda x: pivoted_cholesky(jnp.ones(n), rbf_column(x, 0.5), max_rank=n, rel_tol=0.0)
    )
    chol = factorise(jnp.asarray(x))
    l = np.asarray(chol.factor)
    pivots = np.asarray(chol.pivots)
    assert int(chol.rank) == n and int(chol.num_jittered) == 0
    assert sorted(pivots.tolist()) == list(range(n))
    np.testing.assert_allclose(l @ l.T, a, atol=1e-10)
    # Lower triangular in pivot order, with sqrt(pivot) on the diagonal.
    permuted = l[pivots]
    np.testing.assert_array_equal(np.triu(permuted, 1), 0.0)
    assert np.all(np.diag(permuted) > 0)


def test_pivoted_cholesky_truncation_and_tolerance():
    n = 300
    x, k = rbf_system(n, 2, 0.0, seed=1)
    eigenvalues = np.linalg.eigvalsh(k)[::-1]
    factorise = jax.jit(lambda x: pivoted_cholesky(jnp.ones(n), rbf_column(x), max_rank=30))
    chol = factorise(jnp.asarray(x))
    l = np.asarray(chol.factor)
    residual = k - l @ l.T
    assert int(chol.rank) == 30
    np.testing.assert_allclose(float(chol.residual_trace), np.trace(residual), rtol=1e-8)
    # The residual of a Cholesky factorisation is PSD, and greedy pivoting is close to the best
    # rank-30 approximation (within a few times the tail of the spectrum).
    assert np.min(np.linalg.eigvalsh(residual)) > -1e-10
    assert np.trace(residual) < 10 * eigenvalues[30:].sum()

    stopped = jax.jit(
        lambda x: pivoted_cholesky(jnp.ones(n), rbf_column(x), max_rank=100, rel_tol=1e-3)
    )(jnp.asarray(x))
    rank = int(stopped.rank)
    assert 0 < rank < 100
    assert float(stopped.residual_trace) <= 1e-3 * n
    assert np.all(np.asarray(stopped.factor)[:, rank:] == 0)
    assert np.all(np.asarray(stopped.pivots)[rank:] == -1)


def test_non_positive_pivot_gets_jitter_and_a_warning():
    n = 50
    x = np.random.default_rng(2).standard_normal((n, 3))
    k = x @ x.T  # rank 3
    column = lambda i: jnp.asarray(k)[:, i]
    with pytest.warns(RuntimeWarning, match="non-positive pivot"):
        chol = pivoted_cholesky(jnp.asarray(np.diag(k)), column, max_rank=6, rel_tol=0.0)
    assert int(chol.num_jittered) == 3
    assert np.all(np.isfinite(np.asarray(chol.factor)))
    l = np.asarray(chol.factor)
    np.testing.assert_allclose(l @ l.T, k, atol=1e-9 * np.max(np.diag(k)))
    # Under jit nothing is raised or warned; the count is in the result.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jitted = jax.jit(lambda d: pivoted_cholesky(d, column, max_rank=6, rel_tol=0.0))(
            jnp.asarray(np.diag(k))
        )
    assert int(jitted.num_jittered) == 3
    # The default tolerance stops at the numerical rank instead.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = pivoted_cholesky(jnp.asarray(np.diag(k)), column, max_rank=6)
    assert int(default.rank) == 3 and int(default.num_jittered) == 0


#: The two ways to the eigen-form (`LowRankPreconditioner.from_factor`): "auto" takes the
#: first off a TPU, the second on one.
METHODS = ["householder", "gram"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype, rtol", [(jnp.float64, 1e-9), (jnp.float32, 2e-4)])
@pytest.mark.parametrize("heteroscedastic", [False, True])
def test_low_rank_preconditioner_solve_and_logdet_match_dense(dtype, rtol, heteroscedastic,
                                                              method):
    n, k = 300, 40
    x, kernel = rbf_system(n, 3, 0.0, seed=3)
    rng = np.random.default_rng(4)
    noise = 1e-4 * (1 + rng.random(n)) if heteroscedastic else 1e-4
    factorise = jax.jit(
        lambda x: pivoted_cholesky(jnp.ones(n, dtype), rbf_column(x, dtype=dtype), max_rank=k)
    )
    chol = factorise(jnp.asarray(x))
    build = jax.jit(functools.partial(LowRankPreconditioner.from_factor, method=method))
    preconditioner = build(chol.factor, jnp.asarray(noise, dtype))
    l = np.asarray(chol.factor, np.float64)
    p = l @ l.T + np.diag(np.broadcast_to(noise, (n,)))
    v = rng.standard_normal((n, 3))
    exact = np.linalg.solve(p, v)
    solved = np.asarray(jax.jit(lambda pc, v: pc.solve(v))(preconditioner, jnp.asarray(v, dtype)))
    assert rel_err(solved, exact) <= rtol
    np.testing.assert_allclose(float(preconditioner.logdet()), np.linalg.slogdet(p)[1], rtol=rtol)


@pytest.mark.parametrize("method", METHODS)
def test_zero_columns_of_the_factor_change_nothing(method):
    """A factor stopped below max_rank has zero columns; the preconditioner is that of the
    nonzero part."""
    rng = np.random.default_rng(10)
    factor = rng.standard_normal((50, 4))
    padded = np.concatenate([factor, np.zeros((50, 3))], axis=1)
    v = jnp.asarray(rng.standard_normal((50, 2)))
    trimmed = LowRankPreconditioner.from_factor(jnp.asarray(factor), 0.3, method=method)
    with_zeros = LowRankPreconditioner.from_factor(jnp.asarray(padded), 0.3, method=method)
    np.testing.assert_allclose(with_zeros.solve(v), trimmed.solve(v), rtol=1e-10)
    np.testing.assert_allclose(with_zeros.logdet(), trimmed.logdet(), rtol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_samples_have_covariance_p(method):
    n, k, num = 6, 2, 200_000
    rng = np.random.default_rng(5)
    factor = rng.standard_normal((n, k))
    noise = 0.1 + rng.random(n)
    p = factor @ factor.T + np.diag(noise)
    for preconditioner, cov in [
        (LowRankPreconditioner.from_factor(jnp.asarray(factor), jnp.asarray(noise),
                                           method=method), p),
        (DiagonalPreconditioner(jnp.asarray(noise)), np.diag(noise)),
    ]:
        z = np.asarray(preconditioner.sample(jax.random.PRNGKey(0), num))
        assert z.shape == (n, num)
        # Entrywise standard error of the sample covariance is about sqrt(2/num) * scale.
        np.testing.assert_allclose(z @ z.T / num, cov, atol=0.02 * np.max(np.diag(cov)))


def test_diagonal_preconditioner_and_identity():
    d = jnp.asarray([1.0, 2.0, 4.0])
    v = jnp.ones((3, 2))
    np.testing.assert_allclose(DiagonalPreconditioner(d).solve(v), v / d[:, None])
    np.testing.assert_allclose(DiagonalPreconditioner(d).logdet(), np.log(8.0))
    identity = DiagonalPreconditioner.identity(3, jnp.float32)
    assert identity.solve(v.astype(jnp.float32)).dtype == jnp.float32
    assert float(identity.logdet()) == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_batched_preconditioner_through_vmap_and_leading_dims(method):
    n, k, batch = 60, 8, 3
    xs = np.random.default_rng(6).standard_normal((batch, n, 2))
    noise = jnp.asarray([1e-2, 1e-1, 1.0])[:, None]
    factors = jax.vmap(lambda x: pivoted_cholesky(jnp.ones(n), rbf_column(x), max_rank=k).factor)(
        jnp.asarray(xs)
    )
    v = jnp.asarray(np.random.default_rng(7).standard_normal((batch, n, 2)))

    @jax.jit
    def solve_and_logdet(factor, noise, v):
        preconditioner = LowRankPreconditioner.from_factor(factor, noise, method=method)
        return preconditioner.solve(v), preconditioner.logdet()

    solved, logdets = solve_and_logdet(factors, noise, v)
    assert logdets.shape == (batch,)
    for i in range(batch):
        single_solved, single_logdet = solve_and_logdet(factors[i], noise[i, 0], v[i])
        np.testing.assert_allclose(solved[i], single_solved, rtol=1e-9)
        np.testing.assert_allclose(logdets[i], single_logdet, rtol=1e-12)
    batched = LowRankPreconditioner.from_factor(factors, noise, method=method)
    assert batched.sample(jax.random.PRNGKey(1), 4).shape == (batch, n, 4)


def _iterations_with_and_without(n, rank, dtype=jnp.float64):
    """CG iterations (tol 1e-4) on RBF (l = 1, d = 3) + 1e-2 I without / with pivoted Cholesky."""
    noise = 1e-2
    x, a = rbf_system(n, 3, noise, seed=8)
    b = jnp.asarray(np.random.default_rng(9).standard_normal((n, 1)), dtype)
    matvec = dense_matvec(a, dtype)

    @jax.jit
    def run(x, b):
        plain = cg(matvec, b, tol=1e-4)
        preconditioner = rbf_preconditioner(x, noise, rank, dtype)
        return plain, cg(matvec, b, preconditioner=preconditioner, tol=1e-4)

    plain, preconditioned = run(jnp.asarray(x, dtype), b)
    assert bool(plain.converged[0]) and bool(preconditioned.converged[0])
    return int(plain.iterations[0]), int(preconditioned.iterations[0])


def test_pivoted_cholesky_cuts_cg_iterations():
    plain, preconditioned = _iterations_with_and_without(1000, 50)
    assert plain >= 2.4 * preconditioned, (plain, preconditioned)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_pivoted_cholesky_rank_100_cuts_cg_iterations_3x(dtype):
    plain, preconditioned = _iterations_with_and_without(4000, 100, dtype)
    name = jnp.dtype(dtype).name
    print(f"n=4000 {name}: {plain} iterations plain, {preconditioned} with rank 100")
    assert plain >= 3 * preconditioned, (plain, preconditioned)


@pytest.mark.parametrize("method", METHODS)
def test_float32_solve_stays_positive_definite_in_the_low_rank_span(method):
    """rᵀP⁻¹r for r in the span of L with λ/σ² up to ~1e7 (as K's top eigenvalues against the
    noise at GP scale): the true value is ~|r|²/λ, while a single projection leaves an error of
    ~eps·|r|²/σ², which made P⁻¹ indefinite in float32 and broke CG down (rᵀz < 0). The
    solve projects twice, and stays within 1% of the float64 value."""
    rng = np.random.default_rng(11)
    n, k, noise = 20000, 32, 1e-2
    factor = (rng.standard_normal((n, k)) * np.geomspace(2.0, 0.02, k)).astype(np.float32)
    r = (factor @ rng.standard_normal((k, 8))).astype(np.float32)
    preconditioner = jax.jit(functools.partial(LowRankPreconditioner.from_factor,
                                               method=method))(jnp.asarray(factor), noise)
    z = np.asarray(jax.jit(lambda pc, r: pc.solve(r))(preconditioner, jnp.asarray(r)))
    got = np.asarray(jnp.sum(jnp.asarray(r) * jnp.asarray(z), axis=0))
    u, s, _ = np.linalg.svd(np.float64(factor), full_matrices=False)
    coords = u.T @ np.float64(r)
    rest = np.float64(r) - u @ coords
    want = (coords**2 / (s[:, None] ** 2 + noise)).sum(0) + (rest**2).sum(0) / noise
    assert np.all(got > 0)
    np.testing.assert_allclose(got, want, rtol=1e-2)


def test_nonfinite_factor_gives_nans_by_gram_not_an_exception():
    """The host steps never raise inside a callback: a factor with a NaN gives a NaN
    preconditioner, which the solver's checks then see."""
    factor = np.ones((20, 3))
    factor[4, 1] = np.nan
    built = jax.jit(functools.partial(LowRankPreconditioner.from_factor, method="gram"))(
        jnp.asarray(factor), 0.1)
    assert np.isnan(np.asarray(built.logdet()))


def test_auto_takes_the_gram_matrices_on_a_tpu_and_no_dense_qr(plans_for_a_tpu):
    """On a TPU (the platform faked) "auto" builds the eigen-form from Gram matrices, with
    the k×k work in host callbacks: no QR or SVD left in the program for XLA to compile."""
    jaxpr = str(jax.make_jaxpr(lambda f: LowRankPreconditioner.from_factor(f, 0.1))(
        jnp.ones((64, 8), jnp.float32)))
    dense = re.compile(r"\b(qr|svd)\[|name=(qr|svd)\b")
    assert "pure_callback" in jaxpr and not dense.search(jaxpr)
    off_tpu = str(jax.make_jaxpr(lambda f: LowRankPreconditioner.from_factor(
        f, 0.1, method="householder"))(jnp.ones((64, 8), jnp.float32)))
    assert dense.search(off_tpu)
