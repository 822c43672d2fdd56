"""The hand-written xla path of ``scale · Matern(l, ν)``, ν = 3/2 and 5/2
(`scalegp.ops.backends.xla._matern.matern_mv`, taken by `kernel_mv` on impl "xla" and "auto" on CPU): which
kernels take it, float32 forward and gradients against float64 (offset data, coincident points,
ARD, several lengthscales), the gradient convention at r = 0, finite results at huge coordinates
and memory. Row independence: tests/ops/test_row_independence.py. Tolerances as in
tests/ops/test_kernel_expressions.py: 2e-5 forward, 1e-4 every gradient, norm-wise relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from scalegp.ops import RBF, Matern, kernel_mv
from scalegp.ops._matmul import MATERN_EXPANSION_MEAN_LIMIT
from scalegp.ops.backends.xla import _matern as xla_matern
from tests.ops.test_kernel_expressions import (
    TILES,
    assert_near_float64,
    cast,
    expression_temp_bytes,
    oracle_mv,
    problem,
    value_and_grads,
    xla_matern_expansion_ok,
)

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)

ARD = np.array([0.6, 1.0, 1.7])


@pytest.fixture
def matern_calls(monkeypatch):
    """A list that records each call of `xla_matern.matern_mv` (its ν)."""
    calls, original = [], xla_matern.matern_mv

    def spy(a, b, v, nu, block_sizes):
        calls.append(nu)
        return original(a, b, v, nu, block_sizes)

    monkeypatch.setattr(xla_matern, "matern_mv", spy)
    return calls


@pytest.mark.parametrize("kernel, impl, nu", [
    (Matern(ARD, nu=1.5), "xla", 1.5),
    (Matern(1.0, nu=2.5) * 0.5, "auto", 2.5),
    (2.0 * Matern(ARD, nu=1.5) * 3.0, "xla", 1.5),
    (Matern(1.0, nu=0.5), "xla", None),  # √ of the expansion near r = 0: the differences
    (Matern(1.0, nu=1.5) + RBF(1.0), "xla", None),
    (Matern(1.0, nu=1.5) * Matern(2.0, nu=1.5), "xla", None),
    (Matern(1.0, nu=1.5), "dense", None),
    (Matern(1.0, nu=1.5), "pallas", None),
])
def test_which_kernels_take_the_path(matern_calls, kernel, impl, nu):
    if impl == "auto" and jax.default_backend() == "gpu":
        pytest.skip("auto picks pallas on a GPU")
    x1, x2, v = problem(seed=0, n=5, m=6)
    out = kernel_mv(kernel, x1, x2, v, impl=impl)
    assert matern_calls == ([] if nu is None else [nu])
    np.testing.assert_allclose(out, oracle_mv(kernel, x1, x2, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nu, ard", [
    pytest.param(1.5, True, id="ard-1.5"), pytest.param(2.5, False, id="scalar-2.5"),
    pytest.param(2.5, True, id="ard-2.5", marks=pytest.mark.slow),
    pytest.param(1.5, False, id="scalar-1.5", marks=pytest.mark.slow)])
def test_forward_and_gradients_float32(nu, ard):
    """K(x1, x2) v and K(x, x) v (every diagonal pair coincides: the expansion's rounding is
    largest there, about eps·|a|² in t²), centred and offset (+1e3) data, lengthscales 0.3, 1
    and 10 times the spread, an outputscale; tiles of 16 x 24. Lengthscale 0.1 with x1 != x2:
    tests/ops/test_kernel_expressions.py."""

    @value_and_grads
    def f(kernel, x1, x2, v):
        return kernel_mv(kernel, x1, x2, v, impl="xla", block_q=16, block_k=24)

    for offset in (0.0, 1e3):
        x1, x2, v = problem(seed=11, n=37, m=45, offset=offset)
        for same in (False, True):
            queries = x2 if same else x1
            cot = np.random.default_rng(12).uniform(0.5, 1.5, (queries.shape[0], 2))
            for lengthscale in (0.3, 1.0, 10.0):
                kernel = cast(0.8 * Matern(lengthscale * (ARD if ard else 1.0), nu=nu),
                              jnp.float32)
                out, grads = f(kernel, queries, x2, v, cot.astype(np.float32))
                assert_near_float64(kernel, queries, x2, v, cot, out, grads,
                                    (offset, same, lengthscale))


def clustered(seed, n, d, lengthscale, offset):
    """(x, v, cot): n points in 12 clusters of unit spread overall, each point within about
    a lengthscale of its cluster's centre (so that K(x, x) has entries off the diagonal at
    any lengthscale), shifted by ``offset`` and by a random vector (uncentred); v mostly
    positive and a cotangent, as in `problem`."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((12, d))
    x = centres[rng.integers(0, 12, n)] + 0.7 * lengthscale * rng.standard_normal((n, d))
    x = x + offset + rng.uniform(-3.0, 3.0, d)
    v = rng.standard_normal((n, 2)) + 1.0
    cot = rng.uniform(0.5, 1.5, (n, 2))
    return [a.astype(np.float32) for a in (x, v, cot)]


