"""The Mosaic backend's split bfloat16 products against float64: the pieces are exact, the
hi/lo split within its bound, and the two products at the accuracy `_blocks` states; every
kernel traced in 32 bits under x64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import rbf_kde_density, rbf_kernel_mv
from scalegp.ops.backends.mosaic import _blocks
from tests.conftest import rel_err


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("scale", [1e-20, 1e-3, 1.0, 7e4, 3e30])  # pieces stay normal
def test_three_pieces_sum_to_the_float32_exactly(scale):
    x = (np.random.default_rng(0).standard_normal(4096) * scale).astype(np.float32)
    total = sum(_f64(p) for p in _blocks.pieces(jnp.asarray(x)))
    np.testing.assert_array_equal(total, x.astype(np.float64))


def test_hi_lo_leaves_at_most_two_to_the_minus_17():
    x = np.random.default_rng(1).uniform(0, 1, 1 << 14).astype(np.float32)
    hi, lo = _blocks.hi_lo(jnp.asarray(x))
    left = np.abs(_f64(hi) + _f64(lo) - x) / np.abs(x)
    assert left.max() <= 2.0 ** -17


@pytest.mark.parametrize("columns, rows", [(1, False), (16, False), (70, False), (127, False),
                                           (128, False), (128, True), (256, True)])
def test_split_dot_is_float32_accurate_to_the_bound(columns, rows):
    """Every element within `split_dot`'s bound, ``1.25 · 2^-16 |K| |x|`` (four products up to
    64 columns, three from 128: ``K_lo x_lo`` left out), and the product norm-wise within
    1e-5, the thin operand feature-major or row-major (``rows``); mixed signs, so that the
    element bound is not a sum of like terms."""
    rng = np.random.default_rng(columns)
    tile = rng.uniform(0, 1, (64, 512)).astype(np.float32)
    thin = (rng.standard_normal((512, columns)) + 0.5).astype(np.float32)
    split = (_blocks.hi_lo(jnp.asarray(thin)) if rows else _blocks.split_thin(thin))
    out = np.asarray(_blocks.fold(_blocks.split_dot(jnp.asarray(tile), split), columns))
    tile64, thin64 = tile.astype(np.float64), thin.astype(np.float64)
    ref = tile64 @ thin64
    # the matrix unit accumulates in float32: its rounding, ~q · 2^-24, beside the bound
    bound = (1.25 * 2.0 ** -16 + 512 * 2.0 ** -24) * (np.abs(tile64) @ np.abs(thin64))
    assert np.all(np.abs(out - ref) <= bound)
    assert rel_err(out, ref) < 1e-5


def test_split_dot_leaves_out_only_the_low_pieces_product_from_128_columns():
    """At 128 columns the product is ``K_hi x_hi + K_hi x_lo + K_lo x_hi``, at 64 all four: a
    contraction of one key, so that float32's rounding of the sum (2^-24) stays far below the
    left-out term (near 2^-18 relative)."""
    rng = np.random.default_rng(3)
    tile = rng.uniform(0.5, 1, (16, 1)).astype(np.float32)
    k_hi, k_lo = (_f64(p) for p in _blocks.hi_lo(jnp.asarray(tile)))
    for columns, with_low, rows in ((64, True, False), (128, False, False),
                                    (128, False, True)):
        thin = rng.uniform(0.5, 1, (1, columns)).astype(np.float32)
        x_hi, x_lo = (_f64(p) for p in _blocks.hi_lo(jnp.asarray(thin)))
        three = k_hi @ x_hi + k_hi @ x_lo + k_lo @ x_hi
        low = k_lo @ x_lo
        split = (_blocks.hi_lo(jnp.asarray(thin)) if rows else _blocks.split_thin(thin))
        out = _f64(_blocks.fold(_blocks.split_dot(jnp.asarray(tile), split), columns))
        expected = three + low if with_low else three
        assert np.abs(out - expected).max() <= 4 * 2.0 ** -24 * np.abs(expected).max()
        assert np.abs(low).max() > 16 * 2.0 ** -24 * np.abs(expected).max()


def test_piece_operands_give_float32_products_of_offset_points():
    rng = np.random.default_rng(2)
    a = (rng.standard_normal((50, 9)) * 3 + 40).astype(np.float32)
    b = (rng.standard_normal((70, 9)) * 3 + 40).astype(np.float32)
    x, yt = _blocks.piece_operands(jnp.asarray(a), jnp.asarray(b))
    assert x.shape[1] % _blocks.BF16_ROWS == 0
    out = jnp.dot(x, yt, preferred_element_type=jnp.float32)
    assert rel_err(out, a.astype(np.float64) @ b.astype(np.float64).T) < 3e-7


def test_tiles_must_lie_along_lanes():
    with pytest.raises(ValueError, match="multiples of 128"):
        _blocks.check_blocks(_blocks.BlockSizes(block_q=64, block_k=128))


def _kernels(jaxpr):
    """Every ``pallas_call`` equation in a (closed) jaxpr, its sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _kernels(inner)


def test_kernels_are_traced_in_32_bits_under_x64():
    """Under ``jax_enable_x64`` (float32 inputs) no kernel body or index map holds a 64-bit
    type: Mosaic on a TPU failed to compile an index map's int64 constant."""
    f32 = jax.ShapeDtypeStruct
    q, x, v = f32((300, 2), jnp.float32), f32((600, 2), jnp.float32), f32((600, 3), jnp.float32)
    with jax.enable_x64(True):
        jaxpr = jax.make_jaxpr(lambda q, x, v: (
            jax.grad(lambda x: jnp.sum(rbf_kernel_mv(q, x, v, 0.05, impl="mosaic", prune=True,
                                                     block_k=128)))(x),
            rbf_kde_density(q, x, 0.05, impl="mosaic", prune=True, block_k=128, log=True),
            rbf_kernel_mv(q, x, v, 0.5, impl="mosaic", prune=False)))(q, x, v)
    kernels = list(_kernels(jaxpr.jaxpr))
    assert len(kernels) >= 5
    for eqn in kernels:
        text = " ".join([str(eqn.params["jaxpr"])] + [
            str(m.index_map_jaxpr) for m in eqn.params["grid_mapping"].block_mappings])
        assert "f64" not in text and "i64" not in text, eqn.params["name_and_src_info"]
