"""A repeated eager call of a public product with the same shapes and settings compiles nothing
(issue 42: ``rbf_kernel_mv(q, keys, v, 1.0)`` compiled a ``jit(cond)`` on every call, its branches
being new closures each time; 1 s of XLA compilation per call, 7-10 s under ``prune="auto"``)."""

import numpy as np
import pytest

from scalegp.ops import RBF, Matern, kernel_mv, rbf_kde_density, rbf_kernel_mv
from scalegp.ops.pruning import _rules as pruning_rules
from tests.ops.compiles import count_compiles

M, D = 600, 2

PRODUCTS = {
    "rbf_kernel_mv": lambda q, x, v, prune: rbf_kernel_mv(q, x, v, 0.3, prune=prune),
    # keys spread over many lengthscales: the coordinate differences, a lax.cond on the keys
    "rbf_kernel_mv_short": lambda q, x, v, prune: rbf_kernel_mv(q, x, v[:, 0], 0.01,
                                                                prune=prune),
    "rbf_kde_density": lambda q, x, v, prune: rbf_kde_density(q, x, 0.05, prune=prune),
    "rbf_kde_log_weighted": lambda q, x, v, prune: rbf_kde_density(
        q, x, np.float32([0.05, 0.1]), np.abs(v[:, 0]), log=True, prune=prune),
    "kernel_mv_matern": lambda q, x, v, prune: kernel_mv(
        2.0 * Matern(np.float32(0.1), nu=1.5), q, x, v, prune=prune),
    "kernel_mv_expression": lambda q, x, v, prune: kernel_mv(
        Matern(np.float32(0.2), nu=2.5) * RBF(np.float32(0.3)) + RBF(np.float32(0.1)), q, x,
        v, prune=prune),
}


# In CI the RBF product under every setting and the KDE under "auto" (each case compiles for
# seconds); the rest under -m slow.
CASES = [pytest.param(product, prune, marks=() if product == "rbf_kernel_mv" or (
    product == "rbf_kde_density" and prune == "auto") else pytest.mark.slow)
    for product in sorted(PRODUCTS) for prune in (False, True, "auto")]


@pytest.mark.parametrize("product, prune", CASES)
def test_a_second_eager_call_compiles_nothing(product, prune, monkeypatch):
    # "auto" considers pruning from AUTO_MIN_KEYS keys: lowered so that its run-time choice
    # (a lax.cond on the keys) is traced at this small size too
    monkeypatch.setattr(pruning_rules, "AUTO_MIN_KEYS", 256)
    rng = np.random.default_rng(0)
    keys = rng.uniform(size=(M, D)).astype(np.float32)
    values = rng.normal(size=(M, 2)).astype(np.float32)
    f = PRODUCTS[product]
    first = np.asarray(f(keys[:3] + 0.01, keys, values, prune))
    with count_compiles() as compiled:
        # new arrays of the same shapes and dtypes, as a caller's next query brings
        again = np.asarray(f(keys[:3] + 0.01, keys.copy(), values.copy(), prune))
    assert len(compiled) == 0, f"compiled {compiled}"
    np.testing.assert_array_equal(again, first)


def test_count_compiles_sees_a_compilation():
    """The counter can fail: a function never compiled before is counted."""
    import jax
    import jax.numpy as jnp

    with count_compiles() as compiled:
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(np.ones(7, np.float32)).block_until_ready()
    assert len(compiled) >= 1
