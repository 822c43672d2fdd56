"""The Mosaic RBF kernels in interpret mode against float64 (tests/ops/oracle.py): K v and the
KDE's log-sum-exp, forward and every gradient, by the coordinate differences and by the
expansion, on offset data, odd sizes and several lengthscales. The bounds are the accuracy
`scalegp.ops.backends.mosaic._blocks` states (compiled on a TPU v5e the same cases measured
alike: benchmarks/results/mosaic_check_tpu_v5e.json)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import RBF, Matern, kernel_mv, rbf_kde_density, rbf_kernel_mv
from scalegp.ops._tiling import BlockSizes
from scalegp.ops.backends.mosaic import _blocks, _rbf
from tests.conftest import rel_err
from tests.ops.oracle import grads, kde_log_density_f64, kernel_mv_f64

pytestmark = pytest.mark.x64
TILES = BlockSizes(block_q=128, block_k=128)


def _points(rng, n, d, offset=5.0):
    return (rng.standard_normal((n, d)) + offset).astype(np.float32)


@pytest.mark.parametrize("n, m, d, o, lengthscale", [
    (130, 200, 2, 3, 0.3),     # differences
    pytest.param(1, 150, 3, 1, 0.5, marks=pytest.mark.slow),  # one query
    (100, 257, 8, 16, 1.0),    # expansion
    (130, 200, 3, 256, 0.7),   # wide values: split row-major, three passes (`_blocks.wide`)
    pytest.param(100, 140, 8, 640, 1.2, marks=pytest.mark.slow),  # two forward chunks
    pytest.param(70, 140, 17, 5, 2.0, marks=pytest.mark.slow),
])
def test_kernel_mv_and_every_gradient_against_float64(n, m, d, o, lengthscale):
    rng = np.random.default_rng(n + m + d)
    x1, x2 = _points(rng, n, d), _points(rng, m, d)
    v = rng.standard_normal((m, o)).astype(np.float32)
    ls = np.float32(lengthscale)

    def mosaic(x1, x2, v, ls):
        return rbf_kernel_mv(x1, x2, v, ls, impl="mosaic", block_q=128, block_k=128)

    out = mosaic(*(jnp.asarray(t) for t in (x1, x2, v)), ls)
    assert out.dtype == jnp.float32
    # at most 1.25 · 2^-16 from the split products, where one term dominates a row (one query)
    assert rel_err(out, kernel_mv_f64(x1, x2, v, lengthscale)) < 2e-5
    got = grads(mosaic, [jnp.asarray(t) for t in (x1, x2, v, ls)])
    want = grads(kernel_mv_f64, [t.astype(np.float64) for t in (x1, x2, v, ls)])
    # the lengthscale's gradient from the second moments (`_rbf.scaled_kernel_mv`): 1.2e-6
    # to 4.2e-6 here; by the chain rule through both point sets it was up to 3e-5 by the
    # expansion (d > 4), where the point gradients cancel in it
    bounds = (2e-5, 2e-5, 2e-5, 1e-5)
    for name, g, w, bound in zip(("x1", "x2", "v", "lengthscale"), got, want, bounds):
        assert rel_err(g, w) < bound, name


@pytest.mark.parametrize("differences", [True, False])
def test_both_distances_agree_on_the_kernel_product(differences):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((40, 6)), rng.standard_normal((300, 6))
    v = rng.standard_normal((300, 2))
    out = _rbf.kernel_mv(*(jnp.asarray(t, jnp.float32) for t in (a, b, v)), TILES, True,
                         differences)
    assert rel_err(out, kernel_mv_f64(a, b, v, 1.0)) < 1e-5


def test_keys_spread_over_many_lengthscales_take_the_differences():
    """Between `DIFFERENCES_MAX_D` and 16 features the kernels switch at run time, as the
    other backends do (`_blocks.distances`)."""
    wide = jnp.asarray(np.random.default_rng(4).standard_normal((100, 8)) * 30, jnp.float32)
    assert bool(_blocks.distances(TILES, wide))
    assert not bool(_blocks.distances(TILES, wide / 30))
    assert _blocks.distances(TILES, wide[:, :2]) is True
    assert _blocks.distances(TILES, jnp.zeros((10, 17))) is False


@pytest.mark.parametrize("n, m, d, bandwidth, weighted", [
    (150, 300, 2, 0.3, True),
    pytest.param(60, 200, 8, 1.0, False, marks=pytest.mark.slow),
    pytest.param(90, 130, 3, 0.05, True, marks=pytest.mark.slow),
])
def test_kde_and_every_gradient_against_float64(n, m, d, bandwidth, weighted):
    rng = np.random.default_rng(n + d)
    q, x = _points(rng, n, d), _points(rng, m, d)
    w = rng.uniform(0, 1, m).astype(np.float32) if weighted else None
    if weighted:
        w[::7] = 0.0
    h = np.float32(bandwidth)

    def mosaic(q, x, h, w):
        return rbf_kde_density(q, x, h, w, log=True, impl="mosaic", block_q=128, block_k=128,
                               prune=False)

    def oracle(q, x, h, w):
        return kde_log_density_f64(q, x, h, w)

    w_in = np.ones(m, np.float32) if w is None else w
    out = mosaic(q, x, h, w_in)
    want = oracle(q, x, h, w_in)
    # 2e-5, and float32's own rounding of log-densities of -100 and below (xla's is as large)
    want = np.asarray(want)
    assert np.all(np.abs(np.asarray(out, np.float64) - want) < 2e-5 + 4e-7 * np.abs(want))
    got = grads(mosaic, [jnp.asarray(t) for t in (q, x, h, w_in)])
    ref = grads(oracle, [np.asarray(t, np.float64) for t in (q, x, h, w_in)])
    # the bandwidth's gradient from the rows' second moments (`_rbf.scaled_logsumexp`): up to
    # 1.2e-5 (d = 8, where it is a sum that cancels to -1.13; xla 4.6e-6); by the chain rule
    # through the points it was 5e-5 by the expansion (d > 4)
    # the weights' too, where float32 holds it: a key of weight 0 far nearer a row than the
    # weighted ones has a gradient past float32's range (8.7e139 in the narrow case)
    names = ("queries", "data", "bandwidth", "weights")
    if np.max(np.abs(np.asarray(ref[3]))) > np.finfo(np.float32).max:
        names = names[:3]
    for name, g, r in zip(names, got, ref):
        assert rel_err(g, r) < 2e-5, name


def test_kde_keys_spread_over_many_bandwidths_take_the_differences():
    """Keys at a mean squared norm of ~90 bandwidths (d = 8), past
    `_blocks.LSE_EXPANSION_MEAN_LIMIT`: the KDE takes the differences, whose log-densities err
    by 4.8e-6 here; the expansion's erred by 2.3e-5 (and by 4.7e-5 over 2,048 keys)."""
    rng = np.random.default_rng(1)
    q, x = _points(rng, 256, 8), _points(rng, 1024, 8)
    out = rbf_kde_density(q, x, np.float32(0.3), log=True, impl="mosaic", block_q=128,
                          block_k=128, prune=False)
    want = np.asarray(kde_log_density_f64(q, x, 0.3))
    assert np.max(np.abs(np.asarray(out, np.float64) - want)) < 1.2e-5


