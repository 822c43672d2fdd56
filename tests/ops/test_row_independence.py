"""Row independence in the default configuration (float32, x64 off): with the keys fixed, a query
row's result is bitwise the same alone, in any order, in any batch size, or beside a far row; far
rows get their limits (0 in a product, the float64 log-density in a KDE) and never NaN."""

import jax
import numpy as np
import pytest

from scalegp.ops import (
    RBF,
    Matern,
    RationalQuadratic,
    _plan,
    kernel_mv,
    rbf_kde_density,
    rbf_kernel_mv,
)
from tests.ops.test_kernel_expressions import xla_matern_expansion_ok

M, D = 1500, 3
OFFSET = 50.0  # uncentred data: the centre matters


def _keys(seed=0):
    rng = np.random.default_rng(seed)
    keys = (rng.normal(size=(M, D)) + OFFSET).astype(np.float32)
    values = rng.normal(size=(M, 2)).astype(np.float32)
    queries = (1.5 * rng.normal(size=(1100, D)) + OFFSET).astype(np.float32)
    return keys, values, queries


ENTRY_POINTS = {
    "kernel_mv": lambda q, keys, values: rbf_kernel_mv(q, keys, values, 0.7),
    "kernel_mv_ard": lambda q, keys, values: rbf_kernel_mv(q, keys, values, np.array([0.5, 1, 2])),
    "kde_log": lambda q, keys, values: rbf_kde_density(q, keys, 0.4, log=True),
    "kde_weighted": lambda q, keys, values: rbf_kde_density(
        q, keys, 0.4, np.abs(values[:, 0]), log=True),
    "kde_density": lambda q, keys, values: rbf_kde_density(q, keys, np.array([0.3, 0.5, 1])),
    # inside one jit XLA fuses and rewrites across the whole computation (a lone row once
    # rounded apart: see dispatch._prepare)
    "kde_jit_ard": jax.jit(lambda q, keys, values: rbf_kde_density(
        q, keys, np.array([0.3, 0.5, 1], np.float32), abs(values[:, 1]), log=True)),
    "kernel_mv_jit_ard": jax.jit(lambda q, keys, values: rbf_kernel_mv(
        q, keys, values, np.array([0.5, 1, 2], np.float32))),
    # keys spread over many lengthscales: the coordinate differences (scalegp.ops._plan.
    # rbf_expansion_ok), chosen from the keys alone
    "kernel_mv_short": lambda q, keys, values: rbf_kernel_mv(q, keys, values, 0.1),
    "kernel_mv_jit_ard_short": jax.jit(lambda q, keys, values: rbf_kernel_mv(
        q, keys, values, np.array([0.05, 0.1, 0.2], np.float32))),
    # c · Matern(ν = 3/2, 5/2) on xla: the coordinate differences at these lengthscales (the
    # keys spread over many: scalegp.ops._matmul.MATERN_EXPANSION_MEAN_LIMIT)...
    "matern15_ard": lambda q, keys, values: kernel_mv(
        Matern(np.array([0.05, 0.1, 0.2], np.float32), nu=1.5), q, keys, values),
    "matern25_vector_jit": jax.jit(lambda q, keys, values: 0.7 * kernel_mv(
        Matern(np.float32(0.06), nu=2.5), q, keys, values[:, 0])),
    # ... and the hand-written path (scalegp.ops.backends.xla._matern.matern_mv) at these, whose choice
    # depends on the keys alone: a matrix of values, and one column (its row sums fused into
    # the tile's loop)
    "matern15_ard_expansion": lambda q, keys, values: kernel_mv(
        Matern(np.array([3, 4, 5], np.float32), nu=1.5), q, keys, values),
    "matern25_vector_jit_expansion": jax.jit(lambda q, keys, values: 0.7 * kernel_mv(
        Matern(np.float32(2.5), nu=2.5), q, keys, values[:, 0])),
}


# In CI, one entry per path (the RBF's expansion under jit with ARD and its differences, the
# KDE's log-density, the Matérn's differences); the rest under -m slow (each entry compiles a
# dozen batch sizes).
CI_ENTRIES = {"kernel_mv_jit_ard", "matern15_ard"}


