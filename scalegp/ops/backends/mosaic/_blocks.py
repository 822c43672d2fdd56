"""What the Mosaic kernels share around a ``pallas_call``: their tiles and parameters
(`MosaicParams`), the compiler parameters, the grid specification with VMEM scratch, the
float32-accurate products made of bfloat16 matrix-unit passes, and the tile exponents.

Float32 accuracy from bfloat16 passes. Mosaic (JAX 0.10-0.11) offers a float32 dot at
``DEFAULT`` (one bfloat16 pass: three digits) or ``HIGHEST`` (six passes), nothing between.
The kernels split operands into bfloat16 pieces themselves, by integer masks on the bits
(`hi_lo`, `pieces`): a split written as float conversions, ``x - f32(bf16(x))``, may be
simplified away by a compiler that allows excess precision. Two kinds of products:

- **a tile times a thin operand** (``K @ V``, ``W @ [y, 1]``): the tile is computed in the
  kernel and split once, ``K = K_hi + K_lo`` with ``K_hi`` rounded to 8 bits and ``|K_lo| <=
  2^-8 |K|`` (then rounded to bfloat16: an error of at most ``2^-17 |K|``); the thin operand
  arrives split as ``[V_hi | V_lo]``, feature-major (2o rows: the matrix unit pads every axis
  to 128, so up to 64 columns ride free), and ``K @ V ≈ K_hi [V_hi|V_lo] + K_lo [V_hi|V_lo]``:
  two passes, an element error of at most ``2^-16`` relative; for multiples of 128 columns,
  whose passes grow with the columns, the pieces arrive row-major (`split_operand`) and
  ``K_lo V_lo`` is left out: three passes per 128 columns, not four, at most ``1.25 · 2^-16``
  (`split_dot`). Norm-wise errors of ``K v`` were
  3e-6 to 5e-6 over many keys per row (compiled on a TPU v5e and interpreted), up to 1.5e-5
  where one term dominates a row.
- **thin times thin** (``a · b`` of the distance expansion, ``g · v`` of a backward pass): both
  operands arrive as three pieces each (``x = x1 + x2 + x3`` exactly: 24 bits), and the six
  products of significance above ``2^-24`` are laid side by side along the contraction
  (`piece_operands`): ``[x1 x1 x2 x1 x2 x3] · [y1 y2 y1 y3 y2 y1]``, one pass while six
  times the width fits in 128, with the matrix unit's float32 accumulation: float32
  accuracy.

Layout: query tiles are (block_q, ·) row-major, every key operand feature-major (·, block_k)
so that keys lie along the 128 lanes; the key axis is the grid's last ("arbitrary") axis,
streamed through VMEM, with the running sums in VMEM scratch. In device memory a row-major
(n, c) array takes 128 lanes whatever c: the key operands are feature-major for that reason,
and the rows' are made per chunk of rows (`over_row_chunks`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scalegp.ops._kernels import DIRECT_MAX_D
from scalegp.ops._matmul import RBF_EXPANSION_MEAN_LIMIT, half_sq_norms
from scalegp.ops._tiling import BlockSizes, pad_axis, round_up

#: The lane width of TPU vector registers and of the matrix unit: key tiles are multiples.
LANES = 128
#: bfloat16 rows pack in pairs into (16, 128) tiles: feature-major bfloat16 operands and the
#: contraction of the piece products are padded to multiples of 16 (the matrix unit pads the
#: rest itself, in VMEM, not in device memory).
BF16_ROWS = 16
#: The most query rows (or, in a backward pass, keys) one kernel call takes (`over_row_chunks`).
ROW_CHUNK = 1 << 17
#: The most value columns one kernel call takes (`over_column_chunks`). A tile's VMEM grows with
#: them: a backward pass holds 6o-wide pieces of both thin operands and 2o-wide running sums,
#: and with the GP preconditioner's basis among the columns (o near 800) it outgrew the chip's
#: VMEM (docs/decisions.md #52). 128 columns are the matrix unit's width: past it the products
#: cost more passes anyway, so a chunk repeats only the tile's exponentials.
COLUMN_CHUNK = 128
#: The most value columns one call of a forward ``K v`` takes (its VMEM holds only the split
#: values and their running sums). Each chunk recomputes the tile's exponentials and its split:
#: a prediction's variance, against the 1,024 columns of a large model's cache, paid them eight
#: times in chunks of 128, four in chunks of 256. Wider chunks cost device memory: each chunk's
#: split values are made whole (XLA's analysis at 128, 256 and 512: docs/decisions.md #69).
FORWARD_COLUMN_CHUNK = 256
#: Up to this many features the exponents always come from the coordinate differences on the
#: vector unit; beyond, from the expansion on the matrix unit where the keys allow it
#: (`distances`).
DIFFERENCES_MAX_D = 4
#: `RBF_EXPANSION_MEAN_LIMIT` for the KDE's log-sum-exp, whose target is a log-density's
#: absolute error (2e-5) in every row, not K v's norm-wise one: the expansion's exponents err by
#: about 2.4e-7 to 5.3e-7 times the keys' mean squared norm in the worst row (interpreted,
#: 2,048 Gaussian points at d = 6 and 8, bandwidths 0.3 to 1: 4.7e-5 at a mean of 89, where
#: the differences gave 1.1e-6), so 20 keeps it within 1.1e-5.
LSE_EXPANSION_MEAN_LIMIT = 20.0
#: A key left out of a log-sum-exp (`key_geometry`'s ``keep``) takes this first coordinate:
#: its squared distance to any prepared row (coordinates far below it) is near 1e36, finite.
OUT_OF_REACH = 1e18
#: The same key's ``-|b|²/2`` in the expansion (finite: its bfloat16 pieces stay finite).
OUT_OF_REACH_EXPONENT = -1e30


@dataclasses.dataclass(frozen=True)
class MosaicParams:
    """The Mosaic kernels' parameters besides the tile sizes (`BlockSizes.launch`).

    Attributes:
      vmem_limit_mib: the scoped VMEM limit (Mosaic's default is 16 MiB; larger tiles need
        more).
      differences_max_d: up to this many features the exponents come from the coordinate
        differences (vector unit), beyond from the expansion (matrix unit).
    """

    vmem_limit_mib: int = 64
    differences_max_d: int = DIFFERENCES_MAX_D


#: The parameters of tiles that carry none (a benchmark's tile sweep may set it, then clear
#: JAX's caches).
DEFAULT_PARAMS = MosaicParams()


def params_of(bs: BlockSizes) -> MosaicParams:
    return bs.launch if isinstance(bs.launch, MosaicParams) else DEFAULT_PARAMS


def check_blocks(bs: BlockSizes):
    """Raises ValueError unless block_q and block_k are multiples of `LANES` (the backward
    passes swap the roles of queries and keys, so both lie along lanes somewhere)."""
    if bs.block_q % LANES or bs.block_k % LANES:
        raise ValueError(
            f"the Mosaic kernels need block_q and block_k multiples of {LANES}, got "
            f"block_q={bs.block_q}, block_k={bs.block_k}; leave them None for the defaults")


def _tpu():
    """Pallas's TPU module, imported at the first kernel call rather than with the backend,
    which every ``import scalegp`` (and so every command) would pay for (docs/decisions.md
    #48)."""
    from jax.experimental.pallas import tpu

    return tpu


def smem_spec():
    """A whole small array in SMEM (scalars a kernel reads one at a time)."""
    return pl.BlockSpec(memory_space=_tpu().SMEM)


def vmem_spec():
    """A whole array in VMEM, copied in once per call (an operand every step indexes)."""
    return pl.BlockSpec(memory_space=_tpu().VMEM)


def device_memory_spec():
    """An operand left in device memory, which the kernel copies from itself
    (`KeyTileRing`)."""
    return pl.BlockSpec(memory_space=pl.ANY)


class KeyTileRing:
    """Key tiles copied into VMEM ``depth - 1`` grid steps ahead of their use, by the kernel's
    own DMAs: a ring of ``depth`` buffers ``(depth, rows, height)`` and one DMA semaphore each.

    Why: a grid step that visits one listed tile pair does little work, and Pallas's own
    pipeline starts a block's copy one step ahead only, so a step shorter than a copy's latency
    would wait for it. With the tiles read from the prefetched visit list, the copies can
    start several steps ahead. (On a TPU v5e, at tiles of 256 rows, depths 2 to 16 scored
    alike: those steps were not waiting; docs/decisions.md #55.) The grid must run in order
    (its axis "arbitrary"). ``tile_of(step)`` reads a step's key tile (a traced int32) and may
    be called for any step below the grid's size."""

    def __init__(self, source, buffers, semaphores, tile_of, height: int):
        self.source, self.buffers, self.semaphores = source, buffers, semaphores
        self.tile_of, self.height = tile_of, height
        self.depth = buffers.shape[0]

    @staticmethod
    def scratch(rows: int, height: int, depth: int):
        """The ring's scratch shapes, to append to a kernel's (they arrive last, in order)."""
        tpu = _tpu()
        return [tpu.VMEM((depth, rows, height), jnp.float32), tpu.SemaphoreType.DMA((depth,))]

    def _copy(self, step, slot):
        start = pl.multiple_of(self.tile_of(step) * self.height, self.height)
        return _tpu().make_async_copy(self.source.at[:, pl.ds(start, self.height)],
                                      self.buffers.at[slot], self.semaphores.at[slot])

    def current(self):
        """The copies this step needs started (the first step's ahead of everything), then
        this step's tile, waited for: a (rows, height) value."""
        s, steps, depth = pl.program_id(0), pl.num_programs(0), self.depth

        @pl.when(s == 0)
        def _():
            for ahead in range(depth - 1):
                @pl.when(ahead < steps)
                def _():
                    self._copy(ahead, ahead).start()

        # the slot refilled here is the one the previous step read (done with it)
        @pl.when(s + (depth - 1) < steps)
        def _():
            self._copy(s + (depth - 1), lax.rem(s + (depth - 1), depth)).start()

        slot = lax.rem(s, depth)
        self._copy(s, slot).wait()
        return self.buffers[slot]


def compiler_params(bs: BlockSizes, interpret: bool, semantics=("parallel", "arbitrary")):
    if interpret:
        return None
    return _tpu().CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=params_of(bs).vmem_limit_mib << 20)


