"""What moved between the JAX versions scalegp supports, in one place (library-internal:
scalegp.gp uses it too)."""

from __future__ import annotations

import jax


def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` (JAX >= 0.6), or `jax.experimental.shard_map.shard_map` on older JAX.

    The replication check is off: the per-device kernels (pallas calls, custom VJPs) carry no
    replication annotations, and every output here is row-sharded anyway.
    """
    if hasattr(jax, "shard_map"):
        try:
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False)
        except TypeError:  # a JAX that names the flag check_rep
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_rep=False)
    from jax.experimental.shard_map import shard_map as _legacy

    return _legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def x64_mode(enabled: bool):
    """A context manager with JAX's x64 mode ``enabled`` in this thread only: `jax.enable_x64`
    (JAX >= 0.8), or `jax.experimental.enable_x64` / `disable_x64` on older JAX."""
    state = getattr(jax, "enable_x64", None)
    if state is not None:
        return state(enabled)
    from jax import experimental

    return experimental.enable_x64() if enabled else experimental.disable_x64()


def in_callers_x64_mode(call):
    """``call`` (no arguments) wrapped to run in this thread's x64 mode wherever it runs: JAX
    keeps the mode per thread, and a float64 estimator turns it on in its own only."""
    enabled = bool(jax.config.jax_enable_x64)

    def wrapped():
        with x64_mode(enabled):
            return call()

    return wrapped
