"""Public entry points of the engine: validation, lengthscale scaling, centring, batching, and the
choice of implementation (``impl="auto"``).

Every implementation works on *prepared* inputs ``a = (x1 - c) / l`` and ``b = (x2 - c) / l``: one
kernel then serves scalar and ARD lengthscales, and centring keeps ``|a|^2 + |b|^2 - 2 a.b``
accurate for offset data. The centre ``c`` comes from the keys ``x2`` alone (a median of them,
`scalegp.ops._centre.centre_of`, which one outlier does not move), so a query row's result
depends on that row and the keys only: a far query cannot shift the centre and cost the
other rows their digits. It is held constant under autodiff (``stop_gradient``): the kernel is
translation invariant, so its true derivative through ``c`` is exactly zero. Gradients with
respect to the lengthscale flow through the scaling.

Row independence, bitwise: the implementation and tile sizes that ``auto`` (and an explicit "xla")
picks depend on the keys, never on the number of queries, and the query tile has a fixed height,
so every query row goes through the same compiled arithmetic whatever else is in the batch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp.ops import _pallas, _pruning, _reference, _xla
from scalegp.ops._centre import centre_of
from scalegp.ops._kernels import DIRECT_MAX_D, RBF
from scalegp.ops._tiling import BlockSizes, even_block, round_up, rowwise_padded

IMPLEMENTATIONS = ("dense", "xla", "pallas")

# Height of the xla path's query tile: fixed, so that a row's arithmetic does not depend on how
# many queries share the call. As tall as the tiles large problems had before (512 rows cost the
# kernel product up to a tenth more); the price is that a lone query pays for a full tile.
XLA_BLOCK_Q = 1024
XLA_MAX_BLOCK_K = 1024


def _backend(backend: str | None) -> str:
    return backend or jax.default_backend()


def available_implementations(backend: str | None = None) -> dict[str, str]:
    """Which implementations run on ``backend`` (default: JAX's default backend), and how."""
    backend = _backend(backend)
    pallas_mode = (
        "compiled (Triton)" if backend == "gpu" else "interpret mode (correct but slow: for tests)"
    )
    return {"dense": "compiled", "xla": "compiled", "pallas": pallas_mode}


def auto_config(m: int, d: int, *, dtype=jnp.float32, backend: str | None = None
                ) -> tuple[str, BlockSizes]:
    """The implementation and tile sizes that ``impl="auto"`` picks for ``m`` keys of ``d``
    features.

    The choice depends on the keys only, never on the number of queries, so that each query
    row's result is bitwise the same in any batch. Hence no dense path under auto: its
    ``(n, m)`` products round differently for different n. Pallas on a GPU in float32, else xla.

    Returns ``(impl, block_sizes)``.
    """
    backend = _backend(backend)
    if backend == "gpu" and jnp.dtype(dtype) == jnp.float32:
        return "pallas", _pallas.default_block_sizes(d)
    return "xla", xla_block_sizes(m)


def xla_block_sizes(m: int) -> BlockSizes:
    """The xla path's tiles for ``m`` keys: a fixed query height, keys in near-equal tiles."""
    return BlockSizes(block_q=XLA_BLOCK_Q, block_k=even_block(m, XLA_MAX_BLOCK_K))


def check_impl(impl) -> None:
    if impl not in IMPLEMENTATIONS + ("auto",):
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS + ('auto',)}, got {impl!r}")


def implementation(impl, m, d, dtype) -> str:
    """"dense", "xla" or "pallas": ``impl`` with "auto" resolved (`auto_config`)."""
    check_impl(impl)
    return auto_config(m, d, dtype=dtype)[0] if impl == "auto" else impl


def overridden(default: BlockSizes, block_q=None, block_k=None, block_o=None) -> BlockSizes:
    """``default`` with the tile sizes the caller gave (None: keep)."""
    overrides = {k: int(v) for k, v in (("block_q", block_q), ("block_k", block_k),
                                        ("block_o", block_o)) if v is not None}
    return BlockSizes(**{**vars(default), **overrides})


