"""Tests for scalegp.linalg.refine: float32 CG with float64 residuals against dense solves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.linalg import LowRankPreconditioner, cg, cg_refined, pivoted_cholesky

from .helpers import dense_matvec, random_spd, rbf_column, rbf_system

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


def _rel_err(x, exact):
    return np.linalg.norm(np.asarray(x, np.float64) - exact) / np.linalg.norm(exact)


def _refined_rbf(n, noise, rank, seed=1):
    """(refined result, float64 dense solution, LAPACK float32 solution) for an RBF system on
    offset points, with a float64 rank-``rank`` preconditioner and float32 inner products."""
    x, a = rbf_system(n, 3, noise, seed=seed)
    x = x + 5.0  # uncentred points: the kernel depends only on differences
    b = np.random.default_rng(seed + 1).standard_normal((n, 2))
    chol = pivoted_cholesky(jnp.ones(n), rbf_column(x), max_rank=rank)
    pre = LowRankPreconditioner.from_factor(chol.factor, noise)
    solve = jax.jit(lambda b: cg_refined(dense_matvec(a), b, inner_matvec=dense_matvec(a, jnp.float32),
                                         preconditioner=pre, tol=1e-10, max_iters=2000))
    lapack32 = np.linalg.solve(a.astype(np.float32), b.astype(np.float32))
    return solve(jnp.asarray(b)), np.linalg.solve(a, b), lapack32


def test_float32_products_reach_float64_accuracy_at_condition_1e6():
    """RBF, n = 500, noise 1e-4 (κ ≈ 1.2e6): LAPACK's float32 solve is ~1.5e-3 off; refinement
    with float32 products gets 1e-4 with orders of magnitude to spare."""
    result, exact, lapack32 = _refined_rbf(500, 1e-4, rank=100)
    assert _rel_err(lapack32, exact) > 1e-4  # what plain float32 can do
    assert _rel_err(result.solution, exact) <= 1e-8
    assert np.all(np.asarray(result.converged)) and 1 <= int(result.sweeps) <= 10
    assert result.solution.dtype == jnp.float64


@pytest.mark.slow
@pytest.mark.parametrize("n, rank", [(2000, 200), (4000, 200)])
def test_float32_products_reach_float64_accuracy_large(n, rank):
    """n = 2000 / 4000, noise 1e-4 (κ ≈ 4.7e6 / 9.5e6): 1.5e-10 / 4.3e-10 measured, against
    3.3e-3 / 4.7e-3 for LAPACK in float32 and 1.5e-2 / 2.5e-2 for plain float32 CG."""
    result, exact, lapack32 = _refined_rbf(n, 1e-4, rank=rank)
    assert _rel_err(lapack32, exact) > 1e-3
    assert _rel_err(result.solution, exact) <= 1e-8


def test_random_spd_condition_1e6():
    a = random_spd(120, 1e6, seed=3)
    b = np.random.default_rng(2).standard_normal((120, 3))
    result = cg_refined(dense_matvec(a), jnp.asarray(b), inner_matvec=dense_matvec(a, jnp.float32),
                        tol=1e-10, max_iters=4000, max_sweeps=20)
    assert np.all(np.asarray(result.converged))
    assert _rel_err(result.solution, np.linalg.solve(a, b)) <= 1e-8
    plain = cg(dense_matvec(a, jnp.float32), jnp.asarray(b, jnp.float32), tol=1e-6, max_iters=4000)
    assert _rel_err(plain.solution, np.linalg.solve(a, b)) > 1e-4


def test_out_of_reach_of_float32_is_reported_not_hidden():
    """κ = 1e9 > 1 / eps₃₂: no convergence, flagged, finite."""
    a = random_spd(80, 1e9, seed=3)
    b = np.random.default_rng(2).standard_normal((80, 1))
    result = cg_refined(dense_matvec(a), jnp.asarray(b), inner_matvec=dense_matvec(a, jnp.float32),
                        tol=1e-12, max_iters=500)
    assert not bool(result.converged[0])
    assert np.all(np.isfinite(np.asarray(result.solution)))
    assert float(result.relative_residual[0]) > 1e-12


def test_zero_columns_batches_and_vmap():
    """A zero right-hand side is solved by 0 in no sweep; leading batch dimensions and vmap give
    the same solutions as separate solves."""
    mats = np.stack([random_spd(30, 1e3, seed=s) for s in (1, 2)])
    b = np.random.default_rng(0).standard_normal((2, 30, 2))
    b[:, :, 1] = 0.0

    def solve(a, b):
        return cg_refined(dense_matvec(a), b, inner_matvec=dense_matvec(a, jnp.float32), tol=1e-12)

    batched = jax.jit(solve)(jnp.asarray(mats), jnp.asarray(b))
    mapped = jax.jit(jax.vmap(solve))(jnp.asarray(mats), jnp.asarray(b))
    for i in range(2):
        exact = np.linalg.solve(mats[i], b[i][:, :1])
        assert _rel_err(batched.solution[i][:, :1], exact) <= 1e-10
        assert _rel_err(mapped.solution[i][:, :1], exact) <= 1e-10
    assert np.all(np.asarray(batched.solution[:, :, 1]) == 0.0)
    assert np.all(np.asarray(batched.converged)) and np.all(np.asarray(mapped.converged))
    assert np.all(np.asarray(batched.iterations[:, 1]) == 0)


def test_rejects_a_vector_right_hand_side():
    with pytest.raises(ValueError, match=r"\(\.\.\., n, t\)"):
        cg_refined(lambda v: v, jnp.ones(3), inner_matvec=lambda v: v)
