"""rbf_kde_density: (log-)densities and gradients against a float64 oracle, for every implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from scalegp.ops import rbf_kde_density
from tests.conftest import engine_impls, needs, rel_err
from tests.ops.oracle import cotangent, grads, kde_log_density_f64, value_and_grads

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)

SMALL_TILES = {"dense": {}, "xla": {"block_q": 32, "block_k": 48}, "pallas": {"block_q": 32, "block_k": 16}}
SMALL_TILES["triton"] = SMALL_TILES["pallas"]  # "pallas" on a CPU: triton, interpreted
SMALL_TILES["mosaic"] = {"block_q": 128, "block_k": 128}  # its tiles are lane multiples


def problem(seed, n=83, m=121, d=2, offset=0.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, d)) + offset
    x = rng.standard_normal((m, d)) + offset
    w = rng.uniform(0.1, 2.0, m)
    return [a.astype(dtype) for a in (q, x, w)]


@pytest.mark.parametrize("impl", engine_impls())
@pytest.mark.parametrize("bandwidths", [(0.3, 1.0, 3.0), (np.array([0.4, 1.7]),)],
                         ids=["scalar", "diagonal"])
def test_log_density_and_gradients_float32(impl, bandwidths):
    """Scalar bandwidths 0.3, 1 and 3 (one compiled function serves the three) and a diagonal
    one: log-density and density within 2e-5, gradients within 1e-4 of the float64 oracle."""
    q, x, w = problem(seed=1)
    f = value_and_grads(lambda q, x, h, w: rbf_kde_density(q, x, h, w, log=True, impl=impl,
                                                           **SMALL_TILES[impl]))
    cot = cotangent(q.shape[:1])  # the one `grads` takes for the oracle
    for bandwidth in bandwidths:
        h = np.asarray(bandwidth, np.float32)
        out, got = f(q, x, h, w, cot)
        want = kde_log_density_f64(q, x, h, w)
        assert rel_err(out, want) <= 2e-5, bandwidth
        assert rel_err(jnp.exp(out), jnp.exp(want)) <= 2e-5, bandwidth
        ref = grads(kde_log_density_f64, tuple(np.float64(a) for a in (q, x, h, w)))
        for name, g, r in zip(("dqueries", "ddata", "dbandwidth", "dweights"), got, ref):
            assert g.dtype == jnp.float32
            assert rel_err(g, r) <= 1e-4, (bandwidth, name)


@pytest.mark.parametrize("impl", engine_impls("triton"))
def test_density_gradients_float32(impl):
    q, x, w = problem(seed=2, d=3)

    def f(q, x, h, w):
        return rbf_kde_density(q, x, h, w, impl=impl, **SMALL_TILES[impl])

    def ref(q, x, h, w):
        return jnp.exp(kde_log_density_f64(q, x, h, w))

    h = np.float32(0.8)
    assert rel_err(f(q, x, h, w), ref(q, x, h, w)) <= 2e-5
    for g, r in zip(grads(f, (q, x, h, w)), grads(ref, tuple(np.float64(a) for a in (q, x, h, w)))):
        assert rel_err(g, r) <= 1e-4


@pytest.mark.parametrize("impl", engine_impls())
def test_far_queries_have_finite_accurate_log_density(impl):
    """Queries 50 bandwidths from all data: exp underflows, the stable log-sum-exp does not."""
    q, x, w = problem(seed=3, offset=0.0)
    h = np.float32(0.5)
    far = q + np.float32(50 * 0.5 + 10.0)
    out = rbf_kde_density(far, x, h, w, log=True, impl=impl, **SMALL_TILES[impl])
    want = kde_log_density_f64(far, x, h, w)
    assert np.all(np.isfinite(out)) and np.all(np.asarray(want) < -300)
    assert np.max(np.abs(np.asarray(out) - want) / np.abs(want)) <= 1e-4

    def f(q, x, h, w):
        return rbf_kde_density(q, x, h, w, log=True, impl=impl, **SMALL_TILES[impl])

    got = grads(f, (far, x, h, w))
    ref = grads(kde_log_density_f64, tuple(np.float64(a) for a in (far, x, h, w)))
    for name, g, r in zip(("dqueries", "ddata", "dbandwidth", "dweights"), got, ref):
        assert np.all(np.isfinite(g)) and rel_err(g, r) <= 1e-4, name


@pytest.mark.parametrize("impl", engine_impls())
def test_offset_data_and_float64(impl):
    q, x, w = problem(seed=4, offset=10.0)
    out = rbf_kde_density(q, x, 0.7, w, log=True, impl=impl, **SMALL_TILES[impl])
    assert rel_err(out, kde_log_density_f64(q, x, 0.7, w)) <= 1e-4
    needs(impl, "float64")
    q, x, w = problem(seed=5, offset=5.0, dtype=np.float64)

    def f(q, x, h, w):
        return rbf_kde_density(q, x, h, w, log=True, impl=impl, **SMALL_TILES[impl])

    h = np.array([0.6, 1.2])
    assert rel_err(f(q, x, h, w), kde_log_density_f64(q, x, h, w)) <= 1e-10
    for g, r in zip(grads(f, (q, x, h, w)), grads(kde_log_density_f64, (q, x, h, w))):
        assert rel_err(g, r) <= 1e-10


@pytest.mark.parametrize("impl", engine_impls())
def test_check_grads(impl):
    needs(impl, "float64")
    q, x, w = problem(seed=6, n=7, m=9, dtype=np.float64)

    def f(q, x, h, w):
        return rbf_kde_density(q, x, h, w, log=True, impl=impl, **SMALL_TILES[impl])

    check_grads(f, (q, x, np.array([0.7, 1.1]), w), order=1, modes=["rev"])


@pytest.mark.parametrize("impl", engine_impls())
def test_zero_weights_and_unweighted(impl):
    q, x, w = problem(seed=7)
    w[::3] = 0.0
    tiles = SMALL_TILES[impl]
    out = rbf_kde_density(q, x, 0.9, w, log=True, impl=impl, **tiles)
    keep = w > 0
    assert rel_err(out, kde_log_density_f64(q, x[keep], 0.9, w[keep])) <= 2e-5
    dw = jax.grad(lambda w: jnp.sum(rbf_kde_density(q, x, 0.9, w, log=True, impl=impl, **tiles)))(w)
    dw_ref = jax.grad(lambda w: jnp.sum(kde_log_density_f64(q, x, 0.9, w)))(np.float64(w))
    assert rel_err(dw, dw_ref) <= 1e-4
    unweighted = rbf_kde_density(q, x, 0.9, impl=impl, **tiles)
    assert rel_err(unweighted, jnp.exp(kde_log_density_f64(q, x, 0.9))) <= 2e-5


def test_batched_kde():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((3, 10, 2)).astype(np.float32)
    x = rng.standard_normal((3, 20, 2)).astype(np.float32)
    out = rbf_kde_density(q, x, 0.5, log=True, impl="xla", block_q=8, block_k=8)
    assert out.shape == (3, 10)
    assert rel_err(out, kde_log_density_f64(q, x, 0.5)) <= 2e-5


@pytest.mark.parametrize("impl", engine_impls())
def test_zero_weight_point_nearest_to_query_gives_finite_data_gradient(impl):
    """A zero-weight point far closer to a query than any weighted point must not turn the data
    gradient into 0 * inf = nan (its exact data gradient is zero)."""
    x = np.array([[0.0, 0.0], [30.0, 0.0], [31.0, 0.0]], np.float32)
    w = np.array([0.0, 1.0, 1.0], np.float32)
    q = np.array([[0.1, 0.0]], np.float32)
    tiles = SMALL_TILES[impl]
    dx = jax.grad(lambda x: jnp.sum(rbf_kde_density(q, x, 0.5, w, log=True, impl=impl, **tiles)))(x)
    assert np.all(np.isfinite(dx)) and np.all(dx[0] == 0)
    ref = jax.grad(lambda x: jnp.sum(kde_log_density_f64(q, x, 0.5, w)))(np.float64(x))
    assert rel_err(dx[1:], ref[1:]) <= 1e-4
