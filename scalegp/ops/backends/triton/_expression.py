"""Fused Pallas kernels for ``K(x, y) v`` of any kernel expression, forward and backward.

The kernel expression (`scalegp.ops._kernels`) is a pytree of small hyperparameter arrays. Its
leaves go to every kernel instance as whole-array inputs (a scalar as a (1,) array, an ARD
lengthscale as a (d_pad,) one, padded with ones), and the kernel body rebuilds the expression
from the treedef and calls `kernel_tile`: the fused kernels evaluate the expression with the
xla path's code (only the distances' sum is arranged for Triton, see below). Points go in
centred and unscaled, the queries row-major and the keys feature-major, (d_pad, m), as
`kernel_tile` takes them.

Three kernels, each instance owning one block of rows and looping (``fori_loop``) over blocks
of the other point set, as in `_rbf.py`::

    forward      grid (n / block_q, o / block_o)   out_i  = Σ_j K_ij v_j
    query pass   grid (n / block_q,)               dx_i and the block's share of dθ
    key pass     grid (m / block_k,)               dy_j, dv_j = Σ_i K_ij g_i

Both backward passes take the tile's VJP (``jax.vjp`` of `kernel_tile` inside the kernel body,
with the cotangent ``G = g vᵀ`` of the tile): the query pass with respect to the query rows and
the hyperparameters, the key pass with respect to the key rows only, on the transposed tile
``K(y, x)`` (the kernels are stationary, so symmetric). Query blocks run in parallel, so the
hyperparameter gradients cannot be summed in one place: each query block writes its partial
sums to row i of an output of shape (n / block_q, size) per leaf, and the rows are summed
outside (memory O(n / block_q · #hyperparameters)). Nothing of size n x m exists anywhere.

Precision: the products are IEEE float32 (``precision=HIGHEST``, so Triton emits no TF32 dots;
checked by `benchmarks/gpu/pallas_lowering.py`). On GPU the kernels go through the Triton
lowering with explicit compiler parameters (`_blocks.compiler_params`); on CPU the same
kernels run with ``interpret=True``.

Distances on GPU: `kernel_tile` forms ``Σ_d (x_id - y_jd)²`` for d <= 16 from a (p, d, q)
broadcast, which XLA fuses into one loop but which a Triton program would hold in registers
whole (``block_q · d · block_k`` floats). The kernels here give `kernel_tile` a ``direct`` sum
that takes the same squares one feature at a time (`feature_loop_squares`; in the backward
kernels `_recomputed_squares`): the same arithmetic, in (p, q) tiles only. Triton has no
slicing of register tensors, so a feature's column is picked out of the tile by a masked sum,
which is exact (one nonzero term).

Padding: rows to a multiple of the block (padded queries have g = 0 and are cut from the
output; padded keys have v = 0), d and o to powers of two with zeros (zero features change no
distance), ARD lengthscales with ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._kernels import TileArithmetic, kernel_tile
from scalegp.ops._tile_math import tile_product
from scalegp.ops._tiling import BlockSizes, next_power_of_2, pad_axis, round_up
from scalegp.ops.backends.triton._blocks import (
    PRECISION,
    TritonLaunch,
    accumulator_dtype,
    check_pow2,
    compiler_params,
    matmul,
    matmul_nt,
    row_block_spec,
    whole_array_spec,
)
from scalegp.ops.backends.triton._rbf import (
    feature,
    feature_loop_squares,
    placed,
    register_half_sq_norms,
)


def default_block_sizes(d: int = 1) -> BlockSizes:
    """Tiles and Triton launch parameters for an expression on points of ``d`` features.

    16 x 16 tiles on 8 warps for every d, much smaller than the RBF kernels'
    (`_rbf.default_block_sizes`): a tile's VJP keeps several (block_q, block_k)
    intermediates per term alive. It is the one setting tried whose three kernels spill
    nothing for the composite kernel and an ARD Matérn-3/2 at every d <= 16 and o in 1, 16, 64
    (32 x 16 and 16 x 16 on 4 warps spill a few bytes in some, 32 x 32 up to 28 B at d = 16,
    64 x 64 kilobytes), and up to d = 128 for the ARD Matérn. From the compile statistics of
    `benchmarks/gpu/pallas_lowering.py` (Triton 3.9, sm_90; docs/decisions.md #18), not from
    GPU timings: the speed of these tiles is unmeasured.
    """
    del d  # one setting for all d (see above)
    return BlockSizes(block_q=16, block_k=16, block_o=64, launch=TritonLaunch(8, 2))


# ----------------------------------------------------------------------------------------------
# distances and hyperparameters inside a kernel body


def _squares(x, keys_t):
    """`feature_loop_squares` whose VJP recomputes each feature's differences instead of
    keeping them from the forward pass (d tiles of (p, q) held across the tile's VJP were what
    made the backward kernels spill registers)."""
    return feature_loop_squares(x, keys_t), ()


def _squares_bwd(inputs, saved, g):
    del saved
    x, keys_t = inputs
    dx, dkeys = [], []
    for f in range(x.shape[1]):
        # y - x, not x - y: not the forward's expression, so that Triton's common-subexpression
        # elimination cannot merge the two and keep the forward's tiles alive after all
        w = g * (feature(keys_t, f, 0)[None, :] - feature(x, f, 1)[:, None])
        dx.append(-2.0 * jnp.sum(w, axis=1))
        dkeys.append(2.0 * jnp.sum(w, axis=0))
    return placed(dx, x.shape, 1), placed(dkeys, keys_t.shape, 0)


_recomputed_squares = tile_product(_squares, _squares_bwd, inputs=2)


#: The kernels' distances (`scalegp.ops._kernels.TileArithmetic`): the coordinate differences
#: one feature at a time (forward), or recomputed in the backward passes, and past
#: `scalegp.ops._kernels.DIRECT_MAX_D` one product at this backend's precision.
LOOP_ARITHMETIC = TileArithmetic(feature_loop_squares, register_half_sq_norms, PRECISION)
RECOMPUTED_ARITHMETIC = TileArithmetic(_recomputed_squares, register_half_sq_norms, PRECISION)




@dataclasses.dataclass(frozen=True)
class _Hyperparameters:
    """How the kernel's leaves travel as pallas_call inputs, and back (static: no arrays).

    A scalar goes as a (1,) array, an ARD lengthscale as a (d_pad,) one padded with ones (the
    padded features are 0 in every point, so any positive scale leaves them out)."""

    treedef: Any
    shapes: tuple
    d_pad: int

    @classmethod
    def of(cls, kernel, d_pad) -> tuple["_Hyperparameters", list]:
        """(layout, inputs) for ``kernel``."""
        leaves, treedef = jax.tree_util.tree_flatten(kernel)
        leaves = [jnp.asarray(leaf) for leaf in leaves]
        layout = cls(treedef, tuple(leaf.shape for leaf in leaves), d_pad)
        inputs = [jnp.reshape(leaf, (1,)) if leaf.ndim == 0 else pad_axis(leaf, d_pad, value=1.0)
                  for leaf in leaves]
        return layout, inputs

    @property
    def sizes(self):
        return tuple(1 if shape == () else self.d_pad for shape in self.shapes)

    @property
    def specs(self):
        return [pl.BlockSpec((size,), lambda *_: (0,)) for size in self.sizes]

    def load(self, refs):
        """The leaves inside a kernel body: scalars as scalars, vectors as (d_pad,)."""
        return [ref[0] if shape == () else ref[...] for ref, shape in zip(refs, self.shapes)]

    def kernel(self, leaves):
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def partial_outputs(self, num_blocks, dtype):
        """Out shapes and specs of the per-query-block partial gradients: (num_blocks, size)."""
        shapes = [jax.ShapeDtypeStruct((num_blocks, size), dtype) for size in self.sizes]
        specs = [pl.BlockSpec((1, size), lambda i: (i, 0)) for size in self.sizes]
        return shapes, specs

    def gradient(self, partials):
        """The kernel's gradient (a kernel pytree) from the partial sums, (num_blocks, size)."""
        grads = []
        for part, shape in zip(partials, self.shapes):
            total = jnp.sum(part, axis=0)
            grads.append(total[0] if shape == () else total[: shape[0]])
        return self.kernel(grads)


# ----------------------------------------------------------------------------------------------
# kernels


def _forward_kernel(x_ref, yt_ref, v_ref, *refs, hyper: _Hyperparameters, block_k):
    *leaf_refs, out_ref = refs
    kernel = hyper.kernel(hyper.load(leaf_refs))
    x = x_ref[...]

    def body(j, acc):
        cols = pl.ds(j * block_k, block_k)
        k = kernel_tile(kernel, x, yt_ref[:, cols], LOOP_ARITHMETIC)
        return acc + matmul(k, v_ref[cols, :])

    acc = jnp.zeros(out_ref.shape, accumulator_dtype(out_ref.dtype))
    acc = lax.fori_loop(0, yt_ref.shape[1] // block_k, body, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def _query_pass_kernel(x_ref, g_ref, yt_ref, v_ref, *refs, hyper: _Hyperparameters, block_k):
    """dx for the block's query rows and the block's share of every hyperparameter's gradient."""
    num = len(hyper.sizes)
    leaf_refs, dx_ref, dleaf_refs = refs[:num], refs[num], refs[num + 1:]
    leaves = hyper.load(leaf_refs)
    x, g = x_ref[...], g_ref[...]

    def body(j, carry):
        dx, dleaves = carry
        cols = pl.ds(j * block_k, block_k)
        keys_t = yt_ref[:, cols]
        def tile(leaves, x):
            return kernel_tile(hyper.kernel(leaves), x, keys_t, RECOMPUTED_ARITHMETIC)

        _, pullback = jax.vjp(tile, leaves, x)
        dl, dx_tile = pullback(matmul_nt(g, v_ref[cols, :]))
        return dx + dx_tile, [a + b for a, b in zip(dleaves, dl)]

    init = (jnp.zeros(x.shape, x.dtype), [jnp.zeros_like(leaf) for leaf in leaves])
    dx, dleaves = lax.fori_loop(0, yt_ref.shape[1] // block_k, body, init)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    for ref, dl in zip(dleaf_refs, dleaves):
        ref[...] = jnp.reshape(dl, ref.shape).astype(ref.dtype)


def _key_pass_kernel(y_ref, v_ref, xt_ref, g_ref, *refs, hyper: _Hyperparameters, block_q):
    """dy and dv for the block's keys, from the transposed tiles K(y, x)."""
    *leaf_refs, dy_ref, dv_ref = refs
    kernel = hyper.kernel(hyper.load(leaf_refs))
    y, v = y_ref[...], v_ref[...]

    def body(i, carry):
        dy, dv = carry
        rows = pl.ds(i * block_q, block_q)
        g = g_ref[rows, :]
        k_t, pullback = jax.vjp(
            lambda y: kernel_tile(kernel, y, xt_ref[:, rows], RECOMPUTED_ARITHMETIC), y)
        (dy_tile,) = pullback(matmul_nt(v, g))
        return dy + dy_tile, dv + matmul(k_t, g)

    init = (jnp.zeros(y.shape, y.dtype), jnp.zeros(v.shape, accumulator_dtype(v.dtype)))
    dy, dv = lax.fori_loop(0, xt_ref.shape[1] // block_q, body, init)
    dy_ref[...] = dy.astype(dy_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers


def _padded(a, rows, cols):
    return pad_axis(pad_axis(a, cols, axis=1), rows)


def _forward(kernel, x, y, v, bs: BlockSizes, interpret: bool):
    (n, d), (m, o) = x.shape, v.shape
    d_pad = next_power_of_2(d)
    block_o = min(bs.block_o, next_power_of_2(o))
    n_pad, m_pad, o_pad = round_up(n, bs.block_q), round_up(m, bs.block_k), round_up(o, block_o)
    hyper, leaves = _Hyperparameters.of(kernel, d_pad)
    out = pl.pallas_call(
        functools.partial(_forward_kernel, hyper=hyper, block_k=bs.block_k),
        grid=(n_pad // bs.block_q, o_pad // block_o),
        in_specs=[
            row_block_spec(bs.block_q, d_pad),
            whole_array_spec((d_pad, m_pad)),
            pl.BlockSpec((m_pad, block_o), lambda i, j: (0, j)),
            *hyper.specs,
        ],
        out_specs=pl.BlockSpec((bs.block_q, block_o), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_pad, o_pad), v.dtype),
        compiler_params=compiler_params(bs, interpret),
        interpret=interpret,
        name="expression_mv_fwd",
    )(_padded(x, n_pad, d_pad), _padded(y, m_pad, d_pad).T, _padded(v, m_pad, o_pad), *leaves)
    return out[:n, :o]


def _backward(kernel, x, y, v, g, bs: BlockSizes, interpret: bool):
    (n, d), (m, o) = x.shape, v.shape
    d_pad, o_pad = next_power_of_2(d), next_power_of_2(o)
    n_pad, m_pad = round_up(n, bs.block_q), round_up(m, bs.block_k)
    hyper, leaves = _Hyperparameters.of(kernel, d_pad)
    x_p, y_p = _padded(x, n_pad, d_pad), _padded(y, m_pad, d_pad)
    g_p, v_p = _padded(g, n_pad, o_pad), _padded(v, m_pad, o_pad)
    common = dict(compiler_params=compiler_params(bs, interpret), interpret=interpret)
    num_q = n_pad // bs.block_q
    grad_shapes, grad_specs = hyper.partial_outputs(num_q, x.dtype)
    dx, *partials = pl.pallas_call(
        functools.partial(_query_pass_kernel, hyper=hyper, block_k=bs.block_k),
        grid=(num_q,),
        in_specs=[row_block_spec(bs.block_q, d_pad), row_block_spec(bs.block_q, o_pad),
                  whole_array_spec((d_pad, m_pad)), whole_array_spec((m_pad, o_pad)),
                  *hyper.specs],
        out_specs=[row_block_spec(bs.block_q, d_pad), *grad_specs],
        out_shape=[jax.ShapeDtypeStruct((n_pad, d_pad), x.dtype), *grad_shapes],
        name="expression_mv_bwd_query",
        **common,
    )(x_p, g_p, y_p.T, v_p, *leaves)
    dy, dv = pl.pallas_call(
        functools.partial(_key_pass_kernel, hyper=hyper, block_q=bs.block_q),
        grid=(m_pad // bs.block_k,),
        in_specs=[row_block_spec(bs.block_k, d_pad), row_block_spec(bs.block_k, o_pad),
                  whole_array_spec((d_pad, n_pad)), whole_array_spec((n_pad, o_pad)),
                  *hyper.specs],
        out_specs=[row_block_spec(bs.block_k, d_pad), row_block_spec(bs.block_k, o_pad)],
        out_shape=[jax.ShapeDtypeStruct((m_pad, d_pad), y.dtype),
                   jax.ShapeDtypeStruct((m_pad, o_pad), v.dtype)],
        name="expression_mv_bwd_key",
        **common,
    )(y_p, v_p, x_p.T, g_p, *leaves)
    return hyper.gradient(partials), dx[:n, :d], dy[:m, :d], dv[:m, :o]


def _expression_mv(kernel, x, y, v, block_sizes: BlockSizes, interpret: bool = False):
    """``K(x, y) @ v`` for a kernel expression, centred x (n, d), y (m, d), v (m, o) -> (n, o);
    memory O((n + m)(d + o)) forward and backward (see module docstring)."""
    check_pow2(block_sizes)
    return _forward(kernel, x, y, v, block_sizes, interpret), ()


def expression_mv_bwd(inputs, saved, g, block_sizes, interpret):
    """(dkernel, dx, dy, dv) for the cotangent g (n, o) of the output."""
    del saved
    return _backward(*inputs, g, block_sizes, interpret)


expression_mv = tile_product(_expression_mv, expression_mv_bwd, inputs=4, settings=2)
