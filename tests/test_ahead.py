"""scalegp._ahead: programs compiled ahead in background threads, then run by their calls
without compiling again."""

import contextlib
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from scalegp._ahead import abstract, compile_ahead


@contextlib.contextmanager
def compiled_programs():
    """The names of the programs JAX compiles inside, in any thread."""
    names = []

    class Log(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of "):
                names.append(message.split(" of ", 1)[1].split(" in ")[0])

    handler, logger = Log(), logging.getLogger("jax")
    logger.addHandler(handler)
    previous = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield names
    finally:
        jax.config.update("jax_log_compiles", previous)
        logger.removeHandler(handler)


def _fresh(scale):
    """A jitted function no other test has compiled (static ``power``)."""

    def ahead_probe(x, power):
        return jnp.sum(jnp.sin(x * scale) ** power)

    return jax.jit(ahead_probe, static_argnums=1)


def test_a_program_compiled_ahead_is_run_by_the_call_without_compiling_again():
    fn = _fresh(1.5)
    x = np.linspace(0, 1, 64, dtype=np.float32)
    with compiled_programs() as names:
        assert compile_ahead(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), 3).result() is None
        value = fn(x, 3)
    assert names.count("jit(ahead_probe)") == 1  # in the background only
    np.testing.assert_allclose(float(value), np.sum(np.sin(x * 1.5) ** 3), rtol=1e-5)


def test_the_callers_x64_mode_is_the_background_compilations():
    fn = _fresh(0.5)
    with jax.enable_x64(True), compiled_programs() as names:
        compile_ahead(fn, jax.ShapeDtypeStruct((4,), jnp.float64), 1).result()
        value = fn(np.ones(4), 1)
    assert names.count("jit(ahead_probe)") == 1 and value.dtype == jnp.float64


def test_then_gets_the_output_shapes_and_its_result_is_the_futures():
    fn = _fresh(2.0)
    seen = []
    future = compile_ahead(fn, jax.ShapeDtypeStruct((5,), jnp.float32), 2,
                           then=lambda out: seen.append(out) or "started")
    assert future.result() == "started"
    assert seen == [jax.ShapeDtypeStruct((), jnp.float32)]


def test_a_call_while_the_program_compiles_waits_for_it():
    # What the module relies on: JAX compiles a program once, whichever thread asks first.
    started = threading.Event()

    def slowly_traced(x):
        started.set()
        time.sleep(0.5)  # tracing: the call comes while the program is under way
        return x * 2

    fn = jax.jit(slowly_traced)
    with compiled_programs() as names:
        compile_ahead(fn, jax.ShapeDtypeStruct((4,), jnp.float32))
        assert started.wait(10)
        fn(np.ones(4, np.float32))
    assert names.count("jit(slowly_traced)") == 1


def test_other_signatures_compile_their_own_programs():
    fn = _fresh(2.5)
    with compiled_programs() as names:
        compile_ahead(fn, jax.ShapeDtypeStruct((8,), jnp.float32), 2).result()
        fn(np.ones(16, np.float32), 2)  # another shape
        fn(np.ones(8, np.float32), 3)  # another static argument
    assert names.count("jit(ahead_probe)") == 3


def test_a_failure_in_the_background_is_the_futures():
    def broken(x):
        return jnp.reshape(x, (3, 5))

    future = compile_ahead(jax.jit(broken), jax.ShapeDtypeStruct((4,), jnp.float32))
    assert isinstance(future.exception(), TypeError)


def test_only_shapes_are_kept():
    on_one = jax.device_put(jnp.ones(3), jax.devices()[0])
    loose, placed = abstract((jnp.ones(3), on_one))
    assert isinstance(loose, jax.ShapeDtypeStruct) and loose.sharding is None
    assert placed.sharding == on_one.sharding  # a committed array keeps its placement
    assert abstract("static") == "static"
