"""The RBF product's and the KDE's (xla and pallas) choice between the distance expansion and
the coordinate differences (`scalegp.ops._plan.rbf_expansion_ok`, by the keys' mean scaled
squared norm against `scalegp.ops._matmul.RBF_EXPANSION_MEAN_LIMIT`): which keys take which, and
float32 forward and gradients against float64 at lengthscales short against the points' spread,
where the expansion alone errs by ~u · mean |b|² (2.1e-4 for Gaussian points at d = 4, l = 0.03
of their spread: docs/decisions.md #4). Tolerances as in
tests/ops/test_kernel_expressions.py: 2e-5 forward, 1e-4 every gradient, norm-wise relative. Row
independence at a short lengthscale: tests/ops/test_row_independence.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from scalegp.ops import RBF, _plan, kernel_mv, rbf_kde_density, rbf_kernel_mv
from scalegp.ops._matmul import RBF_EXPANSION_MEAN_LIMIT
from tests.conftest import rel_err
from tests.ops.test_kernel_expressions import (
    FORWARD_TOL,
    GRAD_TOL,
    assert_near_float64,
    cast,
    value_and_grads,
)
from tests.ops.backends.xla.test_matern import clustered

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


def mean_sq(x, lengthscale):
    b = (np.float64(x) - np.float64(x).mean(axis=0)) / lengthscale
    return float(np.mean(np.sum(b * b, axis=1)))


@pytest.mark.parametrize("d, lengthscale, expected", [
    (8, 1.0, True),    # Gaussian keys at a lengthscale of their spread: mean |b|² = 8
    (16, 0.5, True),   # 64
    (2, 0.05, False),  # 800
    (4, 0.1, False),   # 400
])
def test_which_keys_take_the_expansion(d, lengthscale, expected):
    x = np.random.default_rng(d).standard_normal((2000, d)).astype(np.float32)
    assert (mean_sq(x, lengthscale) <= RBF_EXPANSION_MEAN_LIMIT) == expected
    ok = _plan.rbf_expansion_ok(jnp.asarray(x), jnp.float32(lengthscale), (), jnp.float32)
    assert bool(ok) == expected


@pytest.mark.parametrize("d", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_coincident_points_at_small_lengthscales(d):
    """K(x, x) v (every diagonal pair coincides) through the public RBF path, clustered points
    centred and offset (+1e3), ARD lengthscales 0.3-0.01 of the spread: the expansion at 0.3
    (mean |b|² under the limit), the differences below. Before the switch the float32 forward
    error at 0.03 was ~1e-4."""
    ard = np.linspace(1.0, 0.6, d)

    @value_and_grads
    def f(kernel, x1, x2, v):
        return kernel_mv(kernel, x1, x2, v, impl="xla", block_q=32, block_k=48, prune=False)

    for offset in (0.0, 1e3):
        for scale in (0.3, 0.03, 0.01):
            x, v, cot = clustered(41 + d, 96, d, scale, offset)
            kernel = cast(0.8 * RBF(scale * ard), jnp.float32)
            takes_expansion = mean_sq(x, scale * ard) <= RBF_EXPANSION_MEAN_LIMIT
            assert takes_expansion == (scale == 0.3), (offset, scale)
            out, grads = f(kernel, x, x, v, cot)
            assert_near_float64(kernel, x, x, v, cot, out, grads, (offset, scale))


def test_pallas_takes_the_same_choice():
    """The pallas path's K v (interpret mode here) takes the same choice, the differences from
    the Pallas expression kernels: clustered points offset by 1e3 at 0.3 (the expansion) and
    0.01 (the differences) of their spread, forward and gradients against float64."""

    @value_and_grads
    def f(kernel, x1, x2, v):
        return kernel_mv(kernel, x1, x2, v, impl="pallas", block_q=32, block_k=32, prune=False)

    for scale in (0.3, 0.01):
        x, v, cot = clustered(43, 64, 2, scale, 1e3)
        kernel = cast(0.8 * RBF(scale * np.array([1.0, 0.6])), jnp.float32)
        out, grads = f(kernel, x, x, v, cot)
        assert_near_float64(kernel, x, x, v, cot, out, grads, scale)


def test_a_batch_takes_one_branch():
    """Two key sets, one spread over many lengthscales: the batch takes the differences for
    both (the largest mean chooses), and each member equals its own call within the target."""
    rng = np.random.default_rng(5)
    keys = np.stack([rng.standard_normal((80, 2)), 30.0 * rng.standard_normal((80, 2))])
    keys = keys.astype(np.float32)
    v = rng.standard_normal((2, 80, 1)).astype(np.float32)
    assert not bool(_plan.rbf_expansion_ok(jnp.asarray(keys), jnp.float32(1.0), (2,),
                                               jnp.float32))
    out = rbf_kernel_mv(keys, keys, v, 1.0, impl="xla", prune=False)
    for i in range(2):
        want = rbf_kernel_mv(np.float64(keys[i]), np.float64(keys[i]), np.float64(v[i]), 1.0,
                             impl="dense")
        assert rel_err(out[i], want) <= FORWARD_TOL, i


def test_check_grads_float64_on_the_differences():
    """Keys spread over ~20 lengthscales, queries near some of them (so that gradients are not
    all 0)."""
    rng = np.random.default_rng(7)
    x2 = 20.0 * rng.standard_normal((11, 3))
    x1 = x2[:9] + 0.5 * rng.standard_normal((9, 3))
    v = rng.standard_normal((11, 2))
    lengthscale = np.array([0.7, 1.0, 1.4])
    assert not bool(_plan.rbf_expansion_ok(jnp.asarray(x2), jnp.asarray(lengthscale), (),
                                               jnp.float64))

    def f(x1, x2, v, lengthscale):
        return rbf_kernel_mv(x1, x2, v, lengthscale, impl="xla", block_q=8, block_k=8,
                             prune=False)

    check_grads(jax.jit(f), (x1, x2, v, lengthscale), order=1, modes=["rev"])


def offset_cube(seed, n, m, d):
    """Queries (n, d) and data (m, d) on a unit cube offset by 100, float32."""
    rng = np.random.default_rng(seed)
    data = (rng.random((m, d)) + 100.0).astype(np.float32)
    return (rng.random((n, d)) + 100.0).astype(np.float32), data


def assert_kde_near_float64(log_density, queries, data, bandwidth):
    """``log_density(q, x)`` (float32) against the dense float64 log-density of the same float32
    inputs: densities within 1e-5 relative, row by row; query and data gradients within
    `GRAD_TOL` norm-wise."""
    assert not bool(_plan.rbf_expansion_ok(jnp.asarray(data), jnp.float32(bandwidth), (),
                                               jnp.float32))

    def reference(q, x):
        return rbf_kde_density(q, x, bandwidth, log=True, impl="dense", prune=False)

    out = np.asarray(log_density(queries, data))
    want = np.asarray(reference(np.float64(queries), np.float64(data)))
    assert np.max(np.abs(np.expm1(out - want))) <= 1e-5
    grads = jax.grad(lambda q, x: jnp.sum(log_density(q, x)), argnums=(0, 1))(queries, data)
    want_grads = jax.grad(lambda q, x: jnp.sum(reference(q, x)), argnums=(0, 1))(
        np.float64(queries), np.float64(data))
    for got, ref in zip(grads, want_grads):
        assert rel_err(got, ref) <= GRAD_TOL


@pytest.mark.parametrize("impl, d, bandwidth", [
    pytest.param("xla", 2, 0.01, marks=pytest.mark.slow), ("xla", 3, 0.03), ("pallas", 2, 0.01)])
def test_kde_at_small_bandwidths(impl, d, bandwidth):
    """The KDE's log-density takes the same choice (`rbf_expansion_ok` on the data), on xla and
    on pallas (interpret mode here; `_pallas.kernel_logsumexp_differences`): data on a unit cube
    offset by 100 (mean |b|² = 1,667 and 333), float32 against float64 on the same float32
    inputs. Before, the expansion's densities erred by up to 3.3e-4 and 7e-5 relative here (on
    pallas 2.7e-4 with the branch disabled); the differences by 1e-6 (a /tmp check)."""
    m, n = (1200, 300) if impl == "xla" else (400, 100)  # interpret mode is slow
    queries, data = offset_cube(d, n, m, d)

    def log_density(q, x):
        return rbf_kde_density(q, x, bandwidth, log=True, impl=impl, prune=False)

    assert_kde_near_float64(log_density, queries, data, bandwidth)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_the_bandwidth_gradient_over_hundreds_of_bandwidths(impl):
    """``∂/∂ log h`` of the mean log-density, data spread over ~600 bandwidths, against float64.
    The chain rule through the prepared points, ``-Σ_i da_i a_i - Σ_j db_j b_j``, multiplies
    any absolute error of da and db by ``|a|``: the backward passes take their sums from the
    coordinate differences on this branch (`xla_rbf.difference_sums`). Before, they took
    ``Σ_j P_ij b_j - a_i Σ_j P_ij``, and the gradient erred by 3e-3 relative here (now 3e-5),
    by 2% (xla) and 10% (pallas) at 10⁶ keys."""
    rng = np.random.default_rng(11)
    data = rng.standard_normal((2000, 2)).astype(np.float32)
    queries = (data[:64] + 0.01 * rng.standard_normal((64, 2))).astype(np.float32)
    bandwidth = 0.01

    def mean_log_density(log_h, q, x):
        return jnp.mean(rbf_kde_density(q, x, jnp.exp(log_h), log=True, impl=impl, prune=False))

    got = jax.grad(mean_log_density)(jnp.float32(np.log(bandwidth)), queries, data)
    with jax.enable_x64(True):
        want = jax.grad(lambda t: jnp.mean(rbf_kde_density(
            np.float64(queries), np.float64(data), jnp.exp(t), log=True, impl="dense",
            prune=False)))(np.log(bandwidth))
    assert abs(float(got) - float(want)) <= 1e-4 * abs(float(want))
