"""The pruned KDE log-sum-exp over a host plan (issue 41): `scalegp.ops._pruning_lse`'s forward
pass with each query tile's visit lists taken from `scalegp.ops._pruning_plan` (a tree descent,
O(visited · depth) host work) instead of testing every key tile inside the program (O(n · m /
block²) per call).

Two compiled programs, one per pass of the rule (`scalegp.ops._pruning`): `near_pass` folds in
each row's near tiles from the near plan and gives each row's level; the rest plan needs the
smallest level of each query tile, so it is made on the host between the two, and `rest_pass`
folds in the rest. Each row applies its own rule to each listed tile, in ascending key order,
as `_pruning_lse.lse_forward` does over its own (smaller or equal) lists: a listed tile that a
row does not add leaves its state as it is, so the results equal `pruned_kernel_logsumexp`'s
(bitwise in the tests at the default tolerance; elsewhere a level may differ by an ulp, as the
two programs fold the constant ``log(tol)`` apart, which moves only a tile whose bound sits at
the level) and do not depend on the row's tile-mates.

Forward only (scoring). The backward pass of cross-validation (`_pruning_lse._lse_backward`)
visits, per query tile, the union of the two lists with each row's (near, rest) rule and its
levels: the same plans, kept from the forward pass, would serve it as a third program.

`PlannedDensity` orders the keys once and builds their tree (`build_tree`) once; each call then
plans for its bandwidth and queries. `planned_block` is its tile height per number of features,
and `PlannedDensity.pays` the ``prune="auto"`` test (`scalegp.ops._pruning.pruning_pays` on the
keys in the order the plan put them, so that the decision sorts nothing more);
`scalegp.ops.Engine` builds one where its KDE scoring takes this path (`Engine.planned_kde`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp.ops._prepare import gaussian_log_norm
from scalegp.ops._pruning import (
    PRUNE_BLOCK,
    default_tolerance,
    ordered_keys,
    ordered_queries,
    pruning_pays,
    reach_allows_pruning,
)
from scalegp.ops._pruning_bounds import (
    lse_bounds,
    lse_level,
    lse_log_tol,
    lse_near,
    lse_rest,
    lse_setup,
)
from scalegp.ops._pruning_lse import lse_tile
from scalegp.ops._pruning_order import tile_values, unordered
from scalegp.ops._pruning_plan import Plan, build_tree, near_plan, rest_plan
from scalegp.ops._pruning_tiles import fold_visits


def _fold_list(tiles, start, count, body, init):
    """``body(t, state)`` for the key tiles ``tiles[start : start + count]`` in order."""
    return fold_visits(count, lambda k, state: body(tiles[start + k], state), init)


def _fold_tile(x_t, y, w, lw, inv_scale, t, include, state):
    """Key tile t folded into the (max, scaled sum) of the rows that ``include`` (p,)."""
    new = lse_tile(x_t, y[t], w[t], lw[t], inv_scale, *state)
    return tuple(jnp.where(include, a, b) for a, b in zip(new, state))


@functools.partial(jax.jit, static_argnums=(7,))
def near_pass(x, y, w, inv_scale, tiles, start, count, log_tol: float):
    """x (tq, p, d) query tiles, y (tk, q, d) key tiles, w (tk, q), inv_scale (d,); the near
    plan's lists (`Plan`'s arrays). -> ((max, scaled sum), top, level), each (tq, p): the rows'
    running state over their near tiles, their largest bound and their level (`lse_level`)."""
    setup, lw = lse_setup(y, w)
    p = x.shape[1]

    def one_row_tile(_, row):
        x_t, s, c = row
        top = _fold_list(tiles, s, c, lambda t, top: jnp.maximum(
            top, lse_bounds(x_t, setup, inv_scale, t)[1]), jnp.full((p,), -jnp.inf, x.dtype))

        def add(t, state):
            near = lse_near(lse_bounds(x_t, setup, inv_scale, t)[1], top, setup[1][t] > 0,
                            log_tol)
            return _fold_tile(x_t, y, w, lw, inv_scale, t, near, state)

        init = (jnp.full((p,), -jnp.inf, x.dtype), jnp.zeros((p,), x.dtype))
        state = _fold_list(tiles, s, c, add, init)
        return None, (state, top, lse_level(*state, setup[1], y.shape[1], log_tol))

    return lax.scan(one_row_tile, None, (x, start, count))[1]


@functools.partial(jax.jit, static_argnums=(10,))
def rest_pass(x, y, w, inv_scale, tiles, start, count, state, top, level, log_tol: float):
    """The log-sums (tq, p): `near_pass`'s state, top and level with each row's rest tiles
    (`lse_rest`) from the rest plan's lists folded in."""
    setup, lw = lse_setup(y, w)

    def one_row_tile(_, row):
        x_t, s, c, state_t, top_t, level_t = row

        def add(t, state):
            neg_half_sq, bound = lse_bounds(x_t, setup, inv_scale, t)
            positive = setup[1][t] > 0
            rest = lse_rest(neg_half_sq, lse_near(bound, top_t, positive, log_tol), positive,
                            level_t)
            return _fold_tile(x_t, y, w, lw, inv_scale, t, rest, state)

        run_max, run_sum = _fold_list(tiles, s, c, add, state_t)
        return None, run_max + jnp.log(run_sum)

    return lax.scan(one_row_tile, None, (x, start, count, state, top, level))[1]


