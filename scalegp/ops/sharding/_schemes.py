"""The two schemes by which keys reach every query shard of a mesh, on prepared, padded,
row-sharded inputs (`_products` describes them): the ring (key blocks passed on by
``lax.ppermute``, each product's backward a second ring) and the all-gather (``lax.all_gather``;
for kernel expressions with its backward written out), and keys already on every device
(``replicated``). Per device they run the tile cores a `scalegp.ops._plan.Plan` gives."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from scalegp.ops._compat import shard_map
from scalegp.ops._interface import ExpressionCore, RbfCore
from scalegp.ops._tile_math import tile_product


def ring_perm(p: int):
    return [(i, (i + 1) % p) for i in range(p)]


def ring_loop(p, body, carry, blocks, axis):
    """Runs ``carry = body(carry, blocks)`` on the home blocks and on each of the p - 1 blocks that
    arrive from the previous device; the next block is sent before this one is used."""
    perm = ring_perm(p)
    send = lambda blocks: tuple(lax.ppermute(t, axis, perm) for t in blocks)  # noqa: E731

    def step(_, state):
        carry, blocks = state
        incoming = send(blocks)
        return body(carry, blocks), incoming

    carry, blocks = lax.fori_loop(0, p - 1, step, (carry, blocks))
    return body(carry, blocks)


def ring_mv(mesh, axis, p, core: RbfCore):
    spec = PartitionSpec(axis)

    def forward_local(a, b, v):
        out = jnp.zeros((a.shape[0], v.shape[1]), v.dtype)
        return ring_loop(p, lambda acc, kv: acc + core.mv(a, *kv), out, (b, v), axis)

    def backward_local(a, b, v, g):
        perm = ring_perm(p)

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

    return tile_product(lambda a, b, v: (forward(a, b, v), ()),
                        lambda inputs, saved, g: backward(*inputs, g), inputs=3)


def combine_lse(pair, block):
    """(M, L) of two key sets from each one's (M, L): the online log-sum-exp's rescaling step."""
    (m1, l1), (m2, l2) = pair, block
    m = jnp.maximum(m1, m2)
    # m1 - m and m2 - m are exact (one is 0); an empty block has L = -inf and drops out.
    return m, jnp.logaddexp(l1 + (m1 - m), l2 + (m2 - m))


def ring_lse(mesh, axis, p, core: RbfCore):
    spec = PartitionSpec(axis)

    def forward_local(a, b, w):
        # (M, L) = (-inf, -inf) is the empty sum; combine_lse then takes the first block as it is.
        empty = (jnp.full((a.shape[0],), -jnp.inf, a.dtype),) * 2
        body = lambda acc, kw: combine_lse(acc, core.lse_pair(a, *kw))  # noqa: E731
        return ring_loop(p, body, empty, (b, w), axis)

    def backward_local(a, b, w, f_max, f_log_sum, g):
        perm = ring_perm(p)

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
        return f_max + f_log_sum, (f_max, f_log_sum)

    return tile_product(fwd, lambda inputs, saved, g: backward(*inputs, *saved, g), inputs=3)


def replicated(mesh, axis, fn):
    """``fn(a, b / scale, w)`` per device on keys ``b`` (centred, not yet scaled) and weights that
    every device already holds: nothing is gathered. Scaling on the device means the backward pass
    sums only the scale's partial gradients across devices (a psum of d numbers, from the
    transpose of the replicated input), not (m, d) key gradients, when b itself is a constant."""
    rows, same = PartitionSpec(axis), PartitionSpec()

    def local(a, b, scale, w):
        return fn(a, b * (1 / scale), w)

    return shard_map(local, mesh=mesh, in_specs=(rows, same, same, same), out_specs=rows)


def gathered(mesh, axis, fn, num_keys_args):
    """``fn(a, *keys)`` per device after all-gathering the key arrays (autodiff: reduce-scatter)."""
    spec = PartitionSpec(axis)

    def local(a, *keys):
        return fn(a, *(lax.all_gather(k, axis, tiled=True) for k in keys))

    return shard_map(local, mesh=mesh, in_specs=(spec,) * (1 + num_keys_args), out_specs=spec)


def psum_tree(tree, axis):
    return jax.tree_util.tree_map(lambda t: lax.psum(t, axis), tree)


def expression_with_vjp(mesh, axis, forward_local, backward_local):
    """``f(kernel, x, y, v)`` over ``mesh`` from per-device ``forward_local(kernel, x, y, v)`` and
    ``backward_local(kernel, x, y, v, g) -> (dkernel, dx, dy, dv)``: the kernel replicated, the
    rest row-sharded, the backward written out (a custom VJP) rather than left to autodiff
    through ``shard_map``."""
    spec, same = PartitionSpec(axis), PartitionSpec()
    forward = shard_map(forward_local, mesh=mesh, in_specs=(same,) + (spec,) * 3,
                        out_specs=spec)
    backward = shard_map(backward_local, mesh=mesh, in_specs=(same,) + (spec,) * 4,
                         out_specs=(same,) + (spec,) * 3)

    return tile_product(lambda kernel, x, y, v: (forward(kernel, x, y, v), ()),
                        lambda inputs, saved, g: backward(*inputs, g), inputs=4)


def ring_expression_mv(mesh, axis, p, core: ExpressionCore):
    """`ring_mv` for a kernel expression: the kernel (its hyperparameters) is replicated, and
    each device's share of its gradient (summed over the p blocks that pass by) is summed over
    the devices at the end, a psum of the hyperparameters alone."""
    def forward_local(kernel, x, y, v):
        out = jnp.zeros((x.shape[0], v.shape[1]), v.dtype)
        return ring_loop(p, lambda acc, kv: acc + core.mv(kernel, x, *kv), out, (y, v), axis)

    def backward_local(kernel, x, y, v, g):
        perm = ring_perm(p)
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
        return psum_tree(dkernel, axis), dx, dy, dv

    return expression_with_vjp(mesh, axis, forward_local, backward_local)


def gathered_expression_mv(mesh, axis, core: ExpressionCore):
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
        return psum_tree(dkernel, axis), dx, dy, dv

    return expression_with_vjp(mesh, axis, forward_local, backward_local)
