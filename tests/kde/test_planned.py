"""Scoring on the host-planned pruned path (`scalegp.ops.Engine.planned_kde`, issue 41): the
data are ordered and their tile tree built once, at fit, and every `FittedKDE.log_density` /
``score_samples`` reuses them; results within the pruning bound of a float64 evaluation and of
the unpruned path, row-independent across batches, and the fitted model pickles."""

import pickle
import threading

import numpy as np
import pytest
import scipy.special
from sklearn.base import clone

from scalegp import ScalableKernelDensity, kde
from scalegp.kde import _density, _fitted
from scalegp.ops import Engine
from scalegp.ops.pruning import _tree as tree
from scalegp.ops.backends.xla import _planned as xla_planned
from scalegp.ops.pruning import _planned as planned
from tests.kde.references import brute_log_density
from tests.ops.pruning.problems import clustered

TOL = 0.5 * float(np.finfo(np.float32).eps)  # prune_tol=None


def _reference(fitted, queries):
    """float64 log-density of the fitted float32 data at the queries as the model scales them."""
    z = fitted.data.astype(np.float64)
    q = fitted.scaling.transform(queries).astype(np.float32).astype(np.float64)
    h = np.broadcast_to(np.asarray(fitted.bandwidth, np.float64), (z.shape[1],))
    sq = np.sum(((q[:, None, :] - z[None, :, :]) / h) ** 2, axis=-1)
    return (scipy.special.logsumexp(-0.5 * sq, axis=1) - np.log(len(z))
            - 0.5 * z.shape[1] * np.log(2 * np.pi) - np.sum(np.log(h)) + fitted.scaling.log_abs_det)


def _within_bound(out, ref):
    rounding = 2e-6 + 4e-7 * np.abs(ref)
    assert np.all(ref - out <= np.log1p(TOL) + rounding)  # at most tol of the mass skipped
    assert np.all(out - ref <= rounding)


def _problem(d, seed=0, n=3000):
    rng = np.random.default_rng(seed)
    x = clustered(rng, n, d, clusters=15, spread=0.02, offset=100.0)
    queries = np.concatenate([x[:300] + np.float32(0.004), clustered(rng, 100, d, offset=100.0)])
    queries[:3] += 0.5  # a few queries away from the data
    return x, queries


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("bandwidth", [0.003, 0.02])
def test_planned_scoring_is_within_the_bound_of_float64_and_unpruned(d, bandwidth):
    x, queries = _problem(d)
    fitted = kde.fit_kde(x, bandwidth=bandwidth, prune=True)
    assert fitted.planned is not None
    np.testing.assert_array_equal(fitted.data_order, fitted.planned.order)
    out = fitted.log_density(queries, prune=True, batch_size=128)
    ref = _reference(fitted, queries)
    _within_bound(np.asarray(out, np.float64), ref)
    # the unpruned float32 path's own error: up to ~1.3e-5 absolute, 4e-6 relative here
    unpruned = fitted.log_density(queries, prune=False)
    np.testing.assert_allclose(out, unpruned, rtol=1e-5, atol=np.log1p(TOL) + 2e-5)


def test_rows_do_not_depend_on_their_batch():
    x, queries = _problem(2, seed=1)
    fitted = kde.fit_kde(x, bandwidth=0.005, prune=True)
    whole = fitted.log_density(queries, prune=True)
    for batch_size in (1, 37, 128):
        np.testing.assert_array_equal(fitted.log_density(queries, prune=True,
                                                         batch_size=batch_size), whole)
    np.testing.assert_array_equal(fitted.log_density(queries[50:90], prune=True), whole[50:90])