def _device(plan: Plan):
    return jnp.asarray(plan.tiles), jnp.asarray(plan.start), jnp.asarray(plan.count)


def planned_kernel_logsumexp(x, y, w, inv_scale, tol: float, tree):
    """``log Σ_j w_j exp(-|(x_i - y_j) / l|² / 2)`` as `pruned_kernel_logsumexp` (same shapes
    and rule: x (tq, p, d), y (tk, q, d) in k-d order, w (tk, q), inv_scale (d,) -> (tq, p)),
    planned on the host with ``tree = build_tree(y, w)``. Not under jit.

    Returns (log-sums, near plan, rest plan); a plan's ``pairs`` is its number of tile pairs."""
    log_tol = lse_log_tol(tol, x.dtype)
    x_host = np.asarray(x)
    q_lo, q_hi = x_host.min(axis=1).astype(np.float64), x_host.max(axis=1).astype(np.float64)
    inv = np.asarray(inv_scale, np.float64)
    near = near_plan(tree, q_lo, q_hi, inv, log_tol)
    state, top, level = near_pass(x, y, w, inv_scale, *_device(near), log_tol)
    rest = rest_plan(tree, q_lo, q_hi, inv, log_tol,
                     np.asarray(level, np.float64).min(axis=1),
                     np.asarray(top, np.float64).max(axis=1))
    out = rest_pass(x, y, w, inv_scale, *_device(rest), state, top, level, log_tol)
    return out, near, rest


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


reach_gate = jax.jit(reach_allows_pruning, static_argnums=(2,))


@functools.partial(jax.jit, static_argnums=(2,))
def _pays_in_order(x, scale, tol: float):
    return pruning_pays(ordered_keys(x, scale, PRUNE_BLOCK, in_order=True), scale, tol)


_ordered_keys = jax.jit(ordered_keys, static_argnums=(2,))
_ordered_queries = jax.jit(ordered_queries, static_argnums=(3,))


@jax.jit
def _tile_weights(w, keys):
    w = jnp.where(keys.far, 0.0, w / jnp.sum(w)).astype(keys.tiles.dtype)
    return tile_values(w, keys.perm, keys.tiles.shape[1])


class PlannedDensity:
    """A Gaussian KDE's data in k-d order and their tile tree, made once (the order and the tree
    do not depend on the bandwidth, only on its ratios across features, given by ``scale``):
    `log_density` then plans and scores for any bandwidth and queries, not under jit.

    Args:
      data: (m, d) points; weights: optional (m,) >= 0 (normalised here); scale: scalar or
        (d,); block: tile height.
    """

    def __init__(self, data, weights=None, scale=1.0, block: int = PRUNE_BLOCK):
        data = jnp.asarray(data)
        scale = jnp.asarray(scale, data.dtype)
        weights = jnp.ones(data.shape[0], data.dtype) if weights is None else weights
        self.keys = _ordered_keys(data, scale, block)
        self.weights = _tile_weights(jnp.asarray(weights, data.dtype), self.keys)
        self.tree = build_tree(self.keys.tiles, self.weights)
        self.plans = None  # the (near, rest) plans of the last call

    def __getstate__(self):  # a pickle holds the order and the tree, not the last call's plans
        return {**self.__dict__, "plans": None}

    @property
    def order(self) -> np.ndarray:
        """(m,) the data's rows in the k-d order of the tiles (`scalegp.ops.spatial_order`'s
        kind of permutation, at this tile height)."""
        perm = np.asarray(self.keys.perm)
        return perm[perm < self.keys.far.shape[0]]

    def pays(self, data, bandwidth, tol: float) -> bool:
        """``prune="auto"``'s test on these keys (``data``, the (m, d) points this was built on)
        at ``bandwidth``: `scalegp.ops._pruning.pruning_pays` on the data in this object's order
        in tiles of `PRUNE_BLOCK`, as the in-jit path decides on keys given in order. Depends
        on the keys and the bandwidth only (row independence)."""
        x = jnp.asarray(data)[self.order]
        return bool(_pays_in_order(x, jnp.asarray(bandwidth, x.dtype), float(tol)))

    def log_density(self, bandwidth, queries=None, tol=None):
        """(n,) log-densities at ``queries`` (n, d) (None: the data themselves, in their order),
        each query's skipped mass at most ``tol`` (None: half the dtype's epsilon) times its
        density, as `scalegp.ops.rbf_kde_density(..., log=True, prune=True)`."""
        keys, d = self.keys, self.keys.tiles.shape[2]
        bandwidth = jnp.broadcast_to(jnp.asarray(bandwidth, keys.tiles.dtype), (d,))
        if queries is None:
            x, perm, far, n = keys.tiles, keys.perm, keys.far, keys.far.shape[0]
        else:
            queries = jnp.asarray(queries, keys.tiles.dtype)
            x, perm, far = _ordered_queries(queries, keys, bandwidth, False)
            n = queries.shape[0]
        tol = default_tolerance(x.dtype) if tol is None else tol
        out, *self.plans = planned_kernel_logsumexp(x, keys.tiles, self.weights, 1 / bandwidth,
                                                    tol, self.tree)
        out = unordered(out.reshape(-1), perm, n) + gaussian_log_norm(bandwidth, d)
        return jnp.where(far, -jnp.inf, out)