def _resolve(impl, m, d, dtype, block_q, block_k, block_o, lse_differences=False):
    """(core kernel_mv, core kernel_logsumexp) for the requested implementation and tiles;
    with ``lse_differences`` (xla or pallas, d <= `DIRECT_MAX_D`), the log-sum-exp whose
    exponents come from the coordinate differences."""
    impl = implementation(impl, m, d, dtype)
    if impl == "dense":
        return _reference.kernel_mv, _reference.kernel_logsumexp
    if impl == "xla":
        block_sizes = overridden(xla_block_sizes(m), block_q, block_k, block_o)
        lse = _xla.kernel_logsumexp_differences if lse_differences else _xla.kernel_logsumexp
        return (
            functools.partial(_xla.kernel_mv, block_sizes=block_sizes),
            functools.partial(lse, block_sizes=block_sizes),
        )
    block_sizes = overridden(_pallas.default_block_sizes(d), block_q, block_k, block_o)
    interpret = _backend(None) != "gpu"
    lse = _pallas.kernel_logsumexp_differences if lse_differences else _pallas.kernel_logsumexp
    return (
        functools.partial(_pallas.kernel_mv, block_sizes=block_sizes, interpret=interpret),
        functools.partial(lse, block_sizes=block_sizes, interpret=interpret),
    )


# ----------------------------------------------------------------------------------------------
# validation


def float_dtype(*arrays):
    dtype = jnp.result_type(float, *arrays)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"expected real floating-point inputs, got dtype {dtype}")
    return dtype


def concrete(x):
    """x as a numpy array, or None when it is traced (inside jit/grad) and has no value yet."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_point_sets(x1, x2, names):
    n1, n2 = names
    for name, x in ((n1, x1), (n2, x2)):
        if x.ndim < 2:
            raise ValueError(
                f"{name} must have shape (..., n, d), got shape {x.shape}; "
                f"for n points in one dimension pass {name}[:, None]"
            )
    if x1.shape[-1] != x2.shape[-1]:
        raise ValueError(
            f"{n1} has d={x1.shape[-1]} but {n2} has d={x2.shape[-1]}; both point sets need the "
            "same number of dimensions"
        )


def check_scale(scale, d, name, dtype):
    scale = jnp.asarray(scale)
    if scale.ndim > 1 or (scale.ndim == 1 and scale.shape[0] != d):
        raise ValueError(
            f"{name} must be a scalar or have d={d} entries (one per dimension), "
            f"got shape {scale.shape}"
        )
    value = concrete(scale)
    if value is not None and not np.all(np.isfinite(value) & (value > 0)):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return scale.astype(dtype)


def _batch_shape(*shapes_and_names):
    try:
        return np.broadcast_shapes(*(s for s, _ in shapes_and_names))
    except ValueError:
        desc = ", ".join(f"{name} {s}" for s, name in shapes_and_names)
        raise ValueError(f"leading batch dimensions do not broadcast: {desc}") from None


def _flat_batch(x, batch_shape, core_ndim):
    """Broadcast x's batch dimensions to batch_shape and merge them into one leading axis."""
    core = x.shape[x.ndim - core_ndim :]
    return jnp.broadcast_to(x, batch_shape + core).reshape((-1,) + core)


def prepare(x1, x2, scale):
    """Prepared coordinates ``((x1 - c) / scale, (x2 - c) / scale, far_1, far_2)``, with ``c`` the
    centre of the keys x2 (`centre_of`).

    ``far_*`` (p,) flag rows whose squared norm is not finite in the dtype. Such a row is farther
    from every other point than the dtype can express, so its kernel values are exactly 0; its
    coordinates are set to 0 here, which keeps ``inf - inf`` (NaN) out of the distance expansion,
    and the caller gives it its limit: 0 in a product, zero weight as a key, -inf as a
    log-density query.
    """
    return centred(x1, x2, scale)


