"""Preparing a product's inputs: the keys' centre, the shift and scaling ``a = (x - c) / l``,
rows too far to express masked to 0, and a batch laid out as one leading axis. A leaf: it
imports nothing from scalegp.

Every implementation works on *prepared* inputs ``a = (x1 - c) / l`` and ``b = (x2 - c) / l``: one
kernel then serves scalar and ARD lengthscales, and centring keeps ``|a|^2 + |b|^2 - 2 a.b``
accurate for offset data. The centre ``c`` comes from the keys ``x2`` alone (a median of them,
`centre_of`, which one outlier does not move), so a query row's result depends on that row and
the keys only: a far query cannot shift the centre and cost the other rows their digits. It is
held constant under autodiff (``stop_gradient``): the kernel is translation invariant, so its
true derivative through ``c`` is exactly zero. Gradients with respect to the lengthscale flow
through the scaling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

#: The centre is a median over at most this many keys, taken at an even stride.
CENTRE_SAMPLE = 1024


def centre_of(keys):
    """The centre (d,) of keys (m, d): per feature, the median of at most `CENTRE_SAMPLE` keys
    taken at an even stride (every key when there are fewer), held constant (no gradient).

    Why a median: every consumer forms ``x - c`` in the working dtype, and nearby points keep
    their difference only while ``|x - c|`` is a modest number of lengthscales. A mean follows
    one outlier: a key at 1e15 among 300 standard normal points put it at 3e12, where float32
    numbers lie 2.6e5 apart, and every other point lost all its digits (KDE log-densities off by
    2.6 there; a GP with one input at 1e10 predicted with an RMSE of 383). The sample's median
    stays among the keys unless half of the sample lies beyond them; infinite keys sort to the
    ends. A sample, because its sort costs the same whatever the number of keys (the one-query
    product against 10^5 keys would otherwise sort all of them on every call). The lower median
    is one of the keys' numbers, picked rather than computed, so every consumer shifts by the
    very same float (see `centred`).
    """
    m = keys.shape[0]
    stride = -(-m // CENTRE_SAMPLE)
    # the rows by a gather, not a strided slice: for a TPU, XLA stages a strided slice of ten
    # million keys through more scoped VMEM than the chip allows (docs/decisions.md #51)
    sample = lax.stop_gradient(jnp.take(keys, jnp.arange(0, m, stride), axis=0))
    if jnp.issubdtype(sample.dtype, jnp.floating) and sample.dtype.itemsize in (4, 8):
        return _lower_median_by_bits(sample)
    return jnp.sort(sample, axis=0)[(sample.shape[0] - 1) // 2]


def _lower_median_by_bits(sample):
    """``jnp.sort(sample, axis=0)[(k - 1) // 2]`` for a float32/64 sample (k, d), found by
    sorting the floats' bits as integers, mapped so that integer order is float order (negative
    floats with their magnitude bits flipped): XLA's CPU sort with JAX's float comparator (NaNs
    last, ``-0 == 0``) cost a good part of a one-query product, a plain integer sort a small
    fraction of that (docs/decisions.md #36). ``-0`` and the subnormals are read as 0 (XLA's
    CPU arithmetic flushes subnormals, so its sort ties them with 0) and every NaN as the
    positive quiet NaN: the value picked is jnp.sort's, up to those readings."""
    itype = jnp.int32 if sample.dtype.itemsize == 4 else jnp.int64
    flip = jnp.iinfo(itype).max
    tiny = jnp.finfo(sample.dtype).tiny
    x = jnp.where(jnp.abs(sample) < tiny, jnp.zeros((), sample.dtype), sample)
    x = jnp.where(jnp.isnan(x), jnp.full((), jnp.nan, sample.dtype), x)
    bits = lax.bitcast_convert_type(x, itype)
    key = jnp.where(bits < 0, bits ^ flip, bits)
    key = lax.sort(key, dimension=0, is_stable=False)[(sample.shape[0] - 1) // 2]
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ flip, key), sample.dtype)


#: `feature_sum` adds up to this many features one by one.
UNROLLED_FEATURES = 8


def feature_sum(x):
    """``jnp.sum(x, axis=-1)`` over a short feature axis, added feature by feature (left to
    right) for at most `UNROLLED_FEATURES` features. Why: XLA's CPU backend (jaxlib 0.10) sends
    a reduction over a minor axis of a few elements to its YNN fusions, whose fixed cost was
    most of a one-query call (docs/decisions.md #36). Not for the tiles' pair arithmetic,
    where that fusion is the fast one."""
    d = x.shape[-1]
    if d == 0 or d > UNROLLED_FEATURES:
        return jnp.sum(x, axis=-1)
    out = x[..., 0]
    for i in range(1, d):
        out = out + x[..., i]
    return out


