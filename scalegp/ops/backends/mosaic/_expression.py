"""Mosaic kernels of ``K(x, y) v`` for any kernel expression (`scalegp.ops._kernels`), forward
and backward, on centred, unscaled points.

The tile is the xla backend's arithmetic (`profile_tile` of the tile's distances), but the
distances are formed so that nothing inside a kernel reshapes a hyperparameter: the shared
squared distance from the points, and each term that owns its distance (ARD lengthscales, every
Matérn: `owns_distance`) from coordinates scaled outside the kernel, ``u = x / l``; the scalar
hyperparameters travel in SMEM, and the owned terms' lengthscales never enter a kernel (their
gradients come from the distances). Squares by coordinate differences, one feature at a time;
past `_blocks.DIFFERENCES_MAX_D` features the forward takes the shared distance from the
expansion on the matrix unit instead (`_shared_distance`), as the RBF's kernels do, where the
keys' spread allows: the differences cost three vector-unit operations per feature and pair,
the expansion one matrix-unit pass (docs/decisions.md #71).

One kernel serves the three passes, on a grid (row tiles, key tiles)::

    forward     rows x, keys y:  out_i = Σ_j K_ij v_j
    query pass  rows x, keys y:  per distance D, S_i = Σ_j W_ij (y_j - x_i), W = (g vᵀ) ∘ ∂K/∂D;
                                 per owned D, Σ_j W_ij (u_i - w_j)² per feature (its
                                 lengthscale); per scalar θ, Σ_j (g vᵀ ∘ ∂K/∂θ)_ij
    key pass    rows y, keys x:  S_j of the transposed tile, and dv_j = Σ_i K_ij g_i

With ``D = Σ_f (r_f - c_f)²`` of the rows' and the keys' (scaled) coordinates, ``dr = -2 S``
(over l for owned distances) and ``∂D/∂l_f = -2 (r_f - c_f)² / l_f``: the gradients come from
the coordinate differences, never ``Σ W y - x Σ W``, which cancels for points far from the
centre. ``∂K/∂θ`` by forward mode (one tangent per scalar), so that no kernel reduces a tile to
a scalar; its row sums are summed outside.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalegp.ops._kernels import (
    COORDINATE_LIMIT,
    own_lengthscales,
    owns_distance,
    profile_tile,
    profiles_of,
    shared_distance_slope,
    uses_squared,
    with_own_gradients,
)
from scalegp.ops._matmul import RBF_EXPANSION_MEAN_LIMIT
from scalegp.ops._tile_math import tile_product
from scalegp.ops._tiling import BlockSizes, compensated_add, pad_axis, round_up
from scalegp.ops.backends.mosaic._blocks import (
    call,
    check_blocks,
    cols_spec,
    distances,
    either,
    exponents,
    fold,
    key_geometry,
    key_pieces,
    on_first_key_tile,
    on_last_key_tile,
    over_column_chunks,
    over_row_chunks,
    row_pieces,
    row_geometry,
    rows_spec,
    smem_spec,
    split_dot,
    split_operand,
    split_value,
    split_width,
    swapped,
)
from scalegp.ops.backends.mosaic._rbf import difference_sums


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a kernel expression travels into a kernel (static): its treedef, which leaves are
    scalars (in SMEM, in leaf order), how many distances it reads (the shared one first, then
    the owned ones), and what the pass computes."""

    treedef: Any
    shapes: tuple  # per leaf: () for a scalar, (d,) for an owned term's lengthscale vector
    shared: bool
    owned: int
    with_mv: bool = False
    with_w: bool = False
    with_leaves: bool = False
    split_arrays: int = 1  # the arrays of the split values (`_blocks.split_operand`)
    expansion: bool = False  # the shared distance by the expansion (forward passes only)

    @property
    def scalar(self) -> tuple:
        return tuple(shape == () for shape in self.shapes)

    @property
    def distances(self) -> int:
        return int(self.shared) + self.owned

    def kernel(self, scalars):
        """The expression inside a kernel: scalar leaves from SMEM; vector leaves (owned
        lengthscales, which `profile_tile` does not read) as host placeholders of their shape
        (which `owns_distance` reads)."""
        values, k = [], 0
        for shape in self.shapes:
            values.append(scalars[k] if shape == () else np.ones(shape, np.float32))
            k += shape == ()
        return jax.tree_util.tree_unflatten(self.treedef, values)