def call(kernel, grid, in_specs, out_specs, out_shape, scratch, bs, interpret, name,
         prefetch=(), aliases=None, semantics=("parallel", "arbitrary")):
    """``pallas_call(...)(*inputs)`` of a kernel over (row tiles, key tiles) with VMEM
    scratch: float32 arrays of the given shapes, other scratch (`KeyTileRing.scratch`) as
    given; ``prefetch``: arrays (visit lists) prefetched into SMEM ahead of the inputs, which
    the index maps and the kernel take first; ``aliases``: input positions (after the
    prefetched ones) -> the outputs they are; ``semantics``: the grid axes' dimension
    semantics. Inputs are float32 and the like: the kernels are traced with 64-bit types
    off."""
    tpu = _tpu()
    fn = pl.pallas_call(
        kernel,
        grid_spec=tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[tpu.VMEM(shape, jnp.float32) if isinstance(shape, tuple)
                            else shape for shape in scratch]),
        out_shape=out_shape,
        compiler_params=compiler_params(bs, interpret, semantics),
        interpret=interpret,
        name=name,
        input_output_aliases={len(prefetch) + a: o for a, o in (aliases or {}).items()},
    )

    def run(*inputs):
        # traced in 32 bits whatever jax_enable_x64 says: under it a Python 0 in an index map
        # became an int64 constant, which Mosaic failed to compile on a TPU v5e
        with jax.enable_x64(False):
            return fn(*(jnp.asarray(p, jnp.int32) for p in prefetch), *inputs)

    return run


