"""The Mosaic dense products (`mosaic._dense`, interpreted) against float64 over shapes that end
inside a tile and span several, on offset operands (their wrapping and dispatch:
tests/ops/test_dense.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops.backends.mosaic import _dense as mosaic_dense

# (n, k, t): within one block; the long axis ragged over several; the short axes past
# `COLUMNS` (ragged blocks); one row; wide outputs
SHAPES = [(40, 5, 3), (700, 300, 31), (1300, 1100, 40), (1, 7, 2), (300, 8, 600)]


def _rel(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


@pytest.mark.parametrize("n, k, t", SHAPES)
def test_products_are_float32_accurate(n, k, t):
    rng = np.random.default_rng(n + k + t)
    # offset and of unequal scales: the pieces must carry every bit, not only the top ones
    a = (rng.normal(size=(n, k)) + 3.0).astype(np.float32)
    b = (rng.normal(size=(n, t)) * 1e-3 - 2e-3).astype(np.float32)
    s = (rng.normal(size=(k, t)) * 50.0).astype(np.float32)
    a64 = a.astype(np.float64)
    # float32's own rounding of the operands' products, summed over k or n terms: under 1e-6
    assert _rel(mosaic_dense.matmul_tn(a, b, interpret=True), a64.T @ b) < 1e-6
    assert _rel(mosaic_dense.matmul(a, s, interpret=True), a64 @ s) < 1e-6


def test_one_bfloat16_pass_would_fail_the_bound():
    """The bound above catches a product that kept only the top pieces."""
    rng = np.random.default_rng(0)
    a = (rng.normal(size=(700, 300)) + 3.0).astype(np.float32)
    b = rng.normal(size=(700, 31)).astype(np.float32)
    one_pass = jnp.matmul(a.T.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)
    assert _rel(one_pass, a.astype(np.float64).T @ b) > 1e-4
