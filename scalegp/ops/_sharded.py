"""The engine's reductions over several devices: a `jax.sharding.Mesh` and `jax.shard_map`.

Same maths and the same per-device code as `scalegp.ops._dispatch` (the xla or pallas kernels, or
the dense oracle when asked for); only the data are spread::

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
gradients). The centre c is held constant, as in `dispatch`.

RBF keys spread over too many lengthscales for the distance expansion (d <= 16) take the
expression kernels' coordinate differences instead, with ``RBF(l)``, by a ``lax.cond`` on the keys'
mean squared norm, as `scalegp.ops.rbf_kernel_mv` does on one device; KDE data spread over too
many bandwidths take the log-sum-exp kernels' differences variants, as `rbf_kde_density` does.

n or m not divisible by p: queries are padded with zero rows (cut from the output, zero
cotangent), keys with zero values / zero weights (which contribute nothing, forward or backward).

Kernel expressions (`sharded_expression_mv`, the sharded `scalegp.ops.kernel_mv`): the same two
schemes around the expression kernels (`_xla.expression_mv`, `_pallas_expression`), on points
centred in the global view as `scalegp.ops._expression` centres them (not scaled: each term
scales its own distances). The kernel's hyperparameters are replicated on every device. Both
schemes have their backward written out (a `jax.custom_vjp` each): a device's gradient in the
hyperparameters sums over the key blocks it saw and is then summed over the devices (a psum of
the hyperparameters alone); the key gradients go home with their blocks (ring) or by a
reduce-scatter (all-gather).

Per device, the ``impl`` choice (``"auto"``, ``"dense"``, ``"xla"``, ``"pallas"``) is made for the
shard sizes (n/p x m for the gather, n/p x m/p for the ring), as `scalegp.ops.auto_config` does.
Results agree with the single-device engine up to float summation order (~1e-7 relative).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scalegp.ops._compat import shard_map
from scalegp.ops import _dispatch, _pallas, _xla
from scalegp.ops._kernels import DIRECT_MAX_D, RBF, check_kernel, rbf_form
from scalegp.ops._tiling import BlockSizes, pad_axis, round_up

SCHEMES = ("allgather", "ring")

# ----------------------------------------------------------------------------------------------
# meshes


def data_mesh(devices=None, axis_name: str = "data") -> Mesh:
    """A one-axis mesh over ``devices`` (default: all devices of all processes, `jax.devices()`)."""
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("data_mesh needs at least one device, got an empty list")
    return Mesh(np.asarray(devices, dtype=object), (axis_name,))


def as_mesh(mesh) -> Mesh | None:
    """Normalises the ``mesh=`` setting of the estimators.

    None -> None (one device, the unsharded engine); a `Mesh` -> itself; ``"all"`` -> a
    `data_mesh` over `jax.devices()`; an int k -> the first k devices; a sequence of devices ->
    a `data_mesh` over them.
    """
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, str):
        if mesh != "all":
            raise ValueError(
                f"mesh must be None, a Mesh, 'all', an int or a list of devices; got {mesh!r}"
            )
        return data_mesh()
    if isinstance(mesh, (int, np.integer)) and not isinstance(mesh, bool):
        available = jax.devices()
        if not 1 <= mesh <= len(available):
            raise ValueError(
                f"mesh={mesh} asks for {mesh} devices but {len(available)} are available "
                f"({jax.default_backend()}); pass at most {len(available)}"
            )
        return data_mesh(available[:mesh])
    if isinstance(mesh, Sequence):
        return data_mesh(mesh)
    raise TypeError(
        f"mesh must be None, a jax.sharding.Mesh, 'all', an int or a list of devices; got "
        f"{type(mesh).__name__}"
    )


def mesh_axis(mesh: Mesh, axis=None) -> tuple[str | tuple[str, ...], int]:
    """``(axis, p)``: the mesh axis (or tuple of axes) rows are sharded over, and its size.

    Default: all of the mesh's axes (a one-axis mesh gives its single name).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis is None:
        names = tuple(mesh.axis_names)
        axis = names[0] if len(names) == 1 else names
    names = axis if isinstance(axis, tuple) else (axis,)
    for name in names:
        if name not in mesh.shape:
            raise ValueError(f"axis {name!r} is not an axis of the mesh {dict(mesh.shape)}")
    return axis, math.prod(mesh.shape[name] for name in names)