def prepared_rows(x, centre, scale):
    """``((x - centre) / scale`` with its far rows set to 0, far (p,))``: one point set of
    `prepare`."""
    # times the reciprocal, not divided: XLA rewrites a division by a broadcast into that
    # product, but not when x has one row (no broadcast), which made a lone row round apart
    a = (x - centre) * (1 / scale)
    far = ~jnp.isfinite(jnp.sum(a * a, axis=-1))
    return masked_rows(a, far), far


def masked_rows(x, far):
    """x with the flagged rows (leading axis) set to 0."""
    return jnp.where(far[:, None], jnp.zeros((), x.dtype), x)


def centred(x1, x2, scale=None):
    """``((x1 - c) / scale, (x2 - c) / scale, far_1, far_2)`` with c the keys' centre
    (`centre_of`); unscaled when ``scale`` is None.

    Both point sets must be shifted by the very same float ``c``: the differences of nearby
    points far from the origin are then exact. The centre was once the keys' mean, which XLA
    recomputed as ``sum · (1/m)`` inside each consumer's fusion, and those fusions rounded
    ``x - sum · (1/m)`` apart (a fused multiply-add leaves the product unrounded): a 1e-4
    relative error of K v at a lengthscale of 0.1 on points offset by 1e3. A median is one of
    the keys' own numbers, picked, not computed, so every consumer sees the same float.
    """
    centre = centre_of(x2)
    scale = jnp.ones((), x2.dtype) if scale is None else scale
    (a, far_a), (b, far_b) = prepared_rows(x1, centre, scale), prepared_rows(x2, centre, scale)
    return a, b, far_a, far_b


def centred_product(core):
    """``(x1, x2, v) -> K v`` from ``core(a, b, v)``, a product on points centred as `centred`
    does: rows too far to express are set to 0 going in (keys: zero weight) and coming out."""

    def product(x1, x2, v):
        a, b, far_a, far_b = centred(x1, x2)
        return masked_rows(core(a, b, masked_rows(v, far_b)), far_a)

    return product


