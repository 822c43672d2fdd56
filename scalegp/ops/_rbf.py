"""The public RBF products on one device: ``K v``, the Gaussian KDE's (log-)density, and the
dense kernel matrix and its logarithm. Inputs are checked (`_checks`), centred on the keys and
scaled (`_prepare`), and run by what the backend table plans (`_plan.plan`).

Row independence, bitwise: the implementation and tile sizes that ``auto`` (and an explicit "xla")
picks depend on the keys, never on the number of queries, and the query tile has a fixed height,
so every query row goes through the same compiled arithmetic whatever else is in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops._checks import (
    batch_shape,
    check_point_sets,
    check_scale,
    check_weights,
    float_dtype,
    product_arguments,
)
from scalegp.ops._kernels import RBF
from scalegp.ops._plan import (
    expansion_ok,
    expansion_or_differences,
    plan,
    pruning_mode,
    rbf_expansion_ok,
)
from scalegp.ops._prepare import (
    batched_product,
    centre_of,
    centred,
    centred_product,
    far_rows,
    flat_batch,
    masked_rows,
    normalised_weights,
    prepare,
    sum_to_one,
    through_one_scalar,
)
from scalegp.ops._tile_math import gaussian_log_norm, sq_differences
from scalegp.ops._tiling import FULL_TILE_ROWS, round_up, rowwise_padded
from scalegp.ops.pruning import (
    auto_keys,
    check_prune,
    kde_max_visited,
    kernel_logsumexp,
    ordered_keys,
    pruned_product,
)


def rbf_kernel_mv(x1, x2, v, lengthscale, *, impl="auto", block_q=None, block_k=None, block_o=None,
                  prune="auto", prune_tol=None, keys_in_order=False):
    """RBF kernel matrix times vectors, without forming the kernel matrix.

    ``out = K(x1, x2) @ v`` with ``K_ij = exp(-1/2 sum_d ((x1_id - x2_jd) / l_d)^2)``.

    Args:
      x1: (..., n, d) query points.
      x2: (..., m, d) key points.
      v: (..., m, o) or (..., m) values: a matrix when ``v.ndim == x2.ndim``, a vector when it
        has one dimension fewer. Leading batch dimensions of x1, x2 and v broadcast.
      lengthscale: scalar or (d,) (ARD), positive. The outputscale is the caller's multiplication.
      impl: "dense" (builds K by the distance expansion, the oracle: no tiles, no coordinate
        differences; the same on a mesh), "xla" (blocked, memory-linear), "triton" (fused
        kernels; GPU, or interpret mode on CPU), "mosaic" (fused kernels; TPU, float32 only,
        or interpret mode on CPU), "pallas" (the platform's fused kernels) or "auto" (see
        `scalegp.ops._plan`, `auto_config`).
      block_q, block_k, block_o: tile sizes overriding the implementation's defaults (the
        pruned fused kernels take one tile height for queries and keys: block_q = block_k).
      prune: skip tiles of the kernel matrix that provably cannot matter (after putting both
        point sets in a k-d order; see `scalegp.ops.pruning`): True, False, or "auto", which
        prunes only large, low-dimensional key sets whose tile bounds show that it pays
        (decided from the keys alone). Pruning runs the backend's pruned kernels (True on one
        that has none, dense, is a ValueError); "auto" prunes only on
        backends whose pruned path was timed (``prunes_under_auto``: xla).
      prune_tol: what may be skipped: per output row and column at most
        ``prune_tol · sum_j |v_j|``. None: half the dtype's epsilon (under rounding); 0: only
        tiles whose every kernel value underflows to 0.
      keys_in_order: x2 is already in `scalegp.ops.spatial_order` (for repeated calls with the
        same keys: pruning then does not sort them each time). Never changes the result's
        accuracy, only how much pruning saves.
    Returns:
      (..., n, o), or (..., n) for vector ``v``. Differentiable in x1, x2, v and lengthscale; the
      tiled backends use O((n + m)(d + o)) memory in the forward and backward pass.

    Distances come from the expansion ``|a|² + |b|² - 2 a·b`` (one matrix product per tile),
    whose rounding grows with the points' squared norms in lengthscales. For d <= 16 on xla,
    triton and mosaic, keys spread over many lengthscales (`rbf_expansion_ok`) take the
    coordinate differences instead (on triton, the expression kernels'; mosaic takes them up
    to d = 4 always), by ``lax.cond`` on the keys; pass
    a batch as leading dimensions rather than ``jax.vmap`` around this function, under which
    the predicate is batched and both paths run. On mosaic a scalar lengthscale's gradient
    comes from the tiles' second moments (`scalegp.ops._interface.RbfCore.scaled_mv`), not by
    the chain rule through the point gradients, which its split products' rounding spoils.
    """
    self_product = x1 is x2
    x1, x2, v, vector, dtype = product_arguments(x1, x2, v)
    n, m, d, o = x1.shape[-2], x2.shape[-2], x1.shape[-1], v.shape[-1]
    lengthscale = check_scale(lengthscale, d, "lengthscale", dtype)
    batch = batch_shape((x1.shape[:-2], "x1"), (x2.shape[:-2], "x2"), (v.shape[:-2], "v"))
    check_prune(prune, prune_tol)
    if n == 0 or m == 0:
        out = jnp.zeros(batch + (n, o), dtype)
        return out[..., 0] if vector else out
    return _rbf_kernel_mv(x1.astype(dtype), x2.astype(dtype), v.astype(dtype), lengthscale,
                          impl=impl, block_q=block_q, block_k=block_k, block_o=block_o,
                          prune=prune, prune_tol=static_tol(prune_tol),
                          keys_in_order=bool(keys_in_order), self_product=self_product,
                          vector=vector)


def static_tol(prune_tol):
    """``prune_tol`` as a static argument of ``jit``: None or a float (checked before)."""
    return None if prune_tol is None else float(prune_tol)


# One compiled program per shapes and settings: run eagerly, the product's branches (`lax.cond`)
# and loops would be traced anew on every call, as new closures, and compiled again each time.
@functools.partial(jax.jit, static_argnames=(
    "impl", "block_q", "block_k", "block_o", "prune", "prune_tol", "keys_in_order",
    "self_product", "vector"))
def _rbf_kernel_mv(x1, x2, v, lengthscale, *, impl, block_q, block_k, block_o, prune, prune_tol,
                   keys_in_order, self_product, vector):
    """`rbf_kernel_mv` on checked arguments in the compute dtype (n, m >= 1)."""
    n, m, d, o = x1.shape[-2], x2.shape[-2], x1.shape[-1], v.shape[-1]
    dtype = x1.dtype
    batch = batch_shape((x1.shape[:-2], "x1"), (x2.shape[:-2], "x2"), (v.shape[:-2], "v"))
    # short query tiles for a small unbatched call (`Backend.shorten`)
    tiles = {"block_q": block_q, "block_k": block_k, "block_o": block_o,
             "queries": None if batch else n, "columns": o}
    chosen = plan(impl, m, d, dtype, **tiles)
    core = chosen.rbf()
    mv = core.mv

    def expansion(a, b, far_a, far_b, v):
        return masked_rows(mv(a, b, masked_rows(v, far_b)), far_a)

    def single(x1, x2, v):
        return expansion(*prepare(x1, x2, lengthscale), v)

    if core.scaled_mv is not None and jnp.ndim(lengthscale) == 0:
        fixed, through = through_one_scalar(lengthscale)

        def single(x1, x2, v):
            a, b, far_a, far_b = prepare(x1, x2, fixed)
            return masked_rows(core.scaled_mv(a, b, masked_rows(v, far_b), through), far_a)

    if chosen.differences:
        # keys spread over many lengthscales: the coordinate differences, whose lengthscale
        # gradient is accurate there too
        expression = plan(impl, m, d, dtype, family="expression", **tiles)
        differences = centred_product(functools.partial(
            expression.expression(direct_weights=True).mv, RBF(lengthscale)))
        single = _rbf_branches(lengthscale, batch, x2, dtype, expansion, differences)
    pruning = pruning_mode(prune, prune_tol, impl, m, d, dtype, bool(batch), block_q, block_k)
    if pruning is not None:
        always, tol, core = pruning
        single = pruned_product(single, lengthscale, always, tol, keys_in_order, self_product,
                                core)
    return batched_product(single, x1, x2, v, batch, vector, dtype)


def _rbf_branches(lengthscale, batch, x2, dtype, expansion, differences):
    """``single(x1, x2, *rest)`` that runs ``expansion(a, b, far_a, far_b, *rest)`` on the
    prepared points (`prepare`) where the keys allow it (`rbf_expansion_ok`), else
    ``differences(x1, x2, *rest, centre=c)`` (`expansion_or_differences`; c the keys' centre,
    taken once for both). Unbatched, the choice comes from the prepared keys the expansion
    uses (no second pass over them); batched, from all members' keys before the engine's
    ``vmap`` (`scalegp.ops._plan.keys_mean_sq`)."""
    batch_ok = rbf_expansion_ok(x2, lengthscale, batch, dtype) if batch else None

    def single(x1, x2, *rest):
        centre = centre_of(x2)  # one sort for both branches
        a, b, far_a, far_b = prepare(x1, x2, lengthscale, centre)
        ok = expansion_ok(b) if batch_ok is None else batch_ok
        return expansion_or_differences(ok, lambda: expansion(a, b, far_a, far_b, *rest),
                                        lambda: differences(x1, x2, *rest, centre=centre))

    return single


def rbf_log_kernel_matrix(x1, x2, lengthscale):
    """The dense exponents ``log K(x1, x2) = -1/2 sum_d ((x1_id - x2_jd) / l_d)^2``, (n, m): for
    small problems and log-space sums (a KDE's leave-one-out terms); it holds n x m numbers.

    Prepared as the memory-linear products are (scaled, centred by the keys x2; rows whose
    squared norm overflows give -inf), so dense and blocked computations on the same points
    agree to rounding. The squares are of coordinate differences, feature by feature, never the
    expansion ``|a|² + |b|² - 2 a·b``: that one rounds at the points' scaled norms, and at a
    lengthscale of 1e-3 of the data's spread float32 put the diagonal of K at 0.6 instead of
    1 (the blocked products switch to differences there by `rbf_expansion_ok`; a dense matrix
    holds n x m numbers anyway, and d passes over them cost less than its Cholesky).
    Differentiable in x1, x2 and the lengthscale, in both modes (`_tile_math.sq_differences`).

    Args:
      x1: (n, d); x2: (m, d); lengthscale: scalar or (d,), positive.
    Returns:
      (n, m), every entry <= 0.
    """
    x1, x2 = jnp.asarray(x1), jnp.asarray(x2)
    check_point_sets(x1, x2, ("x1", "x2"))
    dtype = float_dtype(x1, x2)
    lengthscale = check_scale(lengthscale, x1.shape[-1], "lengthscale", dtype)
    x1, x2 = x1.astype(dtype), x2.astype(dtype)
    centre = centre_of(x2)
    far_a, far_b = (far_rows((x - centre) * (1 / lengthscale)) for x in (x1, x2))
    # differences of the centred points, scaled after: equal points give exactly 0, where a
    # jitted fusion could round the scaled points apart on the two sides (docs/decisions.md #32)
    u, v = masked_rows(x1 - centre, far_a), masked_rows(x2 - centre, far_b)
    exponents = -0.5 * sq_differences(u, v, jnp.broadcast_to(1 / lengthscale, (u.shape[1],)))
    return jnp.where(far_a[:, None] | far_b[None, :], -jnp.inf, exponents)


def rbf_kernel_matrix(x1, x2, lengthscale):
    """The dense RBF kernel matrix ``K(x1, x2) = exp(rbf_log_kernel_matrix(x1, x2, l))``, (n, m):
    for small problems (Cholesky, cross covariances)."""
    return jnp.exp(rbf_log_kernel_matrix(x1, x2, lengthscale))


def rbf_kde_density(
    queries, data, bandwidth, weights=None, *, log=False, impl="auto", block_q=None, block_k=None,
    prune="auto", prune_tol=None, keys_in_order=False,
):
    """Gaussian kernel density estimate at arbitrary query points.

    ``p(q_i) = sum_j w_j N(q_i; x_j, diag(h^2)) / sum_j w_j``.

    Args:
      queries: (..., n, d) points where the density is evaluated.
      data: (..., m, d) sample points; m >= 1.
      bandwidth: scalar or (d,) per-dimension standard deviation h of the Gaussian kernel.
      weights: optional (..., m) non-negative sample weights (normalised here); None for equal.
      log: return the log-density, computed with a running row maximum so that queries far from
        every data point get their true, very negative value rather than -inf.
      impl, block_q, block_k, prune, keys_in_order: as in `rbf_kernel_mv` (data are the keys).
      prune_tol: with pruning, each query's skipped mass is at most ``prune_tol`` times its
        computed density (a relative error). None: half the dtype's epsilon.
    Returns:
      (..., n) densities or log-densities, differentiable in queries, data, bandwidth and weights.

    As in `rbf_kernel_mv`, data spread over many bandwidths take the coordinate differences
    instead of the distance expansion (xla and pallas, d <= 16), decided from the data alone.
    """
    queries, data = jnp.asarray(queries), jnp.asarray(data)
    check_point_sets(queries, data, ("queries", "data"))
    n, m, d = queries.shape[-2], data.shape[-2], data.shape[-1]
    if m == 0:
        raise ValueError("data must contain at least one point, got m=0")
    if weights is not None:
        weights = jnp.asarray(weights)
        check_weights(weights, m)
    dtype = float_dtype(queries, data, *([] if weights is None else [weights]))
    bandwidth = check_scale(bandwidth, d, "bandwidth", dtype)
    batch = _kde_batch_shape(queries, data, weights)
    check_prune(prune, prune_tol)
    if n == 0:
        return jnp.zeros(batch + (0,), dtype)
    # No weights stay None into the program: each branch that needs them builds them
    # (`sum_to_one`), where ones passed in were an operand of every branch (docs/decisions.md #41)
    return _rbf_kde_density(queries.astype(dtype), data.astype(dtype),
                            None if weights is None else weights.astype(dtype), bandwidth,
                            log=bool(log), impl=impl, block_q=block_q, block_k=block_k,
                            prune=prune, prune_tol=static_tol(prune_tol),
                            keys_in_order=bool(keys_in_order))


@functools.partial(jax.jit, static_argnames=(
    "log", "impl", "block_q", "block_k", "prune", "prune_tol", "keys_in_order"))
def _rbf_kde_density(queries, data, weights, bandwidth, *, log, impl, block_q, block_k, prune,
                     prune_tol, keys_in_order):
    """`rbf_kde_density` on checked arguments in the compute dtype (n, m >= 1); compiled once
    per shapes and settings, as `_rbf_kernel_mv`."""
    n, m, d = queries.shape[-2], data.shape[-2], data.shape[-1]
    dtype = queries.dtype
    batch = _kde_batch_shape(queries, data, weights)
    chosen = plan(impl, m, d, dtype, queries=None if batch else n, block_q=block_q,
                  block_k=block_k)
    log_sum = _kde_log_sum(chosen, bandwidth, batch, data, dtype)
    pruning = pruning_mode(prune, prune_tol, impl, m, d, dtype, bool(batch), block_q, block_k)
    if pruning is not None:
        log_sum = _pruned_kde_log_sum(log_sum, pruning, bandwidth, keys_in_order)
    log_norm = gaussian_log_norm(bandwidth, d)

    def single(q, x, w):
        out = log_sum(q, x, w) + log_norm
        # exp on whole tiles: its vector and remainder loops round differently (tiling.py)
        return out if log else rowwise_padded(jnp.exp, out, round_up(n, FULL_TILE_ROWS))

    if batch:
        flat = [flat_batch(x, batch, k) for x, k in zip((queries, data), (2, 2))]
        if weights is None:
            return jax.vmap(lambda q, x: single(q, x, None))(*flat).reshape(batch + (n,))
        return jax.vmap(single)(*flat, flat_batch(weights, batch, 1)).reshape(batch + (n,))
    return single(queries, data, weights)


def _kde_batch_shape(queries, data, weights):
    """The broadcast batch shape of a KDE call's queries, data and weights (None: none)."""
    shapes = [(queries.shape[:-2], "queries"), (data.shape[:-2], "data")]
    return batch_shape(*shapes, *([] if weights is None else [(weights.shape[:-1], "weights")]))


def _kde_log_sum(chosen, bandwidth, batch, data, dtype):
    """``(q, x, w) -> log sum_j w_j K(q_i, x_j) / sum_j w_j`` by the plan's log-sum-exp; data
    spread over many bandwidths take the exponents from the coordinate differences (3e-4
    relative error in the density at d = 2, bandwidth 0.01 of a unit square, before;
    docs/decisions.md #4)."""
    core = chosen.rbf()
    lse = core.lse

    def expansion(a, b, far_a, far_b, w):
        return jnp.where(far_a, -jnp.inf, lse(a, b, normalised_weights(w, far_b, a.dtype)))

    def log_sum(q, x, w):
        return expansion(*prepare(q, x, bandwidth), w)

    if core.scaled_lse is not None and jnp.ndim(bandwidth) == 0:
        fixed, through = through_one_scalar(bandwidth)

        def log_sum(q, x, w):
            a, b, far_a, far_b = prepare(q, x, fixed)
            return jnp.where(far_a, -jnp.inf, core.scaled_lse(
                a, b, normalised_weights(w, far_b, a.dtype), through))

    if not chosen.differences:
        return log_sum
    lse_differences = chosen.rbf(direct=True).lse

    def differences(q, x, w, centre=None):
        a, b, far_a, far_b = centred(q, x, bandwidth, centre)
        return jnp.where(far_a, -jnp.inf,
                         lse_differences(a, b, normalised_weights(w, far_b, a.dtype)))

    return _rbf_branches(bandwidth, batch, data, dtype, expansion, differences)


def _pruned_kde_log_sum(log_sum, pruning, bandwidth, keys_in_order):
    """`_kde_log_sum` with tiles pruned (`pruning_mode`): always, or where ``prune="auto"``
    finds at run time that it pays (else ``log_sum``)."""
    always, tol, core = pruning

    def pruned_log_sum(q, x, w):
        if always:
            keys = ordered_keys(x, bandwidth, core.block, in_order=keys_in_order)
            return kernel_logsumexp(q, keys, sum_to_one(w, x.shape[0], x.dtype), bandwidth, tol,
                                    core)
        pays, keys = auto_keys(x, bandwidth, tol, keys_in_order,
                                        max_visited=kde_max_visited(x.shape[1]))
        return lax.cond(
            pays, lambda: kernel_logsumexp(q, keys(), sum_to_one(w, x.shape[0], x.dtype),
                                           bandwidth, tol, core),
            lambda: log_sum(q, x, w))

    return pruned_log_sum
