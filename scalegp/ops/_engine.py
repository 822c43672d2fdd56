"""`Engine`: where and how gp and kde run the kernel reductions: the implementation, and one
device or a mesh with a scheme for the keys. The one door from the models into ops, so that no
model branches on ``mesh is None`` or carries ``impl, mesh, scheme`` through its signatures."""

from __future__ import annotations

import dataclasses
from typing import Any

from scalegp.ops._backends import check_impl
from scalegp.ops._expression import kernel_mv
from scalegp.ops._mesh import as_mesh, check_scheme
from scalegp.ops._pruning import check_prune, worth_ordering
from scalegp.ops._rbf import rbf_kde_density
from scalegp.ops._sharded import sharded_expression_mv, sharded_kde_density


@dataclasses.dataclass(frozen=True)
class Engine:
    """Settings of the kernel reductions; hashable, so it can be a static argument of ``jit``.

    Attributes:
      impl: "auto", "dense", "xla" or "pallas" (see `scalegp.ops.auto_config`).
      mesh: None (one device) or a `jax.sharding.Mesh` whose devices share the query rows.
      scheme: with a mesh, how the keys reach the devices: "allgather" or "ring" (see
        `scalegp.ops.sharded_kernel_mv`); "replicated" for keys already on every device (KDE
        cross-validation scores many query groups against the same data).
      prune, prune_tol: tile pruning on one device (see `scalegp.ops.rbf_kernel_mv`). False by
        default, unlike the public functions' "auto": a model calls the engine many times with
        the same keys, and opts in when it keeps them in `scalegp.ops.spatial_order`
        (``keys_in_order``), so that they are not sorted again on every call.
      keys_in_order: the keys of every call are in `scalegp.ops.spatial_order` (or a
        subsequence of it).
    """

    impl: str = "auto"
    mesh: Any = None
    scheme: str = "allgather"
    prune: Any = False
    prune_tol: Any = None
    keys_in_order: bool = False

    @classmethod
    def create(cls, impl="auto", mesh=None, scheme="allgather", *, prune=False, prune_tol=None,
               keys_in_order=False) -> "Engine":
        """An `Engine` from user settings: ``mesh`` as the estimators take it (None, a Mesh,
        "all", an int or a list of devices; see `scalegp.ops.as_mesh`), all values checked.
        With a mesh, ``prune="auto"`` means no pruning (the sharded products do not prune)."""
        check_impl(impl)
        check_scheme(scheme)
        check_prune(prune, prune_tol)
        mesh = as_mesh(mesh)
        if mesh is not None:
            if prune is True:
                raise ValueError("prune=True runs on one device; pass mesh=None, or prune=False "
                                 "or 'auto' with a mesh")
            prune = False
        return cls(impl, mesh, scheme, prune,
                   None if prune_tol is None else float(prune_tol), bool(keys_in_order))

    def orders_keys(self, m: int, d: int) -> bool:
        """Whether a model with ``m`` keys of ``d`` features should keep them in
        `scalegp.ops.spatial_order` for this engine: when it may prune them."""
        return self.mesh is None and worth_ordering(self.prune, m, d)

    def kernel_mv(self, x1, x2, v, kernel):
        """``K(x1, x2) v``: (n, d), (m, d), (m, o) -> (n, o) for a `scalegp.ops` kernel
        expression; see `scalegp.ops.kernel_mv`, and with a mesh
        `scalegp.ops.sharded_expression_mv` (``c · RBF`` takes the RBF kernels in both)."""
        if self.mesh is None:
            return kernel_mv(kernel, x1, x2, v, impl=self.impl, prune=self.prune,
                             prune_tol=self.prune_tol, keys_in_order=self.keys_in_order)
        return sharded_expression_mv(kernel, x1, x2, v, mesh=self.mesh, scheme=self.scheme,
                                     impl=self.impl)

    def kde_log_density(self, queries, data, bandwidth, weights):
        """Log of the weighted Gaussian KDE at each query: (n, d), (m, d), h, (m,) -> (n,); see
        `scalegp.ops.rbf_kde_density`."""
        if self.mesh is None:
            return rbf_kde_density(queries, data, bandwidth, weights, log=True, impl=self.impl,
                                   prune=self.prune, prune_tol=self.prune_tol,
                                   keys_in_order=self.keys_in_order)
        return sharded_kde_density(queries, data, bandwidth, weights, log=True, mesh=self.mesh,
                                   scheme=self.scheme, impl=self.impl)
