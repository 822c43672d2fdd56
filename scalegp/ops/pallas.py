"""Fused Pallas kernels: the kernel product and the KDE log-sum-exp, forward and backward.

Each kernel instance owns one block of rows and loops (``fori_loop``) over blocks of the other
point set, so a ``block_q x block_k`` tile of K lives only in registers/shared memory. On GPU the
kernels go through the Triton lowering, with `jax.experimental.pallas.triton.CompilerParams`
passed explicitly (newer JAX defaults to Mosaic GPU otherwise); on CPU the very same kernels run
with ``interpret=True`` (correct but slow: for tests).

The maths, the gradient formulas and the prepared-input convention are those of `xla.py`; the
backward pass is two tiled passes (over query blocks for da; over key blocks for db and dv), each
an instance of one "pair" kernel with the roles of the two point sets swapped.

Padding: rows to a multiple of the block, the feature dimension d to a power of two >= 16 and the
value dimension o to a multiple of ``block_o`` (Triton's dot wants power-of-two tiles of at least
16). Zero features do not change distances, zero values and ``MASK_VALUE`` log-weights make padded
keys contribute nothing, and padded query rows are cut from the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops.reference import HIGHEST, half_sq_norms, neg_half_sqdist
from scalegp.ops.tiling import MASK_VALUE, BlockSizes, log_weights, next_power_of_2, pad_axis, round_up

MIN_DOT_SIZE = 16


def default_block_sizes() -> BlockSizes:
    # Best forward+backward tiles of the seed's RTX 3090 sweep; not yet re-tuned on Hopper.
    return BlockSizes(block_q=64, block_k=64, block_o=64, num_warps=4, num_stages=2)


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _dot(x, y):
    return lax.dot_general(
        x, y, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=x.dtype
    )


def _dot_t(x, y):
    """x @ y.T"""
    return lax.dot_general(
        x, y, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=x.dtype
    )


def _compiler_params(bs: BlockSizes, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)


def _check_pow2(bs: BlockSizes):
    for name in ("block_q", "block_k", "block_o"):
        value = getattr(bs, name)
        if value < MIN_DOT_SIZE or value & (value - 1):
            raise ValueError(
                f"pallas needs {name} to be a power of two >= {MIN_DOT_SIZE}, got {value}; "
                "pass e.g. 32, 64 or 128, or leave it None for the default"
            )


def _padded_features(x):
    return pad_axis(x, max(MIN_DOT_SIZE, next_power_of_2(x.shape[1])), axis=1)


def _full(shape):
    """BlockSpec of a whole (small-per-row) array, visible to every kernel instance."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _rows(block, width=None):
    if width is None:
        return pl.BlockSpec((block,), lambda i, *_: (i,))
    return pl.BlockSpec((block, width), lambda i, *_: (i, 0))


# ----------------------------------------------------------------------------------------------
# K v


