"""Fused Pallas kernels: the kernel product and the KDE log-sum-exp, forward and backward.

Each kernel instance owns one block of rows and loops (``fori_loop``) over blocks of the other
point set, so a ``block_q x block_k`` tile of K lives only in registers/shared memory. On GPU the
kernels go through the Triton lowering, with `jax.experimental.pallas.triton.CompilerParams`
passed explicitly (newer JAX defaults to Mosaic GPU otherwise); on CPU the very same kernels run
with ``interpret=True`` (correct but slow: for tests).

The maths, the gradient formulas and the prepared-input convention are those of `xla/_blocks.py`; as
there, the KDE's log-sum-exp has a variant whose exponents come from the coordinate differences
(`kernel_logsumexp_differences`, for data spread over many bandwidths), summed one feature at a
time in (p, q) tiles (`feature_loop_squares`). Query
blocks run in parallel here, so instead of xla's one sweep (which accumulates row and column sums
together) the backward is two tiled passes, as in FlashAttention: over query blocks for da, over
key blocks for db and dv (and dw). For the kernel product both are one "pair" kernel with the
roles of the two point sets swapped.

Padding: rows to a multiple of the block; the feature dimension d and the value dimension o to
powers of two, since Triton's tensors have power-of-two sizes. Nothing is padded to 16 (the
minimum of tensor-core products): the products here are IEEE float32, which Triton computes with
FMA instructions at any power-of-two size (checked by compiling: benchmarks/gpu/pallas_lowering.py).
So at d = 8 and o = 16 the prepared points and values go to the kernels as they are, without a
padded copy in device memory. Zero features do not change
distances, zero values and zero weights make padded keys contribute nothing, and padded query
rows are cut from the output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._matmul import half_sq_norms
from scalegp.ops._tile_math import lse_step, tile_product
from scalegp.ops._tiling import (
    BlockSizes,
    log_weights,
    next_power_of_2,
    pad_axis,
    round_up,
)
from scalegp.ops.backends.triton._blocks import (
    TritonLaunch,
    accumulator_dtype,
    check_pow2,
    compiler_params,
    matmul,
    matmul_nt,
    neg_half_sqdist,
    row_block_spec,
    whole_array_spec,
)


def default_block_sizes(d: int = 1) -> BlockSizes:
    """Tiles and Triton launch parameters for points of ``d`` features (padded to a power of two
    inside the kernels).

    Up to d = 16: the best forward+backward tiles of the RTX 3090 tile sweep the project started
    from (d = 8). Wider points need more registers per thread for the (block, d) tiles and
    accumulators, so 8 warps from d = 32 and 32 x 32 tiles from d = 64, where the backward
    kernels of 64 x 64 tiles on 4 warps spill. These rules come from the compile statistics of
    `benchmarks/gpu/pallas_lowering.py` (docs/decisions.md #18), not from GPU timings.
    """
    d_pad = next_power_of_2(d)
    if d_pad <= 16:
        return BlockSizes(block_q=64, block_k=64, block_o=64, launch=TritonLaunch(4, 2))
    if d_pad == 32:
        return BlockSizes(block_q=64, block_k=64, block_o=64, launch=TritonLaunch(8, 2))
    return BlockSizes(block_q=32, block_k=32, block_o=64, launch=TritonLaunch(8, 2))


def _padded_features(x):
    return pad_axis(x, next_power_of_2(x.shape[1]), axis=1)


def feature(x, f, axis):
    """Feature f of x: column f of a (p, d) tile (axis=1), row f of a (d, q) one (axis=0), as a
    masked sum: Triton cannot slice a register tensor, and one nonzero term sums exactly."""
    features = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.sum(jnp.where(features == f, x, jnp.zeros((), x.dtype)), axis=axis)


def placed(columns, shape, axis):
    """The inverse of `feature`: a (p, d) (axis=1) or (d, q) (axis=0) tile from its d
    features."""
    features = lax.broadcasted_iota(jnp.int32, shape, axis)
    out = jnp.zeros(shape, columns[0].dtype)
    for f, column in enumerate(columns):
        out = jnp.where(features == f, jnp.expand_dims(column, axis), out)
    return out


def register_half_sq_norms(x):
    """``|x_i|² / 2`` (p,) of a (p, d) tile in a kernel's registers, by ``jnp.sum``: Triton
    cannot slice them for the written-out sum of `scalegp.ops._matmul.half_sq_norms`, and a
    kernel's tile height is fixed per call, so a row rounds the same in any batch."""
    return 0.5 * jnp.sum(x * x, axis=-1)


def feature_loop_squares(x, y, y_axis=0, features=None):
    """``Σ_f (x_if - y_jf)²`` (p, q) for a (p, d) tile x and a (d, q) (``y_axis=0``) or (q, d)
    (``y_axis=1``) tile y, one feature at a time, over the first ``features`` (default all d):
    the squares of the coordinate differences in (p, q) tiles only, where a (p, d, q)
    broadcast would be held in registers whole."""
    out = None
    for f in range(x.shape[1] if features is None else features):
        term = jnp.square(feature(x, f, 1)[:, None] - feature(y, f, y_axis)[None, :])
        out = term if out is None else out + term
    return out


def _exponents(a, b, a_hn, b_hn, direct):
    """``-|a_i - b_j|² / 2`` of a (p, q) tile of prepared points a (p, d_pad), b (q, d_pad):
    by the distance expansion, or with ``direct`` (the number of real features) from the
    coordinate differences (`xla._rbf._exponents`, the same arithmetic one feature at a time)."""
    if direct:
        return -0.5 * feature_loop_squares(a, b, y_axis=1, features=direct)
    return neg_half_sqdist(a, b, a_hn, b_hn)


# ----------------------------------------------------------------------------------------------
# K v


def _mv_forward_kernel(a_ref, a_hn_ref, b_ref, b_hn_ref, v_ref, out_ref, *, block_k):
    a, a_hn = a_ref[...], a_hn_ref[...]

    def body(j, acc):
        keys = pl.ds(j * block_k, block_k)
        k = jnp.exp(neg_half_sqdist(a, b_ref[keys, :], a_hn, b_hn_ref[keys]))
        return acc + matmul(k, v_ref[keys, :])

    acc = jnp.zeros(out_ref.shape, accumulator_dtype(out_ref.dtype))
    acc = lax.fori_loop(0, b_ref.shape[0] // block_k, body, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def _mv_pair_kernel(x_ref, x_hn_ref, ux_ref, y_ref, y_hn_ref, uy_ref, *out_refs, block_k, with_mv):
    x, x_hn, ux = x_ref[...], x_hn_ref[...], ux_ref[...]
    acc_dtype = accumulator_dtype(x.dtype)

    def body(j, carry):
        mv, w_rowsum, w_y = carry
        cols = pl.ds(j * block_k, block_k)
        y, uy = y_ref[cols, :], uy_ref[cols, :]
        k = jnp.exp(neg_half_sqdist(x, y, x_hn, y_hn_ref[cols]))
        w = k * matmul_nt(ux, uy)
        if with_mv:
            mv = mv + matmul(k, uy)
        return mv, w_rowsum + jnp.sum(w, axis=1), w_y + matmul(w, y)

    p = x.shape[0]
    mv0 = jnp.zeros((p, uy_ref.shape[1]), acc_dtype) if with_mv else None
    init = (mv0, jnp.zeros((p,), acc_dtype), jnp.zeros((p, x.shape[1]), acc_dtype))
    mv, w_rowsum, w_y = lax.fori_loop(0, y_ref.shape[0] // block_k, body, init)
    diff_ref = out_refs[-1]
    diff_ref[...] = (w_y - x * w_rowsum[:, None]).astype(diff_ref.dtype)
    if with_mv:
        out_refs[0][...] = mv.astype(out_refs[0].dtype)


def _mv_forward(a, b, v, bs: BlockSizes, interpret: bool):
    n, o = a.shape[0], v.shape[1]
    block_o = min(bs.block_o, next_power_of_2(o))
    n_pad, m_pad, o_pad = round_up(n, bs.block_q), round_up(b.shape[0], bs.block_k), round_up(o, block_o)
    a_p = pad_axis(_padded_features(a), n_pad)
    b_p = pad_axis(_padded_features(b), m_pad)
    v_p = pad_axis(pad_axis(v, o_pad, axis=1), m_pad)
    d_pad = a_p.shape[1]
    out = pl.pallas_call(
        functools.partial(_mv_forward_kernel, block_k=bs.block_k),
        grid=(n_pad // bs.block_q, o_pad // block_o),
        in_specs=[
            row_block_spec(bs.block_q, d_pad),
            row_block_spec(bs.block_q),
            whole_array_spec((m_pad, d_pad)),
            whole_array_spec((m_pad,)),
            pl.BlockSpec((m_pad, block_o), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bs.block_q, block_o), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_pad, o_pad), v.dtype),
        compiler_params=compiler_params(bs, interpret),
        interpret=interpret,
        name="rbf_kernel_mv_fwd",
    )(a_p, half_sq_norms(a_p), b_p, half_sq_norms(b_p), v_p)
    return out[:n, :o]


def _mv_pair(x, ux, y, uy, bs: BlockSizes, interpret: bool, with_mv: bool):
    """For each row x_i: ``(sum_j K_ij uy_j, sum_j W_ij (y_j - x_i))`` with ``W_ij = K_ij ux_i.uy_j``.

    da is ``_mv_pair(a, g, b, v)[1]``; (dv, db) is ``_mv_pair(b, v, a, g)``: the same pass with the
    roles of (a, g) and (b, v) swapped. The first output is only computed when ``with_mv``.
    """
    p, d, o = x.shape[0], x.shape[1], ux.shape[1]
    o_pad = next_power_of_2(o)
    p_pad, q_pad = round_up(p, bs.block_q), round_up(y.shape[0], bs.block_k)
    x_p, y_p = pad_axis(_padded_features(x), p_pad), pad_axis(_padded_features(y), q_pad)
    ux_p = pad_axis(pad_axis(ux, o_pad, axis=1), p_pad)
    uy_p = pad_axis(pad_axis(uy, o_pad, axis=1), q_pad)
    d_pad = x_p.shape[1]
    out_shape = [jax.ShapeDtypeStruct((p_pad, d_pad), x.dtype)]
    out_specs = [row_block_spec(bs.block_q, d_pad)]
    if with_mv:
        out_shape.insert(0, jax.ShapeDtypeStruct((p_pad, o_pad), uy.dtype))
        out_specs.insert(0, row_block_spec(bs.block_q, o_pad))
    outs = pl.pallas_call(
        functools.partial(_mv_pair_kernel, block_k=bs.block_k, with_mv=with_mv),
        grid=(p_pad // bs.block_q,),
        in_specs=[
            row_block_spec(bs.block_q, d_pad),
            row_block_spec(bs.block_q),
            row_block_spec(bs.block_q, o_pad),
            whole_array_spec((q_pad, d_pad)),
            whole_array_spec((q_pad,)),
            whole_array_spec((q_pad, o_pad)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(bs, interpret),
        interpret=interpret,
        name="rbf_kernel_mv_bwd",
    )(x_p, half_sq_norms(x_p), ux_p, y_p, half_sq_norms(y_p), uy_p)
    diff = outs[-1][:p, :d]
    mv = outs[0][:p, :uy.shape[1]] if with_mv else None
    return mv, diff


def _kernel_mv(a, b, v, block_sizes: BlockSizes, interpret: bool = False):
    """``K(a, b) @ v`` for a (n, d), b (m, d), v (m, o) -> (n, o); see module docstring."""
    check_pow2(block_sizes)
    return _mv_forward(a, b, v, block_sizes, interpret), ()


def kernel_mv_bwd(inputs, saved, g, block_sizes, interpret):
    """(da, db, dv) of `kernel_mv` at the cotangent g (n, o): two tiled passes."""
    del saved
    a, b, v = inputs
    _, da = _mv_pair(a, g, b, v, block_sizes, interpret, with_mv=False)
    dv, db = _mv_pair(b, v, a, g, block_sizes, interpret, with_mv=True)
    return da, db, dv


kernel_mv = tile_product(_kernel_mv, kernel_mv_bwd, inputs=3, settings=2)


# ----------------------------------------------------------------------------------------------
# log sum_j w_j K_ij   (KDE); formulas, and why f is kept as the pair (M, L), in xla/_rbf.py


def _lse_forward_kernel(a_ref, a_hn_ref, b_ref, b_hn_ref, w_ref, lw_ref, max_ref, log_sum_ref, *,
                        block_k, direct):
    a, a_hn = a_ref[...], a_hn_ref[...]
    acc_dtype = accumulator_dtype(a.dtype)

    def body(j, carry):
        run_max, run_sum = carry
        keys = pl.ds(j * block_k, block_k)
        w = w_ref[keys][None, :]
        e = _exponents(a, b_ref[keys, :], a_hn, b_hn_ref[keys], direct)
        return lse_step(run_max, run_sum, e, w, lw_ref[keys][None, :])[:2]

    p = a.shape[0]
    init = (jnp.full((p,), -jnp.inf, acc_dtype), jnp.zeros((p,), acc_dtype))
    run_max, run_sum = lax.fori_loop(0, b_ref.shape[0] // block_k, body, init)
    max_ref[...] = run_max.astype(max_ref.dtype)
    log_sum_ref[...] = jnp.log(run_sum).astype(log_sum_ref.dtype)


def _lse_dq_kernel(a_ref, a_hn_ref, max_ref, log_sum_ref, b_ref, b_hn_ref, w_ref, p_sum_ref,
                   p_diff_ref, *, block_k, direct):
    """Per query: ``sum_j P_ij`` and ``sum_j P_ij (b_j - a_i)``, P_ij = w_j exp(e_ij - M_i - L_i);
    with ``direct`` the latter from the coordinate differences (`xla._rbf.difference_sums`)."""
    a, a_hn = a_ref[...], a_hn_ref[...]
    f_max, f_log_sum = max_ref[...][:, None], log_sum_ref[...][:, None]
    acc_dtype = accumulator_dtype(a.dtype)

    def body(j, carry):
        p_rowsum, p_b = carry
        keys = pl.ds(j * block_k, block_k)
        b, w = b_ref[keys, :], w_ref[keys][None, :]
        t = jnp.exp((_exponents(a, b, a_hn, b_hn_ref[keys], direct) - f_max) - f_log_sum)
        p = jnp.where(w > 0, t * w, 0.0)
        if direct:
            sums = [jnp.sum(p * (feature(b, f, 1)[None, :] - feature(a, f, 1)[:, None]), axis=1)
                    for f in range(direct)]
            return p_rowsum + jnp.sum(p, axis=1), p_b + placed(sums, a.shape, 1)
        return p_rowsum + jnp.sum(p, axis=1), p_b + matmul(p, b)

    init = (jnp.zeros((a.shape[0],), acc_dtype), jnp.zeros(a.shape, acc_dtype))
    p_rowsum, p_b = lax.fori_loop(0, b_ref.shape[0] // block_k, body, init)
    p_sum_ref[...] = p_rowsum.astype(p_sum_ref.dtype)
    p_diff = p_b if direct else p_b - a * p_rowsum[:, None]
    p_diff_ref[...] = p_diff.astype(p_diff_ref.dtype)


def _lse_dk_kernel(b_ref, b_hn_ref, a_ref, a_hn_ref, max_ref, log_sum_ref, g_ref, t_sum_ref,
                   t_diff_ref, *, block_q, direct):
    """Per key: ``sum_i g_i T_ij`` and ``sum_i g_i T_ij (a_i - b_j)``, T_ij = exp(e_ij - M_i - L_i);
    with ``direct`` the latter from the coordinate differences (`xla._rbf.difference_sums`)."""
    b, b_hn = b_ref[...], b_hn_ref[...]
    acc_dtype = accumulator_dtype(b.dtype)

    def body(i, carry):
        t_colsum, t_a = carry
        queries = pl.ds(i * block_q, block_q)
        a = a_ref[queries, :]
        if direct:
            # Elementwise, so any orientation rounds as the forward pass did: built as
            # (keys, queries) directly (a transposed tile spilled registers on sm_90).
            e = -0.5 * feature_loop_squares(b, a, y_axis=1, features=direct)
            t = jnp.exp((e - max_ref[queries][None, :]) - log_sum_ref[queries][None, :])
            gt = t * g_ref[queries][None, :]
            sums = [jnp.sum(gt * (feature(a, f, 1)[None, :] - feature(b, f, 1)[:, None]), axis=1)
                    for f in range(direct)]
            return t_colsum + jnp.sum(gt, axis=1), t_a + placed(sums, b.shape, 1)
        # Built in the forward kernel's orientation and tile shape, then transposed: T must use
        # exponents rounded exactly as in the forward pass (see xla/_rbf.py).
        e = neg_half_sqdist(a, b, a_hn_ref[queries], b_hn)  # (queries, keys)
        t = jnp.exp((e - max_ref[queries][:, None]) - log_sum_ref[queries][:, None])
        gt = (t * g_ref[queries][:, None]).T
        return t_colsum + jnp.sum(gt, axis=1), t_a + matmul(gt, a)

    init = (jnp.zeros((b.shape[0],), acc_dtype), jnp.zeros(b.shape, acc_dtype))
    t_colsum, t_a = lax.fori_loop(0, a_ref.shape[0] // block_q, body, init)
    t_sum_ref[...] = t_colsum.astype(t_sum_ref.dtype)
    t_diff = t_a if direct else t_a - b * t_colsum[:, None]
    t_diff_ref[...] = t_diff.astype(t_diff_ref.dtype)


def _padded_points(a, b, bs: BlockSizes):
    a_p = pad_axis(_padded_features(a), round_up(a.shape[0], bs.block_q))
    b_p = pad_axis(_padded_features(b), round_up(b.shape[0], bs.block_k))
    return a_p, b_p


def lse_forward(a, b, w, bs: BlockSizes, interpret: bool, direct: bool = False):
    """(M, L) as `xla._rbf.lse_forward`; ``direct``: exponents from the coordinate differences."""
    n = a.shape[0]
    features = a.shape[1] if direct else 0  # the kernels see d padded to a power of two
    a_p, b_p = _padded_points(a, b, bs)
    (n_pad, d_pad), m_pad = a_p.shape, b_p.shape[0]
    w_p = pad_axis(w, m_pad)
    f_max, f_log_sum = pl.pallas_call(
        functools.partial(_lse_forward_kernel, block_k=bs.block_k, direct=features),
        grid=(n_pad // bs.block_q,),
        in_specs=[
            row_block_spec(bs.block_q, d_pad),
            row_block_spec(bs.block_q),
            whole_array_spec((m_pad, d_pad)),
            whole_array_spec((m_pad,)),
            whole_array_spec((m_pad,)),
            whole_array_spec((m_pad,)),
        ],
        out_specs=[row_block_spec(bs.block_q), row_block_spec(bs.block_q)],
        out_shape=[jax.ShapeDtypeStruct((n_pad,), a.dtype)] * 2,
        compiler_params=compiler_params(bs, interpret),
        interpret=interpret,
        name="rbf_logsumexp_fwd" + ("_differences" if direct else ""),
    )(a_p, half_sq_norms(a_p), b_p, half_sq_norms(b_p), w_p, log_weights(w_p))
    return f_max[:n], f_log_sum[:n]


#: The differences' backward tiles, from 8 padded features: at most this many rows and keys.
#: Their per-feature sums hold more of a tile live than the product did, and 64 x 64 tiles
#: spilled registers on sm_90 at d = 8 and 16 (`benchmarks/gpu/pallas_lowering.py`;
#: docs/decisions.md #35). Elementwise exponents round alike in any tile, so the backward need
#: not share the forward's.
DIFFERENCES_BACKWARD_BLOCK = 32


def backward_block_sizes(bs: BlockSizes, d: int, direct: bool) -> BlockSizes:
    """The tiles of `lse_backward`: the forward's, capped for the differences from d = 5."""
    if not direct or next_power_of_2(d) < 8:
        return bs
    cap = DIFFERENCES_BACKWARD_BLOCK
    return dataclasses.replace(bs, block_q=min(bs.block_q, cap), block_k=min(bs.block_k, cap))


def lse_backward(a, b, w, f_max, f_log_sum, g, bs: BlockSizes, interpret: bool,
                 direct: bool = False):
    (n, d), m = a.shape, b.shape[0]
    features = d if direct else 0
    bs = backward_block_sizes(bs, d, direct)
    a_p, b_p = _padded_points(a, b, bs)
    (n_pad, d_pad), m_pad = a_p.shape, b_p.shape[0]
    a_hn, b_hn = half_sq_norms(a_p), half_sq_norms(b_p)
    f_max, f_log_sum = pad_axis(f_max, n_pad), pad_axis(f_log_sum, n_pad)
    common = dict(compiler_params=compiler_params(bs, interpret), interpret=interpret)
    _, p_diff = pl.pallas_call(
        functools.partial(_lse_dq_kernel, block_k=bs.block_k, direct=features),
        grid=(n_pad // bs.block_q,),
        in_specs=[row_block_spec(bs.block_q, d_pad)] + [row_block_spec(bs.block_q)] * 3
        + [whole_array_spec((m_pad, d_pad)), whole_array_spec((m_pad,)),
           whole_array_spec((m_pad,))],
        out_specs=[row_block_spec(bs.block_q), row_block_spec(bs.block_q, d_pad)],
        out_shape=[jax.ShapeDtypeStruct((n_pad,), a.dtype), jax.ShapeDtypeStruct((n_pad, d_pad), a.dtype)],
        name="rbf_logsumexp_bwd_dq" + ("_differences" if direct else ""),
        **common,
    )(a_p, a_hn, f_max, f_log_sum, b_p, b_hn, pad_axis(w, m_pad))
    dw, t_diff = pl.pallas_call(
        functools.partial(_lse_dk_kernel, block_q=bs.block_q, direct=features),
        grid=(m_pad // bs.block_k,),
        in_specs=[row_block_spec(bs.block_k, d_pad), row_block_spec(bs.block_k),
                  whole_array_spec((n_pad, d_pad))]
        + [whole_array_spec((n_pad,))] * 4,
        out_specs=[row_block_spec(bs.block_k), row_block_spec(bs.block_k, d_pad)],
        out_shape=[jax.ShapeDtypeStruct((m_pad,), b.dtype), jax.ShapeDtypeStruct((m_pad, d_pad), b.dtype)],
        name="rbf_logsumexp_bwd_dk" + ("_differences" if direct else ""),
        **common,
    )(b_p, b_hn, a_p, a_hn, f_max, f_log_sum, pad_axis(g, n_pad))
    da = g[:, None] * p_diff[:n, :d]
    db = jnp.where(w[:, None] > 0, w[:, None] * t_diff[:m, :d], 0.0)  # no 0 * inf from zero weights
    return da, db, dw[:m]


def _logsumexp_pass(a, b, w, block_sizes: BlockSizes, interpret: bool, direct: bool):
    check_pow2(block_sizes)
    f_max, f_log_sum = lse_forward(a, b, w, block_sizes, interpret, direct)
    return f_max + f_log_sum, (f_max, f_log_sum)


def _logsumexp_bwd(inputs, saved, g, block_sizes, interpret, direct):
    return lse_backward(*inputs, *saved, g, block_sizes, interpret, direct)


_logsumexp = tile_product(_logsumexp_pass, _logsumexp_bwd, inputs=3, settings=3)


def kernel_logsumexp(a, b, w, block_sizes: BlockSizes, interpret: bool = False):
    """``log sum_j w_j exp(-|a_i - b_j|^2 / 2)`` for a (n, d), b (m, d), w (m,) >= 0 -> (n,)."""
    return _logsumexp(a, b, w, block_sizes, interpret, False)


def kernel_logsumexp_differences(a, b, w, block_sizes: BlockSizes, interpret: bool = False):
    """`kernel_logsumexp` with the exponents from the coordinate differences, one feature at a
    time (`feature_loop_squares`; for d <= `DIRECT_MAX_D`): accurate for points spread over
    many lengthscales, as `xla._rbf.kernel_logsumexp_differences`. The point gradients still come
    from products, as there."""
    return _logsumexp(a, b, w, block_sizes, interpret, True)