def test_weights_on_the_planned_path():
    x, queries = _problem(2, seed=2)
    weights = np.random.default_rng(3).uniform(0.1, 2.0, len(x))
    fitted = kde.fit_kde(x, weights, bandwidth=0.01, prune=True)
    assert fitted.planned is not None
    plain = kde.fit_kde(x, weights, bandwidth=0.01, prune=False)
    np.testing.assert_allclose(fitted.log_density(queries, prune=True),
                               plain.log_density(queries, prune=False), rtol=1e-5, atol=2e-5)


def test_the_data_are_ordered_once(monkeypatch):
    """Two score_samples calls sort only their queries: neither the data's k-d order nor the
    tree is made again."""
    x, queries = _problem(2, seed=4)
    est = ScalableKernelDensity(bandwidth=0.005, prune=True).fit(x)
    density = est.planned_density_
    assert density is not None
    first = est.score_samples(queries)

    def forbidden(*args, **kwargs):
        raise AssertionError("the data were ordered again")

    monkeypatch.setattr(planned, "_ordered_keys", forbidden)
    monkeypatch.setattr(planned, "build_tree", forbidden)
    monkeypatch.setattr(tree, "build_tree", forbidden)
    monkeypatch.setattr(_density, "spatial_order", forbidden)
    monkeypatch.setattr(_fitted, "spatial_order", forbidden)
    np.testing.assert_array_equal(est.score_samples(queries), first)
    np.testing.assert_array_equal(est.score_samples(queries[::-1]), first[::-1])
    assert est.planned_density_ is density


def test_prune_auto_decides_at_fit_from_the_data_and_bandwidth():
    rng = np.random.default_rng(5)
    x = clustered(rng, 20000, 2, clusters=30, spread=0.01)
    narrow = kde.fit_kde(x, bandwidth=0.002)  # prune="auto"
    assert narrow.planned is not None
    assert kde.fit_kde(x, bandwidth=0.5).planned is None  # the kernel spans the data
    assert kde.fit_kde(x, bandwidth=0.002, prune=False).planned is None
    assert kde.fit_kde(x[:2000], bandwidth=0.002).planned is None  # too few for "auto"
    assert Engine.create(prune=True).planned_kde(x[:100], 0.01) is not None
    queries = x[:200] + np.float32(1e-3)
    _within_bound(np.asarray(narrow.log_density(queries), np.float64),
                  _reference(narrow, queries))


def test_a_fitted_model_pickles_and_clones():
    x, queries = _problem(2, seed=6)
    est = ScalableKernelDensity(bandwidth=0.005, prune=True).fit(x)
    scores = est.score_samples(queries)
    loaded = pickle.loads(pickle.dumps(est))
    assert loaded.planned_density_ is not None and loaded.planned_density_.plans is None
    np.testing.assert_array_equal(loaded.score_samples(queries), scores)
    fresh = clone(est)
    assert not hasattr(fresh, "planned_density_")
    np.testing.assert_array_equal(fresh.fit(x).score_samples(queries), scores)
    del loaded.planned_density_  # as in a pickle from before the attribute: the in-jit path
    np.testing.assert_allclose(loaded.score_samples(queries), scores, rtol=1e-6,
                               atol=np.log1p(TOL) + 2e-6)


def test_the_data_themselves_are_scored_in_their_own_tiles(monkeypatch):
    """score_samples of the training data takes the data's tiles as query tiles (in chunks of
    batch_size rows), with the same rows as any batch of queries."""
    x, _ = _problem(2, seed=7)
    fitted = kde.fit_kde(x, bandwidth=0.005, prune=True)
    batched = fitted.log_density(x[::-1].copy(), prune=True)[::-1]
    monkeypatch.setattr(planned, "_ordered_queries", lambda *a: 1 / 0)  # not called
    for batch_size in (100, 1 << 16):
        own = fitted.log_density(x, prune=True, batch_size=batch_size)
        np.testing.assert_array_equal(own, batched)
    _within_bound(np.asarray(own, np.float64), _reference(fitted, x))