def at_expansion_limit(x, nu, ard):
    """The lengthscale (times ``ard``) at which keys x have a mean scaled squared norm of 0.9
    of `MATERN_EXPANSION_MEAN_LIMIT`: the most spread keys that take the expansion."""
    b = (np.float64(x) - np.float64(x).mean(axis=0)) * np.sqrt(2 * nu) / ard
    limit = MATERN_EXPANSION_MEAN_LIMIT[nu]
    return np.sqrt(np.mean(np.sum(b * b, axis=1)) / (0.9 * limit))


def _coincident_params():
    """(nu, d, impl): in CI xla at (1.5, 2) and (2.5, 4), dense at (1.5, 2); the rest under
    -m slow."""
    in_ci = {(1.5, 2, "xla"), (2.5, 4, "xla"), (1.5, 2, "dense")}
    return [pytest.param(nu, d, impl, id=f"{nu}-{d}-{impl}",
                         marks=[] if (nu, d, impl) in in_ci else [pytest.mark.slow])
            for nu in (1.5, 2.5) for d in (2, 4) for impl in ("xla", "dense", "pallas")]


@pytest.mark.parametrize("nu, d, impl", _coincident_params())
def test_coincident_points_at_small_lengthscales(nu, d, impl):
    """K(x, x) v at ARD lengthscales 0.03-0.1 of the data's spread (and at the largest ones
    whose spread still takes the expansion), centred and offset (+1e3) data: the expansion's
    rounding, a few eps·(|a|² + |b|²) in t², is largest there, and reached 3.3e-4 forward before
    the xla path chose by the keys' spread (`MATERN_EXPANSION_MEAN_LIMIT`). Which branch
    the xla path takes is checked too."""
    ard = np.linspace(1.0, 0.6, d)

    @value_and_grads
    def f(kernel, x1, x2, v):
        return kernel_mv(kernel, x1, x2, v, impl=impl, **TILES[impl])

    for offset in (0.0, 1e3):
        for scale in (0.1, 0.06, 0.03, None):
            x, v, cot = clustered(31 + d, 64, d, 0.1 if scale is None else scale, offset)
            lengthscale = (at_expansion_limit(x, nu, ard) if scale is None else scale) * ard
            kernel = cast(0.8 * Matern(lengthscale, nu=nu), jnp.float32)
            if impl == "xla":
                takes_expansion = bool(xla_matern_expansion_ok(
                    x, kernel.terms[1].lengthscale, nu, jnp.float32))
                assert takes_expansion == (scale is None), (offset, scale)
            out, grads = f(kernel, x, x, v, cot)
            assert_near_float64(kernel, x, x, v, cot, out, grads, (offset, scale))


@pytest.mark.parametrize("nu", [1.5, 2.5])
def test_check_grads_float64(nu):
    """Finite differences (order 1, reverse mode) in float64 for every argument."""
    x1, x2, v = problem(seed=13, n=9, m=11, d=3, o=2, dtype=np.float64)
    kernel = cast(1.3 * Matern(0.9 * ARD, nu=nu), jnp.float64)

    def f(kernel, x1, x2, v):
        return kernel_mv(kernel, x1, x2, v, impl="xla", block_q=8, block_k=8)

    check_grads(jax.jit(f), (kernel, x1, x2, v), order=1, modes=["rev"])


