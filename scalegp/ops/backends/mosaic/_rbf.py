"""Mosaic kernels of the RBF's ``K v`` and the KDE's ``log Σ_j w_j K_ij``, forward and
backward, on prepared points (``K_ij = exp(-|a_i - b_j|² / 2)``; formulas as in
`scalegp.ops.backends.xla._blocks`); the smooth Matérn's ``K v`` is the RBF's with another
profile of the squared distance (`scalegp.ops._matmul.matern_of_squared`, on points scaled by
``√(2ν) / l``).

Every kernel runs on a grid (row tiles, key tiles): the row tile stays in VMEM while the key
tiles stream past it (the "arbitrary" axis), and running sums live in VMEM scratch, written out
at the last key tile. The exponents come from the coordinate differences (small d) or the
expansion on the matrix unit, and the products with thin operands are the split bfloat16
passes of `_blocks` (the errors are stated there and pinned by tests/ops/backends/mosaic/).

::

    K v        rows a, keys b:   out_i = Σ_j K_ij v_j                     (compensated sums)
    K v grad   rows a, keys b:   Σ_j W_ij (b_j - a_i) per row, Σ_i W_ij (a_i - b_j) and
                                 Σ_i K_ij g_i per key, W_ij = w_ij (g_i · v_j)
                                 (w = -2 ∂K/∂|a_i - b_j|²: K for the RBF)
    lse        rows a, keys b:   M_i, L_i with log Σ_j w_j K_ij = M_i + L_i    (online max)
    lse grad   rows a, keys b:   Σ_j P_ij (b_j - a_i) per row, Σ_i C_ij [b_j - a_i, 1] per key,
                                 P = w_j E, C = g_i E, E = e^{(e_ij - M_i) - L_i}
    exp sums   rows r, keys c:   Σ_c T_rc [y_c - x_r, 1],  T_rc = s_c e^{(e_rc - M) - L}

The backward of K v is one pass (K v grad), whose keys' sums stay in VMEM for a call's grid
(docs/decisions.md #70), as the KDE's backward by the differences (lse grad, #68); the KDE's by
the expansion is two exp-sums passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from scalegp.ops._matmul import matern_of_squared
from scalegp.ops._tile_math import accurate_log, tile_product
from scalegp.ops._tiling import (
    BlockSizes,
    compensated_add,
    pad_axis,
    round_up,
)
from scalegp.ops.backends.mosaic._blocks import (
    call,
    check_blocks,
    cols_spec,
    exponents,
    fold,
    key_geometry,
    key_pieces,
    on_first_key_tile,
    on_last_key_tile,
    over_column_chunks,
    over_resident_keys,
    over_row_chunks,
    row_geometry,
    row_pieces,
    rows_spec,
    split_dot,
    split_dot_t,
    split_operand,
    split_thin,
    split_value,
    split_width,
    swapped,
)

#: Default tiles: 512 query rows against 2,048 keys, chosen by the chip's tile sweep (tile
#: sizes mattered little there: docs/decisions.md #47, benchmarks/results/
#: mosaic_check_tpu_v5e_sweep.json); 512 x 2,048 fits the 64 MiB VMEM limit with room for
#: wide value blocks.
BLOCK_Q, BLOCK_K = 512, 2048


def default_block_sizes(d: int = 1) -> BlockSizes:
    del d
    return BlockSizes(block_q=BLOCK_Q, block_k=BLOCK_K)


# ----------------------------------------------------------------------------------------------
# K v and the pair pass


def profile(e, nu):
    """``(K, w)`` of a tile from its exponents ``e = -|a - b|² / 2``: the RBF's (``nu`` None)
    ``K = w = e^e``, else the Matérn ν's (`matern_of_squared`); ``w = -2 ∂K/∂|a - b|²``."""
    if nu is None:
        k = jnp.exp(e)
        return k, k
    return matern_of_squared(-2.0 * e, nu)


