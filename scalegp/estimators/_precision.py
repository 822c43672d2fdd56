"""An estimator's ``dtype="float64"`` without the caller's switching JAX's x64 mode on.

JAX creates float64 arrays only while ``jax_enable_x64`` is on. The estimators' public methods
run inside `precision_scope`, which turns it on for the duration of the call when the
estimator asks for float64 and the caller has it off, and restores it on return: the estimator
computes in float64, and before and after the call the process is in float32
(``jnp.asarray(1.0).dtype`` is float32). Within the scope the arithmetic is that of a process
with x64 on, so its results are the same.

The scope sets the process-wide value, not only this thread's (``jax.enable_x64``): the host
callbacks of compiled code (LAPACK's ``potri`` of the exact solver, the Lanczos quadrature's
tridiagonal eigenproblems) run on XLA's threads when the computation is dispatched
asynchronously, and JAX converts their float64 results to float32 there unless x64 is on
(then fails: "Incorrect output dtype"). So while a float64 method runs, other threads of the
process also see x64 on; nested and concurrent scopes restore the caller's value when the last
one ends.

What an estimator keeps between calls is numpy (host) arrays, which hold float64 outside the
scope too; JAX arrays created inside it must not escape to the caller, who would compute with
them in float32.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import numpy as np


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


def x64_context():
    """A context manager that turns JAX's x64 mode on in this thread: ``jax.enable_x64`` (a
    config state since jax 0.8), else ``jax.experimental.enable_x64`` (older jax)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        return enable(True)
    from jax.experimental import enable_x64  # jax < 0.8

    return enable_x64(True)


#: Guards the scopes' count and the value they restore.
_LOCK = threading.Lock()
_open_scopes = 0
_restore_to = False


def _global_x64():
    """The process-wide value of ``jax_enable_x64`` (not a thread's context)."""
    try:
        from jax._src.config import enable_x64

        return bool(enable_x64.get_global())
    except (ImportError, AttributeError):  # another jax: this thread's value, the same unless
        return bool(jax.config.jax_enable_x64)  # a context manager of the caller's is open


@contextlib.contextmanager
def x64_scope():
    """x64 on, for this thread and the process (see the module docstring), until the last
    open scope ends; then the value before the first."""
    global _open_scopes, _restore_to
    with _LOCK:
        if _open_scopes == 0:
            _restore_to = _global_x64()
            jax.config.update("jax_enable_x64", True)
        _open_scopes += 1
    try:
        with x64_context():  # over a context of the caller's that turned it off here
            yield
    finally:
        with _LOCK:
            _open_scopes -= 1
            if _open_scopes == 0:
                jax.config.update("jax_enable_x64", _restore_to)


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
