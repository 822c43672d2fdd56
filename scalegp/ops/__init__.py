"""The engine: memory-linear RBF kernel reductions and their exact gradients.

- `rbf_kernel_mv`: ``K(x1, x2) @ v`` without forming K.
- `rbf_kde_density`: Gaussian KDE (log-)density at arbitrary points.
- Both take ``prune=``: skip the tiles that provably cannot matter, with a stated bound
  (``_pruning``); `spatial_order` puts keys in the order pruning wants, once.
- `rbf_kernel_matrix`, `rbf_log_kernel_matrix`: the dense kernel matrix and its logarithm,
  prepared the same way (small problems only).
- `available_implementations`, `auto_config`: what runs on this backend and what ``impl="auto"``
  picks (an implementation and its tile sizes, a ``BlockSizes``; override them with the
  products' ``block_q``, ``block_k``, ``block_o``).
- `sharded_kernel_mv`, `sharded_kde_density`: the same two reductions with query rows sharded over
  a `jax.sharding.Mesh` (keys all-gathered or passed around a ring, `SCHEMES`); `data_mesh` builds
  a one-axis mesh, `as_mesh` turns the estimators' ``mesh=`` setting into one, `mesh_axis` and
  `shard_rows` lay rows out over it. Separate functions rather than a ``mesh=`` argument on the
  single-device ones, so those keep their batching and their tiny, mesh-free jit cache.
- `kernel_mv`, `kernel_matrix`: the same for any kernel expression: `RBF`, `Matern`,
  `RationalQuadratic`, `ExpSineSquared` and `Constant` kernels and their sums and products
  (`Sum`, `Product`, or ``+`` and ``*``), all pytrees of their hyperparameters;
  `sharded_expression_mv` is `kernel_mv` over a mesh. `kernel_mv` prunes the expressions whose
  values fall to 0 with distance (``_pruning_expression``).
- `Engine`: implementation and devices in one hashable object; the models call the reductions
  through it.

The private modules, in layers (each imports only from the layers above it):

1. leaves: ``_checks`` (argument checks), ``_prepare`` (the keys' centre, scaling, far rows
   masked, batch layout), ``_tiling`` (tile sizes, padding), ``_matmul`` (full-precision
   products), ``_compat`` (JAX versions);
2. kernels: ``_kernels`` (the kernel expressions and their tiles), ``_reference`` (the dense
   oracle);
3. tile implementations: ``_xla_rbf``, ``_xla_expression`` and ``_xla_matern`` on ``_xla_blocks``
   (blocked, the CPU default); ``_pallas`` and ``_pallas_expression`` on ``_pallas_blocks``
   (fused GPU kernels); the pruned products: ``_pruning`` (rules, entry points) on
   ``_pruning_order``, ``_pruning_bounds`` and ``_pruning_tiles``, with ``_pruning_mv``,
   ``_pruning_lse`` and ``_pruning_expression`` (xla) and ``_pallas_pruning`` with
   ``_pallas_pruning_mv`` and ``_pallas_pruning_lse`` (Pallas);
4. ``_backends``: the one backend table; `_backends.plan` decides for every call, on one device
   or a mesh, the backend, interpret mode, tiles and whether the coordinate differences may run;
5. the products: ``_rbf`` (RBF on one device), ``_expression`` (kernel expressions), ``_mesh``
   and ``_schemes`` (meshes; the ring and the all-gather) under ``_sharded`` (the products over
   a mesh), and ``_engine``.

A new implementation is one entry in ``_backends.BACKENDS`` plus its tile module.
"""

from scalegp.ops._backends import IMPLEMENTATIONS, auto_config, available_implementations
from scalegp.ops._compat import shard_map, x64_mode
from scalegp.ops._engine import Engine
from scalegp.ops._expression import kernel_matrix, kernel_mv
from scalegp.ops._kernels import (
    MATERN_NUS,
    RBF,
    Constant,
    ExpSineSquared,
    Kernel,
    Matern,
    Product,
    RationalQuadratic,
    Sum,
)
from scalegp.ops._mesh import SCHEMES, as_mesh, data_mesh, mesh_axis, shard_rows
from scalegp.ops._prepare import host_centre_of
from scalegp.ops._pruning import spatial_order
from scalegp.ops._rbf import (
    rbf_kde_density,
    rbf_kernel_matrix,
    rbf_kernel_mv,
    rbf_log_kernel_matrix,
)
from scalegp.ops._sharded import sharded_expression_mv, sharded_kde_density, sharded_kernel_mv
from scalegp.ops._tiling import MASK_VALUE, BlockSizes, log_weights

# Library-internal, not user API (hence not in __all__): `BlockSizes` is what `auto_config`
# returns (the products take the tile sizes as numbers); gp's sharded preconditioner build uses
# `shard_map`, the KDE's leave-one-out sums `MASK_VALUE` and `log_weights`, the GP estimator and
# the KDE centre their inputs on the host by `host_centre_of`; the estimators' float64 scope is
# `x64_mode`, the context the planned KDE's worker threads enter too.
__all__ = [
    "IMPLEMENTATIONS",
    "MATERN_NUS",
    "RBF",
    "Constant",
    "ExpSineSquared",
    "Kernel",
    "Matern",
    "Product",
    "RationalQuadratic",
    "Sum",
    "kernel_matrix",
    "kernel_mv",
    "SCHEMES",
    "Engine",
    "as_mesh",
    "auto_config",
    "available_implementations",
    "data_mesh",
    "mesh_axis",
    "rbf_kde_density",
    "rbf_kernel_matrix",
    "rbf_kernel_mv",
    "rbf_log_kernel_matrix",
    "shard_rows",
    "spatial_order",
    "sharded_expression_mv",
    "sharded_kde_density",
    "sharded_kernel_mv",
]
