"""Argument checks shared by every public product (one device or a mesh): dtypes, point-set
shapes, scales, values and batch dimensions. A leaf: it imports nothing from scalegp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def float_dtype(*arrays):
    dtype = jnp.result_type(float, *arrays)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"expected real floating-point inputs, got dtype {dtype}")
    return dtype


def concrete(x):
    """x as a numpy array, or None when it is traced (inside jit/grad) and has no value yet."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_point_sets(x1, x2, names):
    n1, n2 = names
    for name, x in ((n1, x1), (n2, x2)):
        if x.ndim < 2:
            raise ValueError(
                f"{name} must have shape (..., n, d), got shape {x.shape}; "
                f"for n points in one dimension pass {name}[:, None]"
            )
    if x1.shape[-1] != x2.shape[-1]:
        raise ValueError(
            f"{n1} has d={x1.shape[-1]} but {n2} has d={x2.shape[-1]}; both point sets need the "
            "same number of dimensions"
        )


def check_scale(scale, d, name, dtype):
    scale = jnp.asarray(scale)
    if scale.ndim > 1 or (scale.ndim == 1 and scale.shape[0] != d):
        raise ValueError(
            f"{name} must be a scalar or have d={d} entries (one per dimension), "
            f"got shape {scale.shape}"
        )
    value = concrete(scale)
    if value is not None and not np.all(np.isfinite(value) & (value > 0)):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return scale.astype(dtype)


def check_weights(weights, m, batched=True):
    """Non-negative, finite, not all zero sample weights (..., m) (or (m,) unbatched); checked
    only when concrete (inside jit they have no value yet)."""
    if batched and (weights.ndim < 1 or weights.shape[-1] != m):
        raise ValueError(f"weights must have shape (..., m) with m={m}, got shape {weights.shape}")
    if not batched and weights.shape != (m,):
        raise ValueError(f"weights must have shape (m,) with m={m}, got shape {weights.shape}")
    value = concrete(weights)
    if value is not None and not (np.all(np.isfinite(value)) and np.all(value >= 0)):
        raise ValueError("weights must be finite and non-negative")
    if value is not None and np.any(np.sum(value, axis=-1) <= 0):
        raise ValueError("weights must not all be zero")


def batch_shape(*shapes_and_names):
    """The broadcast of the leading batch shapes ``(shape, name)``, or an error naming them."""
    try:
        return np.broadcast_shapes(*(s for s, _ in shapes_and_names))
    except ValueError:
        desc = ", ".join(f"{name} {s}" for s, name in shapes_and_names)
        raise ValueError(f"leading batch dimensions do not broadcast: {desc}") from None


def product_arguments(x1, x2, v):
    """The checked arguments of a kernel product: ``(x1, x2, v (..., m, o), vector, dtype)``."""
    x1, x2, v = jnp.asarray(x1), jnp.asarray(x2), jnp.asarray(v)
    check_point_sets(x1, x2, ("x1", "x2"))
    vector = v.ndim == x2.ndim - 1
    if not vector and v.ndim != x2.ndim:
        raise ValueError(
            f"v must have shape (..., m, o) or (..., m) to match x2 of shape {x2.shape}, "
            f"got shape {v.shape}"
        )
    if vector:
        v = v[..., None]
    if v.shape[-2] != x2.shape[-2]:
        raise ValueError(f"v has {v.shape[-2]} rows but x2 has m={x2.shape[-2]} points")
    return x1, x2, v, vector, float_dtype(x1, x2, v)


def check_unbatched(x1, x2, names):
    """`check_point_sets`, and both (n, d): the sharded products take no batch dimensions."""
    check_point_sets(x1, x2, names)
    for name, x in zip(names, (x1, x2)):
        if x.ndim != 2:
            raise ValueError(
                f"the sharded engine takes unbatched {name} of shape (n, d), got {x.shape}; "
                "loop (or vmap) over the batch, or use scalegp.ops.rbf_kernel_mv on one device"
            )


def unbatched_values(v, m):
    """(v as (m, o), whether it was a vector), checked against the m rows of x2."""
    if v.ndim not in (1, 2) or v.shape[0] != m:
        raise ValueError(
            f"v must have shape (m, o) or (m,) with m={m} rows (the rows of x2), "
            f"got shape {v.shape}"
        )
    return (v[:, None], True) if v.ndim == 1 else (v, False)