@pytest.mark.parametrize("d, nu, lengthscale, offset", [
    (2, 1.5, 0.3, 5.0),                                      # differences
    (8, 2.5, 0.7, 3.0),                                      # expansion
    pytest.param(8, 1.5, 2.0, 0.0, marks=pytest.mark.slow),
    pytest.param(3, 2.5, 1.0, 5.0, marks=pytest.mark.slow),
])
def test_matern_by_the_rbf_kernels_and_every_gradient_against_float64(d, nu, lengthscale,
                                                                       offset):
    """A lone Matérn 3/2 or 5/2 takes the RBF's kernels with its profile (`_rbf.profile`), its
    lengthscale's gradient from the second moments (`_rbf.scaled_kernel_mv`): 1e-5 where the
    chain rule through the points gave 1.2e-5 to 2.2e-5 at d = 8 (offset 3, l = 0.7)."""
    rng = np.random.default_rng(d + int(10 * nu))
    x1, x2 = _points(rng, 100, d, offset), _points(rng, 300, d, offset)
    v = rng.standard_normal((300, 4)).astype(np.float32)
    kernel = Matern(np.float32(lengthscale), nu)

    def mosaic(k, a, b, v):
        return kernel_mv(k, a, b, v, impl="mosaic", block_q=128, block_k=128, prune=False)

    def dense(k, a, b, v):
        return kernel_mv(k, a, b, v, impl="dense")

    with jax.default_device(jax.devices("cpu")[0]):  # float64 on the host: a TPU has none
        args64 = [Matern(np.float64(lengthscale), nu)] + [t.astype(np.float64)
                                                          for t in (x1, x2, v)]
        ref = dense(*args64)
        want = jax.tree_util.tree_leaves(grads(dense, args64))
    assert rel_err(mosaic(kernel, x1, x2, v), ref) < 1e-5
    got = jax.tree_util.tree_leaves(grads(mosaic, [kernel] + [jnp.asarray(t)
                                                              for t in (x1, x2, v)]))
    for name, g, w in zip(("lengthscale", "x1", "x2", "v"), got, want, strict=True):
        assert rel_err(g, w) < 1e-5, name