def _mv_kernel(*refs, nu, split_arrays: int):
    x_ref, y_ref = refs[0], refs[1]
    v_refs = refs[2:2 + split_arrays]
    mv_out, mv_sum, mv_carry = refs[2 + split_arrays:]

    @on_first_key_tile
    def _():
        mv_sum[...] = jnp.zeros_like(mv_sum)
        mv_carry[...] = jnp.zeros_like(mv_carry)

    k, _ = profile(exponents(x_ref[...], y_ref[...]), nu)
    mv_sum[...], mv_carry[...] = compensated_add((mv_sum[...], mv_carry[...]),
                                                 split_dot(k, split_value(v_refs)))

    @on_last_key_tile
    def _():
        mv_out[...] = mv_sum[...] + mv_carry[...]


def _mv(x, y, v, bs: BlockSizes, interpret: bool, differences: bool, nu=None):
    """``Σ_j K_ij v_j`` (p, o) for rows x (p, d) against keys y (q, d), K of the profile
    ``nu`` (`profile`), its tile sums compensated. Wide v goes through in chunks of columns
    (`over_column_chunks`); in each, the keys' operands are laid out once, the rows' per chunk
    of rows (`over_row_chunks`)."""

    def columns(v):
        return _mv_columns(x, y, v, bs, interpret, differences, nu), ()

    return over_column_chunks(columns, v, forward=True)[0]


