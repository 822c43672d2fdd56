"""The engine's reductions over several devices: a `jax.sharding.Mesh` and `jax.shard_map`.

Same maths and the same per-device code as one device (`scalegp.ops._rbf`, the tile cores
that `scalegp.ops._plan.plan` gives); only the data are spread::

    out = K(x1, x2) @ v                 x1 (n, d), x2 (m, d), v (m, o)  -> (n, o)
    log p(q_i) = log sum_j w_j N(q_i; x_j, diag(h^2)) / sum_j w_j      -> (n,)

Query rows are sharded over the mesh axis (p devices, n/p rows each). The keys (x2 with v, or the
data with their weights) are sharded too, and reach every query shard in one of two ways:

- ``scheme="allgather"``: each device gathers all m keys once (``lax.all_gather``) and runs the
  single-device kernel on (n/p queries) x (m keys). Fastest when m (d + o) numbers fit on one
  device. Gradients: autodiff through ``shard_map``; the transpose of the gather reduce-scatters
  (psum over devices) each device's partial key gradients to their owners.
- ``scheme="ring"``: key blocks of m/p rows travel around a ring (``lax.ppermute`` to the next
  device, p - 1 hops), so per-device memory stays O((n + m)/p (d + o)). Each step adds one block's
  contribution: partial products for K v; for the KDE, partial log-sum-exps combined as
  (running max M, log-sum L) pairs exactly like the xla kernel's online log-sum-exp. The backward
  is a second ring (a `jax.custom_vjp`, so no per-step residuals are stored): the query gradient
  accumulates in place, and each key block's gradient travels with the block and is sent home by
  one last hop.

The sends are issued before the block's computation so XLA can overlap transfer and compute.

Lengthscale/bandwidth scaling and centring happen in the global view (outside ``shard_map``, as
``a = (x1 - c) / l``) on row-sharded arrays, so the lengthscale gradient is a sum over sharded
rows, which XLA's partitioner finishes with an all-reduce (the psum of the per-device partial
gradients). The centre c is held constant, as in `scalegp.ops._prepare`.

RBF keys spread over too many lengthscales for the distance expansion (d <= 16) take the
expression kernels' coordinate differences instead, with ``RBF(l)``, by a ``lax.cond`` on the keys'
mean squared norm (`scalegp.ops._plan.expansion_or_differences`), as
`scalegp.ops.rbf_kernel_mv` does on one device; KDE data spread over too many bandwidths take the
log-sum-exp kernels' differences variants, as `rbf_kde_density` does. The plan decides whether
the differences may run at all, as on one device (not for "dense").

n or m not divisible by p: queries are padded with zero rows (cut from the output, zero
cotangent), keys with zero values / zero weights (which contribute nothing, forward or backward).

Kernel expressions (`sharded_expression_mv`, the sharded `scalegp.ops.kernel_mv`): the same two
schemes around the expression kernels (each backend's `ExpressionCore`), on
points centred in the global view as `scalegp.ops._expression` centres them (not scaled: each term
scales its own distances). The kernel's hyperparameters are replicated on every device. Both
schemes have their backward written out (a `jax.custom_vjp` each): a device's gradient in the
hyperparameters sums over the key blocks it saw and is then summed over the devices (a psum of
the hyperparameters alone); the key gradients go home with their blocks (ring) or by a
reduce-scatter (all-gather).

Per device, the ``impl`` choice (``"auto"``, ``"dense"``, ``"xla"``, ``"pallas"``) is made for the
shard sizes (n/p x m for the gather, n/p x m/p for the ring) by `scalegp.ops._plan.plan`, the
one-device table; "dense" runs a shard's kernel matrix as one tile of the blocked code.
Results agree with the single-device engine up to float summation order (~1e-7 relative).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from scalegp.ops._checks import (
    check_scale,
    check_unbatched,
    check_weights,
    float_dtype,
    unbatched_values,
)
from scalegp.ops._interface import Plan
from scalegp.ops._kernels import RBF, check_kernel, rbf_form
from scalegp.ops._plan import expansion_ok, expansion_or_differences, plan
from scalegp.ops._prepare import (
    centre_of,
    centred,
    masked_rows,
    normalised_weights,
    prepare,
    prepared_rows,
)
from scalegp.ops._tile_math import gaussian_log_norm
from scalegp.ops._tiling import pad_axis, round_up
from scalegp.ops.sharding._mesh import SCHEMES, check_scheme, mesh_axis
from scalegp.ops.sharding._schemes import (
    gathered,
    gathered_expression_mv,
    replicated,
    ring_expression_mv,
    ring_lse,
    ring_mv,
)

_STATIC = ("mesh", "axis", "p", "scheme", "chosen")


@functools.partial(jax.jit, static_argnames=_STATIC + ("differences",))
def _kernel_mv(x1, x2, v, lengthscale, *, mesh, axis, p, scheme, chosen: Plan, differences):
    """``differences``: None, or the `Plan` of the expression kernels, which take the
    coordinate differences where the keys are spread over too many lengthscales for the
    distance expansion (`scalegp.ops._plan.expansion_ok`), chosen by
    `expansion_or_differences` as on one device."""
    n, m = x1.shape[0], x2.shape[0]
    a, b, far_a, far_b = prepare(x1, x2, lengthscale)

    def expansion():
        n_pad, m_pad = round_up(n, p), round_up(m, p)
        a_pad, b_pad = pad_axis(a, n_pad), pad_axis(b, m_pad)
        v_pad = pad_axis(masked_rows(v, far_b), m_pad)
        core = chosen.rbf()
        if scheme == "ring":
            out = ring_mv(mesh, axis, p, core)(a_pad, b_pad, v_pad)
        else:
            out = gathered(mesh, axis, core.mv, 2)(a_pad, b_pad, v_pad)
        return masked_rows(out[:n], far_a)

    if differences is None:
        return expansion()
    return expansion_or_differences(expansion_ok(b), expansion, lambda: _expression_product(
        RBF(lengthscale), x1, x2, v, mesh=mesh, axis=axis, p=p, scheme=scheme,
        chosen=differences, direct_weights=True))


def _expression_product(kernel, x1, x2, v, *, mesh, axis, p, scheme, chosen: Plan,
                        direct_weights=False):
    n, m = x1.shape[0], x2.shape[0]
    x, y, far_x, far_y = centred(x1, x2)
    v = masked_rows(v, far_y)
    n_pad, m_pad = round_up(n, p), round_up(m, p)
    x, y, v = pad_axis(x, n_pad), pad_axis(y, m_pad), pad_axis(v, m_pad)
    core = chosen.expression(direct_weights)
    if scheme == "ring":
        out = ring_expression_mv(mesh, axis, p, core)(kernel, x, y, v)
    else:
        out = gathered_expression_mv(mesh, axis, core)(kernel, x, y, v)
    return masked_rows(out[:n], far_x)


_expression_mv = jax.jit(_expression_product, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _kde_log_density(queries, data, bandwidth, weights, *, mesh, axis, p, scheme, chosen: Plan):
    """As on one device, where the plan allows (d <= 16, not "dense"), data spread over too
    many bandwidths for the distance expansion (`scalegp.ops._plan.expansion_ok`) take the
    coordinate differences, by `expansion_or_differences` on the data."""
    n, m, d = queries.shape[0], data.shape[0], data.shape[1]
    if scheme == "replicated":
        # keys are scaled per device; the data are finite (fitted), so only queries can be far
        w = weights / jnp.sum(weights)
        centre = centre_of(data)
        a, far_a = prepared_rows(queries, centre, bandwidth)
        a = pad_axis(a, round_up(n, p))

        def log_sum(core):
            return replicated(mesh, axis, core.lse)(a, data - centre, bandwidth, w)

        ok = expansion_ok(prepared_rows(data, centre, bandwidth)[0])
    else:
        a, b, far_a, far_b = prepare(queries, data, bandwidth)
        ok = expansion_ok(b)
        w = normalised_weights(weights, far_b, weights.dtype)
        n_pad, m_pad = round_up(n, p), round_up(m, p)
        a, b, w = pad_axis(a, n_pad), pad_axis(b, m_pad), pad_axis(w, m_pad)

        def log_sum(core):
            if scheme == "ring":
                return ring_lse(mesh, axis, p, core)(a, b, w)
            return gathered(mesh, axis, core.lse, 2)(a, b, w)

    if chosen.differences:
        f = expansion_or_differences(ok, lambda: log_sum(chosen.rbf()),
                                     lambda: log_sum(chosen.rbf(direct=True)))
    else:
        f = log_sum(chosen.rbf())
    return jnp.where(far_a, -jnp.inf, f[:n] + gaussian_log_norm(bandwidth, d))


def _shard_sizes(n, m, p, scheme):
    """The queries and keys one device holds: n/p queries; keys m/p (ring), m (all-gather,
    replicated)."""
    n_local = round_up(n, p) // p
    return n_local, {"ring": round_up(m, p) // p, "allgather": round_up(m, p)}.get(scheme, m)


def _checked_products(x1, x2, v, scheme):
    """The checked arguments of a sharded product: unbatched points, values (m, o) with whether
    they came as a vector, and the compute dtype."""
    check_scheme(scheme)
    x1, x2, v = jnp.asarray(x1), jnp.asarray(x2), jnp.asarray(v)
    check_unbatched(x1, x2, ("x1", "x2"))
    v, vector = unbatched_values(v, x2.shape[0])
    return x1, x2, v, vector, float_dtype(x1, x2, v)


def sharded_kernel_mv(
    x1, x2, v, lengthscale, *, mesh: Mesh, scheme: str = "allgather", axis=None, impl="auto",
    block_q=None, block_k=None, block_o=None,
):
    """`scalegp.ops.rbf_kernel_mv` with query rows sharded over ``mesh``.

    Args:
      x1: (n, d) queries; x2: (m, d) keys; v: (m, o) or (m,) values; lengthscale: scalar or (d,).
      mesh: the devices; rows are sharded over ``axis`` (default: all mesh axes).
      scheme: "allgather" (each device gathers all keys: fastest when m (d + o) fits on one
        device) or "ring" (key blocks passed around with ppermute: O((n + m)/p (d + o)) memory
        per device). See the module docstring.
      impl, block_q, block_k, block_o: the per-device implementation and tiles (as in
        `rbf_kernel_mv`), chosen for the shard sizes.
    Returns:
      (n, o) or (n,), row-sharded over the mesh axis when n is a multiple of its size. Equal to
      the single-device result up to summation order; differentiable in every argument, with the
      memory of the chosen scheme also in the backward pass.

    As on one device, for d <= 16 keys spread over too many lengthscales for the distance
    expansion take the expression kernels' coordinate differences (`sharded_expression_mv` with
    ``RBF(lengthscale)``), by a ``lax.cond`` on the keys.
    """
    x1, x2, v, vector, dtype = _checked_products(x1, x2, v, scheme)
    (n, d), m, o = x1.shape, x2.shape[0], v.shape[1]
    lengthscale = check_scale(lengthscale, d, "lengthscale", dtype)
    if n == 0 or m == 0:
        out = jnp.zeros((n, o), dtype)
        return out[:, 0] if vector else out
    axis, p = mesh_axis(mesh, axis)
    n_local, m_local = _shard_sizes(n, m, p, scheme)
    tiles = {"n": n_local, "block_q": block_q, "block_k": block_k, "block_o": block_o}
    chosen = plan(impl, m_local, d, dtype, **tiles)
    # as on one device: keys far apart in lengthscales take these
    differences = (plan(impl, m_local, d, dtype, family="expression", **tiles)
                   if chosen.differences else None)
    out = _kernel_mv(x1.astype(dtype), x2.astype(dtype), v.astype(dtype), lengthscale,
                     mesh=mesh, axis=axis, p=p, scheme=scheme, chosen=chosen,
                     differences=differences)
    return out[:, 0] if vector else out


def sharded_expression_mv(
    kernel, x1, x2, v, *, mesh: Mesh, scheme: str = "allgather", axis=None, impl="auto",
    block_q=None, block_k=None, block_o=None,
):
    """`scalegp.ops.kernel_mv` (any kernel expression) with query rows sharded over ``mesh``.

    Args:
      kernel: a `scalegp.ops` kernel (RBF, Matern, RationalQuadratic, ExpSineSquared, Constant,
        sums and products); its hyperparameters are replicated on every device.
      x1: (n, d) queries; x2: (m, d) keys; v: (m, o) or (m,) values.
      mesh, scheme, axis, impl, block_q, block_k, block_o: as in `sharded_kernel_mv`; the
        per-device kernels are the expression ones (`scalegp.ops.kernel_mv`'s xla or pallas
        paths). A kernel ``c · RBF(l)`` takes `sharded_kernel_mv`, as on one device.
    Returns:
      (n, o) or (n,), as `sharded_kernel_mv`. Differentiable in x1, x2, v and every
      hyperparameter: the ring and the all-gather each have their backward written out, the
      key gradients going home with their blocks (ring) or by a reduce-scatter (all-gather), and
      each device's share of the hyperparameter gradients summed over the devices (a psum of
      the hyperparameters alone).
    """
    fast = rbf_form(kernel)
    if fast is not None:
        scale, lengthscale = fast
        out = sharded_kernel_mv(x1, x2, v, lengthscale, mesh=mesh, scheme=scheme, axis=axis,
                                impl=impl, block_q=block_q, block_k=block_k, block_o=block_o)
        return out if scale is None else scale * out
    x1, x2, v, vector, dtype = _checked_products(x1, x2, v, scheme)
    (n, d), m, o = x1.shape, x2.shape[0], v.shape[1]
    kernel = check_kernel(kernel, d, dtype)
    if n == 0 or m == 0:
        out = jnp.zeros((n, o), dtype)
        return out[:, 0] if vector else out
    axis, p = mesh_axis(mesh, axis)
    n_local, m_local = _shard_sizes(n, m, p, scheme)
    chosen = plan(impl, m_local, d, dtype, family="expression", n=n_local, block_q=block_q,
                  block_k=block_k, block_o=block_o)
    out = _expression_mv(kernel, x1.astype(dtype), x2.astype(dtype), v.astype(dtype),
                         mesh=mesh, axis=axis, p=p, scheme=scheme, chosen=chosen)
    return out[:, 0] if vector else out


def sharded_kde_density(
    queries, data, bandwidth, weights=None, *, mesh: Mesh, log: bool = False,
    scheme: str = "allgather", axis=None, impl="auto", block_q=None, block_k=None,
):
    """`scalegp.ops.rbf_kde_density` with query rows sharded over ``mesh``.

    Args:
      queries: (n, d); data: (m, d), m >= 1; bandwidth: scalar or (d,); weights: optional (m,)
        non-negative, not all zero.
      mesh, scheme, axis, impl, block_q, block_k: as in `sharded_kernel_mv`; scheme may also be
        "replicated": ``data`` and ``weights`` are already on every device (put there once by a
        caller that evaluates many query sets against them, as cross-validation does), so
        nothing is gathered.
      log: return the log-density (finite far from all data, as on one device).
    Returns:
      (n,) densities or log-densities; differentiable in queries, data, bandwidth and weights.
    """
    check_scheme(scheme, SCHEMES + ("replicated",))
    queries, data = jnp.asarray(queries), jnp.asarray(data)
    check_unbatched(queries, data, ("queries", "data"))
    (n, d), m = queries.shape, data.shape[0]
    if m == 0:
        raise ValueError("data must contain at least one point, got m=0")
    weights = jnp.ones((m,), data.dtype) if weights is None else jnp.asarray(weights)
    check_weights(weights, m, batched=False)
    dtype = float_dtype(queries, data, weights)
    bandwidth = check_scale(bandwidth, d, "bandwidth", dtype)
    if n == 0:
        return jnp.zeros((0,), dtype)
    axis, p = mesh_axis(mesh, axis)
    n_local, m_local = _shard_sizes(n, m, p, scheme)
    chosen = plan(impl, m_local, d, dtype, n=n_local, block_q=block_q, block_k=block_k)
    out = _kde_log_density(queries.astype(dtype), data.astype(dtype), bandwidth,
                           weights.astype(dtype), mesh=mesh, axis=axis, p=p, scheme=scheme,
                           chosen=chosen)
    return out if log else jnp.exp(out)