def shard_rows(x, mesh: Mesh, axis=None):
    """``x`` placed on ``mesh`` with its leading axis sharded (when it divides; else replicated)."""
    axis, p = mesh_axis(mesh, axis)
    x = jnp.asarray(x)
    spec = PartitionSpec(axis) if x.ndim and x.shape[0] % p == 0 else PartitionSpec()
    return jax.device_put(x, NamedSharding(mesh, spec))


# ----------------------------------------------------------------------------------------------
# per-device kernels


class _Core(NamedTuple):
    """The single-device kernels on prepared inputs, as used on each shard."""

    mv: Callable  # (a, b, v) -> K v, differentiable (custom VJP)
    mv_bwd: Callable  # (a, b, v, g) -> (da, db, dv)
    lse: Callable  # (a, b, w) -> log sum_j w_j K_ij, differentiable (custom VJP)
    lse_pair: Callable  # (a, b, w) -> (M, L), f = M + L (see _xla.py)
    lse_bwd: Callable  # (a, b, w, M, L, g) -> (da, db, dw) for f = M + L


def _plan(impl, n, m, d, o, dtype, block_q, block_k, block_o,
          pallas_blocks=_pallas.default_block_sizes) -> tuple[str, BlockSizes]:
    """(implementation, tile sizes) for one shard of n queries x m keys; hashable (a jit key).
    ``pallas_blocks(d)``: the Pallas defaults (the RBF kernels', or the expression kernels')."""
    _dispatch.check_impl(impl)
    if impl == "auto":
        impl, _ = _dispatch.auto_config(m, d, dtype=dtype)
    if impl == "pallas":
        blocks = pallas_blocks(d)
    elif impl == "dense":
        # One tile of the blocked code is the dense computation (and gives the (M, L) pair).
        blocks = BlockSizes(block_q=round_up(n, 8), block_k=round_up(m, 8))
    else:
        blocks = _dispatch.xla_block_sizes(m)
    overrides = {
        k: int(v)
        for k, v in (("block_q", block_q), ("block_k", block_k), ("block_o", block_o))
        if v is not None
    }
    return ("xla" if impl == "dense" else impl), BlockSizes(**{**vars(blocks), **overrides})


def _core(impl: str, bs: BlockSizes, direct: bool = False) -> _Core:
    """``direct``: the KDE's exponents from the coordinate differences (`_xla.lse_forward`'s
    ``direct``, `_pallas.kernel_logsumexp_differences`), for data spread over many
    bandwidths."""
    if impl == "xla":
        return _Core(
            mv=functools.partial(_xla.kernel_mv, block_sizes=bs),
            mv_bwd=lambda a, b, v, g: _xla.kernel_mv_bwd(bs, (a, b, v), g),
            lse=functools.partial(_xla.kernel_logsumexp_differences if direct
                                  else _xla.kernel_logsumexp, block_sizes=bs),
            lse_pair=lambda a, b, w: _xla.lse_forward(a, b, w, bs, direct),
            lse_bwd=lambda a, b, w, f_max, f_log_sum, g: _xla.lse_backward(
                a, b, w, f_max, f_log_sum, g, bs, direct),
        )
    interpret = jax.default_backend() != "gpu"
    return _Core(
        mv=functools.partial(_pallas.kernel_mv, block_sizes=bs, interpret=interpret),
        mv_bwd=lambda a, b, v, g: _pallas.kernel_mv_bwd(bs, interpret, (a, b, v), g),
        lse=functools.partial(_pallas.kernel_logsumexp_differences if direct
                              else _pallas.kernel_logsumexp, block_sizes=bs,
                              interpret=interpret),
        lse_pair=lambda a, b, w: _pallas.lse_forward(a, b, w, bs, interpret, direct),
        lse_bwd=lambda a, b, w, f_max, f_log_sum, g: _pallas.lse_backward(
            a, b, w, f_max, f_log_sum, g, bs, interpret, direct),
    )


class _ExpressionCore(NamedTuple):
    """The single-device kernels of a kernel expression on centred inputs, as used on each
    shard."""

    mv: Callable  # (kernel, x, y, v) -> K v, differentiable (custom VJP)
    mv_bwd: Callable  # (kernel, x, y, v, g) -> (dkernel, dx, dy, dv)