def _mv_columns(x, y, v, bs, interpret, differences, nu):
    """`_mv` in one kernel call per chunk of rows."""
    q, o = y.shape[0], v.shape[1]
    cols = round_up(q, bs.block_k)
    y_geo = key_geometry(y, differences, cols)
    split, split_specs = split_operand(pad_axis(v, cols), bs.block_k)
    width = split_width(o)
    kernel = functools.partial(_mv_kernel, nu=nu, split_arrays=len(split))

    def rows_part(x):
        rows = round_up(x.shape[0], bs.block_q)
        x_geo = row_geometry(x, differences, rows)
        out = call(kernel, (rows // bs.block_q, cols // bs.block_k),
                   [rows_spec(bs.block_q, x_geo.shape[1]), cols_spec(y_geo.shape[0],
                                                                     bs.block_k),
                    *split_specs],
                   [rows_spec(bs.block_q, width)],
                   [jax.ShapeDtypeStruct((rows, width), jnp.float32)],
                   [(bs.block_q, width)] * 2, bs, interpret, _names(nu)[0])(x_geo, y_geo,
                                                                            *split)[0]
        return fold(out, o)[:x.shape[0]].astype(v.dtype)

    return over_row_chunks(rows_part, bs.block_q, x)


def _with_ones(y, cols, differences, operands, in_specs, bs):
    """Appends the expansion's thin operand ``split_thin([y, 1])`` (none for the
    differences); returns the width of the sums ``Σ_c T_rc [y_c - x_r, 1]``."""
    d = y.shape[1]
    if differences:
        return d + 1
    y1 = jnp.concatenate([y, jnp.ones_like(y[:, :1])], axis=1)
    operands.append(split_thin(pad_axis(y1, cols)))
    in_specs.append(cols_spec(operands[-1].shape[0], bs.block_k))
    return operands[-1].shape[0]


def _differences_of(out, x, differences):
    """``(Σ_c T_rc (y_c - x_r), Σ_c T_rc)`` from a kernel's sums (`_with_ones`)."""
    p, d = x.shape
    if differences:
        sums = out[:p]
        return sums[:, :d].astype(x.dtype), sums[:, d].astype(x.dtype)
    sums = fold(out, d + 1)[:p]
    return (sums[:, :d] - x * sums[:, d:]).astype(x.dtype), sums[:, d].astype(x.dtype)


def difference_sums(acc, t, x, y):
    """``acc += [Σ_c t_rc (y_c - x_r), Σ_c t_rc]`` by the coordinate differences, one feature
    at a time, for rows x (p, d) and feature-major keys y (d, q): ``Σ t y - x Σ t`` would
    cancel for points far from the centre in lengthscales, and the lengthscale's gradient,
    ``-Σ_i da_i·a_i - Σ_j db_j·b_j``, multiplies the loss by |a| (docs/decisions.md #35)."""
    d = x.shape[1]
    for f in range(d):
        acc[:, f:f + 1] += jnp.sum(t * (y[f:f + 1, :] - x[:, f:f + 1]), axis=1, keepdims=True)
    acc[:, d:] += jnp.sum(t, axis=1, keepdims=True)


def _kernel_mv(a, b, v, block_sizes: BlockSizes, interpret: bool = False,
               differences: bool = True, nu=None):
    """``K(a, b) @ v`` for prepared a (n, d), b (m, d), v (m, o) -> (n, o); ``differences``:
    the exponents from the coordinate differences, else from the expansion; ``nu``: the RBF
    (None) or the Matérn ν = 1.5, 2.5 on points scaled by ``√(2ν) / l`` (`profile`)."""
    check_blocks(block_sizes)
    return _mv(a, b, v, block_sizes, interpret, differences, nu), ()


def kernel_mv_bwd(inputs, saved, g, block_sizes, interpret, differences, nu=None):
    """(da, db, dv) of `kernel_mv` at the cotangent g (n, o), in one pass (`_backward`)."""
    del saved
    return _backward(*inputs, g, block_sizes, interpret, differences, nu, False)[:3]


#: The most bytes one call of the backward (`_backward`) keeps of its keys' sums in VMEM
#: (float32: d rounded to 8, or the expansion's split [a, 1]ᵀ W, and the split Kᵀ g, per key):
#: its keys are as many as fit.
FUSED_KEY_SUMS_BYTES = 4 << 20


def _backward_kernel(*refs, nu, differences: bool, with_moment: bool, dv_row: int):
    """One tile of the fused backward of K v: the exponents, K and ``W = w (g_i · v_j)`` once,
    then the rows' sums of ``W (b_j - a_i)`` [and ``W e``] and the keys' of ``W (a_i - b_j)``
    and ``[g_hi; g_lo]ᵀ K`` (`_backward`). By the differences the sums of ``W (b - a)``
    are taken feature by feature; by the expansion they are ``W [b, 1]`` and ``[a, 1]ᵀ W`` on
    the matrix unit (rows' ``[a, 1]`` and keys' ``[b, 1]`` split, `split_thin`). The keys'
    sums live in the output block, which every grid step holds, one (height, block_k) slab per
    key tile: set at the first row tile, added to at the others."""
    refs = list(refs)
    x_ref, gp_ref, gt_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    a1t_ref = None if differences else refs.pop(0)
    y_ref, vp_ref = refs.pop(0), refs.pop(0)
    b1t_ref = None if differences else refs.pop(0)
    row_out, key_out, row_acc = refs

    @on_first_key_tile
    def _():
        row_acc[...] = jnp.zeros_like(row_acc)

    x, y = x_ref[...], y_ref[...]
    e = exponents(x, y)
    k, slope = profile(e, nu)
    w = slope * jnp.dot(gp_ref[...], vp_ref[...], preferred_element_type=jnp.float32)
    width = row_acc.shape[1] - with_moment
    if differences:  # (start row, sums) of the keys' slab
        key_sums = []
        for f in range(y.shape[0]):  # the differences again: no d tiles held since e
            wd = w * (y[f:f + 1, :] - x[:, f:f + 1])
            row_acc[:, f:f + 1] += jnp.sum(wd, axis=1, keepdims=True)
            key_sums.append((f, jnp.sum(wd, axis=0, keepdims=True)))
    else:
        row_acc[:, :width] += split_dot(w, b1t_ref[...])
        key_sums = [(0, split_dot_t(a1t_ref[...], w))]
    if with_moment:
        row_acc[:, width:] += jnp.sum(w * e, axis=1, keepdims=True)
    key_sums.append((dv_row, split_dot_t(gt_ref[...], k)))
    j = pl.program_id(1)

    @pl.when(pl.program_id(0) == 0)
    def _():
        for start, part in key_sums:
            key_out[j, start:start + part.shape[0], :] = part

    @pl.when(pl.program_id(0) > 0)
    def _():
        for start, part in key_sums:
            key_out[j, start:start + part.shape[0], :] += part

    @on_last_key_tile
    def _():
        row_out[...] = row_acc[...]


def _backward(a, b, v, g, bs: BlockSizes, interpret: bool, differences: bool, nu,
              with_moment: bool):
    """(da, db, dv, moments or None) of ``K(a, b) v`` at g (n, o) in one pass over the tiles,
    each tile's exponents and exponentials computed once:

    rows (n, d [+ 1]): ``da_i = Σ_j W_ij (b_j - a_i)`` [and ``Σ_j W_ij e_ij``]
    keys (m, d + o):   ``db_j = Σ_i W_ij (a_i - b_j)`` and ``dv_j = Σ_i K_ij g_i``

    with ``W_ij = w_ij (g_i · v_j)`` (`profile`'s w; the coupling by `piece_operands`, float32
    accurate) and ``Kᵀ g`` by `split_dot_t`. The keys' sums of a call stay in VMEM for its
    whole grid (both axes "arbitrary": they add over the row tiles, in float32), so a call takes
    the keys whose sums fit `FUSED_KEY_SUMS_BYTES`; the chunks of keys add into the rows' sums,
    the chunks of rows (`over_row_chunks`) into the keys'. Wide v and g go through in chunks of
    columns (`over_column_chunks`), whose point gradients add up.

    Why one pass: two (over query tiles for da, over key tiles for db and dv, as the Triton
    backend's) each recomputed the tile's exponents, exponentials and coupling."""

    def columns(v, g):
        dv, da, db, moment = _backward_columns(a, b, v, g, bs, interpret, differences, nu,
                                               with_moment)
        return dv, (da, db, moment)

    dv, (da, db, moment) = over_column_chunks(columns, v, g)
    return da, db, dv, moment


def _with_ones_split(x, rows):
    """``split_thin([x, 1])`` of x (p, d) padded to ``rows``: (split_width(d + 1), rows)."""
    return split_thin(pad_axis(jnp.concatenate([x, jnp.ones_like(x[:, :1])], axis=1), rows))


def _backward_columns(a, b, v, g, bs, interpret, differences, nu, with_moment):
    """`_backward` for one chunk of columns."""
    (m, d), o = b.shape, v.shape[1]
    # the keys' slab: the sums of W (a - b) [split, with Σ W, by the expansion], then Kᵀ g split
    dv_row = round_up(d, 8) if differences else split_width(d + 1)
    height = dv_row + split_width(o)
    fits = FUSED_KEY_SUMS_BYTES // (4 * height) // bs.block_k * bs.block_k
    chunk = round_up(min(max(fits, bs.block_k), m), bs.block_k)
    cols = round_up(m, chunk)
    keys = [key_geometry(b, differences, cols), key_pieces(pad_axis(v, cols))]
    if not differences:
        keys.append(_with_ones_split(b, cols))

    def rows_of(rows, x, g):
        g = pad_axis(g, rows)
        row_ops = [row_geometry(x, differences, rows), row_pieces(g), split_thin(g)]
        if not differences:
            row_ops.append(_with_ones_split(x, rows))
        specs = [rows_spec(bs.block_q, t.shape[1]) for t in row_ops[:2]]
        specs += [pl.BlockSpec((t.shape[0], bs.block_q), lambda i, j: (0, i))
                  for t in row_ops[2:]]
        return row_ops, specs

    kernel = functools.partial(_backward_kernel, nu=nu, differences=differences,
                               with_moment=with_moment, dv_row=dv_row)
    row_sums, key_sums = over_resident_keys(
        kernel, _names(nu)[1], keys, rows_of, (a, g),
        width=(d if differences else split_width(d + 1)) + with_moment, height=height,
        chunk=chunk, bs=bs, interpret=interpret)
    key_sums = key_sums[:, :m]
    dv = key_sums[dv_row:dv_row + o] + key_sums[dv_row + o:dv_row + 2 * o]
    if differences:
        da, db = row_sums[:, :d], -key_sums[:d].T
    else:  # Σ W (b - a) = Σ W b - a Σ W on centred points (as the two-pass kernels)
        da = _differences_of(row_sums, a, False)[0]
        sums = (key_sums[:d + 1] + key_sums[d + 1:2 * d + 2]).T
        db = sums[:, :d] - b * sums[:, d:]
    moment = row_sums[:, -1].astype(a.dtype) if with_moment else None
    return dv.T.astype(v.dtype), da.astype(a.dtype), db.astype(b.dtype), moment
def _names(nu):
    stem = "rbf_kernel_mv" if nu is None else f"matern{int(2 * nu)}2_kernel_mv"
    return f"{stem}_fwd", f"{stem}_bwd"


kernel_mv = tile_product(_kernel_mv, kernel_mv_bwd, inputs=3, settings=4)


def _scaled_kernel_mv(a, b, v, scale, block_sizes: BlockSizes, interpret: bool = False,
                      differences: bool = True, nu=None):
    """`kernel_mv` of the points ``a' = scale · a``, ``b' = scale · b`` for a scalar ``scale``
    (the caller's ``l₀ / l`` = 1, through which a scalar lengthscale's gradient flows), whose
    gradient comes from the second moments, ``∂/∂scale = -Σ_ij W_ij |a'_i - b'_j|² / scale``:
    one more sum per pair in the query pass. By the chain rule through the points it would be
    ``(Σ da'·a' + Σ db'·b') / scale``, which carries the split products' rounding of da' and
    db' (a few 1e-6 of each) times |a'|² and cancels: 1e-5 to 2e-5 norm-wise at d = 8
    (interpreted, Matérn; 2.4e-5 the RBF's on the chip: docs/decisions.md #49)."""
    return _kernel_mv(a * scale, b * scale, v, block_sizes, interpret, differences, nu)


def scaled_kernel_mv_bwd(inputs, saved, g, block_sizes, interpret, differences, nu=None):
    """(da, db, dv, dscale) of `scaled_kernel_mv` at the cotangent g (n, o)."""
    del saved
    a, b, v, scale = inputs
    da, db, dv, moment = _backward(a * scale, b * scale, v, g, block_sizes, interpret,
                                   differences, nu, True)
    dscale = (2.0 * jnp.sum(moment) / scale).astype(jnp.result_type(scale))
    return da * scale, db * scale, dv, jnp.reshape(dscale, jnp.shape(scale))


scaled_kernel_mv = tile_product(_scaled_kernel_mv, scaled_kernel_mv_bwd, inputs=4, settings=4)


# ----------------------------------------------------------------------------------------------
# log Σ_j w_j K_ij


def _lse_kernel(x_ref, y_ref, w_ref, max_out, log_sum_out, run_max, run_sum):
    """The online log-sum-exp (`scalegp.ops._tile_math.lse_step`'s) with two departures, which
    save a select and an addition per pair (the vector unit bounds this kernel at small d):
    the running maximum is of the exponents alone, not of ``e + log w`` (any shift is exact;
    the terms ``w_j e^{e - M}`` stay at most w_j), and keys of weight 0 are not masked: their
    terms are ``0 · e^{e - M}`` with ``e <= M``, and the caller put them out of reach
    (`key_geometry`'s ``keep``) so that they do not set M.
    A row whose maximum is -inf so far (exponents of -inf: coordinates near float32's limit)
    shifts by 0 instead."""
    @on_first_key_tile
    def _():
        run_max[...] = jnp.full(run_max.shape, -jnp.inf, jnp.float32)
        run_sum[...] = jnp.zeros_like(run_sum)

    e = exponents(x_ref[...], y_ref[...])
    new_max = jnp.maximum(run_max[...], jnp.max(e, axis=1, keepdims=True))
    shift = jnp.where(new_max > -jnp.inf, new_max, 0.0)
    terms = jnp.exp(e - shift) * w_ref[...]
    run_sum[...] = (run_sum[...] * jnp.exp(run_max[...] - shift)
                    + jnp.sum(terms, axis=1, keepdims=True))
    run_max[...] = new_max

    @on_last_key_tile
    def _():
        max_out[...] = run_max[...]
        log_sum_out[...] = accurate_log(run_sum[...])  # -inf where w is 0 throughout


def lse_forward(a, b, w, bs: BlockSizes, interpret: bool, differences: bool):
    """(M, L), each (n,), with ``log Σ_j w_j K_ij = M_i + L_i``: the running maximum and the
    log of the scaled sum (kept apart, as the xla backend does, for the backward pass). M is
    the largest exponent of a row's tiles (`_lse_kernel`: keys of weight 0 lie out of reach,
    near -5e35); L is -inf where w is 0 throughout."""
    check_blocks(bs)
    cols = round_up(b.shape[0], bs.block_k)
    w_p = pad_axis(w.astype(jnp.float32), cols)
    y_geo = key_geometry(b, differences, cols, keep=w_p > 0)
    w_p = w_p[None, :]

    def rows_part(a):
        rows = round_up(a.shape[0], bs.block_q)
        x_geo = row_geometry(a, differences, rows)
        f_max, f_log_sum = call(
            _lse_kernel, (rows // bs.block_q, cols // bs.block_k),
            [rows_spec(bs.block_q, x_geo.shape[1]), cols_spec(y_geo.shape[0], bs.block_k),
             cols_spec(1, bs.block_k)],
            [rows_spec(bs.block_q, 1)] * 2,
            [jax.ShapeDtypeStruct((rows, 1), jnp.float32)] * 2,
            [(bs.block_q, 1)] * 2, bs, interpret, "rbf_logsumexp_fwd",
        )(x_geo, y_geo, w_p)
        n = a.shape[0]
        return f_max[:n, 0].astype(a.dtype), f_log_sum[:n, 0].astype(a.dtype)

    return over_row_chunks(rows_part, bs.block_q, a)


def _exp_sums_kernel(*refs, masked: bool, with_moment: bool):
    x_ref, y_ref, s_ref, max_ref, log_sum_ref, y1_ref = refs[:6]
    outs, scratch = refs[-2 - 2 * with_moment:][:1 + with_moment], refs[-1 - with_moment:]
    acc = scratch[0]

    @on_first_key_tile
    def _():
        for ref in scratch:
            ref[...] = jnp.zeros_like(ref)

    x, y = x_ref[...], y_ref[...]
    s = s_ref[...]
    e = exponents(x, y)
    t = jnp.exp((e - max_ref[...]) - log_sum_ref[...]) * s
    if masked:
        t = jnp.where(s > 0, t, 0.0)  # no 0 * inf from keys of weight 0
    acc[...] += split_dot(t, y1_ref[...])
    if with_moment:
        scratch[1][...] += jnp.sum(t * e, axis=1, keepdims=True)

    @on_last_key_tile
    def _():
        for out, ref in zip(outs, scratch):
            out[...] = ref[...]


def _exp_sums(x, y, s, f_max, f_log_sum, bs: BlockSizes, interpret: bool, shift_rows: bool,
              masked: bool, name: str, with_moment: bool = False):
    """By the expansion, for rows x (p, d) against keys y (q, d): ``Σ_c T_rc (y_c - x_r)``
    (p, d) and ``Σ_c T_rc`` (p,), ``T_rc = s_c exp((e_rc - M) - L)`` with (M, L) the rows'
    (``shift_rows``) or the keys' saved log-sum-exp, and s (q,) the keys' factors (where
    ``masked``, terms of ``s_c = 0`` are 0 whatever the exponential); with ``with_moment`` also
    the second moments ``Σ_c T_rc e_rc`` (p,)."""
    cols = round_up(y.shape[0], bs.block_k)
    keys = [key_geometry(y, False, cols), pad_axis(s.astype(jnp.float32), cols)[None, :]]
    key_specs = [cols_spec(keys[0].shape[0], bs.block_k), cols_spec(1, bs.block_k)]
    if not shift_rows:
        keys += [pad_axis(t.astype(jnp.float32), cols)[None, :] for t in (f_max, f_log_sum)]
        key_specs += [cols_spec(1, bs.block_k)] * 2
    key_shifts = len(keys)
    width = _with_ones(y, cols, False, keys, key_specs, bs)
    kernel = functools.partial(_exp_sums_kernel, masked=masked, with_moment=with_moment)

    def rows_part(x, f_max, f_log_sum):
        rows = round_up(x.shape[0], bs.block_q)
        x_geo = row_geometry(x, False, rows)
        if shift_rows:
            shifts = [pad_axis(t.astype(jnp.float32), rows)[:, None] for t in (f_max, f_log_sum)]
            shift_specs = [rows_spec(bs.block_q, 1)] * 2
        else:
            shifts, shift_specs = keys[2:key_shifts], key_specs[2:key_shifts]
        operands = [x_geo, keys[0], keys[1], *shifts, *keys[key_shifts:]]
        in_specs = [rows_spec(bs.block_q, x_geo.shape[1]), key_specs[0], key_specs[1],
                    *shift_specs, *key_specs[key_shifts:]]
        widths = [width] + [1] * with_moment
        outs = call(kernel, (rows // bs.block_q, cols // bs.block_k), in_specs,
                    [rows_spec(bs.block_q, c) for c in widths],
                    [jax.ShapeDtypeStruct((rows, c), jnp.float32) for c in widths],
                    [(bs.block_q, c) for c in widths], bs, interpret, name)(*operands)
        sums = _differences_of(outs[0], x, False)
        return (*sums, outs[1][:x.shape[0], 0]) if with_moment else sums

    if shift_rows:
        return over_row_chunks(rows_part, bs.block_q, x, f_max, f_log_sum)
    return over_row_chunks(rows_part, bs.block_q, x, None, None)


#: The most keys one call of the fused backward (`_lse_grad_sums`) takes: their sums stay in
#: VMEM for the whole grid, (8, LSE_GRAD_KEY_CHUNK) float32 (2 MiB).
LSE_GRAD_KEY_CHUNK = 1 << 16


def _lse_grad_kernel(rows_ref, y_ref, w_ref, row_out, key_out, row_acc, *, with_moment: bool):
    """One tile of the fused backward: ``E = e^{(e - M) - L}`` once, then the rows' sums of
    ``P = w E`` and the keys' sums of ``C = g E`` (`_lse_grad_sums`); the rows' operand is
    ``[a, g, M, L]``. The keys' sums live in the output block, which every grid step holds
    (its index never changes), one (8, block_k) slab per key tile: set at the first row tile,
    added to at the others."""
    d = y_ref.shape[0]

    @on_first_key_tile
    def _():
        row_acc[...] = jnp.zeros_like(row_acc)

    rows, y = rows_ref[...], y_ref[...]
    deltas = [y[f:f + 1, :] - rows[:, f:f + 1] for f in range(d)]  # b_j - a_i
    total = deltas[0] * deltas[0]
    for delta in deltas[1:]:
        total = total + delta * delta
    e = -0.5 * total
    t = jnp.exp((e - rows[:, d + 1:d + 2]) - rows[:, d + 2:d + 3])
    w = w_ref[...]
    p = jnp.where(w > 0, t, 0.0) * w  # no 0 * inf: a key of weight 0 may lie nearer than M's
    c = t * rows[:, d:d + 1]
    for f, delta in enumerate(deltas):
        row_acc[:, f:f + 1] += jnp.sum(p * delta, axis=1, keepdims=True)
    if with_moment:
        row_acc[:, d:d + 1] += jnp.sum(p * e, axis=1, keepdims=True)
    j = pl.program_id(1)
    sums = [jnp.sum(c * delta, axis=0, keepdims=True) for delta in deltas]
    sums.append(jnp.sum(c, axis=0, keepdims=True))

    @pl.when(pl.program_id(0) == 0)
    def _():
        for f, part in enumerate(sums):
            key_out[j, f:f + 1, :] = part

    @pl.when(pl.program_id(0) > 0)
    def _():
        for f, part in enumerate(sums):
            key_out[j, f:f + 1, :] += part

    @on_last_key_tile
    def _():
        row_out[...] = row_acc[...]


def _lse_grad_sums(a, b, w, f_max, f_log_sum, g, bs: BlockSizes, interpret: bool,
                   with_moment: bool):
    """The backward's sums by the coordinate differences in one pass over the tiles, each
    tile's exponentials computed once: with ``E_ij = exp((e_ij - M_i) - L_i)``,
    ``P = w_j E`` (the rows' softmax weights) and ``C = g_i E``,

    rows (n, d [+ 1]): ``Σ_j P_ij (b_j - a_i)`` [and the moments ``Σ_j P_ij e_ij``]
    keys (m, d + 1):   ``Σ_i C_ij (b_j - a_i)`` and ``Σ_i C_ij``

    The keys' sums of a call stay in VMEM for its whole grid (both axes "arbitrary": they add
    over the row tiles), so a call takes at most `LSE_GRAD_KEY_CHUNK` keys; the chunks of keys
    add into the rows' sums, the chunks of rows (`over_row_chunks`) into the keys'. Keys of
    weight 0 keep their coordinates (their ``C`` is dw's), and P is 0 there by a select."""
    m, d = b.shape
    chunk = round_up(min(LSE_GRAD_KEY_CHUNK, m), bs.block_k)
    cols = round_up(m, chunk)
    keys = [key_geometry(b, True, cols), pad_axis(w.astype(jnp.float32), cols)[None, :]]

    def rows_of(rows, x, g, f_max, f_log_sum):
        # one operand: in device memory a row-major array takes 128 lanes whatever its width
        row_op = pad_axis(jnp.concatenate([x, g[:, None], f_max[:, None], f_log_sum[:, None]],
                                          axis=1).astype(jnp.float32), rows)
        return [row_op], [rows_spec(bs.block_q, d + 3)]

    row_sums, key_sums = over_resident_keys(
        functools.partial(_lse_grad_kernel, with_moment=with_moment), "rbf_logsumexp_bwd",
        keys, rows_of, (a, g, f_max, f_log_sum), width=d + with_moment,
        height=round_up(d + 1, 8), chunk=chunk, bs=bs, interpret=interpret)
    return row_sums, key_sums[:d + 1, :m].T


def lse_backward(a, b, w, f_max, f_log_sum, g, bs: BlockSizes, interpret: bool,
                 differences: bool, with_moment: bool = False):
    """(da, db, dw) of ``f = M + L`` at the cotangent g (n,); with ``with_moment`` also the
    rows' second moments ``Σ_j P_ij e_ij`` (n,), P the rows' softmax weights. By the
    differences in one pass (`_lse_grad_sums`); by the expansion in two, one over query tiles
    and one over key tiles (`_exp_sums`: their products with ``[b, 1]`` and ``[a, 1]`` are
    split matrix-unit passes on opposite axes of the tile)."""
    if differences:
        rows, keys = _lse_grad_sums(a, b, w, f_max, f_log_sum, g, bs, interpret, with_moment)
        d = a.shape[1]
        p_diff = rows[:, :d].astype(a.dtype)
        moment = [rows[:, d].astype(a.dtype)] if with_moment else []
        t_diff, t_sum = -keys[:, :d].astype(b.dtype), keys[:, d].astype(b.dtype)
    else:
        p_diff, _, *moment = _exp_sums(a, b, w, f_max, f_log_sum, bs, interpret, True, True,
                                       "rbf_logsumexp_bwd_dq", with_moment)
        t_diff, t_sum = _exp_sums(b, a, g, f_max, f_log_sum, swapped(bs), interpret, False,
                                  False, "rbf_logsumexp_bwd_dk")
    da = g[:, None] * p_diff
    db = jnp.where(w[:, None] > 0, w[:, None] * t_diff, 0.0)  # no 0 * inf
    return (da, db, t_sum, *moment)


def _logsumexp(a, b, w, block_sizes: BlockSizes, interpret: bool = False,
               differences: bool = True):
    """``log Σ_j w_j exp(-|a_i - b_j|² / 2)`` for prepared a (n, d), b (m, d), w (m,) >= 0 ->
    (n,); ``differences`` as in `kernel_mv`."""
    f_max, f_log_sum = lse_forward(a, b, w, block_sizes, interpret, differences)
    return f_max + f_log_sum, (f_max, f_log_sum)


def _logsumexp_bwd(inputs, saved, g, block_sizes, interpret, differences):
    return lse_backward(*inputs, *saved, g, block_sizes, interpret, differences)


kernel_logsumexp = tile_product(_logsumexp, _logsumexp_bwd, inputs=3, settings=3)


def _scaled_logsumexp(a, b, w, scale, block_sizes: BlockSizes, interpret: bool = False,
                      differences: bool = True):
    """`kernel_logsumexp` of ``scale · a``, ``scale · b`` for a scalar ``scale`` (the caller's
    ``h₀ / h``), whose gradient comes from the rows' second moments, ``∂f_i/∂scale = 2 Σ_j
    P_ij e_ij / scale`` (as `scaled_kernel_mv`'s: by the chain rule through the points it
    carried their products' rounding times |a|², 5e-5 by the expansion interpreted)."""
    return _logsumexp(a * scale, b * scale, w, block_sizes, interpret, differences)


def _scaled_logsumexp_bwd(inputs, saved, g, block_sizes, interpret, differences):
    a, b, w, scale = inputs
    da, db, dw, moment = lse_backward(a * scale, b * scale, w, *saved, g, block_sizes,
                                      interpret, differences, with_moment=True)
    dscale = (2.0 * jnp.sum(g * moment) / scale).astype(jnp.result_type(scale))
    return da * scale, db * scale, dw, jnp.reshape(dscale, jnp.shape(scale))


scaled_logsumexp = tile_product(_scaled_logsumexp, _scaled_logsumexp_bwd, inputs=4,
                                settings=3)