def _mv_forward_kernel(a_ref, a_hn_ref, b_ref, b_hn_ref, v_ref, out_ref, *, block_k):
    a, a_hn = a_ref[...], a_hn_ref[...]

    def body(j, acc):
        keys = pl.ds(j * block_k, block_k)
        k = jnp.exp(neg_half_sqdist(a, b_ref[keys, :], a_hn, b_hn_ref[keys]))
        return acc + _dot(k, v_ref[keys, :])

    acc = jnp.zeros(out_ref.shape, _acc_dtype(out_ref.dtype))
    acc = lax.fori_loop(0, b_ref.shape[0] // block_k, body, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def _mv_pair_kernel(x_ref, x_hn_ref, ux_ref, y_ref, y_hn_ref, uy_ref, *out_refs, block_k, with_mv):
    x, x_hn, ux = x_ref[...], x_hn_ref[...], ux_ref[...]
    acc_dtype = _acc_dtype(x.dtype)

    def body(j, carry):
        mv, w_rowsum, w_y = carry
        cols = pl.ds(j * block_k, block_k)
        y, uy = y_ref[cols, :], uy_ref[cols, :]
        k = jnp.exp(neg_half_sqdist(x, y, x_hn, y_hn_ref[cols]))
        w = k * _dot_t(ux, uy)
        if with_mv:
            mv = mv + _dot(k, uy)
        return mv, w_rowsum + jnp.sum(w, axis=1), w_y + _dot(w, y)

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
    block_o = min(bs.block_o, max(MIN_DOT_SIZE, next_power_of_2(o)))
    n_pad, m_pad, o_pad = round_up(n, bs.block_q), round_up(b.shape[0], bs.block_k), round_up(o, block_o)
    a_p = pad_axis(_padded_features(a), n_pad)
    b_p = pad_axis(_padded_features(b), m_pad)
    v_p = pad_axis(pad_axis(v, o_pad, axis=1), m_pad)
    d_pad = a_p.shape[1]
    out = pl.pallas_call(
        functools.partial(_mv_forward_kernel, block_k=bs.block_k),
        grid=(n_pad // bs.block_q, o_pad // block_o),
        in_specs=[
            _rows(bs.block_q, d_pad),
            _rows(bs.block_q),
            _full((m_pad, d_pad)),
            _full((m_pad,)),
            pl.BlockSpec((m_pad, block_o), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bs.block_q, block_o), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_pad, o_pad), v.dtype),
        compiler_params=_compiler_params(bs, interpret),
        interpret=interpret,
        name="rbf_kernel_mv_fwd",
    )(a_p, half_sq_norms(a_p), b_p, half_sq_norms(b_p), v_p)
    return out[:n, :o]


def _mv_pair(x, ux, y, uy, bs: BlockSizes, interpret: bool, with_mv: bool):
    """Pallas twin of `xla._mv_pair`."""
    p, d, o = x.shape[0], x.shape[1], ux.shape[1]
    o_pad = max(MIN_DOT_SIZE, next_power_of_2(o))
    p_pad, q_pad = round_up(p, bs.block_q), round_up(y.shape[0], bs.block_k)
    x_p, y_p = pad_axis(_padded_features(x), p_pad), pad_axis(_padded_features(y), q_pad)
    ux_p = pad_axis(pad_axis(ux, o_pad, axis=1), p_pad)
    uy_p = pad_axis(pad_axis(uy, o_pad, axis=1), q_pad)
    d_pad = x_p.shape[1]
    out_shape = [jax.ShapeDtypeStruct((p_pad, d_pad), x.dtype)]
    out_specs = [_rows(bs.block_q, d_pad)]
    if with_mv:
        out_shape.insert(0, jax.ShapeDtypeStruct((p_pad, o_pad), uy.dtype))
        out_specs.insert(0, _rows(bs.block_q, o_pad))
    outs = pl.pallas_call(
        functools.partial(_mv_pair_kernel, block_k=bs.block_k, with_mv=with_mv),
        grid=(p_pad // bs.block_q,),
        in_specs=[
            _rows(bs.block_q, d_pad),
            _rows(bs.block_q),
            _rows(bs.block_q, o_pad),
            _full((q_pad, d_pad)),
            _full((q_pad,)),
            _full((q_pad, o_pad)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(bs, interpret),
        interpret=interpret,
        name="rbf_kernel_mv_bwd",
    )(x_p, half_sq_norms(x_p), ux_p, y_p, half_sq_norms(y_p), uy_p)
    diff = outs[-1][:p, :d]
    mv = outs[0][:p, :uy.shape[1]] if with_mv else None
    return mv, diff


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def kernel_mv(a, b, v, block_sizes: BlockSizes, interpret: bool = False):
    """``K(a, b) @ v`` for a (n, d), b (m, d), v (m, o) -> (n, o); see module docstring."""
    _check_pow2(block_sizes)
    return _mv_forward(a, b, v, block_sizes, interpret)


def _kernel_mv_fwd(a, b, v, block_sizes, interpret):
    return kernel_mv(a, b, v, block_sizes, interpret), (a, b, v)


def _kernel_mv_bwd(block_sizes, interpret, residuals, g):
    a, b, v = residuals
    _, da = _mv_pair(a, g, b, v, block_sizes, interpret, with_mv=False)
    dv, db = _mv_pair(b, v, a, g, block_sizes, interpret, with_mv=True)
    return da, db, dv


kernel_mv.defvjp(_kernel_mv_fwd, _kernel_mv_bwd)


# ----------------------------------------------------------------------------------------------
# log sum_j w_j K_ij   (KDE); formulas in xla.py


def _lse_forward_kernel(a_ref, a_hn_ref, b_ref, b_hn_ref, lw_ref, out_ref, *, block_k):
    a, a_hn = a_ref[...], a_hn_ref[...]
    acc_dtype = _acc_dtype(out_ref.dtype)

    def body(j, carry):
        run_max, run_sum = carry
        keys = pl.ds(j * block_k, block_k)
        t = neg_half_sqdist(a, b_ref[keys, :], a_hn, b_hn_ref[keys]) + lw_ref[keys][None, :]
        new_max = jnp.maximum(run_max, jnp.max(t, axis=1))
        run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.sum(
            jnp.exp(t - new_max[:, None]), axis=1
        )
        return new_max, run_sum

    p = a.shape[0]
    init = (jnp.full((p,), -jnp.inf, acc_dtype), jnp.zeros((p,), acc_dtype))
    run_max, run_sum = lax.fori_loop(0, b_ref.shape[0] // block_k, body, init)
    out_ref[...] = (run_max + jnp.log(run_sum)).astype(out_ref.dtype)


def _lse_pair_kernel(x_ref, x_hn_ref, r_ref, y_ref, y_hn_ref, lw_ref, u_ref, s_ref, diff_ref, *, block_k):
    x, x_hn, r = x_ref[...], x_hn_ref[...], r_ref[...]
    acc_dtype = _acc_dtype(x.dtype)

    def body(j, carry):
        q_rowsum, q_y = carry
        cols = pl.ds(j * block_k, block_k)
        y = y_ref[cols, :]
        e = neg_half_sqdist(x, y, x_hn, y_hn_ref[cols]) + lw_ref[cols][None, :] + r[:, None]
        q = jnp.exp(e) * u_ref[cols][None, :]
        return q_rowsum + jnp.sum(q, axis=1), q_y + _dot(q, y)

    p = x.shape[0]
    init = (jnp.zeros((p,), acc_dtype), jnp.zeros((p, x.shape[1]), acc_dtype))
    q_rowsum, q_y = lax.fori_loop(0, y_ref.shape[0] // block_k, body, init)
    s_ref[...] = q_rowsum.astype(s_ref.dtype)
    diff_ref[...] = (q_y - x * q_rowsum[:, None]).astype(diff_ref.dtype)


def _lse_forward(a, b, log_w, bs: BlockSizes, interpret: bool):
    n = a.shape[0]
    n_pad, m_pad = round_up(n, bs.block_q), round_up(b.shape[0], bs.block_k)
    a_p, b_p = pad_axis(_padded_features(a), n_pad), pad_axis(_padded_features(b), m_pad)
    d_pad = a_p.shape[1]
    out = pl.pallas_call(
        functools.partial(_lse_forward_kernel, block_k=bs.block_k),
        grid=(n_pad // bs.block_q,),
        in_specs=[
            _rows(bs.block_q, d_pad),
            _rows(bs.block_q),
            _full((m_pad, d_pad)),
            _full((m_pad,)),
            _full((m_pad,)),
        ],
        out_specs=_rows(bs.block_q),
        out_shape=jax.ShapeDtypeStruct((n_pad,), a.dtype),
        compiler_params=_compiler_params(bs, interpret),
        interpret=interpret,
        name="rbf_logsumexp_fwd",
    )(a_p, half_sq_norms(a_p), b_p, half_sq_norms(b_p), pad_axis(log_w, m_pad, value=MASK_VALUE))
    return out[:n]


def _lse_pair(x, r, y, lw, u, bs: BlockSizes, interpret: bool):
    """Pallas twin of `xla._lse_pair`."""
    p, d = x.shape
    p_pad, q_pad = round_up(p, bs.block_q), round_up(y.shape[0], bs.block_k)
    x_p, y_p = pad_axis(_padded_features(x), p_pad), pad_axis(_padded_features(y), q_pad)
    d_pad = x_p.shape[1]
    s, diff = pl.pallas_call(
        functools.partial(_lse_pair_kernel, block_k=bs.block_k),
        grid=(p_pad // bs.block_q,),
        in_specs=[
            _rows(bs.block_q, d_pad),
            _rows(bs.block_q),
            _rows(bs.block_q),
            _full((q_pad, d_pad)),
            _full((q_pad,)),
            _full((q_pad,)),
            _full((q_pad,)),
        ],
        out_specs=[_rows(bs.block_q), _rows(bs.block_q, d_pad)],
        out_shape=[
            jax.ShapeDtypeStruct((p_pad,), x.dtype),
            jax.ShapeDtypeStruct((p_pad, d_pad), x.dtype),
        ],
        compiler_params=_compiler_params(bs, interpret),
        interpret=interpret,
        name="rbf_logsumexp_bwd",
    )(
        x_p,
        half_sq_norms(x_p),
        pad_axis(r, p_pad),
        y_p,
        half_sq_norms(y_p),
        pad_axis(lw, q_pad, value=MASK_VALUE),
        pad_axis(u, q_pad),
    )
    return s[:p], diff[:p, :d]



@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def kernel_logsumexp(a, b, w, block_sizes: BlockSizes, interpret: bool = False):
    """``log sum_j w_j exp(-|a_i - b_j|^2 / 2)`` for a (n, d), b (m, d), w (m,) >= 0 -> (n,)."""
    _check_pow2(block_sizes)
    return _lse_forward(a, b, log_weights(w), block_sizes, interpret)


def _kernel_logsumexp_fwd(a, b, w, block_sizes, interpret):
    f = kernel_logsumexp(a, b, w, block_sizes, interpret)
    return f, (a, b, w, f)


def _kernel_logsumexp_bwd(block_sizes, interpret, residuals, g):
    a, b, w, f = residuals
    _, p_diff = _lse_pair(a, -f, b, log_weights(w), jnp.ones_like(w), block_sizes, interpret)
    dw, t_diff = _lse_pair(b, jnp.zeros_like(w), a, -f, g, block_sizes, interpret)
    return g[:, None] * p_diff, w[:, None] * t_diff, dw


kernel_logsumexp.defvjp(_kernel_logsumexp_fwd, _kernel_logsumexp_bwd)