def _expression_core(impl: str, bs: BlockSizes, direct_weights=False) -> _ExpressionCore:
    """``direct_weights``: on xla, the own-distance lengthscale gradients from the coordinate
    differences (`_xla.expression_mv_direct_weights`); the Pallas tiles take them so anyway."""
    if impl == "xla":
        forward = _xla.expression_mv_direct_weights if direct_weights else _xla.expression_mv
        return _ExpressionCore(
            mv=lambda kernel, x, y, v: forward(kernel, x, y, v, bs),
            mv_bwd=lambda kernel, x, y, v, g: _xla.expression_mv_bwd(
                bs, (kernel, x, y, v), g, direct_weights),
        )
    from scalegp.ops import _pallas_expression

    interpret = jax.default_backend() != "gpu"
    return _ExpressionCore(
        mv=lambda kernel, x, y, v: _pallas_expression.expression_mv(kernel, x, y, v, bs,
                                                                    interpret),
        mv_bwd=lambda kernel, x, y, v, g: _pallas_expression.expression_mv_bwd(
            bs, interpret, (kernel, x, y, v), g),
    )


# ----------------------------------------------------------------------------------------------
# the two schemes on prepared, padded, row-sharded inputs


def _ring_perm(p: int):
    return [(i, (i + 1) % p) for i in range(p)]


def _ring_loop(p, body, carry, blocks, axis):
    """Runs ``carry = body(carry, blocks)`` on the home blocks and on each of the p - 1 blocks that
    arrive from the previous device; the next block is sent before this one is used."""
    perm = _ring_perm(p)
    send = lambda blocks: tuple(lax.ppermute(t, axis, perm) for t in blocks)  # noqa: E731

    def step(_, state):
        carry, blocks = state
        incoming = send(blocks)
        return body(carry, blocks), incoming

    carry, blocks = lax.fori_loop(0, p - 1, step, (carry, blocks))
    return body(carry, blocks)


def _ring_mv(mesh, axis, p, core: _Core):
    spec = PartitionSpec(axis)

    def forward_local(a, b, v):
        out = jnp.zeros((a.shape[0], v.shape[1]), v.dtype)
        return _ring_loop(p, lambda acc, kv: acc + core.mv(a, *kv), out, (b, v), axis)

    def backward_local(a, b, v, g):
        perm = _ring_perm(p)

        def body(carry, blocks):
            da, db, dv = carry
            b_blk, v_blk = blocks
            da_s, db_s, dv_s = core.mv_bwd(a, b_blk, v_blk, g)
            return da + da_s, db + db_s, dv + dv_s

        # The key gradients travel with their block: (b, v, db, dv) move together.
        def step(_, state):
            da, b_blk, v_blk, db, dv = state
            da, db, dv = body((da, db, dv), (b_blk, v_blk))
            b_blk, v_blk, db, dv = (lax.ppermute(t, axis, perm) for t in (b_blk, v_blk, db, dv))
            return da, b_blk, v_blk, db, dv

        state = (jnp.zeros_like(a), b, v, jnp.zeros_like(b), jnp.zeros_like(v))
        da, b_blk, v_blk, db, dv = lax.fori_loop(0, p - 1, step, state)
        da, db, dv = body((da, db, dv), (b_blk, v_blk))
        # after p - 1 hops a block sits one device before its owner: one more hop brings it home
        db, dv = (lax.ppermute(t, axis, perm) for t in (db, dv))
        return da, db, dv

    forward = shard_map(forward_local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    backward = shard_map(backward_local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3)

    @jax.custom_vjp
    def ring(a, b, v):
        return forward(a, b, v)

    ring.defvjp(lambda a, b, v: (forward(a, b, v), (a, b, v)),
                lambda res, g: backward(*res, g))
    return ring


def _combine(pair, block):
    """(M, L) of two key sets from each one's (M, L): the online log-sum-exp's rescaling step."""
    (m1, l1), (m2, l2) = pair, block
    m = jnp.maximum(m1, m2)
    # m1 - m and m2 - m are exact (one is 0); an empty block has L = -inf and drops out.
    return m, jnp.logaddexp(l1 + (m1 - m), l2 + (m2 - m))


def _ring_lse(mesh, axis, p, core: _Core):
    spec = PartitionSpec(axis)

    def forward_local(a, b, w):
        # (M, L) = (-inf, -inf) is the empty sum; _combine then takes the first block as it is.
        empty = (jnp.full((a.shape[0],), -jnp.inf, a.dtype),) * 2
        body = lambda acc, kw: _combine(acc, core.lse_pair(a, *kw))  # noqa: E731
        return _ring_loop(p, body, empty, (b, w), axis)

    def backward_local(a, b, w, f_max, f_log_sum, g):
        perm = _ring_perm(p)

        def body(carry, b_blk, w_blk):
            da, db, dw = carry
            # The block's share of the gradient of the *total* f = M + L: T = exp(e - M - L).
            da_s, db_s, dw_s = core.lse_bwd(a, b_blk, w_blk, f_max, f_log_sum, g)
            return da + da_s, db + db_s, dw + dw_s

        def step(_, state):
            da, b_blk, w_blk, db, dw = state
            da, db, dw = body((da, db, dw), b_blk, w_blk)
            b_blk, w_blk, db, dw = (lax.ppermute(t, axis, perm) for t in (b_blk, w_blk, db, dw))
            return da, b_blk, w_blk, db, dw

        state = (jnp.zeros_like(a), b, w, jnp.zeros_like(b), jnp.zeros_like(w))
        da, b_blk, w_blk, db, dw = lax.fori_loop(0, p - 1, step, state)
        da, db, dw = body((da, db, dw), b_blk, w_blk)
        db, dw = (lax.ppermute(t, axis, perm) for t in (db, dw))
        return da, db, dw

    forward = shard_map(forward_local, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec))
    backward = shard_map(backward_local, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec,) * 3)

    def fwd(a, b, w):
        f_max, f_log_sum = forward(a, b, w)
        return f_max + f_log_sum, (a, b, w, f_max, f_log_sum)

    @jax.custom_vjp
    def ring(a, b, w):
        return fwd(a, b, w)[0]

    ring.defvjp(fwd, lambda res, g: backward(*res, g))
    return ring


