"""Small dense steps of a compiled program done on the host CPU, through ``jax.pure_callback``:
LAPACK's eigensolvers on the ``m × m`` tridiagonals of the Lanczos quadrature and on the
``k × k`` matrices of the low-rank preconditioner, in float64.

Why on the host: these matrices are small (kilobytes to a few megabytes cross), and an
accelerator gains nothing on them, while XLA compiles its own dense factorisations for a TPU
for minutes (docs/decisions.md #52) and a TPU has no float64. The cost: a program with a host
callback is not kept in JAX's persistent compilation cache.

A host function never raises (an exception inside a callback is undefined behaviour): it
returns NaNs instead, which the caller's result carries.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scalegp._runtime import bounded_host_blas
from scalegp.ops import dense_work_on_host


def host_call(host_fn: Callable, results: Sequence[jax.ShapeDtypeStruct], *args):
    """``host_fn(*args)`` on the host inside ``jit`` and ``vmap``: numpy arrays in (with any
    leading batch axes: ``vmap_method="broadcast_all"``), a tuple of arrays out, of the
    ``results``' shapes (plus those batch axes) and dtypes. LAPACK there runs bounded beside
    XLA's threads (`scalegp._runtime.bounded_host_blas`).

    float64 results cross as pairs of uint32 and are bitcast back in the graph: JAX converts a
    callback's float64 results to float32 on the thread that runs it (one of XLA's) unless x64
    is on there, and a float64 estimator turns x64 on in its own thread only
    (`scalegp.estimators.precision_scope`), so another thread's float32 work is untouched."""
    wide = [r.dtype == jnp.float64 for r in results]
    crossing = tuple(jax.ShapeDtypeStruct(r.shape + (2,), jnp.uint32) if w else r
                     for r, w in zip(results, wide))

    def on_host(*arrays):
        with bounded_host_blas():
            values = host_fn(*arrays)
        return tuple(_as_uint32_pairs(np.asarray(v, np.float64)) if w
                     else np.asarray(v, r.dtype) for v, r, w in zip(values, results, wide))

    values = jax.pure_callback(on_host, crossing, *args, vmap_method="broadcast_all")
    return tuple(jax.lax.bitcast_convert_type(v, jnp.float64) if w else v
                 for v, w in zip(values, wide))


def _as_uint32_pairs(values: np.ndarray) -> np.ndarray:
    """float64 ``values`` as uint32 pairs of the same bits, shape ``values.shape + (2,)``."""
    return np.ascontiguousarray(values).reshape(-1).view(np.uint32).reshape(values.shape + (2,))


def small_eigh(a: jax.Array, method: str = "auto") -> tuple[jax.Array, jax.Array]:
    """``(eigenvalues, eigenvectors)`` of a small symmetric ``a (..., k, k)``, as
    ``jnp.linalg.eigh`` gives them (ascending; eigenvectors as columns).

    ``method``: ``"graph"``, ``jnp.linalg.eigh`` in the compiled program; ``"host"``, LAPACK's
    on the host in float64 (`host_call`), rounded to ``a``'s dtype; ``"auto"`` (default):
    "host" where dense work belongs on the host (`scalegp.ops.dense_work_on_host`: a TPU, for
    which XLA's own eigensolver compiles slowly: docs/decisions.md #52), else "graph". Only the
    lower triangle is read, as ``jnp.linalg.eigh`` does.
    """
    if method == "auto":
        method = "host" if dense_work_on_host() else "graph"
    if method == "graph":
        return jnp.linalg.eigh(a)
    if method != "host":
        raise ValueError(f"method must be 'auto', 'graph' or 'host', got {method!r}")
    values = jax.ShapeDtypeStruct(a.shape[:-1], a.dtype)
    return host_call(eigh_numpy, (values, jax.ShapeDtypeStruct(a.shape, a.dtype)), a)


def eigh_numpy(a):
    """``np.linalg.eigh`` of ``a (..., k, k)`` (its lower triangle) in float64, for host
    functions: NaNs for every matrix with a non-finite entry, or where LAPACK did not converge,
    never an exception."""
    a = np.asarray(a, np.float64)
    bad = ~np.isfinite(np.tril(a)).all(axis=(-2, -1))  # NaNs for every matrix with one
    try:
        values, vectors = np.linalg.eigh(np.where(bad[..., None, None], 0.0, a), UPLO="L")
    except np.linalg.LinAlgError:  # unconverged
        return np.full(a.shape[:-1], np.nan), np.full_like(a, np.nan)
    return (np.where(bad[..., None], np.nan, values),
            np.where(bad[..., None, None], np.nan, vectors))