def _layout(kernel, **flags) -> tuple[_Layout, jax.Array]:
    leaves, treedef = jax.tree_util.tree_flatten(kernel)
    shapes = tuple(jnp.shape(leaf) for leaf in leaves)
    values = [jnp.asarray(leaf, jnp.float32) for leaf, shape in zip(leaves, shapes)
              if shape == ()]
    scalars = jnp.stack(values) if values else jnp.zeros((1,), jnp.float32)
    owned = sum(owns_distance(node) for node in profiles_of(kernel))
    shared = uses_squared(kernel) or not owned
    return _Layout(treedef, shapes, shared, owned, **flags), scalars


def _coordinates(kernel, layout: _Layout, x):
    """The coordinates of x (n, d) for each distance the expression reads: the points, then
    ``x / l`` per owned term, clipped as `scalegp.ops._kernels.sum_of_squares` clips them."""
    out = [x] if layout.shared else []
    out += [x / lengthscale for lengthscale in own_lengthscales(kernel)]
    return [jnp.clip(c, -COORDINATE_LIMIT, COORDINATE_LIMIT).astype(jnp.float32) for c in out]


def _shared_distance(kernel, y, bs: BlockSizes):
    """How the forward forms the shared squared distance ``s = |x - y|²`` (`_blocks.distances`,
    True: the differences), for centred keys y (m, d). The expansion errs by about
    ``u (|x|² + |y|²)`` in s, which moves the kernel by at most ``C`` times that, relatively
    (`shared_distance_slope`); the RBF's exponent ``-|a - b|²/2`` has ``C = 1/2``. So the keys
    are measured in units of ``1/√(2C)`` and held to the RBF's `RBF_EXPANSION_MEAN_LIMIT`;
    a term that reads s and does not decay keeps the differences."""
    slope = shared_distance_slope(kernel)
    if not uses_squared(kernel) or slope is None:
        return True
    return distances(bs, y * jnp.sqrt(2.0 * slope).astype(y.dtype), RBF_EXPANSION_MEAN_LIMIT)


def _expression_kernel(*refs, layout: _Layout):
    refs = list(refs)
    scalars_ref = refs.pop(0)
    nd = layout.distances
    rows = [refs.pop(0) for _ in range(nd)]
    cols = [refs.pop(0) for _ in range(nd)]
    thin_refs = [refs.pop(0) for _ in range(layout.split_arrays)] if layout.with_mv else None
    if layout.with_w:
        ur_ref, uct_ref = refs.pop(0), refs.pop(0)
    n_out = (layout.with_mv + (nd if layout.with_w else 0)
             + (layout.owned if layout.with_leaves else 0) + layout.with_leaves)
    outs, scratch = refs[:n_out], refs[n_out:]

    @on_first_key_tile
    def _():
        for ref in scratch:
            ref[...] = jnp.zeros_like(ref)

    scalars = [scalars_ref[k] for k in range(sum(layout.scalar))]
    kernel = layout.kernel(scalars)
    r_tiles = [ref[...] for ref in rows]
    c_tiles = [ref[...] for ref in cols]
    # (exponents' -|r - c|²/2: by the differences, or by the expansion from bfloat16 pieces)
    dists = [-2.0 * exponents(r, c) for r, c in zip(r_tiles, c_tiles)]

    def tile(dists):
        squared = dists[0] if layout.shared else None
        return profile_tile(kernel, squared, tuple(dists[int(layout.shared):]))

    s = 0
    if layout.with_w:
        coupling = jnp.dot(ur_ref[...], uct_ref[...], preferred_element_type=jnp.float32)
        k, pullback = jax.vjp(tile, dists)
        (weights,) = pullback(coupling)
    else:
        k = tile(dists)
    if layout.with_mv:
        total, carry = scratch[0], scratch[1]
        total[...], carry[...] = compensated_add((total[...], carry[...]),
                                                 split_dot(k, split_value(thin_refs)))
        s = 2
    if layout.with_w:
        for r, c, w in zip(r_tiles, c_tiles, weights):
            difference_sums(scratch[s], w, r, c)
            s += 1
    if layout.with_leaves:
        for r, c, w in zip(r_tiles[int(layout.shared):], c_tiles[int(layout.shared):],
                           weights[int(layout.shared):]):
            acc = scratch[s]
            for f in range(r.shape[1]):
                delta = r[:, f:f + 1] - c[f:f + 1, :]
                acc[:, f:f + 1] += jnp.sum(w * (delta * delta), axis=1, keepdims=True)
            s += 1
        acc = scratch[s]
        for q in range(len(scalars)):
            tangent = [jnp.float32(1.0 if p == q else 0.0) for p in range(len(scalars))]
            _, dk = jax.jvp(lambda *t: profile_tile(layout.kernel(list(t)),
                                                    dists[0] if layout.shared else None,
                                                    tuple(dists[int(layout.shared):])),
                            tuple(scalars), tuple(tangent))
            acc[:, q:q + 1] += jnp.sum(coupling * dk, axis=1, keepdims=True)

    @on_last_key_tile
    def _():
        if layout.with_mv:
            outs[0][...] = scratch[0][...] + scratch[1][...]
        for out, acc in zip(outs[int(layout.with_mv):], scratch[2 * layout.with_mv:]):
            out[...] = acc[...]