def _replicated(mesh, axis, fn):
    """``fn(a, b / scale, w)`` per device on keys ``b`` (centred, not yet scaled) and weights that
    every device already holds: nothing is gathered. Scaling on the device means the backward pass
    sums only the scale's partial gradients across devices (a psum of d numbers, from the
    transpose of the replicated input), not (m, d) key gradients, when b itself is a constant."""
    rows, same = PartitionSpec(axis), PartitionSpec()

    def local(a, b, scale, w):
        return fn(a, b * (1 / scale), w)

    return shard_map(local, mesh=mesh, in_specs=(rows, same, same, same), out_specs=rows)


def _gathered(mesh, axis, fn, num_keys_args):
    """``fn(a, *keys)`` per device after all-gathering the key arrays (autodiff: reduce-scatter)."""
    spec = PartitionSpec(axis)

    def local(a, *keys):
        return fn(a, *(lax.all_gather(k, axis, tiled=True) for k in keys))

    return shard_map(local, mesh=mesh, in_specs=(spec,) * (1 + num_keys_args), out_specs=spec)


def _psum_tree(tree, axis):
    return jax.tree_util.tree_map(lambda t: lax.psum(t, axis), tree)


def _expression_with_vjp(mesh, axis, forward_local, backward_local):
    """``f(kernel, x, y, v)`` over ``mesh`` from per-device ``forward_local(kernel, x, y, v)`` and
    ``backward_local(kernel, x, y, v, g) -> (dkernel, dx, dy, dv)``: the kernel replicated, the
    rest row-sharded, the backward written out (a custom VJP) rather than left to autodiff
    through ``shard_map``."""
    spec, same = PartitionSpec(axis), PartitionSpec()
    forward = shard_map(forward_local, mesh=mesh, in_specs=(same,) + (spec,) * 3,
                        out_specs=spec)
    backward = shard_map(backward_local, mesh=mesh, in_specs=(same,) + (spec,) * 4,
                         out_specs=(same,) + (spec,) * 3)

    @jax.custom_vjp
    def product(kernel, x, y, v):
        return forward(kernel, x, y, v)

    product.defvjp(lambda kernel, x, y, v: (forward(kernel, x, y, v), (kernel, x, y, v)),
                   lambda res, g: backward(*res, g))
    return product


