"""Validation errors of the public products (`scalegp.ops._checks`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import rbf_kde_density, rbf_kernel_mv

X1 = np.zeros((5, 3), np.float32)
X2 = np.ones((4, 3), np.float32)
V = np.ones((4, 2), np.float32)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((X1, np.ones((4, 4)), V, 1.0), {}, "x1 has d=3 but x2 has d=4"),
        ((X1[0], X2, V, 1.0), {}, r"x1 must have shape \(..., n, d\)"),
        ((X1, X2, np.ones((5, 2)), 1.0), {}, "v has 5 rows but x2 has m=4"),
        ((X1, X2, np.ones((1, 1, 4, 2)), 1.0), {}, "v must have shape"),
        ((X1, X2, V, np.ones(5)), {}, "lengthscale must be a scalar or have d=3 entries"),
        ((X1, X2, V, -1.0), {}, "lengthscale must be positive"),
        ((X1, X2, V, np.array([1.0, 0.0, 1.0])), {}, "lengthscale must be positive"),
        ((X1, X2, V, 1.0), {"impl": "cuda"}, "impl must be one of"),
        ((X1, X2, V, 1.0), {"impl": "pallas", "block_q": 24}, "power of two"),
        ((X1, X2, V, 1.0), {"impl": "xla", "block_k": 0}, "block_k must be a positive integer"),
        ((np.ones((2, 5, 3)), np.ones((3, 4, 3)), np.ones((3, 4, 2)), 1.0), {}, "batch dimensions do not broadcast"),
    ],
)
def test_kernel_mv_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rbf_kernel_mv(*args, **kwargs)


def test_complex_input_rejected():
    with pytest.raises(TypeError, match="real floating-point"):
        rbf_kernel_mv(X1.astype(np.complex64), X2, V, 1.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"weights": -np.ones(4)}, "non-negative"),
        ({"weights": np.zeros(4)}, "not all be zero"),
        ({"weights": np.ones(3)}, r"weights must have shape \(..., m\) with m=4"),
        ({"bandwidth": 0.0}, "bandwidth must be positive"),
        ({"bandwidth": np.ones(2)}, "bandwidth must be a scalar or have d=3"),
    ],
)
def test_kde_errors(kwargs, match):
    args = {"bandwidth": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        rbf_kde_density(X1, X2, **args)


def test_kde_needs_data():
    with pytest.raises(ValueError, match="at least one point"):
        rbf_kde_density(X1, X2[:0], 1.0)


def test_integer_inputs_promote_to_float():
    out = rbf_kernel_mv(np.zeros((3, 2), int), np.zeros((2, 2), int), np.ones(2, int), 1)
    assert jnp.issubdtype(out.dtype, jnp.floating)
    np.testing.assert_allclose(out, 2.0)


def test_lengthscale_checked_only_when_concrete():
    """Inside jit the lengthscale has no value; no error is raised at trace time for it."""
    out = jax.jit(lambda ls: rbf_kernel_mv(X1, X2, V, ls))(jnp.float32(1.0))
    assert out.shape == (5, 2)