def host_centre_of(points):
    """`centre_of` on the host: float64 (d,) of points (m, d), the same lower median of the same
    even-stride sample, for inputs centred in their own precision before the cast to the
    compute dtype (the KDE's offset data; the GP keeps np.median, docs/decisions.md #20). Being one of the points' numbers,
    it shifts them by the very same float as the engine would, which then finds them centred
    on an exact 0."""
    points = np.asarray(points, np.float64)
    stride = -(-points.shape[0] // CENTRE_SAMPLE)
    sample = np.sort(points[::stride], axis=0)
    return sample[(sample.shape[0] - 1) // 2]


def prepare(x1, x2, scale, centre=None):
    """Prepared coordinates ``((x1 - c) / scale, (x2 - c) / scale, far_1, far_2)``, with ``c`` the
    centre of the keys x2 (`centre_of`; or ``centre``, already taken from them).

    ``far_*`` (p,) flag rows whose squared norm is not finite in the dtype. Such a row is farther
    from every other point than the dtype can express, so its kernel values are exactly 0; its
    coordinates are set to 0 here, which keeps ``inf - inf`` (NaN) out of the distance expansion,
    and the caller gives it its limit: 0 in a product, zero weight as a key, -inf as a
    log-density query.
    """
    return centred(x1, x2, scale, centre)


def through_one_scalar(scale):
    """``(s₀, s₀ / s)`` for a scalar scale s (a lengthscale or bandwidth), s₀ =
    ``stop_gradient(s)``: points prepared with s₀, and a product that takes ``s₀ / s`` (1 in
    value) as its own scale, carry s's whole gradient through that one scalar, which a backend
    may take from the tiles' second moments (`scalegp.ops._interface.RbfCore.scaled_mv`)."""
    fixed = lax.stop_gradient(scale)
    return fixed, fixed / scale


def prepared_rows(x, centre, scale):
    """``((x - centre) / scale`` with its far rows set to 0, far (p,))``: one point set of
    `prepare`."""
    # times the reciprocal, not divided: XLA rewrites a division by a broadcast into that
    # product, but not when x has one row (no broadcast), which made a lone row round apart
    a = (x - centre) * (1 / scale)
    far = far_rows(a)
    return masked_rows(a, far), far


def far_rows(scaled):
    """(...,) bool: the rows of scaled points (..., d) whose squared norm is not finite in the
    dtype (`prepare`'s far rows: 0 in every kernel value)."""
    return ~jnp.isfinite(feature_sum(scaled * scaled))


def masked_rows(x, far):
    """x with the flagged rows (leading axis) set to 0."""
    return jnp.where(far[:, None], jnp.zeros((), x.dtype), x)


def centred(x1, x2, scale=None, centre=None):
    """``((x1 - c) / scale, (x2 - c) / scale, far_1, far_2)`` with c the keys' centre
    (`centre_of`, unless the caller took it already: ``centre``, so that a product's two
    branches sort for it once); unscaled when ``scale`` is None.

    Both point sets must be shifted by the very same float ``c``: the differences of nearby
    points far from the origin are then exact. The centre was once the keys' mean, which XLA
    recomputed as ``sum · (1/m)`` inside each consumer's fusion, and those fusions rounded
    ``x - sum · (1/m)`` apart (a fused multiply-add leaves the product unrounded): a 1e-4
    relative error of K v at a lengthscale of 0.1 on points offset by 1e3. A median is one of
    the keys' own numbers, picked, not computed, so every consumer sees the same float.
    """
    centre = centre_of(x2) if centre is None else centre
    scale = jnp.ones((), x2.dtype) if scale is None else scale
    (a, far_a), (b, far_b) = prepared_rows(x1, centre, scale), prepared_rows(x2, centre, scale)
    return a, b, far_a, far_b


def centred_product(core):
    """``(x1, x2, v) -> K v`` from ``core(a, b, v)``, a product on points centred as `centred`
    does: rows too far to express are set to 0 going in (keys: zero weight) and coming out."""

    def product(x1, x2, v, centre=None):
        a, b, far_a, far_b = centred(x1, x2, centre=centre)
        return masked_rows(core(a, b, masked_rows(v, far_b)), far_a)

    return product


def sum_to_one(w, m: int, dtype):
    """Weights (m,) summing to 1: ``w / Σ w``, or ``1/m`` each where w is None (no weights,
    built where they are used rather than passed in: an operand of a ``lax.cond`` is made in
    memory, a constant inside a branch fuses into its consumers)."""
    if w is None:
        return jnp.full((m,), 1 / m, dtype)
    return w / jnp.sum(w)


def normalised_weights(w, far_b, dtype):
    """Weights (m,) of dtype summing to 1 (`sum_to_one`; w None: equal), with the far keys'
    (`prepare`) set to 0: they weigh nothing."""
    return jnp.where(far_b, jnp.zeros((), dtype), sum_to_one(w, far_b.shape[0], dtype))


def flat_batch(x, batch_shape, core_ndim):
    """Broadcast x's batch dimensions to batch_shape and merge them into one leading axis."""
    core = x.shape[x.ndim - core_ndim :]
    return jnp.broadcast_to(x, batch_shape + core).reshape((-1,) + core)


def batched_product(single, x1, x2, v, batch_shape, vector, dtype):
    """``single(x1, x2, v)`` over the broadcast batch dimensions (vmapped over one flat axis)."""
    n, o = x1.shape[-2], v.shape[-1]
    args = (x1.astype(dtype), x2.astype(dtype), v.astype(dtype))
    if batch_shape:
        args = [flat_batch(x, batch_shape, 2) for x in args]
        out = jax.vmap(single)(*args).reshape(batch_shape + (n, o))
    else:
        out = single(*args)
    return out[..., 0] if vector else out