def _ring_expression_mv(mesh, axis, p, core: _ExpressionCore):
    """`_ring_mv` for a kernel expression: the kernel (its hyperparameters) is replicated, and
    each device's share of its gradient (summed over the p blocks that pass by) is summed over
    the devices at the end, a psum of the hyperparameters alone."""
    def forward_local(kernel, x, y, v):
        out = jnp.zeros((x.shape[0], v.shape[1]), v.dtype)
        return _ring_loop(p, lambda acc, kv: acc + core.mv(kernel, x, *kv), out, (y, v), axis)

    def backward_local(kernel, x, y, v, g):
        perm = _ring_perm(p)
        add = functools.partial(jax.tree_util.tree_map, jnp.add)

        def body(carry, y_blk, v_blk):
            dkernel, dx, dy, dv = carry
            dk_s, dx_s, dy_s, dv_s = core.mv_bwd(kernel, x, y_blk, v_blk, g)
            return add(dkernel, dk_s), dx + dx_s, dy + dy_s, dv + dv_s

        # The key gradients travel with their block: (y, v, dy, dv) move together.
        def step(_, state):
            dkernel, dx, y_blk, v_blk, dy, dv = state
            dkernel, dx, dy, dv = body((dkernel, dx, dy, dv), y_blk, v_blk)
            y_blk, v_blk, dy, dv = (lax.ppermute(t, axis, perm) for t in (y_blk, v_blk, dy, dv))
            return dkernel, dx, y_blk, v_blk, dy, dv

        dkernel = jax.tree_util.tree_map(jnp.zeros_like, kernel)
        state = (dkernel, jnp.zeros_like(x), y, v, jnp.zeros_like(y), jnp.zeros_like(v))
        dkernel, dx, y_blk, v_blk, dy, dv = lax.fori_loop(0, p - 1, step, state)
        dkernel, dx, dy, dv = body((dkernel, dx, dy, dv), y_blk, v_blk)
        # after p - 1 hops a block sits one device before its owner: one more hop brings it home
        dy, dv = (lax.ppermute(t, axis, perm) for t in (dy, dv))
        return _psum_tree(dkernel, axis), dx, dy, dv

    return _expression_with_vjp(mesh, axis, forward_local, backward_local)


def _gathered_expression_mv(mesh, axis, core: _ExpressionCore):
    """The all-gather scheme for a kernel expression, with its backward written out (a custom
    VJP, as the ring's) rather than left to autodiff through ``shard_map``: each device gathers
    the keys again, takes the single-device VJP, and then reduce-scatters the key gradients to
    their owners and sums the hyperparameter gradients (replicated) over the devices."""
    def gathered(*arrays):
        return tuple(lax.all_gather(t, axis, tiled=True) for t in arrays)

    def forward_local(kernel, x, y, v):
        return core.mv(kernel, x, *gathered(y, v))

    def backward_local(kernel, x, y, v, g):
        dkernel, dx, dy, dv = core.mv_bwd(kernel, x, *gathered(y, v), g)
        dy, dv = (lax.psum_scatter(t, axis, scatter_dimension=0, tiled=True) for t in (dy, dv))
        return _psum_tree(dkernel, axis), dx, dy, dv

    return _expression_with_vjp(mesh, axis, forward_local, backward_local)


# ----------------------------------------------------------------------------------------------
# global-view entry points (jitted; everything mesh-related is static)


_STATIC = ("mesh", "axis", "p", "scheme", "impl", "blocks")


@functools.partial(jax.jit, static_argnames=_STATIC + ("differences",))
def _kernel_mv(x1, x2, v, lengthscale, *, mesh, axis, p, scheme, impl, blocks, differences):
    """``differences``: None, or the (impl, blocks) of the expression kernels, which take the
    coordinate differences where the keys are spread over too many lengthscales for the
    distance expansion (`_dispatch.rbf_expansion_ok`), chosen by ``lax.cond`` as on one
    device."""
    n, m = x1.shape[0], x2.shape[0]
    a, b, far_a, far_b = _dispatch.prepare(x1, x2, lengthscale)

    def expansion():
        n_pad, m_pad = round_up(n, p), round_up(m, p)
        a_pad, b_pad = pad_axis(a, n_pad), pad_axis(b, m_pad)
        v_pad = pad_axis(_dispatch.masked_rows(v, far_b), m_pad)
        core = _core(impl, blocks)
        if scheme == "ring":
            out = _ring_mv(mesh, axis, p, core)(a_pad, b_pad, v_pad)
        else:
            out = _gathered(mesh, axis, core.mv, 2)(a_pad, b_pad, v_pad)
        return _dispatch.masked_rows(out[:n], far_a)

    if differences is None:
        return expansion()
    return lax.cond(_dispatch.expansion_ok(b), expansion, lambda: _expression_product(
        RBF(lengthscale), x1, x2, v, mesh=mesh, axis=axis, p=p, scheme=scheme,
        impl=differences[0], blocks=differences[1], direct_weights=True))