def test_a_row_is_the_same_in_any_batch():
    rng = np.random.default_rng(5)
    x1, x2 = _points(rng, 300, 3), _points(rng, 500, 3)
    v = rng.standard_normal((500, 4)).astype(np.float32)
    whole = rbf_kernel_mv(x1, x2, v, 0.7, impl="mosaic", block_q=128, block_k=128)
    alone = rbf_kernel_mv(x1[17:18], x2, v, 0.7, impl="mosaic", block_q=128, block_k=128)
    np.testing.assert_array_equal(np.asarray(whole[17:18]), np.asarray(alone))


def test_gradients_compile_under_jit():
    rng = np.random.default_rng(6)
    x = jnp.asarray(_points(rng, 64, 2))
    f = jax.jit(jax.grad(lambda x: jnp.sum(rbf_kde_density(x, x, 0.4, impl="mosaic",
                                                           prune=False))))
    assert np.all(np.isfinite(np.asarray(f(x))))


@pytest.mark.parametrize("d", [2, 8])
def test_row_chunks_change_no_value_or_gradient(monkeypatch, d):
    """Calls over more rows than `_blocks.ROW_CHUNK` run chunk by chunk (`over_row_chunks`),
    in both directions of the backward passes: the same values, bit for bit."""
    rng = np.random.default_rng(7)
    q, x = jnp.asarray(_points(rng, 300, d)), jnp.asarray(_points(rng, 290, d))
    v = jnp.asarray(rng.standard_normal((290, 3)), jnp.float32)

    def both(q, x, v):
        mv = rbf_kernel_mv(q, x, v, 0.8, impl="mosaic", block_q=128, block_k=128)
        kde = rbf_kde_density(q, x, 0.8, log=True, impl="mosaic", block_q=128, block_k=128,
                              prune=False)
        return mv, kde

    def run():
        out = jax.jit(both)(q, x, v)
        g = jax.jit(jax.grad(lambda *a: sum(jnp.sum(jnp.sin(t)) for t in both(*a)),
                             (0, 1, 2)))(q, x, v)
        return [np.asarray(t) for t in (*out, *g)]

    whole = run()
    monkeypatch.setattr(_blocks, "ROW_CHUNK", 128)
    jax.clear_caches()
    for got, want in zip(run(), whole):
        np.testing.assert_array_equal(got, want)


