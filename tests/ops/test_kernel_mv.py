"""rbf_kernel_mv: every implementation against a float64 oracle, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from scalegp.ops import rbf_kernel_mv
from tests.conftest import engine_impls, needs, rel_err
from tests.ops.oracle import cotangent, grads, kernel_mv_f64, value_and_grads

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)

# Small tiles so that several blocks, padding and masking are exercised on small shapes.
SMALL_TILES = {"dense": {}, "xla": {"block_q": 32, "block_k": 48}, "pallas": {"block_q": 32, "block_k": 16, "block_o": 16}}
SMALL_TILES["triton"] = SMALL_TILES["pallas"]  # "pallas" on a CPU: triton, interpreted
SMALL_TILES["mosaic"] = {"block_q": 128, "block_k": 128}  # its tiles are lane multiples


def problem(seed, n=97, m=131, d=3, o=5, offset=0.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x1 = rng.standard_normal((n, d)) + offset
    x2 = rng.standard_normal((m, d)) + offset
    v = rng.standard_normal((m, o))
    return [a.astype(dtype) for a in (x1, x2, v)]


@pytest.mark.parametrize("impl", engine_impls())
@pytest.mark.parametrize("lengthscales", [(0.3, 1.0, 3.0), (np.array([0.5, 1.0, 2.0]),)],
                         ids=["scalar", "ard"])
def test_forward_and_gradients_float32(impl, lengthscales):
    """Scalar lengthscales 0.3, 1 and 3 (one compiled function serves the three) and an ARD
    one: forward within 2e-5 and every gradient within 1e-4 of the float64 oracle."""
    x1, x2, v = problem(seed=1)
    f = value_and_grads(lambda x1, x2, v, ls: rbf_kernel_mv(x1, x2, v, ls, impl=impl,
                                                            **SMALL_TILES[impl]))
    cot = cotangent((x1.shape[0], v.shape[1]))  # the one `grads` takes for the oracle
    for lengthscale in lengthscales:
        ls = np.asarray(lengthscale, np.float32)
        out, got = f(x1, x2, v, ls, cot)
        assert out.dtype == jnp.float32
        assert rel_err(out, kernel_mv_f64(x1, x2, v, ls)) <= 2e-5, lengthscale
        want = grads(kernel_mv_f64, tuple(np.float64(a) for a in (x1, x2, v, ls)))
        for name, g, w in zip(("dx1", "dx2", "dv", "dlengthscale"), got, want):
            assert g.shape == w.shape and g.dtype == jnp.float32
            assert rel_err(g, w) <= 1e-4, (lengthscale, name)


@pytest.mark.parametrize("impl", engine_impls())
def test_offset_data_float32(impl):
    x1, x2, v = problem(seed=2, offset=10.0)
    out = rbf_kernel_mv(x1, x2, v, 1.0, impl=impl, **SMALL_TILES[impl])
    assert rel_err(out, kernel_mv_f64(x1, x2, v, 1.0)) <= 1e-4


@pytest.mark.parametrize("impl", engine_impls())
def test_float64(impl):
    needs(impl, "float64")
    x1, x2, v = problem(seed=3, offset=3.0, dtype=np.float64)
    ls = np.array([0.7, 1.3, 2.0])

    def f(x1, x2, v, ls):
        return rbf_kernel_mv(x1, x2, v, ls, impl=impl, **SMALL_TILES[impl])

    assert f(x1, x2, v, ls).dtype == jnp.float64
    assert rel_err(f(x1, x2, v, ls), kernel_mv_f64(x1, x2, v, ls)) <= 1e-10
    for g, w in zip(grads(f, (x1, x2, v, ls)), grads(kernel_mv_f64, (x1, x2, v, ls))):
        assert rel_err(g, w) <= 1e-10


@pytest.mark.parametrize("impl", engine_impls("triton"))
def test_check_grads(impl):
    needs(impl, "float64")
    x1, x2, v = problem(seed=4, n=9, m=11, d=2, o=2, dtype=np.float64)

    def f(x1, x2, v, ls):
        return rbf_kernel_mv(x1, x2, v, ls, impl=impl, **SMALL_TILES[impl])

    check_grads(f, (x1, x2, v, np.array([0.8, 1.5])), order=1, modes=["rev"])
    check_grads(f, (x1, x2, v, 1.1), order=1, modes=["rev"])


@pytest.mark.parametrize(
    "n,m,d,o",
    [(1, 7, 1, 1), (16, 16, 8, 16), *(pytest.param(*shape, marks=pytest.mark.slow) for shape in
                                      ((7, 1, 33, 3), (1025, 40, 2, 3), (40, 1025, 33, 1)))],
)
def test_pallas_odd_shapes(n, m, d, o):
    """Sizes that are not multiples of the tile, d = 1 and 33, o = 1 and 3."""
    x1, x2, v = problem(seed=5, n=n, m=m, d=d, o=o)
    ls = np.float32(np.sqrt(d))

    def f(x1, x2, v, ls):
        return rbf_kernel_mv(x1, x2, v, ls, impl="pallas", block_q=64, block_k=32)

    assert rel_err(f(x1, x2, v, ls), kernel_mv_f64(x1, x2, v, ls)) <= 2e-5
    got = grads(f, (x1, x2, v, ls))
    want = grads(kernel_mv_f64, tuple(np.float64(a) for a in (x1, x2, v, ls)))
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-4


@pytest.mark.parametrize("impl", engine_impls() + ["auto"])
def test_batch_dimensions_broadcast(impl):
    rng = np.random.default_rng(6)
    x1 = rng.standard_normal((2, 1, 13, 3)).astype(np.float32)
    x2 = rng.standard_normal((3, 17, 3)).astype(np.float32)
    v = rng.standard_normal((17, 2)).astype(np.float32)
    tiles = SMALL_TILES.get(impl, {})
    out = rbf_kernel_mv(x1, x2, v[None], 0.9, impl=impl, **tiles)
    assert out.shape == (2, 3, 13, 2)
    want = kernel_mv_f64(np.broadcast_to(x1, (2, 3, 13, 3)), x2, v, 0.9)
    assert rel_err(out, want) <= 2e-5
    # gradients through the batch
    g = jax.grad(lambda x: jnp.sum(rbf_kernel_mv(x, x2, v[None], 0.9, impl=impl, **tiles) ** 2))(x1)
    gw = jax.grad(lambda x: jnp.sum(kernel_mv_f64(jnp.broadcast_to(x, (2, 3, 13, 3)), x2, v, 0.9) ** 2))(
        np.float64(x1)
    )
    assert rel_err(g, gw) <= 1e-4


@pytest.mark.parametrize("impl", engine_impls())
def test_vector_v_equals_single_column(impl):
    x1, x2, v = problem(seed=7, o=1)
    tiles = SMALL_TILES[impl]
    vec = rbf_kernel_mv(x1, x2, v[:, 0], 1.0, impl=impl, **tiles)
    mat = rbf_kernel_mv(x1, x2, v, 1.0, impl=impl, **tiles)
    assert vec.shape == (x1.shape[0],) and mat.shape == (x1.shape[0], 1)
    np.testing.assert_allclose(vec, mat[:, 0], rtol=1e-6, atol=1e-6)
    gv = jax.grad(lambda v: jnp.sum(rbf_kernel_mv(x1, x2, v, 1.0, impl=impl, **tiles) ** 2))(v[:, 0])
    assert gv.shape == (x2.shape[0],)


def test_auto_matches_oracle_above_dense_threshold():
    x1, x2, v = problem(seed=8, n=1100, m=1000, d=4, o=2)
    assert rel_err(rbf_kernel_mv(x1, x2, v, 1.5), kernel_mv_f64(x1, x2, v, 1.5)) <= 2e-5


def test_works_under_jit_with_traced_lengthscale():
    x1, x2, v = problem(seed=9)
    f = jax.jit(lambda ls: rbf_kernel_mv(x1, x2, v, ls, impl="xla"))
    assert rel_err(f(jnp.float32(0.8)), kernel_mv_f64(x1, x2, v, 0.8)) <= 2e-5


def test_empty_inputs():
    x1, x2, v = problem(seed=10, n=4, m=5)
    assert rbf_kernel_mv(x1[:0], x2, v, 1.0).shape == (0, v.shape[1])
    np.testing.assert_array_equal(rbf_kernel_mv(x1, x2[:0], v[:0], 1.0), np.zeros((4, v.shape[1])))


@pytest.mark.parametrize("kernel", ["rbf", "matern32", pytest.param("rq", marks=pytest.mark.slow)])
def test_sum_over_many_key_tiles_is_compensated(kernel):
    """With every kernel value near 1 and v > 0 each row sums thousands of like terms: plain
    float32 accumulation over 512 key tiles drifts by several ulps of the result (at GP scale,
    more than the noise variance); the compensated sum stays within about one ulp."""
    from scalegp.ops import RBF, Matern, RationalQuadratic, kernel_matrix, kernel_mv

    rng = np.random.default_rng(12)
    x1 = rng.uniform(size=(16, 2)).astype(np.float32)
    x2 = rng.uniform(size=(4096, 2)).astype(np.float32)
    v = (1.0 + 0.1 * rng.random((4096, 1))).astype(np.float32)
    k = {"rbf": RBF(30.0), "matern32": Matern(30.0, 1.5),
         "rq": RationalQuadratic(30.0, 1.0)}[kernel]
    out = kernel_mv(k, x1, x2, v, impl="xla", block_k=8, prune=False)
    want = np.asarray(kernel_matrix(k, np.float64(x1), np.float64(x2))) @ np.float64(v)
    ulp = np.spacing(np.float32(np.abs(want).max()))
    assert np.abs(np.asarray(out, np.float64) - want).max() <= 1.5 * ulp


@pytest.mark.parametrize("lengthscale", [1e-5, 1e-3, 1e-2, 0.3])
def test_dense_kernel_matrix_is_accurate_at_short_lengthscales(lengthscale):
    """`rbf_kernel_matrix` in float32 against float64, norm-wise, on offset points at
    lengthscales far below their spread: its squares are of coordinate differences (the
    expansion put K's diagonal at 0.6 at 1e-3 and at 0 at 1e-5)."""
    from scalegp.ops import rbf_kernel_matrix

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((300, 3)) + 50.0).astype(np.float32)
    x64 = x.astype(np.float64)
    sq = np.sum((x64[:, None, :] - x64[None, :, :]) ** 2, axis=-1) / lengthscale**2
    want = np.exp(-0.5 * sq)
    got = np.asarray(jax.jit(rbf_kernel_matrix)(x, x, np.float32(lengthscale)))
    np.testing.assert_array_equal(np.diag(got), 1.0)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
