"""scalegp.kde._loo: the leave-one-out log-densities and objective against brute force (dense,
grouped and rematerialised paths), its float32 gradient, and a program that does not grow with the
number of features."""

import functools

import numpy as np
import pytest

from scalegp import kde
from scalegp.kde import _loo as kde_loo
from scalegp.kde._loo import loo_log_density, loo_problem, neg_mean_loo_value_and_grad
from scalegp.ops import Engine
from tests.kde.references import brute_loo, mixture

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


@pytest.mark.parametrize("path", ["dense", "grouped", "grouped-remat"])
def test_loo_matches_brute_force(path, monkeypatch):
    rng = np.random.default_rng(18)
    X = mixture(700, seed=19)
    X = np.concatenate([X, X[:80], X[:10]])  # exact duplicates, some in triplicate
    w = rng.uniform(0.2, 2.0, X.shape[0])
    w[5] = 0.0
    h = np.array([0.25, 0.4])
    if path != "dense":
        monkeypatch.setattr(kde_loo, "_DENSE_LOO_MAX_ENTRIES", 1000)
        monkeypatch.setattr(kde_loo, "_LOO_GROUP", 128)
    if path == "grouped-remat":
        monkeypatch.setattr(kde_loo, "_REMAT_MIN_ELEMENTS", 0)
    expected = brute_loo(X, h, w)
    np.testing.assert_allclose(loo_log_density(X, h, w), expected, rtol=0, atol=1e-10)
    rows = np.array([3, 700, 5, 789])
    np.testing.assert_allclose(
        loo_log_density(X, h, w, held_out=rows), expected[rows], rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("path", ["dense", *(pytest.param(p, marks=pytest.mark.slow)
                                           for p in ("grouped", "grouped-remat"))])
def test_loo_objective_gradient_in_float32(path, monkeypatch):
    """The objective's float32 gradient (what L-BFGS-B sees) matches float64 central differences,
    also at a bandwidth small enough that isolated points' LOO densities fall below e^-88: there a
    zero-weight (left-out) key next to the query would overflow the engine's backward pass."""
    import jax.numpy as jnp

    rng = np.random.default_rng(40)
    X = np.concatenate([mixture(600, seed=41), rng.uniform(-12, 12, size=(20, 2))])
    if path != "dense":
        monkeypatch.setattr(kde_loo, "_DENSE_LOO_MAX_ENTRIES", 1000)
        monkeypatch.setattr(kde_loo, "_LOO_GROUP", 128)
    if path == "grouped-remat":
        monkeypatch.setattr(kde_loo, "_REMAT_MIN_ELEMENTS", 0)
    held = np.arange(0, 620, 2)
    for log_h in (np.log(0.05), np.log([0.3, 0.15])):
        assert brute_loo(X, np.exp(log_h)).min() < -88
        grads = []
        for dtype in (np.float32, np.float64):
            arrays, static = loo_problem(X, np.ones(620), held, dtype, Engine())
            assert (static["group"] == 0) == (path == "dense")
            value, grad = neg_mean_loo_value_and_grad(
                jnp.asarray(log_h, dtype), *arrays, **static
            )
            assert np.isfinite(value) and np.all(np.isfinite(grad))
            grads.append(np.asarray(grad, np.float64))

        def objective(t):
            return -np.mean(brute_loo(X, np.exp(t))[held])

        step = 1e-5
        numeric = [
            (objective(log_h + step * e) - objective(log_h - step * e)) / (2 * step)
            for e in np.eye(np.size(log_h)).reshape(np.size(log_h), *np.shape(log_h))
        ]
        numeric = np.reshape(numeric, np.shape(log_h))
        np.testing.assert_allclose(grads[1], numeric, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(grads[0], grads[1], rtol=2e-3, atol=2e-4)


def test_loo_of_isolated_points_is_accurate_in_float32():
    """The self term is removed exactly, not subtracted: for an isolated point the self term is
    e^50 times the rest, so subtracting it from the full sum would leave float32 noise."""
    rng = np.random.default_rng(20)
    X = np.concatenate([rng.normal(size=(300, 2)) * 0.1, [[3.0, 0.0], [-2.5, 2.5]]])
    h = 0.3
    expected = brute_loo(X, h)
    got = loo_log_density(X.astype(np.float32), h)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_loo_undefined_for_a_single_distinct_point():
    with pytest.raises(ValueError, match="at least 2 distinct points"):
        loo_log_density(np.ones((5, 2)), 1.0)


def _equation_count(jaxpr):
    """Equations of a jaxpr, those of the jaxprs inside its equations (scan bodies, branches)
    included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    total += _equation_count(sub)
    return total


@pytest.mark.parametrize("path", ["dense", "grouped"])
@pytest.mark.parametrize("diagonal", [False, True])
def test_loo_objective_program_does_not_grow_with_the_number_of_features(
        path, diagonal, monkeypatch):
    """The objective and its gradient trace to the same program at d = 32 and d = 256 (both
    above the engine's coordinate-differences branch, d <= 16): the LOO exponents are a loop
    over features, not one unrolled step per feature (whose compilation took minutes for wide
    data)."""
    import jax
    import jax.numpy as jnp

    if path == "grouped":
        monkeypatch.setattr(kde_loo, "_DENSE_LOO_MAX_ENTRIES", 100)
        monkeypatch.setattr(kde_loo, "_LOO_GROUP", 8)
    counts = []
    for d in (32, 256):
        X = np.random.default_rng(d).normal(size=(24, d))
        arrays, static = loo_problem(X, np.ones(24), np.arange(24), np.float32, Engine())
        assert (static["group"] == 0) == (path == "dense")
        log_h = jnp.zeros((d,) if diagonal else (), jnp.float32)
        objective = functools.partial(kde_loo._neg_mean_loo, **static)
        counts.append(_equation_count(
            jax.make_jaxpr(jax.value_and_grad(objective))(log_h, *arrays).jaxpr))
    assert counts[0] == counts[1]


def test_loo_exponents_and_their_gradients_match_float64_at_many_features():
    """float32 exponents from the coordinate differences, and their VJP in both point sets and
    per-feature bandwidths, against float64 on data offset far from the origin (where the
    distance expansion would lose every digit) at short to long bandwidths, d = 40."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(36)
    d = 40
    x1 = (1e3 + rng.normal(size=(9, d))).astype(np.float32)
    x2 = (1e3 + rng.normal(size=(13, d))).astype(np.float32)
    g = rng.normal(size=(9, 13)).astype(np.float32)

    def reference(x1, x2, h):
        return -0.5 * jnp.sum(((x1[:, None, :] - x2[None, :, :]) / h) ** 2, axis=-1)

    for h in (np.float32(0.05), np.float32(3.0), rng.uniform(0.05, 30.0, d).astype(np.float32)):
        want, want_vjp = jax.vjp(reference, *(jnp.asarray(a, jnp.float64) for a in (x1, x2, h)))
        got, got_vjp = jax.vjp(kde_loo._log_kernel_block, *map(jnp.asarray, (x1, x2, h)))
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=2e-6)
        grads = zip(got_vjp(jnp.asarray(g)), want_vjp(jnp.asarray(g, jnp.float64)))
        for got_grad, want_grad in grads:
            assert got_grad.shape == want_grad.shape and got_grad.dtype == jnp.float32
            scale = np.max(np.abs(want_grad))
            np.testing.assert_allclose(got_grad, want_grad, rtol=0, atol=2e-5 * scale)



@pytest.mark.parametrize("n", [1, 5, 8, 9, 50, 333])
@pytest.mark.parametrize("reverse", [False, True])
def test_running_extremes_in_rows_equal_a_whole_axis_scan(n, reverse):
    """`_running` (the anchors' cumulative max and min, in rows so that a TPU compiles them
    quickly) equals `lax.cummax` / `lax.cummin`, through the rows' carries and, with rows of 4,
    the recursion over them."""
    import jax.numpy as jnp
    from jax import lax

    x = jnp.asarray(np.random.default_rng(n).integers(-3, 1000, n), jnp.int32)
    for maximum, whole, identity in ((True, lax.cummax, -1), (False, lax.cummin, 10**6)):
        got = kde_loo._running(x, identity, maximum=maximum, reverse=reverse, block=4)
        np.testing.assert_array_equal(got, whole(x, reverse=reverse))


def test_anchors_in_order_are_the_nearest_positive_weight_key_before_else_after():
    import jax.numpy as jnp

    w = np.array([0, 0, 1, 0, 0, 2, 0, 1, 0, 0], np.float32)
    data = np.arange(10, dtype=np.float32)[:, None]
    got = np.asarray(kde_loo._anchors(jnp.asarray(data), jnp.asarray(w), True))[:, 0]
    np.testing.assert_array_equal(got, [2, 2, 2, 2, 2, 5, 5, 7, 7, 7])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_collapsed_duplicates_are_numpys_unique_rows(dtype, d):
    # One sort of integer keys where a row fits in 64 bits (float32 up to d = 2, float64 at
    # d = 1), the columns' lexicographic sort beyond: both as np.unique, signs and extremes
    # included, -0.0 one row with 0.0.
    rng = np.random.default_rng(d)
    x = rng.normal(size=(5000, d)).astype(dtype)
    x[1::7][:300] = x[::11][:300]
    info = np.finfo(dtype)
    x[:12] = np.repeat(np.array([0.0, -0.0, info.max, -info.max, info.tiny, -info.tiny],
                                dtype), 2)[:, None]
    weights = rng.uniform(0.5, 2.0, len(x))
    unique, unique_w, inverse = kde_loo.collapse_duplicates(x, weights)
    expected, expected_inverse = np.unique(x + 0.0, axis=0, return_inverse=True)
    np.testing.assert_array_equal(unique, expected)
    np.testing.assert_array_equal(inverse, expected_inverse.ravel())
    np.testing.assert_allclose(unique_w, np.bincount(inverse, weights), rtol=1e-12)
    np.testing.assert_array_equal(unique[inverse], x + 0.0)