@pytest.mark.parametrize("twice", [40, 0])
def test_scoring_reuses_the_cross_validations_tree(twice, monkeypatch):
    """bandwidth="cv" on the planned path: the scoring takes the cross-validation's data in k-d
    order and their tile tree (the distinct points, equal rows one key with their summed
    weight), nothing ordered or built again, and its densities are within the bound; the data
    themselves, as queries or in their own tiles, each take their row's value."""
    x, queries = _problem(2, seed=8)
    x = np.concatenate([x, x[:twice]])  # rows twice: one distinct point each in the cv
    made = []
    init = xla_planned.PlannedDensity.__init__

    def spy(self, *args, order=None, **kwargs):
        made.append((self, order))
        init(self, *args, order=order, **kwargs)

    monkeypatch.setattr(xla_planned.PlannedDensity, "__init__", spy)
    fitted = kde.fit_kde(x, bandwidth="cv", scale="standardize", prune=True, random_state=0)
    ((cv_planned, cv_order),) = made  # one k-d order and tree, the cross-validation's
    assert cv_order is None and fitted.planned is cv_planned
    if twice:
        assert fitted.distinct.shape == (len(x) - twice, 2)
        np.testing.assert_array_equal(fitted.distinct_index[:twice], fitted.distinct_index[-twice:])
        np.testing.assert_array_equal(fitted.distinct_weights[fitted.distinct_index[:twice]], 2.0)
        np.testing.assert_array_equal(fitted.data_order, cv_planned.order)
    else:  # the data are the keys; the tree holds them in the cross-validation's row order
        assert fitted.distinct is None
        np.testing.assert_array_equal(fitted.data[fitted.data_order],
                                      np.unique(fitted.data, axis=0)[cv_planned.order])
    out = fitted.log_density(queries)
    # as the unpruned float32 path, whose own rounding (~5e-6 near the data at this wider
    # bandwidth) exceeds the bound; near the data, float64's value
    np.testing.assert_allclose(out, fitted.log_density(queries, prune=False), rtol=1e-5,
                               atol=np.log1p(TOL) + 2e-5)
    np.testing.assert_allclose(out[3:300], _reference(fitted, queries[3:300]), rtol=0,
                               atol=2e-5)
    own = fitted.log_density(x)
    np.testing.assert_array_equal(own, fitted.log_density(x[::-1].copy())[::-1])
    np.testing.assert_allclose(own, fitted.log_density(x, prune=False), rtol=1e-5,
                               atol=np.log1p(TOL) + 2e-5)


def test_an_in_program_cross_validation_has_the_scorings_order_made_meanwhile(monkeypatch):
    """bandwidth="cv" where the cross-validation runs in programs (a TPU's: it builds no tree to
    reuse): the scoring's k-d order is made in a thread while it runs (at a scalar bandwidth,
    any scalar orders alike), and the tree is built once, after it, in that order."""
    x, queries = _problem(2, seed=9)
    monkeypatch.setattr(Engine, "cross_validates_planned", lambda self, m, d, dtype: False)
    made, threads = [], []
    init, planned_order = xla_planned.PlannedDensity.__init__, Engine.planned_order

    def spy(self, *args, order=None, **kwargs):
        made.append(order)
        init(self, *args, order=order, **kwargs)

    def ordered_in(self, data, scale):
        threads.append(threading.current_thread())
        return planned_order(self, data, scale)

    monkeypatch.setattr(xla_planned.PlannedDensity, "__init__", spy)
    monkeypatch.setattr(Engine, "planned_order", ordered_in)
    fitted = kde.fit_kde(x, bandwidth="cv", scale="standardize", prune=True, random_state=0)
    assert threads and threads[0] is not threading.main_thread()
    (order,) = made  # one tree, in the order made meanwhile
    np.testing.assert_array_equal(order, planned_order(Engine.create(prune=True), fitted.data,
                                                       1.0))
    np.testing.assert_array_equal(fitted.planned.order, order)
    out = fitted.log_density(queries)
    np.testing.assert_allclose(out, fitted.log_density(queries, prune=False), rtol=1e-5,
                               atol=np.log1p(TOL) + 2e-5)