def over_row_chunks(fn, block: int, *row_arrays, summed: bool = False):
    """``fn(*row_arrays)`` (a pytree of arrays whose first axis is the rows') over chunks of at
    most `ROW_CHUNK` rows, a multiple of ``block`` each, one after another (`lax.map`); None
    entries pass through. With ``summed``, ``fn`` returns ``(per_row, total)``: the chunks'
    totals (a pytree of arrays of any shape, sums over a chunk's rows) are added up as the
    chunks go (`lax.scan`), so that no chunk's total is kept.

    Why: a Mosaic operand or result (p, c) lies in device memory in (8, 128) tiles whatever c,
    so a per-row array of a few features takes 128 lanes. Per chunk these arrays are small;
    the chunks travel stacked feature-major and flat, (chunks, c · rows), which no layout pads:
    stacked row-major, or as (chunks, c, rows), XLA laid them out with c along the lanes
    again (docs/decisions.md #48 has the figures)."""
    present = [k for k, a in enumerate(row_arrays) if a is not None]
    n = row_arrays[present[0]].shape[0]
    count = -(-n // ROW_CHUNK)
    if count <= 1:
        return fn(*row_arrays)
    size = round_up(-(-n // count), block)

    def stacked(a):
        a = pad_axis(a, count * size).reshape(count, size, -1)
        return jnp.swapaxes(a, 1, 2).reshape(count, -1)

    traced = {}

    def body(parts):
        args = list(row_arrays)
        for k, part in zip(present, parts):
            args[k] = part.reshape(-1, size).T.reshape(size, *row_arrays[k].shape[1:])
        per_row, total = fn(*args) if summed else (fn(*args), None)
        leaves, traced["tree"] = jax.tree.flatten(per_row)
        traced["tails"] = [leaf.shape[1:] for leaf in leaves]
        return [leaf.reshape(size, -1).T.reshape(-1) for leaf in leaves], total

    chunks = [stacked(row_arrays[k]) for k in present]
    if summed:
        first = jax.eval_shape(body, [c[0] for c in chunks])[1]

        def step(total, parts):
            outs, part = body(parts)
            return jax.tree.map(jnp.add, total, part), outs

        zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), first)
        total, outs = lax.scan(step, zeros, chunks)
    else:
        outs = lax.map(lambda parts: body(parts)[0], chunks)
    per_row = jax.tree.unflatten(traced["tree"], [
        jnp.swapaxes(out.reshape(count, -1, size), 1, 2).reshape(count * size, *tail)[:n]
        for out, tail in zip(outs, traced["tails"])])
    return (per_row, total) if summed else per_row


def over_resident_keys(kernel, name, keys, rows_of, row_arrays, *, width: int, height: int,
                       chunk: int, bs: BlockSizes, interpret: bool):
    """One pass of ``kernel`` over (row tiles, key tiles) that sums both ways: per row, (n,
    width), in VMEM scratch as every kernel does; per key, (height, m), in the output block,
    which every grid step holds (its index never changes), one (height, block_k) slab per key
    tile. Both grid axes therefore run in order ("arbitrary"), and a call takes ``chunk`` keys
    (a multiple of block_k), whose sums must fit VMEM: the chunks of keys run one after another
    (`lax.scan`) and add into the rows' sums, the chunks of rows (`over_row_chunks`) into the
    keys'.

    ``keys``: feature-major key operands (·, m) padded to whole chunks; ``rows_of(rows,
    *chunk_arrays)``: a chunk of ``row_arrays``' rows made into the kernel's row operands,
    padded to ``rows``, and their specs. ``kernel(*row refs, *key refs, row_out, key_out,
    row_acc)``. Returns (row sums (n, width), key sums (height, m))."""
    cols = keys[0].shape[1]
    count, tiles = cols // chunk, chunk // bs.block_k
    key_specs = [cols_spec(t.shape[0], bs.block_k) for t in keys]
    stacked = [jnp.moveaxis(t.reshape(t.shape[0], count, chunk), 1, 0) for t in keys]

    def rows_part(*arrays):
        p = arrays[0].shape[0]
        rows = round_up(p, bs.block_q)
        row_ops, row_specs = rows_of(rows, *arrays)
        fused = call(kernel, (rows // bs.block_q, tiles), row_specs + key_specs,
                     [rows_spec(bs.block_q, width),
                      pl.BlockSpec((tiles, height, bs.block_k), lambda i, j: (0, 0, 0))],
                     [jax.ShapeDtypeStruct((rows, width), jnp.float32),
                      jax.ShapeDtypeStruct((tiles, height, bs.block_k), jnp.float32)],
                     [(bs.block_q, width)], bs, interpret, name,
                     semantics=("arbitrary", "arbitrary"))

        def key_chunk(row_sums, key_ops):
            rows_out, keys_out = fused(*row_ops, *key_ops)
            return row_sums + rows_out, keys_out

        row_sums, key_sums = lax.scan(key_chunk, jnp.zeros((rows, width), jnp.float32),
                                      stacked)
        return row_sums[:p], key_sums

    row_sums, key_sums = over_row_chunks(rows_part, bs.block_q, *row_arrays, summed=True)
    # (count, tiles, height, block_k) -> (height, keys)
    return row_sums, jnp.moveaxis(key_sums, 2, 0).reshape(height, cols)


def over_column_chunks(fn, *thin, forward: bool = False):
    """``fn(*thin)`` over chunks of at most `COLUMN_CHUNK` columns (`FORWARD_COLUMN_CHUNK` for a
    ``forward`` product, with no backward pass's sums) of the thin operands (arrays (·, o) with
    the same o, or None), one after another (`lax.map`). ``fn`` returns
    ``(per_column, summed)``: pytrees of arrays (·, c) for a chunk of c columns, put side by
    side again, and of arrays that the chunks add up (the backward passes' sums over the
    coupling ``Σ_c u_ic v_jc``, linear in each column's term).

    Each chunk is sliced from the operands where it lies, not from a stacked copy: such a copy
    is one more array as large as the widest operand, 4.1 GB for a 10⁶-point model's variance
    cache (docs/decisions.md #66). Where c does not divide o the last chunk
    ends at column o and overlaps the one before; its columns that the earlier chunks took are
    zeroed in every operand, so that they add nothing to the sums, and dropped from the
    per-column results."""
    present = [a for a in thin if a is not None]
    o = present[0].shape[-1]
    width = FORWARD_COLUMN_CHUNK if forward else COLUMN_CHUNK
    count = -(-o // width)
    if count <= 1:
        return fn(*thin)
    skip = count * width - o  # the last chunk's columns that the one before took

    def chunk(j):
        start = jnp.minimum(j * width, o - width)
        fresh = start + jnp.arange(width) >= j * width
        return fn(*(None if a is None else jnp.where(
            fresh, lax.dynamic_slice_in_dim(a, start, width, axis=a.ndim - 1),
            jnp.zeros((), a.dtype)) for a in thin))

    per_column, summed = lax.map(chunk, jnp.arange(count))

    def side_by_side(out):
        *lead, c = out.shape[1:]
        whole = jnp.moveaxis(out[:-1], 0, -2).reshape(*lead, (count - 1) * c)
        return jnp.concatenate([whole, out[-1][..., skip:]], axis=-1)

    return (jax.tree.map(side_by_side, per_column),
            jax.tree.map(lambda out: jnp.sum(out, axis=0), summed))


def rows_spec(block, width):
    """The i-th (block, width) tile of a row-major array (grid (i, j))."""
    return pl.BlockSpec((block, width), lambda i, j: (i, 0))


def cols_spec(height, block):
    """The j-th (height, block) tile of a feature-major array (grid (i, j))."""
    return pl.BlockSpec((height, block), lambda i, j: (0, j))


# ----------------------------------------------------------------------------------------------
# bfloat16 pieces


def _rounded_hi(x):
    """``x`` rounded to its top 8 significant bits (bfloat16's), by integer operations."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type((bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000),
                                    jnp.float32)


def hi_lo(x):
    """(x_hi, x_lo) in bfloat16 with ``x_hi`` exact to 8 bits and ``x_lo`` the rest rounded:
    ``|x - x_hi - x_lo| <= 2^-17 |x|``."""
    hi = _rounded_hi(x)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def pieces(x):
    """Three bfloat16 pieces whose sum is x exactly (24 significant bits)."""
    p1 = _rounded_hi(x)
    r = x - p1
    p2 = _rounded_hi(r)
    p3 = r - p2
    return tuple(p.astype(jnp.bfloat16) for p in (p1, p2, p3))


def split_width(c: int) -> int:
    """The rows of `split_thin`'s operand for c columns: 2c, padded to `BF16_ROWS`."""
    return round_up(2 * c, BF16_ROWS)


def split_thin(x):
    """``[x_hi | x_lo]ᵀ`` in bfloat16, feature-major (`split_width`, n), of x (n, c): the thin
    operand of `split_dot`. Feature-major so that it lies dense in device memory (row-major,
    the 2c columns would take 128 lanes)."""
    both = jnp.concatenate(hi_lo(x.astype(jnp.float32).T), axis=0)
    return pad_axis(both, split_width(x.shape[1]), axis=0)


def wide(c: int) -> bool:
    """Whether c value columns are split row-major (`split_operand`): multiples of 128, whose
    pieces lie dense that way and whose product takes three passes (`split_dot`)."""
    return c % LANES == 0


def split_operand(x, block: int):
    """The thin operand of `split_dot` for values x (n, c) as a kernel's inputs: ``(arrays,
    specs)``, the arrays and their j-th key tiles; `split_value` reads them in the kernel.
    Narrow values: `split_thin`'s feature-major ``[x_hi | x_lo]ᵀ``. Wide ones (`wide`): the
    pieces ``x_hi``, ``x_lo`` row-major, (n, c) each, made where x lies by one elementwise
    pass; a transposed or concatenated copy would be one more array of x's size (4.1 GB for a
    10⁶-point model's variance cache, which XLA for a TPU did not fuse away: #69)."""
    if wide(x.shape[1]):
        spec = pl.BlockSpec((block, x.shape[1]), lambda i, j: (j, 0))
        return list(hi_lo(x.astype(jnp.float32))), [spec, spec]
    split = split_thin(x)
    return [split], [cols_spec(split.shape[0], block)]


def split_value(refs):
    """The thin operand of `split_dot` in a kernel, from the refs of `split_operand`'s
    arrays."""
    return tuple(ref[...] for ref in refs) if len(refs) > 1 else refs[0][...]


def split_dot(tile, thin):
    """``tile @ x`` to ``1.25 · 2^-16`` relative per element for a float32 tile (p, q) and the
    split x: ``split_thin(x)`` (2c', q), contracted along its lanes, or the row-major pieces
    ``(x_hi, x_lo)`` (q, c) each (`split_operand`). Returns (p, 2c) [(p, 2c')], whose two
    column halves sum to the product (`fold`).

    Up to 64 columns ``[x_hi | x_lo]`` is one pass of the matrix unit, and each half of the
    tile takes both: ``K_hi x_hi + K_hi x_lo + K_lo x_hi + K_lo x_lo``. Where c is a multiple
    of 128 the term ``K_lo x_lo`` would cost c/128 passes of its own, a quarter of the
    product, for at most ``2^-18 |K||x|`` (the high pieces are rounded to nearest, so
    ``|K_lo| <= 2^-9 |K|``), below the two rounding terms `hi_lo` leaves (``2^-17`` each): it
    is left out, and the first half of the result carries ``K_hi x_hi + K_lo x_hi``. A
    feature-major split padded to a multiple of 256 rows (c a few columns short of a multiple
    of 128) takes the same three passes: its halves, cut at the padded middle, still sum to the
    product under `fold`, with ``K_lo x_lo`` left out of most columns."""
    hi, lo = hi_lo(tile)
    axis = 0 if isinstance(thin, tuple) else 1
    contract = (((1,), (axis,)), ((), ()))

    def dot(piece, x):
        return lax.dot_general(piece, x, contract, preferred_element_type=jnp.float32)

    if axis == 0:  # only wide values are split this way (`split_operand`)
        x_hi, x_lo = thin
    else:
        c = thin.shape[0] // 2
        if c % LANES:
            return dot(hi, thin) + dot(lo, thin)
        x_hi, x_lo = thin[:c], thin[c:]
    return jnp.concatenate([dot(hi, x_hi) + dot(lo, x_hi), dot(hi, x_lo)], axis=1)


def split_dot_t(thin_t, tile):
    """``xᵀ @ tile`` (c, q), as `split_dot` from the other side, for ``thin_t = split_thin(x)``
    (2c', p) of x (p, c) and a float32 tile (p, q): (2c', q), whose two row halves sum to the
    product; three passes from 128 columns (``x_lo K_lo`` left out), else four."""
    hi, lo = hi_lo(tile)

    def dot(x, piece):
        return jnp.dot(x, piece, preferred_element_type=jnp.float32)

    c = thin_t.shape[0] // 2
    if c % LANES:
        return dot(thin_t, hi) + dot(thin_t, lo)
    x_hi, x_lo = thin_t[:c], thin_t[c:]
    return jnp.concatenate([dot(x_hi, hi) + dot(x_hi, lo), dot(x_lo, hi)], axis=0)


def fold(out, c):
    """The product (n, c) from `split_dot`'s halves."""
    return out[:, :c] + out[:, c:2 * c]


def row_pieces(x):
    """The rows' side of `piece_operands`: (n, k) bfloat16 ``[x1 x1 x2 x1 x2 x3]`` of x (n, c),
    k = 6c padded to `BF16_ROWS`."""
    x1, x2, x3 = pieces(x.astype(jnp.float32))
    return pad_axis(jnp.concatenate([x1, x1, x2, x1, x2, x3], axis=1),
                    round_up(6 * x.shape[1], BF16_ROWS), axis=1)


def key_pieces(y):
    """The keys' side of `piece_operands`, feature-major: (k, m) bfloat16 ``[y1 y2 y1 y3 y2
    y1]ᵀ`` of y (m, c), formed on ``yᵀ`` so that no (m, k) array is laid out in device
    memory."""
    return key_pieces_t(y.astype(jnp.float32).T)


def key_pieces_t(yt):
    """`key_pieces` of feature-major keys yt (c, m)."""
    y1, y2, y3 = pieces(yt.astype(jnp.float32))
    return pad_axis(jnp.concatenate([y1, y2, y1, y3, y2, y1], axis=0),
                    round_up(6 * yt.shape[0], BF16_ROWS), axis=0)


def piece_operands(x, y):
    """``(X, Yt)`` in bfloat16, (n, k) and (k, m) with k = 6c padded to `BF16_ROWS`, such that
    ``X @ Yt = x @ yᵀ`` to float32 accuracy for x (n, c), y (m, c): the six products of
    pieces above ``2^-24``, side by side."""
    return row_pieces(x), key_pieces(y)


# ----------------------------------------------------------------------------------------------
# exponents -|a_i - b_j|² / 2 of a tile


def distances(bs: BlockSizes, b, mean_limit: float = RBF_EXPANSION_MEAN_LIMIT):
    """How a product on prepared keys b (m, d) forms its exponents: True (the coordinate
    differences) up to ``differences_max_d`` features; False (the expansion) beyond
    `DIRECT_MAX_D`; between, a traced boolean: the differences where the keys' mean squared
    norm is past ``mean_limit`` (the RBF's `RBF_EXPANSION_MEAN_LIMIT`, a Matérn's
    `scalegp.ops._matmul.MATERN_EXPANSION_MEAN_LIMIT`, the KDE's `LSE_EXPANSION_MEAN_LIMIT`),
    as on the other backends."""
    d = b.shape[1]
    if d <= params_of(bs).differences_max_d:
        return True
    if d > DIRECT_MAX_D:
        return False
    return lax.stop_gradient(jnp.sum(b * b) / b.shape[0]) > mean_limit


def either(differences, fn, *args):
    """``fn(*args, differences)`` for a static choice, else by ``lax.cond`` on it."""
    if isinstance(differences, bool):
        return fn(*args, differences)
    return lax.cond(differences, lambda: fn(*args, True), lambda: fn(*args, False))


def row_geometry(a, differences: bool, rows: int):
    """The rows' operand from which a kernel forms the exponents of prepared points a (n, d)
    (padded to ``rows``): by the ``differences``, a in float32; by the expansion,
    `row_pieces` of ``[a, -|a|²/2, 1]``."""
    if differences:
        return pad_axis(a, rows).astype(jnp.float32)
    a_aug = jnp.concatenate([a, -half_sq_norms(a)[:, None], jnp.ones_like(a[:, :1])], axis=1)
    return row_pieces(pad_axis(a_aug, rows))


def key_geometry(b, differences: bool, cols: int, keep=None):
    """The keys' operand, feature-major (padded to ``cols``): ``bᵀ`` in float32, or
    `key_pieces` of ``[b, 1, -|b|²/2]``, so that the product with `row_geometry`'s is
    ``a·b - |a|²/2 - |b|²/2``. ``keep`` (cols,) bool, where given: the keys it leaves out
    (padding among them) are put out of every row's reach, their exponents about ``-5e35``
    (first coordinate `OUT_OF_REACH`) or `OUT_OF_REACH_EXPONENT` (by the expansion), so that
    they never set a row's running maximum: a key of weight 0 beside a row whose weighted
    keys lie far would otherwise shift their terms past exp's range (a log-density of -inf)."""
    bt = pad_axis(b, cols).astype(jnp.float32).T
    if differences:
        if keep is not None:
            bt = bt.at[0].set(jnp.where(keep, bt[0], OUT_OF_REACH))
        return bt
    norms = pad_axis(-half_sq_norms(b), cols).astype(jnp.float32)
    if keep is not None:
        norms = jnp.where(keep, norms, OUT_OF_REACH_EXPONENT)
    norms = norms[None, :]
    return key_pieces_t(jnp.concatenate([bt, jnp.ones_like(norms), norms], axis=0))


def exponents(rows, cols_t):
    """A tile's exponents (p, q) from `geometry`'s tiles: rows (p, ·), cols_t (·, q)."""
    if rows.dtype == jnp.float32:  # the differences, one feature at a time
        total = None
        for f in range(rows.shape[1]):
            delta = rows[:, f:f + 1] - cols_t[f:f + 1, :]
            total = delta * delta if total is None else total + delta * delta
        return -0.5 * total
    return jnp.minimum(jnp.dot(rows, cols_t, preferred_element_type=jnp.float32), 0.0)


def swapped(bs: BlockSizes) -> BlockSizes:
    """The tiles of a backward pass whose rows are the keys (padded to block_k) and whose
    columns are the queries (padded to block_q)."""
    return BlockSizes(block_q=bs.block_k, block_k=bs.block_q, block_o=bs.block_o,
                      launch=bs.launch)


def on_first_key_tile(body):
    pl.when(pl.program_id(1) == 0)(body)


def on_last_key_tile(body):
    pl.when(pl.program_id(1) == pl.num_programs(1) - 1)(body)
