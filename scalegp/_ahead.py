"""Programs compiled ahead of their first call, in background threads.

Why: on a TPU a GP fit's few large programs (the BBMM solves, their gradient, the variance
cache) compile for seconds each, mostly their Mosaic kernels, one after another as the fit first
reaches them, while the host's other cores idle (docs/decisions.md #62; on a host CPU of many
cores, where a TPU machine runs the exact GP, likewise: #63). XLA compiles outside
Python's lock, so programs started together compile side by side. A program lowered and compiled
ahead (``jit(f).lower(*shapes).compile()``) lands in the jitted function's own caches: the
later call with arguments of the same shapes, dtypes and placement runs it without compiling,
and a call that comes while it compiles waits for it (JAX compiles one program once, whichever
thread asks; `tests/test_ahead.py` holds JAX to that).

A compilation that fails in the background is dropped with its future: the call then compiles
the program itself and raises the error where it belongs. Nothing of the caller's arrays is
held, only their shapes.
"""

from __future__ import annotations

import concurrent.futures
import threading

from scalegp._runtime import usable_cores

#: Background compilations at once, at most (fewer on a host of fewer usable cores: one core
#: is left to the fit): a BBMM fit queues a dozen and more, in the order it needs them.
MAX_WORKERS = 4
_POOL = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = max(1, min(MAX_WORKERS, usable_cores() - 1))
            _POOL = concurrent.futures.ThreadPoolExecutor(workers,
                                                          thread_name_prefix="scalegp-compile")
        return _POOL


def abstract(tree):
    """``tree`` with its arrays (and shape structures) as `jax.ShapeDtypeStruct` s: shape,
    dtype, weak type, and the sharding of an array committed to its devices (None otherwise,
    as an uncommitted array or a jitted function's output on one has); other leaves (static
    arguments) as they are."""
    import jax

    def leaf(a):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            return a
        committed = getattr(a, "committed", False)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False),
                                    sharding=a.sharding if committed else None)

    return jax.tree.map(leaf, tree)


def compile_ahead(jitted, *args, then=None) -> concurrent.futures.Future:
    """Queues the compilation of ``jitted`` (a `jax.jit` function) for ``args`` (arrays or
    `jax.ShapeDtypeStruct` s, static arguments as the call takes them) under the caller's x64
    mode and default device, on a small pool of threads; ``then(out)``, if given, runs there
    with the program's output shapes (`abstract`) once it is lowered, before it compiles: to
    start the programs that take them. Returns at once: the compilation's future (its result
    what ``then`` returned, or the exception it met)."""
    import jax

    args = abstract(args)
    x64, device = jax.config.jax_enable_x64, jax.config.jax_default_device

    def compile_in_background():
        # JAX's configuration is per thread: the caller's, or another program would compile
        with jax.enable_x64(x64), jax.default_device(device):
            lowered = jitted.lower(*args)
            started = None if then is None else then(jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type),
                lowered.out_info))
            lowered.compile()
            return started

    return _pool().submit(compile_in_background)