def _expression_product(kernel, x1, x2, v, *, mesh, axis, p, scheme, impl, blocks,
                        direct_weights=False):
    n, m = x1.shape[0], x2.shape[0]
    x, y, far_x, far_y = _dispatch.centred(x1, x2)
    v = _dispatch.masked_rows(v, far_y)
    n_pad, m_pad = round_up(n, p), round_up(m, p)
    x, y, v = pad_axis(x, n_pad), pad_axis(y, m_pad), pad_axis(v, m_pad)
    core = _expression_core(impl, blocks, direct_weights)
    if scheme == "ring":
        out = _ring_expression_mv(mesh, axis, p, core)(kernel, x, y, v)
    else:
        out = _gathered_expression_mv(mesh, axis, core)(kernel, x, y, v)
    return _dispatch.masked_rows(out[:n], far_x)


_expression_mv = jax.jit(_expression_product, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _kde_log_density(queries, data, bandwidth, weights, *, mesh, axis, p, scheme, impl, blocks):
    """As on one device, for d <= 16 data spread over too many bandwidths for the distance
    expansion (`_dispatch.expansion_ok`) take the coordinate differences, by ``lax.cond``
    on the data."""
    n, m, d = queries.shape[0], data.shape[0], data.shape[1]
    w = weights / jnp.sum(weights)
    if scheme == "replicated":
        # keys are scaled per device; the data are finite (fitted), so only queries can be far
        centre = _dispatch.centre_of(data)
        a, far_a = _dispatch.prepared_rows(queries, centre, bandwidth)
        a = pad_axis(a, round_up(n, p))

        def log_sum(core):
            return _replicated(mesh, axis, core.lse)(a, data - centre, bandwidth, w)

        expansion_ok = _dispatch.expansion_ok(_dispatch.prepared_rows(data, centre, bandwidth)[0])
    else:
        a, b, far_a, far_b = _dispatch.prepare(queries, data, bandwidth)
        expansion_ok = _dispatch.expansion_ok(b)
        w = jnp.where(far_b, jnp.zeros((), w.dtype), w)
        n_pad, m_pad = round_up(n, p), round_up(m, p)
        a, b, w = pad_axis(a, n_pad), pad_axis(b, m_pad), pad_axis(w, m_pad)

        def log_sum(core):
            if scheme == "ring":
                return _ring_lse(mesh, axis, p, core)(a, b, w)
            return _gathered(mesh, axis, core.lse, 2)(a, b, w)

    if d <= DIRECT_MAX_D:
        f = lax.cond(expansion_ok, lambda: log_sum(_core(impl, blocks)),
                     lambda: log_sum(_core(impl, blocks, direct=True)))
    else:
        f = log_sum(_core(impl, blocks))
    log_norm = -0.5 * d * math.log(2 * math.pi) - jnp.sum(jnp.log(bandwidth)) * (
        d if bandwidth.ndim == 0 else 1
    )
    return jnp.where(far_a, -jnp.inf, f[:n] + log_norm)


def check_scheme(scheme, schemes=SCHEMES):
    if scheme not in schemes:
        raise ValueError(f"scheme must be one of {schemes}, got {scheme!r}")


def _check_unbatched(x1, x2, names):
    _dispatch.check_point_sets(x1, x2, names)
    for name, x in zip(names, (x1, x2)):
        if x.ndim != 2:
            raise ValueError(
                f"the sharded engine takes unbatched {name} of shape (n, d), got {x.shape}; "
                "loop (or vmap) over the batch, or use scalegp.ops.rbf_kernel_mv on one device"
            )


def _values(v, m):
    """(v as (m, o), whether it was a vector), checked against the m rows of x2."""
    if v.ndim not in (1, 2) or v.shape[0] != m:
        raise ValueError(
            f"v must have shape (m, o) or (m,) with m={m} rows (the rows of x2), "
            f"got shape {v.shape}"
        )
    return (v[:, None], True) if v.ndim == 1 else (v, False)


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
    check_scheme(scheme)
    x1, x2, v = jnp.asarray(x1), jnp.asarray(x2), jnp.asarray(v)
    _check_unbatched(x1, x2, ("x1", "x2"))
    v, vector = _values(v, x2.shape[0])
    dtype = _dispatch.float_dtype(x1, x2, v)
    (n, d), m, o = x1.shape, x2.shape[0], v.shape[1]
    lengthscale = _dispatch.check_scale(lengthscale, d, "lengthscale", dtype)
    if n == 0 or m == 0:
        out = jnp.zeros((n, o), dtype)
        return out[:, 0] if vector else out
    axis, p = mesh_axis(mesh, axis)
    n_local = round_up(n, p) // p
    m_local = round_up(m, p) // p if scheme == "ring" else round_up(m, p)
    chosen, blocks = _plan(impl, n_local, m_local, d, o, dtype, block_q, block_k, block_o)
    differences = None
    if d <= DIRECT_MAX_D:  # as on one device: keys far apart in lengthscales take these
        from scalegp.ops import _pallas_expression

        differences = _plan(impl, n_local, m_local, d, o, dtype, block_q, block_k, block_o,
                            pallas_blocks=_pallas_expression.default_block_sizes)
    out = _kernel_mv(x1.astype(dtype), x2.astype(dtype), v.astype(dtype), lengthscale,
                     mesh=mesh, axis=axis, p=p, scheme=scheme, impl=chosen, blocks=blocks,
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
    check_scheme(scheme)
    x1, x2, v = jnp.asarray(x1), jnp.asarray(x2), jnp.asarray(v)
    _check_unbatched(x1, x2, ("x1", "x2"))
    v, vector = _values(v, x2.shape[0])
    dtype = _dispatch.float_dtype(x1, x2, v)
    (n, d), m, o = x1.shape, x2.shape[0], v.shape[1]
    kernel = check_kernel(kernel, d, dtype)
    if n == 0 or m == 0:
        out = jnp.zeros((n, o), dtype)
        return out[:, 0] if vector else out
    axis, p = mesh_axis(mesh, axis)
    n_local = round_up(n, p) // p
    m_local = round_up(m, p) // p if scheme == "ring" else round_up(m, p)
    from scalegp.ops import _pallas_expression

    impl, blocks = _plan(impl, n_local, m_local, d, o, dtype, block_q, block_k, block_o,
                         pallas_blocks=_pallas_expression.default_block_sizes)
    out = _expression_mv(kernel, x1.astype(dtype), x2.astype(dtype), v.astype(dtype),
                         mesh=mesh, axis=axis, p=p, scheme=scheme, impl=impl, blocks=blocks)
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
    _check_unbatched(queries, data, ("queries", "data"))
    (n, d), m = queries.shape, data.shape[0]
    if m == 0:
        raise ValueError("data must contain at least one point, got m=0")
    weights = jnp.ones((m,), data.dtype) if weights is None else jnp.asarray(weights)
    if weights.shape != (m,):
        raise ValueError(f"weights must have shape (m,) with m={m}, got shape {weights.shape}")
    value = _dispatch.concrete(weights)
    if value is not None and not (np.all(np.isfinite(value)) and np.all(value >= 0)):
        raise ValueError("weights must be finite and non-negative")
    if value is not None and np.sum(value) <= 0:
        raise ValueError("weights must not all be zero")
    dtype = _dispatch.float_dtype(queries, data, weights)
    bandwidth = _dispatch.check_scale(bandwidth, d, "bandwidth", dtype)
    if n == 0:
        return jnp.zeros((0,), dtype)
    axis, p = mesh_axis(mesh, axis)
    n_local = round_up(n, p) // p
    m_local = {"ring": round_up(m, p) // p, "allgather": round_up(m, p)}.get(scheme, m)
    impl, blocks = _plan(impl, n_local, m_local, d, 1, dtype, block_q, block_k, None)
    out = _kde_log_density(queries.astype(dtype), data.astype(dtype), bandwidth,
                           weights.astype(dtype), mesh=mesh, axis=axis, p=p, scheme=scheme,
                           impl=impl, blocks=blocks)
    return out if log else jnp.exp(out)