@pytest.mark.parametrize("entry", [
    name if name in CI_ENTRIES else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(ENTRY_POINTS)])
def test_each_row_is_bitwise_the_same_in_any_batch(entry):
    f = ENTRY_POINTS[entry]
    keys, values, queries = _keys()
    if entry.startswith("matern"):  # the path the comment above names
        lengthscale = {"matern15_ard": [0.05, 0.1, 0.2], "matern25_vector_jit": 0.06,
                       "matern15_ard_expansion": [3, 4, 5],
                       "matern25_vector_jit_expansion": 2.5}[entry]
        nu = 2.5 if "25" in entry else 1.5
        takes = bool(xla_matern_expansion_ok(keys, np.asarray(lengthscale, np.float32), nu,
                                             np.float32))
        assert takes == entry.endswith("_expansion"), entry
    if entry.startswith("kernel_mv"):
        lengthscale = {"kernel_mv": 0.7, "kernel_mv_ard": [0.5, 1, 2],
                       "kernel_mv_jit_ard": [0.5, 1, 2], "kernel_mv_short": 0.1,
                       "kernel_mv_jit_ard_short": [0.05, 0.1, 0.2]}[entry]
        takes = bool(_plan.rbf_expansion_ok(
            keys, np.asarray(lengthscale, np.float32), (), np.float32))
        assert takes == (not entry.endswith("_short")), entry
    full = np.asarray(f(queries, keys, values))
    _assert_rows_independent(f, queries, keys, values, full, (1, 2, 7, 511, 1023, 1024, 1025, 1100),
                             seed=1)
    far = np.vstack([queries[:5], np.full((1, D), 1e30, np.float32), queries[5:9]])
    out = np.asarray(f(far, keys, values))
    np.testing.assert_array_equal(out[:5], full[:5])
    np.testing.assert_array_equal(out[6:], full[5:9])


def test_far_rows_get_their_limits_not_nan():
    keys, values, queries = _keys()
    big = np.float32(3e38)
    far = np.array([[1e6] * D, [1e30] * D, [big, 0, 0], [-big, big, big]], np.float32)
    out = np.asarray(rbf_kernel_mv(far, keys, values, 0.7))
    np.testing.assert_array_equal(out, 0.0)
    log_p = np.asarray(rbf_kde_density(far, keys, 0.4, log=True))
    assert not np.any(np.isnan(log_p))
    assert np.all(np.isneginf(log_p[1:]))  # below float32's range: -inf is the rounded value
    # a row at 1e6 has a finite log-density, correct to float32 rounding
    sq = np.sum((far[:1].astype(np.float64) - keys.astype(np.float64)) ** 2, axis=1) / 0.4**2
    top = -0.5 * sq
    expected = (top.max() + np.log(np.mean(np.exp(top - top.max())))
                - D * np.log(0.4) - 0.5 * D * np.log(2 * np.pi))
    np.testing.assert_allclose(log_p[0], expected, rtol=1e-6)


OUTLIER_PRODUCTS = {
    "rbf": lambda q, keys, values, impl: rbf_kernel_mv(q, keys, values, 0.7, impl=impl),
    "rbf_short": lambda q, keys, values, impl: rbf_kernel_mv(q, keys, values, 0.1, impl=impl),
    "matern": lambda q, keys, values, impl: kernel_mv(
        Matern(np.float32(0.7), nu=1.5), q, keys, values, impl=impl),
    "kde": lambda q, keys, values, impl: rbf_kde_density(q, keys, 0.4, log=True, impl=impl),
}


# CI: every product on xla at a finite and an infinite outlier, the RBF and the KDE on pallas at
# one; the rest under -m slow
OUTLIER_CASES = [
    pytest.param(product, impl, outlier, marks=() if (
        impl == "xla" and outlier != 3e38 or product in ("rbf", "kde") and outlier == 1e15)
        else pytest.mark.slow)
    for product in OUTLIER_PRODUCTS for impl in ("xla", "pallas")
    for outlier in (1e15, 3e38, np.inf)]


