"""An estimator's ``dtype="float64"`` without the caller's switching JAX's x64 mode on.

JAX creates float64 arrays only while ``jax_enable_x64`` is on. The estimators' public methods
run inside `precision_scope`, which turns it on for the duration of the call when the
estimator asks for float64 and the caller has it off: the estimator computes in float64, and
before and after the call the caller is in float32 (``jnp.asarray(1.0).dtype`` is float32).
Within the scope the arithmetic is that of a process with x64 on, so its results are the same.

The scope is this thread's only (``jax.enable_x64``, a context JAX keeps per thread): a float32
estimator running in another thread meanwhile keeps computing in float32. Work that leaves the
thread carries the mode along: scalegp's own worker threads (the planned KDE passes) enter
their caller's mode, and the host callbacks that XLA runs on its threads (the Lanczos
quadrature's tridiagonal eigenproblems) pass float64 results as raw bits, which JAX does not
convert (`scalegp.linalg`).

What an estimator keeps between calls is numpy (host) arrays, which hold float64 outside the
scope too; JAX arrays created inside it must not escape to the caller, who would compute with
them in float32.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np

from scalegp.ops import x64_mode


def float_dtype(dtype):
    """``dtype`` as numpy reads it, which must be float32 or float64."""
    try:
        value = np.dtype(dtype)
    except (TypeError, ValueError):
        value = None
    if value is None or value not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(
            "dtype must be None, float32 or float64 (anything numpy reads as one of them: "
            f"'float32', np.float64, ...), got {dtype!r}"
        )
    return value


def x64_scope():
    """x64 on in this thread, not in others, until the scope ends; then the caller's value."""
    return x64_mode(True)


def precision_scope(dtype):
    """The context a computation in ``dtype`` (None, or anything `float_dtype` reads) runs in:
    `x64_scope` for float64 while the caller has x64 off; nothing otherwise (None and float32
    run in the caller's mode; a float32 estimator casts its arrays itself). An invalid
    ``dtype`` is left to the estimator's own checks at fit."""
    if dtype is None or jax.config.jax_enable_x64:
        return contextlib.nullcontext()
    try:
        wants_x64 = float_dtype(dtype) == np.float64
    except ValueError:
        return contextlib.nullcontext()
    return x64_scope() if wants_x64 else contextlib.nullcontext()


def in_precision(method):
    """Runs an estimator's public ``method`` inside `precision_scope` of its ``dtype``."""

    @functools.wraps(method)
    def scoped(self, *args, **kwargs):
        with precision_scope(getattr(self, "dtype", None)):
            return method(self, *args, **kwargs)

    return scoped
