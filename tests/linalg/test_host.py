"""Tests for scalegp.linalg's host steps: `small_eigh` on the host against the graph's, under
jit and vmap, and its platform choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.linalg import small_eigh

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_small_eigh_on_the_host_matches_the_graph_under_jit_and_vmap(dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 40, 40))
    a = jnp.asarray(a @ np.swapaxes(a, 1, 2), dtype)
    host = jax.jit(jax.vmap(lambda m: small_eigh(m, method="host")))(a)
    graph = jnp.linalg.eigh(a)
    assert host[0].dtype == dtype and host[1].shape == (3, 40, 40)
    tol = 1e-4 if dtype == jnp.float32 else 1e-10
    np.testing.assert_allclose(host[0], graph[0], rtol=tol, atol=tol * 100)
    rebuilt = np.einsum("bij,bj,bkj->bik", np.float64(host[1]), np.float64(host[0]),
                        np.float64(host[1]))
    np.testing.assert_allclose(rebuilt, np.float64(a), rtol=0, atol=tol * 100)


def test_small_eigh_reads_the_lower_triangle_and_gives_nans_for_nans():
    a = np.array([[2.0, 99.0], [1.0, 2.0]])
    values, _ = small_eigh(jnp.asarray(a), method="host")
    np.testing.assert_allclose(values, [1.0, 3.0])
    values, vectors = small_eigh(jnp.asarray([[np.nan, 0.0], [0.0, 1.0]]), method="host")
    assert np.isnan(np.asarray(values)).all() and np.isnan(np.asarray(vectors)).all()


def test_small_eigh_auto_goes_to_the_host_on_a_tpu(plans_for_a_tpu):
    jaxpr = str(jax.make_jaxpr(small_eigh)(jnp.eye(4)))
    assert "pure_callback" in jaxpr and "eigh" not in jaxpr.replace("pure_callback", "")


def test_small_eigh_refuses_an_unknown_method():
    with pytest.raises(ValueError, match="'auto', 'graph' or 'host'"):
        small_eigh(jnp.eye(2), method="lapack")