@pytest.mark.parametrize("product, impl, outlier", OUTLIER_CASES)
def test_one_outlier_key_leaves_the_others_their_digits(product, impl, outlier):
    """One key far from the rest (finite or not) adds nothing (a factor m / (m + 1) to a KDE's
    density) and costs the other keys no digits. The centre was the keys' mean, which followed
    the outlier: at 1e15 every other point lost its digits (in a /tmp check, K v off by 35 and
    log-densities by 1.9), at 3e38 or inf every row came out as far (0, -inf)."""
    m = 300 if impl == "xla" else 120  # interpret mode is slow
    keys, values, queries = (a[:m] if a.shape[0] == M else a for a in _keys())
    queries = queries[:40]
    with_outlier = np.vstack([keys[:7], np.full((1, D), outlier, np.float32), keys[7:]])
    outlier_values = np.vstack([values[:7], np.ones((1, 2), np.float32), values[7:]])
    run = OUTLIER_PRODUCTS[product]
    out = np.asarray(run(queries, with_outlier, outlier_values, impl), np.float64)
    want = np.asarray(run(queries, keys, values, impl), np.float64)
    if product == "kde":
        np.testing.assert_allclose(out, want + np.log(m / (m + 1)), rtol=0, atol=1e-5)
    else:
        assert np.linalg.norm(out - want) <= 1e-5 * np.linalg.norm(want)


def _clustered(rng, n, clusters=12, spread=0.03):
    centres = rng.uniform(size=(clusters, 2))
    return (centres[rng.integers(clusters, size=n)]
            + spread * rng.standard_normal((n, 2))).astype(np.float32)


# Pruned products: which key tiles a query tile visits depends on its box, and the query tiles
# on every row of the call (their k-d order); a row's result must not. 2-D clustered data at
# short lengthscales, where pruning skips most tiles.
PRUNED = {
    "kde": lambda q, x, v, **kw: rbf_kde_density(q, x, 0.03, log=True, prune=True, **kw),
    "kde_weighted_tol0": lambda q, x, v, **kw: rbf_kde_density(
        q, x, 0.03, np.abs(v[:, 0]) + 0.1, log=True, prune=True, prune_tol=0, **kw),
    "kde_tol": lambda q, x, v, **kw: rbf_kde_density(q, x, 0.03, log=True, prune=True,
                                                     prune_tol=1e-3, **kw),
    "kernel_mv": lambda q, x, v, **kw: rbf_kernel_mv(q, x, v, 0.03, prune=True, **kw),
    "kernel_mv_tol": lambda q, x, v, **kw: rbf_kernel_mv(q, x, v, np.float32([0.02, 0.04]),
                                                         prune=True, prune_tol=1e-3, **kw),
    "matern": lambda q, x, v, **kw: kernel_mv(
        2.0 * Matern(np.float32(0.02), nu=1.5), q, x, v, prune=True, **kw),
    "expression": lambda q, x, v, **kw: kernel_mv(
        Matern(np.float32(0.03), nu=2.5) * Matern(np.float32(0.05), nu=0.5)
        + 0.5 * Matern(np.float32(0.02), nu=1.5), q, x, v, prune=True, **kw),
}
# Pallas (interpret mode) on the RBF and the KDE, small tiles; "expression" has no Pallas core
PRUNED_CASES = [(name, "xla") for name in PRUNED] + [
    pytest.param(name, "pallas", marks=() if name in ("kde_tol", "kernel_mv") else pytest.mark.slow)
    for name in ("kde", "kde_weighted_tol0", "kde_tol", "kernel_mv", "kernel_mv_tol")]