@pytest.mark.parametrize("nu", [1.5, 2.5])
def test_gradient_at_coincident_points_is_zero(nu):
    """At r = 0 the point and lengthscale gradients are 0 and ∂/∂v is k(x, x) = 1. Up to
    rounding: the point gradient is ``Σ_j W_ij y_j - x_i Σ_j W_ij`` (two matrix products, as
    for the RBF), which XLA may round apart by a fraction of an ulp of ``W y`` (it does for
    ν = 5/2 here, ~1e-16 against coordinates of 2e-8 after centring)."""
    kernel = cast(Matern(np.array([0.5, 1.5]), nu=nu), jnp.float32)
    point = np.array([[0.3, -0.2]], np.float32)
    dk, dx1, dx2, dv = jax.jit(jax.grad(
        lambda k, a, b, c: jnp.sum(kernel_mv(k, a, b, c, impl="xla")), argnums=(0, 1, 2, 3)))(
        kernel, point, point, np.ones((1, 1), np.float32))
    for g in (dx1, dx2, dk.lengthscale):
        np.testing.assert_allclose(g, 0.0, atol=1e-12)
    np.testing.assert_allclose(dv, 1.0, rtol=1e-6)


def test_huge_coordinates_give_finite_values():
    """A query whose scaled squared norm is finite but whose coordinates pass the clip
    (`scalegp.ops._matmul.matern_coordinate_limit`) gets 0, not NaN (no ``inf · 0`` in ``t e^{-t}``), in the
    value and the gradients; one whose squared norm overflows gets 0 too (a far row)."""
    x1, x2, v = problem(seed=14, n=4, m=9)
    x1[1] = 1e19
    x1[2] = 1e30
    kernel = cast(Matern(1.0, nu=1.5), jnp.float32)
    out = kernel_mv(kernel, x1, x2, v, impl="xla")
    np.testing.assert_array_equal(out[1:3], 0.0)
    np.testing.assert_allclose(np.asarray(out)[[0, 3]], oracle_mv(kernel, x1[[0, 3]], x2, v),
                               rtol=1e-5)
    grads = jax.grad(lambda k, a, b, c: jnp.sum(kernel_mv(k, a, b, c, impl="xla")),
                     argnums=(0, 1, 2, 3))(kernel, x1, x2, v)
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.slow
def test_memory_linear():
    """Compiled temporary memory of the forward and all gradients for n = m = 2^14 and 2^16
    (d = 8, o = 16), from XLA's memory analysis (nothing is run); a float32 n x m array alone
    would be 1 and 16 GiB."""
    d, o = 8, 16
    kernel = cast(2.0 * Matern(jnp.ones(d), nu=1.5), jnp.float32)

    small, large = (expression_temp_bytes(kernel, n, d, o) for n in (1 << 14, 1 << 16))
    assert large < 128 * 2**20, large
    assert large - small < 2 * 2**10 * 3 * (1 << 14), (small, large)  # < 2 KiB per added row


def test_batched_call_branches_once():
    """Under the batch dimensions' ``vmap`` the choice between the expansion and the
    differences stays one ``cond`` (an unbatched predicate, from every member's keys), not a
    select that would run both; each member's result matches its own call."""
    rng = np.random.default_rng(15)
    x1 = rng.standard_normal((3, 20, 2)).astype(np.float32)
    x2 = rng.standard_normal((3, 30, 2)).astype(np.float32)
    v = rng.standard_normal((3, 30, 2)).astype(np.float32)
    for lengthscale in (0.05, 5.0):  # the differences, the expansion
        kernel = cast(Matern(lengthscale * np.ones(2), nu=1.5), jnp.float32)

        def f(x1, x2, v):
            return kernel_mv(kernel, x1, x2, v, impl="xla")

        jaxpr = str(jax.make_jaxpr(f)(x1, x2, v))
        assert jaxpr.count("cond[") == 1  # a batched predicate leaves no cond (a select)
        out = f(x1, x2, v)
        for i in range(3):
            np.testing.assert_allclose(out[i], f(x1[i], x2[i], v[i]), rtol=2e-6, atol=1e-7)
