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
