"""Memory-linearity of the blocked paths, from XLA's compiled memory analysis (nothing is run)."""

import jax
import jax.numpy as jnp
import pytest

from scalegp.ops import rbf_kde_density, rbf_kernel_mv

N = 1 << 16
D, O = 8, 16
# The dense float32 n x m matrix alone would be 16 GiB. The RBF gradient took 60 MiB before its
# expansion-or-differences branch (`scalegp.ops._backends.rbf_expansion_ok`) and 69 MiB with it:
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