@pytest.mark.parametrize("entry, impl", PRUNED_CASES)
def test_pruned_rows_are_bitwise_the_same_in_any_batch(entry, impl):
    """A far row (its tile's box spans the plane) or other rows in the call change how the
    queries are tiled; with 1,500 clustered keys, a row's result stayed the same only to within
    the skip bound (4.8e-7 in a log-density at 20,000 keys)."""
    rng = np.random.default_rng(3)
    m, n = (1500, 300) if impl == "xla" else (200, 48)
    keys, queries = _clustered(rng, m), _clustered(rng, n, spread=0.05)
    values = rng.standard_normal((m, 2)).astype(np.float32)
    kw = {"impl": impl} if impl == "xla" else {"impl": impl, "block_q": 16, "block_k": 16}
    f = PRUNED[entry]
    full = np.asarray(f(queries, keys, values, **kw))
    with_far = np.vstack([queries[:5], [[1e6, 1e6]], queries[5:]]).astype(np.float32)
    out = np.asarray(f(with_far, keys, values, **kw))
    np.testing.assert_array_equal(np.delete(out, 5, axis=0), full, err_msg="beside a far row")
    idx = rng.permutation(n)[: n // 3]
    np.testing.assert_array_equal(np.asarray(f(queries[idx], keys, values, **kw)), full[idx],
                                  err_msg="a third of the rows, shuffled")
    more = np.vstack([queries, _clustered(rng, n // 2, spread=0.2)])
    np.testing.assert_array_equal(np.asarray(f(more, keys, values, **kw))[:n], full,
                                  err_msg="with more rows")
    for i in (0, n - 1):
        np.testing.assert_array_equal(np.asarray(f(queries[i : i + 1], keys, values, **kw)),
                                      full[i : i + 1], err_msg=f"row {i} alone")


# One column of values and the KDE take short query tiles for small batches
# (scalegp.ops.backends.xla._blocks.shortened): a row's result must be that of a full tile.
ONE_COLUMN = {
    "kernel_mv_vector": lambda q, keys, values: rbf_kernel_mv(q, keys, values[:, 0], 0.7),
    "kernel_mv_column_ard": lambda q, keys, values: rbf_kernel_mv(
        q, keys, values[:, 1:], np.array([0.5, 1, 2], np.float32)),
    "kernel_mv_vector_short": lambda q, keys, values: rbf_kernel_mv(q, keys, values[:, 0], 0.1),
    "kde_log": lambda q, keys, values: rbf_kde_density(q, keys, 0.4, log=True),
    "kde_density_weighted": lambda q, keys, values: rbf_kde_density(
        q, keys, np.array([0.3, 0.5, 1], np.float32), np.abs(values[:, 0])),
    "matern_vector_expansion": lambda q, keys, values: kernel_mv(
        Matern(np.float32(2.5), nu=2.5), q, keys, values[:, 0]),
    "matern_vector_differences": lambda q, keys, values: kernel_mv(
        Matern(np.array([0.05, 0.1, 0.2], np.float32), nu=1.5), q, keys, values[:, 0]),
    "expression_vector": lambda q, keys, values: kernel_mv(
        Matern(np.float32(0.5), nu=0.5) * RBF(np.float32(1.0)) + RBF(np.float32(0.3)), q, keys,
        values[:, 0]),
    "kernel_mv_vector_jit": jax.jit(lambda q, keys, values: rbf_kernel_mv(
        q, keys, values[:, 0], np.array([0.5, 1, 2], np.float32))),
}
ONE_COLUMN_CI = {"kernel_mv_vector", "kde_log", "expression_vector"}


@pytest.mark.parametrize("entry", [
    name if name in ONE_COLUMN_CI else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(ONE_COLUMN)])
def test_short_tiles_give_each_row_its_full_tile_result(entry):
    assert _plan.plan("xla", M, D, np.float32, queries=7, columns=1).blocks.block_q == 8
    assert _plan.plan("xla", M, D, np.float32, queries=7, columns=2).blocks.block_q == 1024
    f = ONE_COLUMN[entry]
    keys, values, queries = _keys()
    full = np.asarray(f(queries, keys, values))  # 1,100 rows: full tiles
    _assert_rows_independent(f, queries, keys, values, full, (1, 7, 8, 64, 65, 1023, 1024, 1025),
                             seed=2)


@pytest.mark.parametrize("entry", ["kernel_mv_vector", "kde_log"])
def test_rows_at_four_features(entry):
    """At d = 4 the squared norms once came from a reduction that XLA vectorised by rows, and a
    row's result depended on the batch (`scalegp.ops.backends.xla._rbf.half_sq_norms`)."""
    rng = np.random.default_rng(5)
    keys = (rng.normal(size=(M, 4)) + OFFSET).astype(np.float32)
    values = rng.normal(size=(M, 2)).astype(np.float32)
    queries = (1.5 * rng.normal(size=(1100, 4)) + OFFSET).astype(np.float32)
    f = {"kernel_mv_vector": lambda q: rbf_kernel_mv(q, keys, values[:, 0], 0.7),
         "kde_log": lambda q: rbf_kde_density(q, keys, 0.4, log=True)}[entry]
    full = np.asarray(f(queries))
    for size in (1, 7, 1023):
        idx = rng.permutation(queries.shape[0])[:size]
        np.testing.assert_array_equal(np.asarray(f(queries[idx])), full[idx],
                                      err_msg=f"batch of {size}")


@pytest.mark.parametrize("m", [64, 300])
def test_rows_against_a_few_keys(m):
    """Against one key tile of under 512 rows, 8-row query tiles once rounded rows apart from
    1,024-row ones (the KDE's log-sum-exp and the expressions; found scoring 300 points with
    ``kde.log_density(..., batch_size=1)``): such calls keep the full tile."""
    rng = np.random.default_rng(10)
    keys = (rng.normal(size=(m, 2)) + OFFSET).astype(np.float32)
    values = rng.normal(size=m).astype(np.float32)
    queries = (rng.normal(size=(200, 2)) + OFFSET).astype(np.float32)
    for f in (lambda q: rbf_kde_density(q, keys, 0.3, log=True, prune=False),
              lambda q: kernel_mv(RationalQuadratic(np.float32(0.7), np.float32(1.0)), q, keys,
                                  values)):
        full = np.asarray(f(queries))
        for start in (0, 8, 100):
            np.testing.assert_array_equal(np.asarray(f(queries[start:start + 8])),
                                          full[start:start + 8], err_msg=f"rows from {start}")


@pytest.mark.parametrize("d, kernel", [
    (8, Matern(np.float32(1.3), nu=1.5)),  # the hand-written Matérn: its augmented points' norms
    (17, RationalQuadratic(np.float32(1.1), np.float32(0.7))),  # past DIRECT_MAX_D: the
    (17, Matern(np.float32(1.3), nu=0.5)),  # expressions' distances by the expansion
])
def test_expression_rows_with_many_features(d, kernel):
    """One value column, 5,000 keys (issue 58): rows 0 and 1,024 alone once differed from the
    same rows in a batch of 1,100 by up to 2.9e-6, the squared norms having been reduced by
    ``jnp.sum``, which XLA's CPU backend vectorised by rows (`scalegp.ops._matmul.half_sq_norms`
    now writes the sum out)."""
    rng = np.random.default_rng(9)
    keys = rng.normal(size=(5000, d)).astype(np.float32)
    values = rng.normal(size=(5000, 1)).astype(np.float32)
    queries = rng.normal(size=(1100, d)).astype(np.float32)
    f = jax.jit(lambda q: kernel_mv(kernel, q, keys, values))
    full = np.asarray(f(queries))
    for rows in ([0], [1024], [1099], list(range(300)), list(range(1024, 1100))):
        np.testing.assert_array_equal(np.asarray(f(queries[rows])), full[rows],
                                      err_msg=f"rows {rows[0]}..{rows[-1]}")


def _assert_rows_independent(f, queries, keys, values, full, sizes, seed):
    """Random batches of each size, and rows 0, 1023 and 1099 alone, give ``full``'s rows bit
    for bit."""
    rng = np.random.default_rng(seed)
    for size in sizes:
        idx = rng.permutation(queries.shape[0])[:size]
        np.testing.assert_array_equal(np.asarray(f(queries[idx], keys, values)), full[idx],
                                      err_msg=f"batch of {size}")
    for i in (0, 1023, 1099):
        np.testing.assert_array_equal(np.asarray(f(queries[i : i + 1], keys, values)),
                                      full[i : i + 1], err_msg=f"row {i} alone")


def test_engine_says_where_rows_are_independent():
    """`Engine.rows_independent`, which lets a prediction of many rows run in taller blocks
    (`scalegp.gp._predict.TALL_PREDICT_BLOCK`): the tiled backends on one device, not the
    dense one (whose XLA products may round a row by its batch)."""
    from scalegp.ops import Engine

    assert Engine.create("xla").rows_independent(M, D, np.float32)
    assert Engine.create("pallas").rows_independent(M, D, np.float32)
    assert not Engine.create("dense").rows_independent(M, D, np.float32)
    assert not Engine.create("xla", mesh=1).rows_independent(M, D, np.float32)
