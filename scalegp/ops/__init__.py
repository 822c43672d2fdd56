"""The engine: memory-linear RBF kernel reductions and their exact gradients.

- `rbf_kernel_mv`: ``K(x1, x2) @ v`` without forming K.
- `rbf_kde_density`: Gaussian KDE (log-)density at arbitrary points.
- Both take ``prune=``: skip the tiles that provably cannot matter, with a stated bound
  (`scalegp.ops.pruning`); `spatial_order` puts keys in the order pruning wants, once.
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
  values fall to 0 with distance (on backends that declare it).
- `Engine`: implementation and devices in one hashable object; the models call the reductions
  through it.

Inside, in layers (each imports only from the layers before it; `tools/check_structure.py`
enforces them):

1. leaves: ``_checks`` (argument checks), ``_prepare`` (the keys' centre, scaling, far rows
   masked, batch layout), ``_tiling`` (tile sizes, padding), ``_matmul`` (the products at a
   precision, the rows' norms), ``_compat`` (JAX versions), ``_profiles``;
2. ``_kernels`` (the kernel expressions and their tiles), ``_tile_math`` (the arithmetic every
   backend shares, written once: the online log-sum-exp step, the custom-VJP wiring, the
   log-normaliser, the dense differences) and ``_interface`` (what a backend is: `Backend`,
   its cores, capabilities, `Plan`);
3. ``pruning`` (k-d order, tile boxes and bounds, the host tree, the host-planned KDE over a
   backend's passes, the rules on unordered points), backend-neutral;
4. ``backends``: one sub-package per backend (``dense``, ``xla``, ``triton``, ``mosaic``), each
   exporting one ``BACKEND``; nothing outside a backend's folder imports its modules;
5. ``_plan``: the one list of backends and `plan`, which decides for every call, on one device
   or a mesh, the backend (by capability, never by name elsewhere), interpret mode, tiles and
   whether the coordinate differences may run; its docstring is the capability table;
6. the products: ``_rbf`` (RBF on one device), ``_expression`` (kernel expressions),
   ``sharding`` (the products over a mesh), ``_dense`` (float32-accurate dense products for
   the layers above), and ``_engine``.

A new backend is one sub-package of ``backends`` and one line in ``_plan.BACKENDS``
(docs/architecture.md).
"""

from scalegp.ops._compat import shard_map, x64_mode
from scalegp.ops._dense import dense_products
from scalegp.ops._engine import Engine
from scalegp.ops._expression import kernel_matrix, kernel_mv
from scalegp.ops._interface import DenseProducts
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
from scalegp.ops._plan import (
    IMPLEMENTATIONS,
    auto_config,
    available_implementations,
    compiles_ahead,
    dense_work_on_host,
    lapack_on_host,
)
from scalegp.ops._prepare import host_centre_of
from scalegp.ops._rbf import (
    rbf_kde_density,
    rbf_kernel_matrix,
    rbf_kernel_mv,
    rbf_log_kernel_matrix,
)
from scalegp.ops._tile_math import gaussian_log_norm, sq_differences
from scalegp.ops._tiling import MASK_VALUE, BlockSizes, log_weights
from scalegp.ops.pruning import default_device, on_host, spatial_order
from scalegp.ops.sharding import (
    SCHEMES,
    as_mesh,
    data_mesh,
    mesh_axis,
    shard_rows,
    sharded_expression_mv,
    sharded_kde_density,
    sharded_kernel_mv,
)

# Library-internal, not user API (hence not in __all__): `BlockSizes` is what `auto_config`
# returns (the products take the tile sizes as numbers); gp's sharded preconditioner build uses
# `shard_map`, the KDE's leave-one-out sums `MASK_VALUE` and `log_weights` over ops' dense
# exponents (`sq_differences`, `gaussian_log_norm`), the GP estimator and
# the KDE centre their inputs on the host by `host_centre_of`; the estimators' float64 scope is
# `x64_mode`, the context the planned KDE's worker threads enter too; the exact GP asks
# `lapack_on_host` whether scipy's LAPACK runs on the device itself, and the estimators
# `dense_work_on_host` whether float64 and the exact solvers belong on the host CPU (and
# `compiles_ahead` whether a fit compiles its later programs in background threads), then
# enter `on_host` (as the planned KDE's build does), and check their arrays against the memory
# of `default_device`; linalg's preconditioner and the GP's
# variance cache take their float32-accurate products (`DenseProducts`) from `dense_products`.
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