# ----------------------------------------------------------------------------------------------
# public operations


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
      impl: "dense" (builds K), "xla" (blocked, memory-linear), "pallas" (fused kernels; GPU, or
        interpret mode on CPU) or "auto" (see `auto_config`).
      block_q, block_k, block_o: tile sizes overriding the implementation's defaults (the
        pruned Pallas kernels take one tile height for queries and keys: block_q = block_k).
      prune: skip tiles of the kernel matrix that provably cannot matter (after putting both
        point sets in a k-d order; see `scalegp.ops._pruning`): True, False, or "auto", which
        prunes only large, low-dimensional key sets whose tile bounds show that it pays (decided
        from the keys alone). Pruning runs the blocked CPU path (impl "xla", or "auto" on CPU)
        or, with ``prune=True`` where the implementation is "pallas" (given, or "auto" on a
        GPU), the pruned Pallas kernels (`scalegp.ops._pallas_pruning`; "auto" does not prune
        on that path).
      prune_tol: what may be skipped: per output row and column at most
        ``prune_tol · sum_j |v_j|``. None: half the dtype's epsilon (under rounding); 0: only
        tiles whose every kernel value underflows to 0.
      keys_in_order: x2 is already in `scalegp.ops.spatial_order` (for repeated calls with the
        same keys: pruning then does not sort them each time). Never changes the result's
        accuracy, only how much pruning saves.
    Returns:
      (..., n, o), or (..., n) for vector ``v``. Differentiable in x1, x2, v and lengthscale; the
      xla and pallas paths use O((n + m)(d + o)) memory in the forward and backward pass.

    Distances come from the expansion ``|a|² + |b|² - 2 a·b`` (one matrix product per tile),
    whose rounding grows with the points' squared norms in lengthscales. For d <= 16, keys
    spread over many lengthscales (`rbf_expansion_ok`) take the coordinate differences instead
    (on pallas, the expression kernels'), by ``lax.cond`` on the keys; pass a batch as leading
    dimensions rather than ``jax.vmap`` around this function, under which the predicate is
    batched and both paths run.
    """
    self_product = x1 is x2
    x1, x2, v, vector, dtype = _product_arguments(x1, x2, v)
    n, m, d, o = x1.shape[-2], x2.shape[-2], x1.shape[-1], v.shape[-1]
    lengthscale = check_scale(lengthscale, d, "lengthscale", dtype)
    batch_shape = _batch_shape((x1.shape[:-2], "x1"), (x2.shape[:-2], "x2"), (v.shape[:-2], "v"))
    if n == 0 or m == 0:
        out = jnp.zeros(batch_shape + (n, o), dtype)
        return out[..., 0] if vector else out
    mv, _ = _resolve(impl, m, d, dtype, block_q, block_k, block_o)

    def expansion(a, b, far_a, far_b, v):
        return masked_rows(mv(a, b, masked_rows(v, far_b)), far_a)

    def single(x1, x2, v):
        return expansion(*prepare(x1, x2, lengthscale), v)

    chosen = implementation(impl, m, d, dtype)
    if d <= DIRECT_MAX_D and chosen != "dense":
        # keys spread over many lengthscales: the coordinate differences, whose lengthscale
        # gradient is accurate there too
        differences = centred_product(functools.partial(
            expression_core(chosen, m, d, block_q, block_k, block_o, direct_weights=True),
            RBF(lengthscale)))
        single = _rbf_branches(lengthscale, batch_shape, x2, dtype, expansion, differences)
    pruning = _pruning_mode(prune, prune_tol, impl, m, d, dtype, bool(batch_shape),
                            block_q, block_k)
    if pruning is not None:
        always, tol, (block, mv_core, _) = pruning
        single_pruned = _pruning.pruned_product(single, lengthscale, always, tol, keys_in_order,
                                                self_product, block=block, core=mv_core)
        return _batched_product(single_pruned, x1, x2, v, batch_shape, vector, dtype)
    return _batched_product(single, x1, x2, v, batch_shape, vector, dtype)


def expression_core(impl, m, d, block_q=None, block_k=None, block_o=None,
                    direct_weights=False):
    """The kernel-expression product ``(kernel, x, y, v) -> K(x, y) v`` on centred, unscaled
    points for a resolved implementation (`implementation`) and tile overrides (block_o on xla
    only). ``direct_weights``: on xla, the lengthscale gradients from the coordinate
    differences (`_xla.expression_mv_direct_weights`), accurate at short lengthscales; the
    Pallas kernels take them from the tiles' differences anyway (d <= 16)."""
    if impl == "dense":
        return _reference.expression_mv
    if impl == "pallas":
        from scalegp.ops import _pallas_expression

        block_sizes = overridden(_pallas_expression.default_block_sizes(d), block_q, block_k)
        interpret = _backend(None) != "gpu"
        return lambda kernel, x, y, v: _pallas_expression.expression_mv(
            kernel, x, y, v, block_sizes, interpret)
    block_sizes = overridden(xla_block_sizes(m), block_q, block_k, block_o)
    product = _xla.expression_mv_direct_weights if direct_weights else _xla.expression_mv
    return lambda kernel, x, y, v: product(kernel, x, y, v, block_sizes)


def keys_mean_sq(x2, scaled, batch_shape, dtype):
    """The keys' mean squared norm ``mean_j |b_j|²`` with ``b = scaled(x2)`` (prepared keys),
    the largest over a batch, without gradient: what decides between a product's distance
    expansion and its coordinate differences (`scalegp.ops._xla.RBF_EXPANSION_MEAN_LIMIT`).
    It depends on the keys alone (row independence) and is one unbatched number, so that a
    ``lax.cond`` on it stays a branch under the engine's ``vmap`` (a batched predicate would
    make it a select, which runs both paths); across a batch the largest chooses for all."""
    keys = x2.astype(dtype)
    if batch_shape:
        keys = jnp.reshape(keys, (-1,) + keys.shape[-2:])
        return lax.stop_gradient(jnp.max(jax.vmap(lambda x2: mean_sq(scaled(x2)))(keys)))
    return lax.stop_gradient(mean_sq(scaled(keys)))


def mean_sq(b):
    """``mean_j |b_j|²`` of prepared keys b (m, d)."""
    return jnp.mean(jnp.sum(b * b, axis=-1))


def expansion_ok(b):
    """Whether the RBF's distance expansion is accurate enough for prepared keys b (m, d): their
    mean squared norm (`mean_sq`, no gradient) against `_xla.RBF_EXPANSION_MEAN_LIMIT`."""
    return lax.stop_gradient(mean_sq(b)) <= _xla.RBF_EXPANSION_MEAN_LIMIT


def rbf_expansion_ok(x2, lengthscale, batch_shape, dtype):
    """Whether the xla RBF product's distance expansion is accurate enough for these keys
    (`keys_mean_sq` of the keys prepared as `prepare` does, against
    `_xla.RBF_EXPANSION_MEAN_LIMIT`)."""
    def scaled(x2):
        return prepare(x2[:1], x2, lengthscale)[1]

    return keys_mean_sq(x2, scaled, batch_shape, dtype) <= _xla.RBF_EXPANSION_MEAN_LIMIT


def _rbf_branches(lengthscale, batch_shape, x2, dtype, expansion, differences):
    """``single(x1, x2, *rest)`` that runs ``expansion(a, b, far_a, far_b, *rest)`` on the
    prepared points (`prepare`) where the keys allow it (`rbf_expansion_ok`), else
    ``differences(x1, x2, *rest)``, by ``lax.cond``: only the branch taken runs. Unbatched,
    the choice comes from the prepared keys the expansion uses (no second pass over them);
    batched, from all members' keys before the engine's ``vmap`` (`keys_mean_sq`)."""
    batch_ok = rbf_expansion_ok(x2, lengthscale, batch_shape, dtype) if batch_shape else None

    def single(x1, x2, *rest):
        a, b, far_a, far_b = prepare(x1, x2, lengthscale)
        ok = expansion_ok(b) if batch_ok is None else batch_ok
        return lax.cond(ok, lambda: expansion(a, b, far_a, far_b, *rest),
                        lambda: differences(x1, x2, *rest))

    return single


def _pruning_mode(prune, prune_tol, impl, m, d, dtype, batched, block_q=None, block_k=None):
    """None (no pruning), or ``(always, tol, cores)``: prune unconditionally, or as
    ``prune="auto"`` decides at run time (`_pruning.pruning_pays`); ``cores`` is ``(block,
    tiled K v, tiled log-sum-exp)`` of the implementation (`_pruned_cores`)."""
    _pruning.check_prune(prune, prune_tol)
    if prune is False:
        return None
    tol = _pruning.default_tolerance(dtype) if prune_tol is None else float(prune_tol)
    resolved = auto_config(m, d, dtype=dtype)[0] if impl == "auto" else impl
    if prune is True:
        if resolved not in ("xla", "pallas"):
            raise ValueError(
                f"prune=True runs the blocked CPU path or the pruned Pallas kernels, which "
                f"impl={impl!r} does not select here; pass impl='xla' or 'pallas', or "
                "prune=False")
        return True, tol, _pruned_cores(resolved, d, block_q, block_k)
    # "auto" prunes on the xla path only: the pruned Pallas kernels are untimed on a GPU
    if resolved != "xla" or not _pruning.considered_by_auto(m, d, batched):
        return None
    return False, tol, _pruned_cores(resolved, d, block_q, block_k)


def _pruned_cores(impl, d, block_q, block_k):
    """``(block, mv core, logsumexp core)`` of the pruned path: the xla scan (`_pruning`, tiles
    of `_pruning.PRUNE_BLOCK`, cores None for its defaults) or the Pallas kernels
    (`_pallas_pruning`; tiles from its defaults or ``block_q``/``block_k``, which must agree)."""
    if impl == "xla":
        return _pruning.PRUNE_BLOCK, None, None
    from scalegp.ops import _pallas_pruning

    default = _pallas_pruning.default_block_sizes(d)
    block = block_k if block_k is not None else block_q
    bs = default if block is None else BlockSizes(**{
        **vars(default), "block_q": int(block_q if block_q is not None else block),
        "block_k": int(block)})
    block = _pallas_pruning.check_block_sizes(bs)
    interpret = _backend(None) != "gpu"

    def mv(x, y, v, inv_scale, tol):
        return _pallas_pruning.pruned_kernel_mv(x, y, v, inv_scale, tol, bs, interpret)

    def lse(x, y, w, inv_scale, tol):
        return _pallas_pruning.pruned_kernel_logsumexp(x, y, w, inv_scale, tol, bs, interpret)

    return block, mv, lse


def _product_arguments(x1, x2, v):
    """The checked arguments of a kernel product: ``(x1, x2, v (..., m, o), vector, dtype)``."""
    x1, x2, v = jnp.asarray(x1), jnp.asarray(x2), jnp.asarray(v)
    check_point_sets(x1, x2, ("x1", "x2"))
    vector = v.ndim == x2.ndim - 1
    if not vector and v.ndim != x2.ndim:
        raise ValueError(
            f"v must have shape (..., m, o) or (..., m) to match x2 of shape {x2.shape}, "
            f"got shape {v.shape}"
        )
    if vector:
        v = v[..., None]
    if v.shape[-2] != x2.shape[-2]:
        raise ValueError(f"v has {v.shape[-2]} rows but x2 has m={x2.shape[-2]} points")
    return x1, x2, v, vector, float_dtype(x1, x2, v)


def _batched_product(single, x1, x2, v, batch_shape, vector, dtype):
    """``single(x1, x2, v)`` over the broadcast batch dimensions (vmapped over one flat axis)."""
    n, o = x1.shape[-2], v.shape[-1]
    args = (x1.astype(dtype), x2.astype(dtype), v.astype(dtype))
    if batch_shape:
        args = [_flat_batch(x, batch_shape, 2) for x in args]
        out = jax.vmap(single)(*args).reshape(batch_shape + (n, o))
    else:
        out = single(*args)
    return out[..., 0] if vector else out


def rbf_log_kernel_matrix(x1, x2, lengthscale):
    """The dense exponents ``log K(x1, x2) = -1/2 sum_d ((x1_id - x2_jd) / l_d)^2``, (n, m): for
    small problems and log-space sums (a KDE's leave-one-out terms); it holds n x m numbers.

    Prepared as the memory-linear products are (scaled, centred by the keys x2; rows whose
    squared norm overflows give -inf), so dense and blocked computations on the same points
    agree to rounding. Differentiable in x1, x2 and the lengthscale.

    Args:
      x1: (n, d); x2: (m, d); lengthscale: scalar or (d,), positive.
    Returns:
      (n, m), every entry <= 0.
    """
    x1, x2 = jnp.asarray(x1), jnp.asarray(x2)
    check_point_sets(x1, x2, ("x1", "x2"))
    dtype = float_dtype(x1, x2)
    lengthscale = check_scale(lengthscale, x1.shape[-1], "lengthscale", dtype)
    a, b, far_a, far_b = prepare(x1.astype(dtype), x2.astype(dtype), lengthscale)
    e = _reference.neg_half_sqdist(a, b, _reference.half_sq_norms(a), _reference.half_sq_norms(b))
    return jnp.where(far_a[:, None] | far_b[None, :], -jnp.inf, e)


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
    if weights is None:
        weights = jnp.ones(data.shape[:-1], data.dtype)
    weights = jnp.asarray(weights)
    if weights.ndim < 1 or weights.shape[-1] != m:
        raise ValueError(f"weights must have shape (..., m) with m={m}, got shape {weights.shape}")
    value = concrete(weights)
    if value is not None and not (np.all(np.isfinite(value)) and np.all(value >= 0)):
        raise ValueError("weights must be finite and non-negative")
    if value is not None and np.any(np.sum(value, axis=-1) <= 0):
        raise ValueError("weights must not all be zero")
    dtype = float_dtype(queries, data, weights)
    bandwidth = check_scale(bandwidth, d, "bandwidth", dtype)
    batch_shape = _batch_shape(
        (queries.shape[:-2], "queries"), (data.shape[:-2], "data"), (weights.shape[:-1], "weights")
    )
    _, lse = _resolve(impl, m, d, dtype, block_q, block_k, None)
    log_norm = -0.5 * d * math.log(2 * math.pi) - jnp.sum(jnp.log(bandwidth)) * (
        d if bandwidth.ndim == 0 else 1
    )

    pruning = _pruning_mode(prune, prune_tol, impl, m, d, dtype, bool(batch_shape), block_q,
                            block_k)

    def normalised(w, far_b):  # far keys weigh nothing
        return jnp.where(far_b, jnp.zeros((), w.dtype), w / jnp.sum(w))

    def expansion(a, b, far_a, far_b, w):
        return jnp.where(far_a, -jnp.inf, lse(a, b, normalised(w, far_b)))

    def log_sum(q, x, w):
        return expansion(*prepare(q, x, bandwidth), w)

    chosen = implementation(impl, m, d, dtype)
    if d <= DIRECT_MAX_D and chosen != "dense":
        # data spread over many bandwidths: the exponents from the coordinate differences
        # (3e-4 relative error in the density at d = 2, bandwidth 0.01 of a unit square,
        # before; benchmarks/README.md, "Short lengthscales")
        _, lse_differences = _resolve(impl, m, d, dtype, block_q, block_k, None,
                                      lse_differences=True)

        def differences(q, x, w):
            a, b, far_a, far_b = centred(q, x, bandwidth)
            return jnp.where(far_a, -jnp.inf, lse_differences(a, b, normalised(w, far_b)))

        log_sum = _rbf_branches(bandwidth, batch_shape, data, dtype, expansion, differences)

    def pruned_log_sum(q, x, w):
        always, tol, (block, _, lse_core) = pruning
        if always:
            keys = _pruning.ordered_keys(x, bandwidth, block, in_order=keys_in_order)
            return _pruning.kernel_logsumexp(q, keys, w / jnp.sum(w), bandwidth, tol, lse_core)
        pays, keys = _pruning.auto_keys(x, bandwidth, tol, keys_in_order)
        return lax.cond(
            pays, lambda: _pruning.kernel_logsumexp(q, keys, w / jnp.sum(w), bandwidth, tol),
            lambda: log_sum(q, x, w))

    def single(q, x, w):
        out = (log_sum if pruning is None else pruned_log_sum)(q, x, w) + log_norm
        # exp on whole tiles: its vector and remainder loops round differently (tiling.py)
        return out if log else rowwise_padded(jnp.exp, out, round_up(n, XLA_BLOCK_Q))

    args = (queries.astype(dtype), data.astype(dtype), weights.astype(dtype))
    if n == 0:
        out = jnp.zeros(batch_shape + (0,), dtype)
    elif batch_shape:
        flat = [_flat_batch(x, batch_shape, k) for x, k in zip(args, (2, 2, 1))]
        out = jax.vmap(single)(*flat).reshape(batch_shape + (n,))
    else:
        out = single(*args)
    return out
