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

Where JAX's default backend is a TPU, ``dtype="float64"`` and the exact (Cholesky) solvers run
on the host CPU device on purpose (`host_scope`): the chip has no float64 hardware, and runs
small dense factorisations and many short steps far slower than its host
(docs/decisions.md #50).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np

from scalegp._validation import check_memory
from scalegp.ops import default_device, dense_work_on_host, on_host, x64_mode


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


@contextlib.contextmanager
def precision_scope(dtype):
    """The context a computation in ``dtype`` (None, or anything `float_dtype` reads) runs in:
    `x64_scope` for float64 while the caller has x64 off (None and float32 run in the caller's
    mode; a float32 estimator casts its arrays itself), and for float64 `host_scope` (None
    too stays on the default device: what it resolves to may depend on the data, as the
    KDE's does). An invalid ``dtype`` is left to the estimator's own checks at fit."""
    try:
        float64 = dtype is not None and float_dtype(dtype) == np.float64
    except ValueError:
        float64 = False
    with contextlib.ExitStack() as stack:
        if float64 and not jax.config.jax_enable_x64:
            stack.enter_context(x64_scope())
        stack.enter_context(host_scope(float64))
        yield


def host_scope(needed: bool = True):
    """The host CPU as JAX's default device where ``needed`` (float64, or an exact solver's
    fitted model) and the platform wants such work there (`scalegp.ops.dense_work_on_host`:
    a TPU); nothing otherwise. Arrays made inside, and the programs on them, live on the host;
    the estimator keeps numpy between calls, so nothing it holds is tied to either device."""
    if not needed or not dense_work_on_host():
        return contextlib.nullcontext()
    return on_host()


def accelerator_memory() -> tuple[str, int] | None:
    """``(platform, bytes)`` of the memory of JAX's default device as its runtime reports it
    (an accelerator's ``bytes_limit``), or None where it reports none: the host CPU, whose
    limit is this process's (`scalegp._validation.memory_limit`)."""
    device = default_device()
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a runtime that cannot say is not an error
        return None
    limit = (stats or {}).get("bytes_limit")
    return (device.platform, int(limit)) if limit else None


def check_solver_memory(solver, n: int, dtype, engine, what: str, fix: str) -> None:
    """A `scalegp._validation.MemoryLimitError` before any work where the iterative
    ``solver``'s fit on ``n`` points (its ``memory_bytes``, in ``dtype``) cannot be held by the
    device it runs on (`accelerator_memory`, else this process's memory; with the engine's
    mesh, each device holds its share of the rows): on an accelerator XLA would fail only
    part-way, after minutes of the fit."""
    devices = 1 if engine.mesh is None else engine.mesh.size
    needed = -(-solver.memory_bytes(n, np.dtype(dtype).itemsize) // devices)
    check_memory(needed, f"the arrays of {what} on {n:,} points", fix,
                 device=accelerator_memory())


def exact_on_host(method):
    """Runs a fitted estimator's public ``method`` in `host_scope` where its ``solver_`` is
    "exact" (its fit ran there too)."""

    @functools.wraps(method)
    def placed(self, *args, **kwargs):
        with host_scope(getattr(self, "solver_", None) == "exact"):
            return method(self, *args, **kwargs)

    return placed


def in_precision(method):
    """Runs an estimator's public ``method`` inside `precision_scope` of its ``dtype``."""

    @functools.wraps(method)
    def scoped(self, *args, **kwargs):
        with precision_scope(getattr(self, "dtype", None)):
            return method(self, *args, **kwargs)

    return scoped
