"""Counting XLA compilations: `count_compiles`, for tests that a repeated call compiles nothing
(issue 42: an eager engine call once compiled a ``jit(cond)`` on every call)."""

from __future__ import annotations

import contextlib

import jax

#: JAX records one such event per backend compilation (an in-memory cache miss), a persistent
#: compilation cache hit included: what a repeated call must not cause.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compiles(list):
    """The names of the functions compiled inside a `count_compiles` block, in order (a list;
    ``len`` is the count)."""


@contextlib.contextmanager
def count_compiles():
    """``with count_compiles() as compiled: ...`` records every XLA compilation in the block
    into ``compiled`` (the compiled function's name, or "?" where JAX gives none)."""
    compiled = Compiles()

    def listener(event, duration, **kwargs):
        del duration
        if event == BACKEND_COMPILE_EVENT:
            compiled.append(str(kwargs.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