def test_column_chunks_change_no_value_and_add_the_gradients(monkeypatch):
    """Values wider than `_blocks.COLUMN_CHUNK` (the forward's `FORWARD_COLUMN_CHUNK`) run a
    chunk of columns at a time (`over_column_chunks`), forward and in both backward passes:
    the same product, and the gradients of points and lengthscale the chunks' sums, to
    rounding."""
    rng = np.random.default_rng(9)
    q, x = jnp.asarray(_points(rng, 150, 3)), jnp.asarray(_points(rng, 140, 3))
    v = jnp.asarray(rng.standard_normal((140, 19)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((150, 19)), jnp.float32)

    def run():
        f = jax.jit(lambda q, x, v, ls: rbf_kernel_mv(q, x, v, ls, impl="mosaic", block_q=128,
                                                      block_k=128))
        out = f(q, x, v, 0.8)
        g = jax.jit(jax.grad(lambda *a: jnp.sum(weights * f(*a)), (0, 1, 2, 3)))(q, x, v, 0.8)
        return [np.asarray(t) for t in (out, *g)]

    whole = run()
    monkeypatch.setattr(_blocks, "COLUMN_CHUNK", 8)
    monkeypatch.setattr(_blocks, "FORWARD_COLUMN_CHUNK", 16)
    jax.clear_caches()
    for name, got, want in zip(("out", "q", "x", "v", "lengthscale"), run(), whole,
                               strict=True):
        assert rel_err(got, want) < 1e-6, name


@pytest.mark.parametrize("nu, d", [(None, 2), (1.5, 2), (None, 8)])  # differences, expansion
def test_kernel_mv_backward_adds_its_chunks_of_keys(monkeypatch, nu, d):
    """The backward is one pass whose keys' sums stay in VMEM for a call's grid
    (`_rbf._backward`): with room for 128 or 256 keys' sums a call, 700 keys go through
    in several calls, each adding into the rows' sums, and every gradient (points, values, the
    lengthscale by the rows' second moments) is as in one call, to rounding, and as float64
    has it."""
    rng = np.random.default_rng(12)
    x1, x2 = _points(rng, 140, d), _points(rng, 700, d)
    v = rng.standard_normal((700, 5)).astype(np.float32)
    kernel = RBF(np.float32(0.6)) if nu is None else Matern(np.float32(0.6), nu)

    def mosaic(k, a, b, v):
        return kernel_mv(k, a, b, v, impl="mosaic", block_q=128, block_k=128, prune=False)

    def run():
        return [np.asarray(t) for t in jax.tree_util.tree_leaves(jax.jit(
            lambda *a: grads(mosaic, list(a)))(kernel, *(jnp.asarray(t) for t in (x1, x2, v))))]

    whole = run()
    # 256 keys at d = 2: the slab's 8 rows of db's sums and Kᵀ g's 16 split rows (128 at d = 8:
    # the expansion's split [a, 1]ᵀ W takes 32)
    monkeypatch.setattr(_rbf, "FUSED_KEY_SUMS_BYTES", 4 * (8 + 16) * 256)
    jax.clear_caches()
    chunked = run()
    with jax.default_device(jax.devices("cpu")[0]):
        kernel64 = jax.tree_util.tree_map(lambda t: np.float64(t), kernel)
        want = jax.tree_util.tree_leaves(grads(
            lambda *a: kernel_mv(*a, impl="dense"),
            [kernel64] + [t.astype(np.float64) for t in (x1, x2, v)]))
    for name, got, one, ref in zip(("lengthscale", "x1", "x2", "v"), chunked, whole, want,
                                   strict=True):
        assert rel_err(got, one) < 1e-6, name
        assert rel_err(got, ref) < 1e-5, name


def test_kde_keys_of_weight_zero_weigh_nothing_even_beside_a_far_query():
    """The forward kernel does not mask keys of weight 0: `_blocks.key_geometry` puts them out
    of reach. A key of weight 0 on top of each query, whose other keys lie 40 bandwidths off
    (exponents near -800), must leave the log-densities as float64 has them, and padding
    keys (300 keys in tiles of 128) likewise."""
    rng = np.random.default_rng(7)
    q = (rng.standard_normal((130, 2)) * 0.1).astype(np.float32)
    far = (rng.standard_normal((170, 2)) * 0.1 + 12.0).astype(np.float32)
    x = np.concatenate([q, far])
    w = np.concatenate([np.zeros(130), rng.uniform(0.5, 1.0, 170)]).astype(np.float32)
    out = rbf_kde_density(q, x, np.float32(0.3), w, log=True, impl="mosaic", block_q=128,
                          block_k=128, prune=False)
    want = np.asarray(kde_log_density_f64(q, x, 0.3, w))
    assert np.all(want < -700)
    assert np.all(np.abs(np.asarray(out, np.float64) - want) < 4e-7 * np.abs(want))
    # a row of keys all of weight 0 has no mass: M and L are -inf, not nan
    f_max, f_log_sum = _rbf.lse_forward(jnp.asarray(q), jnp.asarray(q), jnp.zeros(130),
                                        TILES, True, True)
    assert np.all(np.isneginf(np.asarray(f_max + f_log_sum)))


def test_kde_expansion_puts_keys_of_weight_zero_out_of_reach():
    """By the expansion (d = 8) too, keys of weight 0 on top of the queries, whose other keys
    lie about 17 bandwidths off (exponents near -140, past exp's float32 range from 0), and
    padding keys (300 in tiles of 128) do not set a row's maximum:
    `_blocks.OUT_OF_REACH_EXPONENT` in their norms."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((130, 8)) * 0.3
    keys = np.concatenate([q, rng.standard_normal((170, 8)) * 0.3 + 6.0])
    w = np.concatenate([np.zeros(130), rng.uniform(0.5, 1.0, 170)])
    f_max, f_log_sum = _rbf.lse_forward(*(jnp.asarray(t, jnp.float32) for t in (q, keys, w)),
                                        TILES, True, False)
    e = -0.5 * np.sum((q[:, None, :] - keys[None, :, :]) ** 2, axis=-1)
    top = e[:, 130:].max(axis=1)
    want = top + np.log(np.exp(e - top[:, None]) @ w)
    assert np.all(want < -110)
    got = np.asarray(f_max + f_log_sum, np.float64)
    assert np.all(np.abs(got - want) < 2e-5 + 4e-7 * np.abs(want))


def _kde(q, x, h, w):
    return rbf_kde_density(q, x, h, w, log=True, impl="mosaic", block_q=128, block_k=128,
                           prune=False)


def test_kde_backward_adds_its_chunks_of_keys(monkeypatch):
    """More keys than `_rbf.LSE_GRAD_KEY_CHUNK` go through the fused backward a chunk at a
    time (their sums stay in VMEM for a call's whole grid), each chunk adding into the rows'
    sums: every gradient as in one call, to rounding."""
    rng = np.random.default_rng(11)
    args = [jnp.asarray(_points(rng, 140, 2)), jnp.asarray(_points(rng, 700, 2)),
            jnp.float32(0.4), jnp.asarray(rng.uniform(0.2, 1.0, 700), jnp.float32)]

    def run():
        return [np.asarray(t) for t in jax.jit(lambda *a: grads(_kde, list(a)))(*args)]

    whole = run()
    monkeypatch.setattr(_rbf, "LSE_GRAD_KEY_CHUNK", 256)
    jax.clear_caches()
    for name, got, want in zip(("queries", "data", "bandwidth", "weights"), run(), whole,
                               strict=True):
        assert rel_err(got, want) < 1e-6, name


def test_kde_gradients_beside_keys_of_weight_zero_nearer_than_the_rest():
    """A key of weight 0 on each query, the weighted keys 40 bandwidths off: such a key's
    exponential relative to its row's mass overflows float32 (e^800), and the rows' weights
    ``P = w E`` must not take ``0 · inf`` (`_rbf._lse_grad_kernel`'s select): the gradients of
    the queries, the data and the bandwidth as float64 has them."""
    rng = np.random.default_rng(12)
    q = (rng.standard_normal((130, 2)) * 0.1).astype(np.float32)
    x = np.concatenate([q, (rng.standard_normal((170, 2)) * 0.1 + 12.0).astype(np.float32)])
    w = np.concatenate([np.zeros(130), rng.uniform(0.5, 1.0, 170)]).astype(np.float32)
    h = np.float32(0.3)
    got = grads(_kde, [jnp.asarray(t) for t in (q, x, h, w)])
    ref = grads(kde_log_density_f64, [np.asarray(t, np.float64) for t in (q, x, h, w)])
    for name, g, r in zip(("queries", "data", "bandwidth"), got, ref):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert rel_err(g, r) < 2e-5, name
