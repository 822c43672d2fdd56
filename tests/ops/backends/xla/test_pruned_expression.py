"""Pruned K v for kernel expressions (`scalegp.ops.backends.xla._pruned_expression`): sums and products of
decaying profiles (and the rational quadratic) against float64 oracles, within the stated bound,
with every gradient; which expressions prune; "auto"; memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    RBF,
    Constant,
    Engine,
    ExpSineSquared,
    Matern,
    RationalQuadratic,
    kernel_matrix,
    kernel_mv,
    spatial_order,
)
from scalegp.ops.backends.xla import _pruned_expression as xla_pruned_expression
from tests.ops.oracle import grads
from tests.ops.pruning.problems import clustered, rel_err
from tests.ops.test_memory import temp_bytes


def _f(value, dtype=jnp.float32):
    return jnp.asarray(value, dtype)


def expressions(dtype=jnp.float32):
    """Narrow kernels (data in the unit square): each prunes, with a different bound."""
    f = lambda v: _f(v, dtype)  # noqa: E731
    return {
        "rq": _f(1.5, dtype) * RationalQuadratic(f(0.004), f(8.0)),
        "rbf+matern": f(0.7) * RBF(f([0.004, 0.008])) + f(0.3) * Matern(f(0.003), nu=0.5),
        "rbf*periodic": f(2.0) * RBF(f(0.01)) * ExpSineSquared(f(1.0), f(0.05)),
        "composite": (f(1.2) * RBF(f(0.006)) + Matern(f([0.003, 0.002]), nu=2.5)
                      * RationalQuadratic(f(0.01), f(3.0))),
    }


def data(seed, n=1536, offset=0.0):
    rng = np.random.default_rng(seed)
    x1 = clustered(rng, n, 2, offset=offset)
    x2 = clustered(rng, n + 200, 2, offset=offset)
    v = rng.standard_normal((n + 200, 3)).astype(np.float32)
    return x1, x2, v


def reference(kernel64, x1, x2, v):
    return np.asarray(kernel_matrix(kernel64, jnp.asarray(x1, jnp.float64),
                                    jnp.asarray(x2, jnp.float64)) @ jnp.asarray(v, jnp.float64))


@pytest.mark.x64
@pytest.mark.parametrize("name", list(expressions()))
@pytest.mark.parametrize("offset", [0.0, 1e3])
@pytest.mark.slow
def test_pruned_expression_matches_float64_at_the_default_tolerance(name, offset):
    # Pruning adds under 1e-6 to the float32 engine's own error, itself within 1.5e-6 but for
    # Matérn-1/2 (2.2e-6 here, pruned or not: √s magnifies the rounding of s). Under 1e-6 and
    # 1.4e-6 with the keys' mean as the centre; its median (1bfa205) rounds a little apart.
    x1, x2, v = data(1, offset=offset)
    expected = reference(expressions(jnp.float64)[name], x1, x2, v)
    pruned = kernel_mv(expressions()[name], x1, x2, v, impl="xla", prune=True)
    unpruned = kernel_mv(expressions()[name], x1, x2, v, impl="xla", prune=False)
    assert pruned.dtype == jnp.float32
    assert rel_err(pruned, expected) < rel_err(unpruned, expected) + 1e-6
    assert rel_err(pruned, expected) < (3e-6 if name == "rbf+matern" else 1.5e-6)


@pytest.mark.x64
@pytest.mark.parametrize("name", list(expressions()))
def test_pruned_expression_error_stays_within_the_bound(name):
    tol = 1e-3
    x1, x2, v = data(2)
    kernel64 = expressions(jnp.float64)[name]
    out = kernel_mv(kernel64, x1.astype(np.float64), x2.astype(np.float64), v.astype(np.float64),
                    impl="xla", prune=True, prune_tol=tol)
    largest = float(kernel64.bound_at_gap(jnp.zeros(2)))
    bound = tol * largest * np.abs(v).sum(axis=0)
    error = np.abs(np.asarray(out) - reference(kernel64, x1, x2, v))
    assert np.all(error <= bound * (1 + 1e-9))
    assert error.max() > 0  # something was skipped: the bound is what held it


@pytest.mark.x64
@pytest.mark.parametrize("name", ["rq", "composite"])
@pytest.mark.slow
def test_pruned_expression_gradients_equal_the_unpruned_ones(name):
    x1, x2, v = (t.astype(np.float64) for t in data(3, n=700))
    kernel = expressions(jnp.float64)[name]

    def product(prune):
        return lambda k, a, b, c: kernel_mv(k, a, b, c, impl="xla", prune=prune)

    pruned = grads(product(True), (kernel, x1, x2, v))
    exact = grads(product(False), (kernel, x1, x2, v))
    for got, want in zip(jax.tree_util.tree_leaves(pruned), jax.tree_util.tree_leaves(exact)):
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9 * np.abs(want).max())


def test_expressions_that_do_not_decay_are_not_pruned():
    f = _f
    assert (RBF(f(1.0)) * ExpSineSquared(f(1.0), f(1.0))).decays
    assert (RationalQuadratic(f(1.0), f(1.0)) + Matern(f(1.0))).decays
    for kernel in (ExpSineSquared(f(1.0), f(1.0)), RBF(f(1.0)) + Constant(f(1.0)),
                   RBF(f(1.0)) + ExpSineSquared(f(1.0), f(1.0))):
        assert not kernel.decays
        x = np.zeros((4, 2), np.float32)
        with pytest.raises(ValueError, match="fall to 0 with distance"):
            kernel_mv(kernel, x, x, np.ones(4, np.float32), prune=True)
        # "auto" leaves them alone
        kernel_mv(kernel, x, x, np.ones(4, np.float32), prune="auto")


def test_auto_prunes_narrow_expressions_and_not_wide_ones():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.uniform(size=(32768, 2)), jnp.float32)
    narrow = expressions()["composite"]
    wide = RBF(_f(1.0)) * RationalQuadratic(_f(1.0), _f(1.0))
    assert bool(xla_pruned_expression.reach_allows_pruning(narrow, x, 6e-8))
    assert not bool(xla_pruned_expression.reach_allows_pruning(wide, x, 6e-8))
    ordered = x[spatial_order(x)].reshape(-1, 256, 2)
    assert bool(xla_pruned_expression.pruning_pays(narrow, ordered, 6e-8))


def _expression_value_and_grad(x1, x2, v, ls):
    kernel = RBF(ls) * RationalQuadratic(ls, _f(2.0)) + Matern(ls, nu=1.5)
    return jax.value_and_grad(
        lambda k, *a: jnp.sum(kernel_mv(k, *a, impl="xla", prune=True) ** 2),
        argnums=(0, 1, 2, 3))(kernel, x1, x2, v)


def test_pruned_expression_is_memory_linear():
    n = 1 << 13
    shapes = lambda n: ((n, 2), (n, 2), (n, 4), ())  # noqa: E731
    small = temp_bytes(_expression_value_and_grad, *shapes(n // 4))
    large = temp_bytes(_expression_value_and_grad, *shapes(n))
    assert large < 6 * small  # 4x the points; quadratic growth would be 16x


@pytest.mark.parametrize("form, in_order", [("rbf", False), ("rbf", True), ("matern", False),
                                            ("expression", False)])
def test_a_decision_taken_once_is_the_one_auto_takes(form, in_order):
    """`Engine.decided` (`auto_prunes` on the host) picks the branch that ``prune="auto"``
    runs, for the three pruned paths (the RBF's, c · Matern's, the generic expression's):
    narrow kernels on clustered keys prune, wide ones do not, and the products agree."""
    rng = np.random.default_rng(11)
    keys = clustered(rng, 16384, 2)
    if in_order:
        keys = keys[np.asarray(spatial_order(keys))]
    queries = keys[:5] + 1e-3
    v = rng.standard_normal((16384, 2)).astype(np.float32)
    narrow, wide = {
        "rbf": (_f(2.0) * RBF(_f(0.004)), _f(2.0) * RBF(_f(3.0))),
        "matern": (_f(0.5) * Matern(_f(0.004), nu=1.5), _f(0.5) * Matern(_f(3.0), nu=1.5)),
        "expression": (expressions()["rbf+matern"], RBF(_f(1.0)) + Matern(_f(2.0), nu=2.5)),
    }[form]
    engine = Engine("xla", prune="auto", keys_in_order=in_order)
    for kernel, prunes in ((narrow, True), (wide, False)):
        decided = engine.decided(keys, kernel)
        assert decided.prune is prunes
        auto = engine.kernel_mv(queries, keys, v, kernel)
        once = decided.kernel_mv(queries, keys, v, kernel)
        scale = float(jnp.max(jnp.abs(auto)))
        np.testing.assert_allclose(np.asarray(once), np.asarray(auto), rtol=0,
                                   atol=1e-6 * scale)
    assert Engine("xla", prune=False).decided(keys, narrow).prune is False
