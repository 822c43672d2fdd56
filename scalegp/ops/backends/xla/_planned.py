"""The xla backend's passes over host plans (issue 41): `_pruned_lse`'s forward pass with each
query tile's visit lists taken from `pruning._tree`, for `scalegp.ops.pruning.PlannedDensity`
(which orders the keys, builds their tree, plans each call on the host and pipelines the calls:
read its module first).

Two compiled programs, one per pass of the rule (`pruning._rules`): `near_pass` folds in each
row's near tiles from the near plan and gives each row's level; `rest_pass` folds in the rest.
Each row applies its own rule to each listed tile, in ascending key order, as
`_pruned_lse.lse_forward` does over its own (smaller or equal) lists: a listed tile that a row
does not add leaves its state as it is, so the results equal `pruned_kernel_logsumexp`'s
(bitwise in the tests at the default tolerance; elsewhere a level may differ by an ulp, as the
two programs fold the constant ``log(tol)`` apart, which moves only a tile whose bound sits at
the level) and do not depend on the row's tile-mates.

Forward only. Cross-validation needs no backward pass: `PlannedDensity.loo_log_density` leaves
each held-out row's own key out inside the tile sums (`loo_tile`) and folds the bandwidth
moments in beside them, which give the gradient in log h directly (and a fourth moment, the
second derivative in a common log-scale).

`planned_block` is the backend's tile height per number of features (`planned_query_block`
that of a batch of queries).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops._tile_math import lse_step
from scalegp.ops.backends.xla._pruned_lse import lse_tile
from scalegp.ops.backends.xla._pruned_tiles import (
    fold_visits,
    scaled_differences,
    sq_distances,
)
from scalegp.ops.pruning import (
    PRUNE_BLOCK,
    Plan,
    PlannedPasses,
    lse_bounds,
    lse_level,
    lse_near,
    lse_rest,
    lse_setup,
)
from scalegp.ops.pruning import PlannedDensity as HostPlannedDensity
from scalegp.ops.pruning import planned_logsumexp


def _fold_list(tiles, start, count, body, init):
    """``body(t, state)`` for the key tiles ``tiles[start : start + count]`` in order."""
    return fold_visits(count, lambda k, state: body(tiles[start + k], state), init)


def loo_tile(x_t, own_t, y_t, w_t, lw_t, first_key, inv_scale, state):
    """`lse_tile` with each row's own key left out: row i of x_t (p, d) skips the key whose
    flat index (``first_key + j`` for column j of this tile) is ``own_t[i]`` (p,). With third
    and fourth state entries ((p, d), (p,)), the moments ``Σ_j w_j exp(e_ij - max_i) D_ijd²``
    and ``Σ_j w_j exp(e_ij - max_i) |D_ij|⁴`` (D the scaled differences) are folded in beside
    the scaled sum: over it, they give ``∂ log Σ_j w_j K_ij / ∂ log h_d``, the bandwidth
    gradient, and the second derivative in a common log-scale (`loo_log_density`), in the
    forward pass."""
    diff = scaled_differences(x_t, y_t, inv_scale)
    sq = sq_distances(diff)
    e = -0.5 * sq
    keep = own_t[:, None] != first_key + jnp.arange(y_t.shape[0])
    new_max, new_sum, rescale, terms = lse_step(*state[:2], e, w_t[None, :], lw_t[None, :], keep)
    new = (new_max, new_sum)
    if len(state) == 4:
        new += (state[2] * rescale[:, None] + jnp.einsum("pq,pdq->pd", terms, diff * diff),
                state[3] * rescale + jnp.sum(terms * (sq * sq), axis=1))
    return new


def _fold_tile(x_t, y, w, lw, inv_scale, t, include, state, own_t):
    """Key tile t folded into the state of the rows that ``include`` (p,): (max, scaled sum),
    or with ``own_t`` (rows' own keys, left out) `loo_tile`'s state."""
    if own_t is None:
        new = lse_tile(x_t, y[t], w[t], lw[t], inv_scale, *state)
    else:
        new = loo_tile(x_t, own_t, y[t], w[t], lw[t], t * y.shape[1], inv_scale, state)
    return tuple(jnp.where(include.reshape(include.shape + (1,) * (a.ndim - 1)), a, b)
                 for a, b in zip(new, state))


@functools.partial(jax.jit, static_argnames=("log_tol", "moments"))
def near_pass(x, y, w, inv_scale, tiles, start, count, log_tol: float, own=None,
              moments: bool = False):
    """x (tq, p, d) query tiles, y (tk, q, d) key tiles, w (tk, q), inv_scale (d,); the near
    plan's lists (`Plan`'s arrays). -> ((max, scaled sum), top, level), each (tq, p): the rows'
    running state over their near tiles, their largest bound and their level (`lse_level`).
    With ``own`` (tq, p), each row's own key's flat index, that key is left out (`loo_tile`),
    and with ``moments`` the state also holds the bandwidth moments (tq, p, d) and (tq, p)."""
    setup, lw = lse_setup(y, w)
    p, d = x.shape[1], x.shape[2]
    own = jnp.full(x.shape[:2], -1, jnp.int32) if own is None and moments else own

    def one_row_tile(_, row):
        x_t, s, c, own_t = row
        top = _fold_list(tiles, s, c, lambda t, top: jnp.maximum(
            top, lse_bounds(x_t, setup, inv_scale, t)[1]), jnp.full((p,), -jnp.inf, x.dtype))

        def add(t, state):
            near = lse_near(lse_bounds(x_t, setup, inv_scale, t)[1], top, setup[1][t] > 0,
                            log_tol)
            return _fold_tile(x_t, y, w, lw, inv_scale, t, near, state, own_t)

        init = (jnp.full((p,), -jnp.inf, x.dtype), jnp.zeros((p,), x.dtype))
        init += (jnp.zeros((p, d), x.dtype), jnp.zeros((p,), x.dtype)) if moments else ()
        state = _fold_list(tiles, s, c, add, init)
        return None, (state, top, lse_level(*state[:2], setup[1], y.shape[1], log_tol))

    return lax.scan(one_row_tile, None, (x, start, count, own))[1]


@functools.partial(jax.jit, static_argnames=("log_tol",))
def rest_pass(x, y, w, inv_scale, tiles, start, count, state, top, level, log_tol: float,
              own=None):
    """The log-sums (tq, p): `near_pass`'s state, top and level with each row's rest tiles
    (`lse_rest`) from the rest plan's lists folded in. With moments in the state: (log-sums,
    second moments over the sums (tq, p, d), fourth moments over the sums (tq, p))."""
    setup, lw = lse_setup(y, w)
    own = jnp.full(x.shape[:2], -1, jnp.int32) if own is None and len(state) == 4 else own

    def one_row_tile(_, row):
        x_t, s, c, state_t, top_t, level_t, own_t = row

        def add(t, state):
            neg_half_sq, bound = lse_bounds(x_t, setup, inv_scale, t)
            positive = setup[1][t] > 0
            rest = lse_rest(neg_half_sq, lse_near(bound, top_t, positive, log_tol), positive,
                            level_t)
            return _fold_tile(x_t, y, w, lw, inv_scale, t, rest, state, own_t)

        run_max, run_sum, *moments = _fold_list(tiles, s, c, add, state_t)
        out = run_max + jnp.log(run_sum)
        if not moments:
            return None, out
        return None, (out, moments[0] / run_sum[:, None], moments[1] / run_sum)

    return lax.scan(one_row_tile, None, (x, start, count, state, top, level, own))[1]


def _device(plan: Plan):
    return jnp.asarray(plan.tiles), jnp.asarray(plan.start), jnp.asarray(plan.count)


def _near(x, y, w, inv_scale, plan, log_tol, own, moments):
    return near_pass(x, y, w, inv_scale, *_device(plan), log_tol, own, moments)


def _rest(x, y, w, inv_scale, plan, state, top, level, log_tol, own):
    return rest_pass(x, y, w, inv_scale, *_device(plan), state, top, level, log_tol, own)


#: The xla backend's passes over host plans: ``lax.scan`` over query tiles, each folding its
#: listed key tiles in a loop; they take the leave-one-out form (``own``, ``moments``).
PASSES = PlannedPasses(near=_near, rest=_rest, loo=True)

planned_kernel_logsumexp = functools.partial(planned_logsumexp, PASSES)


#: Tile height of the host-planned path by number of features (the largest d listed at most):
#: benchmarks/results/kde_plan_cpu.json, 10^6 overlapping-mixture points at d = 2 scored against
#: themselves at h = 0.006, gave 12-25 s at block 32, 30-32 s at 64, 41-78 s at 16, 62 s at 256
#: (and 32 the best of 16-256 at 10^5). Higher d is unmeasured here: tile boxes loosen with d and a
#: visited pair costs block² kernel values either way, so larger tiles (fewer, cheaper-to-plan
#: pairs) there, up to the in-jit path's `PRUNE_BLOCK` from d = 5.
PLANNED_BLOCKS = ((2, 32), (4, 64))


def planned_block(d: int) -> int:
    """The tile height of `PlannedDensity` for ``d`` features (`PLANNED_BLOCKS`)."""
    return next((block for most, block in PLANNED_BLOCKS if d <= most), PRUNE_BLOCK)


#: Query tiles of the host-planned path from 3 features: a batch of queries is usually sparser
#: than the data, and tiles of the keys' 64 or 256 rows span boxes that admit most key tiles.
#: Fixed, not chosen by the batch's size: XLA's CPU code rounds a row's sums differently at
#: some heights, and a row's result may not depend on its batch (docs/decisions.md #44).
PLANNED_QUERY_BLOCK = 16


def planned_query_block(d: int, block: int) -> int:
    """The query tiles' height of `PlannedDensity.log_density` for ``d`` features against key
    tiles of ``block`` rows: the keys' up to 2 features, else `PLANNED_QUERY_BLOCK`."""
    return block if d <= 2 else min(block, PLANNED_QUERY_BLOCK)


class PlannedDensity(HostPlannedDensity):
    """`scalegp.ops.pruning.PlannedDensity` on the xla passes (`PASSES`), a batch of queries in
    tiles of `planned_query_block` rows."""

    passes = PASSES
    query_block = staticmethod(planned_query_block)
