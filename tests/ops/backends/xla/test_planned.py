"""The leave-one-out pass of the host-planned KDE (`PlannedDensity.loo_log_density`): each held
row's own key left out exactly, values within the pruning bound of float64 on adversarial
layouts, the bandwidth gradient from the forward pass's moments against float64, and rows that
do not depend on which other rows are held out with them."""

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from scalegp.ops.backends.xla._planned import PlannedDensity
from scalegp.ops.pruning._rules import default_tolerance
from tests.ops.pruning.test_tree import layout

BLOCK = 16
TOL = default_tolerance(jnp.float32)


def loo_f64(x, w, held, h):
    """float64 ``log p_{-i}(x_i)`` (s,) and ``∂/∂ log h_d`` (s, d), row i's own index left
    out."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    h = np.broadcast_to(np.asarray(h, np.float64), (x.shape[1],))
    diff2 = ((x[held, None, :] - x[None, :, :]) / h) ** 2  # (s, m, d)
    e = -0.5 * diff2.sum(-1) + np.log(w)[None, :]
    e[np.arange(len(held)), held] = -np.inf
    lse = scipy.special.logsumexp(e, axis=1)
    p = np.exp(e - lse[:, None])
    log_norm = -0.5 * x.shape[1] * np.log(2 * np.pi) - np.sum(np.log(h))
    values = lse + log_norm - np.log(w.sum() - w[held])
    return values, np.einsum("sm,smd->sd", p, diff2) - 1.0


def _model(x, w, h):
    return PlannedDensity(jnp.asarray(x), jnp.asarray(w, jnp.float32), h, block=BLOCK)


@pytest.mark.parametrize("name", ["duplicates", "far_cluster", "line", "grid", "d1", "d8"])
@pytest.mark.parametrize("bandwidth", [0.004, 0.03])
def test_loo_matches_float64_within_the_bound(name, bandwidth):
    rng = np.random.default_rng(0)
    x = layout(name, rng)
    w = rng.uniform(0.5, 2.0, len(x)).astype(np.float32)
    held = np.sort(rng.choice(len(x), size=len(x) // 3, replace=False))
    model = _model(x, w, bandwidth)
    values, grads = model.loo_log_density(bandwidth, held, moments=True)
    ref, ref_grads = loo_f64(x, w, held, np.float32(bandwidth))
    # float32 rounding of log-sums of size |ref| + |log norm| (d log(1/h), ~44 at d = 8)
    rounding = 2e-6 + 1e-6 * (np.abs(ref) + x.shape[1] * abs(np.log(bandwidth)))
    assert np.all(ref - values <= np.log1p(TOL) + rounding)  # at most tol of the mass skipped
    assert np.all(values - ref <= rounding)
    # the moments are float32 sums of D² (up to ~30 at the kernel's reach)
    assert np.all(np.abs(grads - ref_grads) <= 3e-4 * (1 + np.abs(ref_grads)))
    np.testing.assert_array_equal(model.loo_log_density(bandwidth, held), values)


def curvature_f64(x, w, held, h):
    """float64 ``∂² log p_{-i}(x_i) / ∂t²`` (s,) in the common log-scale t (``h e^t`` at t = 0),
    by the definition: ``E[r⁴] - E[r²]² - 2 E[r²]`` under each row's kernel weights."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    h = np.broadcast_to(np.asarray(h, np.float64), (x.shape[1],))
    r2 = (((x[held, None, :] - x[None, :, :]) / h) ** 2).sum(-1)
    e = -0.5 * r2 + np.log(w)[None, :]
    e[np.arange(len(held)), held] = -np.inf
    p = np.exp(e - scipy.special.logsumexp(e, axis=1)[:, None])
    mean = np.sum(p * r2, axis=1)
    return np.sum(p * r2 * r2, axis=1) - mean * mean - 2 * mean


@pytest.mark.parametrize("name", ["far_cluster", "d1", "d8"])
def test_loo_curvature_matches_float64(name):
    """The second derivative in log h from the fourth moment of the same pass, against the
    definition in float64 and against central differences of the float64 gradient."""
    rng = np.random.default_rng(4)
    x = layout(name, rng)
    w = rng.uniform(0.5, 2.0, len(x)).astype(np.float32)
    held = np.sort(rng.choice(len(x), size=len(x) // 4, replace=False))
    h = np.float32(0.03)
    values, grads, second = _model(x, w, h).loo_log_density(h, held, moments=True,
                                                            curvature=True)
    ref = curvature_f64(x, w, held, h)
    # float32 moments of r⁴ (up to ~900 at the kernel's reach) less a square: a variance
    assert np.all(np.abs(second - ref) <= 1e-3 * (1 + np.abs(ref))), np.max(np.abs(second - ref))
    step = 1e-4
    up, down = (loo_f64(x, w, held, np.float64(h) * np.exp(s))[1].sum(1) for s in (step, -step))
    np.testing.assert_allclose(ref, (up - down) / (2 * step), rtol=1e-5, atol=1e-5)
    same_values, same_grads = _model(x, w, h).loo_log_density(h, held, moments=True)
    np.testing.assert_array_equal(same_values, values)
    np.testing.assert_array_equal(same_grads, grads)


def test_loo_with_a_bandwidth_per_feature():
    rng = np.random.default_rng(1)
    x = layout("d8", rng)[:, :3] * np.float32([1.0, 3.0, 0.5])
    w = np.ones(len(x), np.float32)
    held = np.arange(0, len(x), 3)
    h = np.array([0.02, 0.05, 0.01])
    values, grads = _model(x, w, h).loo_log_density(h, held, moments=True)
    ref, ref_grads = loo_f64(x, w, held, h.astype(np.float32))
    np.testing.assert_allclose(values, ref, rtol=1e-6, atol=np.log1p(TOL) + 2e-6)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-4, atol=2e-4)


def test_rows_do_not_depend_on_the_other_held_rows():
    rng = np.random.default_rng(2)
    x = layout("far_cluster", rng)
    model = _model(x, np.ones(len(x), np.float32), 0.01)
    some = np.arange(40, 140)
    more = np.concatenate([np.arange(0, 40), some, np.arange(300, 380)])
    alone, alone_grads = model.loo_log_density(0.01, some, moments=True)
    mixed, mixed_grads = model.loo_log_density(0.01, more[::-1], moments=True)
    np.testing.assert_array_equal(alone, mixed[::-1][40:140])
    np.testing.assert_array_equal(alone_grads, mixed_grads[::-1][40:140])


def test_an_isolated_row_adds_every_other_key():
    """A row far from all others has a tiny LOO density: its level falls with it, and the rest
    pass must add the far keys rather than skip them against the row's own (left out) mass."""
    rng = np.random.default_rng(3)
    x = layout("far_cluster", rng)
    x[0] += 3.0  # 3 = 300 bandwidths from everything
    w = np.ones(len(x), np.float32)
    values = _model(x, w, 0.01).loo_log_density(0.01, np.array([0, 1, 2]))
    ref, _ = loo_f64(x, w, np.array([0, 1, 2]), np.float32(0.01))
    assert np.isfinite(values).all() or np.isneginf(ref[0])
    np.testing.assert_allclose(values[1:], ref[1:], rtol=1e-6, atol=2e-6)
