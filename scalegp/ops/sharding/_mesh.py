"""Meshes for the sharded products: a one-axis mesh over devices, the estimators' ``mesh=``
setting turned into one, the axis rows are sharded over, rows placed on it, and the schemes by
which keys reach the devices."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: How the keys reach every query shard: all-gathered, or passed around a ring
#: (`scalegp.ops.sharded_kernel_mv`).
SCHEMES = ("allgather", "ring")


def data_mesh(devices=None, axis_name: str = "data") -> Mesh:
    """A one-axis mesh over ``devices`` (default: all devices of all processes, `jax.devices()`)."""
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("data_mesh needs at least one device, got an empty list")
    return Mesh(np.asarray(devices, dtype=object), (axis_name,))


def as_mesh(mesh) -> Mesh | None:
    """Normalises the ``mesh=`` setting of the estimators.

    None -> None (one device, the unsharded engine); a `Mesh` -> itself; ``"all"`` -> a
    `data_mesh` over `jax.devices()`; an int k -> the first k devices; a sequence of devices ->
    a `data_mesh` over them.
    """
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, str):
        if mesh != "all":
            raise ValueError(
                f"mesh must be None, a Mesh, 'all', an int or a list of devices; got {mesh!r}"
            )
        return data_mesh()
    if isinstance(mesh, (int, np.integer)) and not isinstance(mesh, bool):
        available = jax.devices()
        if not 1 <= mesh <= len(available):
            raise ValueError(
                f"mesh={mesh} asks for {mesh} devices but {len(available)} are available "
                f"({jax.default_backend()}); pass at most {len(available)}"
            )
        return data_mesh(available[:mesh])
    if isinstance(mesh, Sequence):
        return data_mesh(mesh)
    raise TypeError(
        f"mesh must be None, a jax.sharding.Mesh, 'all', an int or a list of devices; got "
        f"{type(mesh).__name__}"
    )


def mesh_axis(mesh: Mesh, axis=None) -> tuple[str | tuple[str, ...], int]:
    """``(axis, p)``: the mesh axis (or tuple of axes) rows are sharded over, and its size.

    Default: all of the mesh's axes (a one-axis mesh gives its single name).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis is None:
        names = tuple(mesh.axis_names)
        axis = names[0] if len(names) == 1 else names
    names = axis if isinstance(axis, tuple) else (axis,)
    for name in names:
        if name not in mesh.shape:
            raise ValueError(f"axis {name!r} is not an axis of the mesh {dict(mesh.shape)}")
    return axis, math.prod(mesh.shape[name] for name in names)


def shard_rows(x, mesh: Mesh, axis=None):
    """``x`` placed on ``mesh`` with its leading axis sharded (when it divides; else replicated)."""
    axis, p = mesh_axis(mesh, axis)
    x = jnp.asarray(x)
    spec = PartitionSpec(axis) if x.ndim and x.shape[0] % p == 0 else PartitionSpec()
    return jax.device_put(x, NamedSharding(mesh, spec))


def check_scheme(scheme, schemes=SCHEMES):
    if scheme not in schemes:
        raise ValueError(f"scheme must be one of {schemes}, got {scheme!r}")
