"""Starting JAX's multi-process runtime from the environment, for runs over several hosts.

JAX runs one Python process per host (or per GPU); `jax.distributed.initialize` connects them
through a coordinator, after which `jax.devices()` lists every process's devices and a
`jax.sharding.Mesh` over them (e.g. `scalegp.ops.data_mesh()`) spans all hosts. Every process runs
the same program on the same global arrays; collectives go over NCCL on GPUs, gloo on CPUs.

`initialize_from_env` reads the documented environment::

    JAX_COORDINATOR_ADDRESS   host:port of process 0's coordinator (read by JAX itself too)
    SCALEGP_NUM_PROCESSES     number of processes
    SCALEGP_PROCESS_ID        this process's index, 0 .. SCALEGP_NUM_PROCESSES - 1

All three set: a run of that many processes. None set: a single process, unless JAX detects a
cluster itself (Slurm, Open MPI, Cloud TPU; ``auto=True``). Part of them set is an error.
"""

from __future__ import annotations

import os
from typing import Mapping

import jax

# The API is the start-up; the variables it reads are named in the module docstring.
__all__ = ["initialize_from_env"]

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "SCALEGP_NUM_PROCESSES"
ENV_PROCESS_ID = "SCALEGP_PROCESS_ID"


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict | None:
    """The keyword arguments of `jax.distributed.initialize` from the environment, or None when
    none of the three variables is set. Raises ValueError for a partial or invalid setting."""
    environ = os.environ if environ is None else environ
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    present = [name for name in names if environ.get(name)]
    if not present:
        return None
    if len(present) != len(names):
        missing = [name for name in names if name not in present]
        raise ValueError(
            f"a multi-process run needs {', '.join(names)}; {', '.join(present)} set but "
            f"{', '.join(missing)} missing. Set all three (or none, for one process)"
        )
    address = environ[ENV_COORDINATOR]
    if ":" not in address:
        raise ValueError(f"{ENV_COORDINATOR} must be host:port, got {address!r}")
    try:
        num_processes, process_id = int(environ[ENV_NUM_PROCESSES]), int(environ[ENV_PROCESS_ID])
    except ValueError:
        raise ValueError(
            f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers, got "
            f"{environ[ENV_NUM_PROCESSES]!r} and {environ[ENV_PROCESS_ID]!r}"
        ) from None
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"need {ENV_NUM_PROCESSES} >= 1 and 0 <= {ENV_PROCESS_ID} < {ENV_NUM_PROCESSES}, got "
            f"{num_processes} and {process_id}"
        )
    return {"coordinator_address": address, "num_processes": num_processes,
            "process_id": process_id}


def initialize_from_env(environ: Mapping[str, str] | None = None, *, auto: bool = False,
                        timeout: int = 300) -> bool:
    """Calls `jax.distributed.initialize` from the environment (see the module docstring).

    Must run before any JAX computation. On CPU the collectives use gloo.

    Args:
      environ: the variables (default `os.environ`).
      auto: with none of the variables set, let JAX detect a cluster (Slurm, Open MPI, TPU)
        instead of staying a single process.
      timeout: seconds to wait for every process to join.
    Returns:
      True if a multi-process runtime was started, False for a single process.
    """
    settings = settings_from_env(environ)
    if settings is None and not auto:
        return False
    # CPU processes need a collectives backend (gloo is the default from JAX 0.4.36 on)
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") in (None, "none", ""):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**(settings or {}), initialization_timeout=timeout)
    return True