def _stacked(rng):
    """Three points stacked 400 times each and ten twice, among 300 distinct points, with
    weights, two rows of zero weight among them."""
    distinct = clustered(rng, 300, 2, clusters=5, spread=0.02, offset=100.0)
    x = np.concatenate([distinct, np.repeat(distinct[:3], 400, axis=0), distinct[10:20]])
    weights = rng.uniform(0.5, 2.0, len(x))
    weights[[5, 400]] = 0.0
    order = rng.permutation(len(x))
    return x[order], weights[order]


@pytest.mark.parametrize("prune", [False, True])
def test_exact_duplicates_are_one_key_each_in_scoring(prune, monkeypatch):
    """Weighted duplicates among distinct points (two rows of zero weight): scoring sums over
    the distinct rows, each once with its copies' summed weight, and scores the data themselves
    as those keys: each row's log-density is the float64 definition's over all rows, and the
    same as a query in another batch."""
    x, weights = _stacked(np.random.default_rng(9))
    sums = []
    score = _fitted.engine_log_density
    monkeypatch.setattr(_fitted, "engine_log_density", lambda engine, queries, data, *args,
                        **kwargs: sums.append((len(queries), len(data)))
                        or score(engine, queries, data, *args, **kwargs))
    fitted = kde.fit_kde(x, weights, bandwidth=0.01, prune=prune)
    assert (fitted.planned is not None) == prune
    keys = len(np.unique(x, axis=0))
    assert fitted.distinct.shape == (keys, 2) and keys < len(x) - 1000
    own = fitted.log_density(x)
    assert sums == [(keys, keys)]
    z = fitted.data.astype(np.float64)
    reference = brute_log_density(z, z, 0.01, weights)
    if prune:
        _within_bound(np.asarray(own, np.float64), reference)
    else:
        np.testing.assert_allclose(own, reference, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(fitted.log_density(x[::-1].copy())[::-1], own)


def test_a_stack_of_copies_costs_one_kernel_value(monkeypatch):
    """30,000 rows on three values (issue 58): the fitted model's data scored as three keys,
    each carrying its copies' weight, equal to the float64 definition over every row."""
    x = np.repeat([[0.0], [1.0], [5.0]], 10_000, axis=0)
    sums = []
    score = _fitted.engine_log_density
    monkeypatch.setattr(_fitted, "engine_log_density", lambda engine, queries, data, *args,
                        **kwargs: sums.append((len(queries), len(data)))
                        or score(engine, queries, data, *args, **kwargs))
    fitted = kde.fit_kde(x, bandwidth="cv", scale="standardize")
    out = fitted.log_density(x)
    assert sums == [(3, 3)]
    np.testing.assert_array_equal(fitted.distinct_weights, [10_000] * 3)
    h, scaling = float(fitted.bandwidth), fitted.scaling
    z = scaling.transform(np.array([[0.0], [1.0], [5.0]])).astype(np.float32).astype(np.float64)
    reference = brute_log_density(z, z, h, np.full(3, 10_000.0)) + scaling.log_abs_det
    np.testing.assert_allclose(out, np.repeat(reference, 10_000), rtol=1e-6)


def test_a_first_cv_fit_and_scoring_compile_few_programs():
    # The planned path's gathers, reordering and joins are one program each (decisions #61:
    # 24 programs before, for this call in a fresh process).
    from tests.compile_counts import program_count

    programs, names = program_count("""
        import numpy as np
        from scalegp.kde import fit_kde
        points = np.random.default_rng(0).standard_normal((3000, 2)).astype(np.float32)
        def call():
            fit_kde(points, bandwidth="cv", random_state=0, prune=True).log_density(points)
    """)
    assert programs <= 16, "\n".join(names)
