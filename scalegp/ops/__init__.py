"""The engine: memory-linear RBF kernel reductions and their exact gradients.

- `rbf_kernel_mv`: ``K(x1, x2) @ v`` without forming K.
- `rbf_kde_density`: Gaussian KDE (log-)density at arbitrary points.
- `rbf_kernel_matrix`: the dense kernel matrix, prepared the same way (small problems only).
- `available_implementations`, `auto_config`: what runs on this backend and what ``impl="auto"``
  picks.
- `sharded_kernel_mv`, `sharded_kde_density`: the same two reductions with query rows sharded over
  a `jax.sharding.Mesh` (keys all-gathered or passed around a ring); `data_mesh` builds a one-axis
  mesh. Separate functions rather than a ``mesh=`` argument on the single-device ones, so those
  keep their batching and their tiny, mesh-free jit cache; see `scalegp.ops.sharded`.
"""

from scalegp.ops.dispatch import (
    IMPLEMENTATIONS,
    auto_config,
    available_implementations,
    rbf_kde_density,
    rbf_kernel_matrix,
    rbf_kernel_mv,
)
from scalegp.ops.sharded import data_mesh, sharded_kde_density, sharded_kernel_mv
from scalegp.ops.tiling import BlockSizes

__all__ = [
    "IMPLEMENTATIONS",
    "BlockSizes",
    "auto_config",
    "available_implementations",
    "data_mesh",
    "rbf_kde_density",
    "rbf_kernel_matrix",
    "rbf_kernel_mv",
    "sharded_kde_density",
    "sharded_kernel_mv",
]