def _pass(kernel, x, y, v, u, bs: BlockSizes, interpret: bool, name: str, **flags):
    """One pass over (row tiles of x) × (key tiles of y); ``v`` (m, o): the thin operand of
    the product (with_mv), ``u`` (n, o): the rows' side of the coupling ``u vᵀ`` (with_w).
    Returns the layout and the outputs, (n, ·) each: the product ``K v`` (n, o) first where
    with_mv, then the sums. Wide v and u go through in chunks of columns
    (`over_column_chunks`); in each, the keys' operands are laid out once, the rows' per chunk
    of rows (`over_row_chunks`)."""
    layout, scalars = _layout(kernel, **flags)

    def columns(v, u):
        outs = _pass_columns(kernel, layout, scalars, x, y, v, u, bs, interpret, name)
        if layout.with_mv:
            return fold(outs[0], v.shape[1]), outs[1:]
        return None, outs

    mv, sums = over_column_chunks(columns, v, u if layout.with_w else None,
                                  forward=not layout.with_w)
    return layout, [mv, *sums] if layout.with_mv else list(sums)


def _pass_columns(kernel, layout: _Layout, scalars, x, y, v, u, bs, interpret, name):
    """`_pass` in one kernel call per chunk of rows: its outputs, the product's unfolded."""
    m, d = y.shape
    cols = round_up(m, bs.block_k)
    # by the differences `key_geometry` is the coordinates, feature-major, and `row_geometry`
    # the rows' own; by the expansion (the shared distance only) their bfloat16 pieces
    by_expansion = [layout.expansion and k == 0 for k in range(layout.distances)]
    keys = [key_geometry(c, not e, cols)
            for c, e in zip(_coordinates(kernel, layout, y), by_expansion)]
    key_specs = [cols_spec(key.shape[0], bs.block_k) for key in keys]
    if layout.with_mv:
        split, specs = split_operand(pad_axis(v, cols), bs.block_k)
        layout = dataclasses.replace(layout, split_arrays=len(split))
        keys += split
        key_specs += specs
    if layout.with_w:
        keys.append(key_pieces(pad_axis(v, cols)))
        key_specs.append(cols_spec(keys[-1].shape[0], bs.block_k))
    widths = [split_width(v.shape[1])] if layout.with_mv else []
    scratch = [(bs.block_q, widths[0])] * 2 if layout.with_mv else []
    if layout.with_w:
        widths += [d + 1] * layout.distances
    if layout.with_leaves:
        widths += [d] * layout.owned + [max(1, sum(layout.scalar))]
    scratch += [(bs.block_q, width) for width in widths[int(layout.with_mv):]]
    nd = layout.distances

    def rows_part(x, u):
        rows = round_up(x.shape[0], bs.block_q)
        geometry = [row_geometry(c, not e, rows)
                    for c, e in zip(_coordinates(kernel, layout, x), by_expansion)]
        operands = [scalars, *geometry, *keys[:nd + layout.split_arrays * layout.with_mv]]
        in_specs = [smem_spec(), *(rows_spec(bs.block_q, g.shape[1]) for g in geometry),
                    *key_specs[:nd + layout.split_arrays * layout.with_mv]]
        if layout.with_w:
            ur = row_pieces(pad_axis(u, rows))
            operands += [ur, keys[-1]]
            in_specs += [rows_spec(bs.block_q, ur.shape[1]), key_specs[-1]]
        outs = call(functools.partial(_expression_kernel, layout=layout),
                    (rows // bs.block_q, cols // bs.block_k), in_specs,
                    [rows_spec(bs.block_q, width) for width in widths],
                    [jax.ShapeDtypeStruct((rows, width), jnp.float32) for width in widths],
                    scratch, bs, interpret, name)(*operands)
        return [out[:x.shape[0]] for out in outs]

    return over_row_chunks(rows_part, bs.block_q, x, u if layout.with_w else None)


def _expression_mv(kernel, x, y, v, block_sizes: BlockSizes, interpret: bool = False):
    """``K(x, y) @ v`` for a kernel expression, centred x (n, d), y (m, d), v (m, o) ->
    (n, o)."""
    check_blocks(block_sizes)

    def forward(differences):
        _, (out,) = _pass(kernel, x, y, v, None, block_sizes, interpret, "expression_mv_fwd",
                          with_mv=True, expansion=not differences)
        return out.astype(v.dtype)

    return either(_shared_distance(kernel, y, block_sizes), forward), ()


def _coordinate_gradient(kernel, layout: _Layout, sums, x):
    """``dx = -2 Σ_D S_D (/ l for owned distances)`` from the passes' difference sums."""
    scales = ([1.0] if layout.shared else []) + [1.0 / l for l in own_lengthscales(kernel)]
    d = x.shape[1]
    return sum(-2.0 * s[:x.shape[0], :d] * scale for s, scale in zip(sums, scales))


def expression_mv_bwd(inputs, saved, g, block_sizes, interpret):
    """(dkernel, dx, dy, dv) for the cotangent g (n, o) of the output."""
    del saved
    kernel, x, y, v = inputs
    layout, outs = _pass(kernel, x, y, v, g, block_sizes, interpret, "expression_mv_bwd_dq",
                         with_w=True, with_leaves=True)
    nd = layout.distances
    dx = _coordinate_gradient(kernel, layout, outs[:nd], x)
    own_sums, leaf_sums = outs[nd:nd + layout.owned], outs[-1]
    key_layout, key_outs = _pass(kernel, y, x, g, v, swapped(block_sizes), interpret,
                                 "expression_mv_bwd_dk", with_mv=True, with_w=True)
    dv = key_outs[0].astype(v.dtype)
    dy = _coordinate_gradient(kernel, key_layout, key_outs[1:], y)
    scalar_grads = list(jnp.sum(leaf_sums[:x.shape[0]], axis=0))
    leaves, k = [], 0
    for leaf, is_scalar in zip(jax.tree_util.tree_leaves(kernel), layout.scalar):
        leaves.append(scalar_grads[k].astype(jnp.asarray(leaf).dtype) if is_scalar
                      else jnp.zeros_like(leaf))
        k += is_scalar
    dkernel = jax.tree_util.tree_unflatten(layout.treedef, leaves)
    # ∂D/∂l_f = -2 (u_f - w_f)² / l_f summed over pairs; one l for all f when it is a scalar
    own = [jnp.reshape(jnp.sum(jnp.reshape(jnp.sum(s[:x.shape[0]], axis=0) * (-2.0 / l),
                                           (-1, jnp.size(l))), axis=0), jnp.shape(l))
           for s, l in zip(own_sums, own_lengthscales(kernel))]
    return (with_own_gradients(dkernel, own), dx.astype(x.dtype), dy.astype(y.dtype), dv)


expression_mv = tile_product(_expression_mv, expression_mv_bwd, inputs=4, settings=2)
