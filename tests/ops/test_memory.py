"""Memory-linearity of the blocked paths (and of the lean dense differences' gradient at any d),
from XLA's compiled memory analysis (nothing is run)."""

import jax
import jax.numpy as jnp
import pytest

from scalegp.ops import rbf_kde_density, rbf_kernel_mv, sq_differences

N = 1 << 16
D, O = 8, 16
# The dense float32 n x m matrix alone would be 16 GiB. The RBF gradient took 60 MiB before its
# expansion-or-differences branch (`scalegp.ops._plan.rbf_expansion_ok`) and 69 MiB with it:
# a lax.cond's backward keeps the residuals of both branches.
LIMIT = 96 * 2**20


def temp_bytes(f, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


def kmv(x1, x2, v, ls):
    return rbf_kernel_mv(x1, x2, v, ls, impl="xla")


def kmv_value_and_grad(x1, x2, v, ls):
    return jax.value_and_grad(lambda *a: jnp.sum(kmv(*a) ** 2), argnums=(0, 1, 2, 3))(x1, x2, v, ls)


def kde_value_and_grad(q, x, h, w):
    return jax.value_and_grad(
        lambda *a: jnp.sum(rbf_kde_density(*a, log=True, impl="xla")), argnums=(0, 1, 2, 3)
    )(q, x, h, w)


@pytest.mark.parametrize("f", [pytest.param(kmv, marks=pytest.mark.slow), kmv_value_and_grad],
                         ids=["fwd", "fwd_bwd"])
def test_xla_kernel_mv_is_memory_linear(f):
    assert temp_bytes(f, (N, D), (N, D), (N, O), (D,)) < LIMIT


def test_xla_kde_is_memory_linear():
    assert temp_bytes(kde_value_and_grad, (N, D), (N, D), (D,), (N,)) < LIMIT


def test_temp_memory_grows_linearly_not_quadratically():
    small = temp_bytes(kmv_value_and_grad, (N // 4, D), (N // 4, D), (N // 4, O), ())
    large = temp_bytes(kmv_value_and_grad, (N, D), (N, D), (N, O), ())
    assert large < 6 * small  # 4x the points; quadratic growth would be 16x


def test_the_lean_dense_differences_hold_one_block_at_any_d():
    """`sq_differences(reverse_only=True)` (the KDE's leave-one-out blocks) recomputes the
    differences feature by feature in its backward pass: at d = 32 it needs about what it needs
    at d = 2, where plain autodiff keeps an (n, m) residual per feature (issue 59)."""
    def value_and_grads(lean):
        def f(x1, x2, s):
            return jax.value_and_grad(lambda *a: jnp.sum(jnp.exp(-0.5 * sq_differences(
                *a, reverse_only=lean))), argnums=(0, 1, 2))(x1, x2, s)
        return f

    def footprint(lean, d):
        return temp_bytes(value_and_grads(lean), (512, d), (1024, d), (d,))

    assert footprint(True, 32) < 2 * footprint(True, 2)
    assert footprint(False, 32) > 8 * footprint(False, 2)  # what the lean pass saves
