"""`Engine`: where and how gp and kde run the kernel reductions: the implementation, and one
device or a mesh with a scheme for the keys. The one door from the models into ops, so that no
model branches on ``mesh is None`` or carries ``impl, mesh, scheme`` through its signatures."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from scalegp.ops._backends import check_impl, implementation
from scalegp.ops._expression import auto_prunes, kernel_mv
from scalegp.ops._mesh import as_mesh, check_scheme
from scalegp.ops._pruning import check_prune, default_tolerance, worth_ordering
from scalegp.ops._pruning_planned import PlannedDensity, planned_block, reach_gate
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

    def scores_planned(self, m: int, d: int, dtype) -> bool:
        """Whether this engine's KDE scoring of ``m`` keys of ``d`` features in ``dtype`` takes
        the host-planned pruned path (`PlannedDensity`) when given one: one device, the xla
        implementation, pruning allowed (True, or "auto" at these shapes)."""
        return (self.orders_keys(m, d) and implementation(self.impl, m, d, dtype) == "xla")

    def planned_kde(self, data, bandwidth, weights=None, order=None):
        """The KDE's data (m, d) in k-d order with their tile tree (`PlannedDensity`, at
        ``bandwidth``'s ratios across features, tiles of `planned_block`), built once for every
        later scoring (`kde_planned_log_density`), or None where this engine scores otherwise:
        `scores_planned` is False, or ``prune="auto"`` finds that pruning does not pay for these
        data at this bandwidth (`_pruning.reach_allows_pruning`, then `PlannedDensity.pays`: the
        in-jit path's test, decided from the keys and bandwidth alone, here once). Host code,
        not under jit; ``weights`` (m,) >= 0 or None; ``order``: optional (m,) permutation of
        the rows in k-d order (a cross-validation's, `PlannedDensity`'s ``order``), used
        instead of ordering them again."""
        data = jnp.asarray(data)
        (m, d), dtype = data.shape, data.dtype
        if not self.scores_planned(m, d, dtype):
            return None
        tol = default_tolerance(dtype) if self.prune_tol is None else self.prune_tol
        bandwidth = jnp.asarray(bandwidth, dtype)
        if self.prune == "auto" and not bool(reach_gate(data, bandwidth, tol)):
            return None
        planned = PlannedDensity(data, weights, bandwidth, block=planned_block(d), order=order)
        if self.prune == "auto" and not planned.pays(data, bandwidth, tol):
            return None
        return planned

    def planned_loo(self, data, weights, scale):
        """The data (m, d) in k-d order (at ``scale``'s ratios across features) with their tile
        tree, for the leave-one-out objective of bandwidth cross-validation
        (`PlannedDensity.loo_log_density`, every bandwidth reusing them): host code, for an
        engine whose `scores_planned` holds."""
        data = jnp.asarray(data)
        return PlannedDensity(data, jnp.asarray(weights, data.dtype), scale,
                              block=planned_block(data.shape[1]))

    def kde_planned_log_density(self, planned, queries, bandwidth, chunk_rows=None):
        """`kde_log_density` (queries (n, d) -> (n,); None: the data themselves, in their
        tiles, ``chunk_rows`` per plan) against the data of ``planned`` (from `planned_kde`) on
        the host-planned pruned path, each query's skipped mass at most ``prune_tol`` times its
        density. Not under jit."""
        return planned.log_density(bandwidth, queries, self.prune_tol, chunk_rows)

    def kernel_mv(self, x1, x2, v, kernel):
        """``K(x1, x2) v``: (n, d), (m, d), (m, o) -> (n, o) for a `scalegp.ops` kernel
        expression; see `scalegp.ops.kernel_mv`, and with a mesh
        `scalegp.ops.sharded_expression_mv` (``c · RBF`` takes the RBF kernels in both)."""
        if self.mesh is None:
            return kernel_mv(kernel, x1, x2, v, impl=self.impl, prune=self.prune,
                             prune_tol=self.prune_tol, keys_in_order=self.keys_in_order)
        return sharded_expression_mv(kernel, x1, x2, v, mesh=self.mesh, scheme=self.scheme,
                                     impl=self.impl)

    def decided(self, keys, kernel) -> "Engine":
        """This engine for many `kernel_mv` calls against the same ``keys`` (m, d) and
        ``kernel``: ``prune="auto"`` resolved once to True or False (`auto_prunes`), so that
        the calls run the branch "auto" would without testing the keys each time. Host code,
        not under jit."""
        if self.prune != "auto" or self.mesh is not None:
            return self
        return dataclasses.replace(self, prune=auto_prunes(
            kernel, keys, impl=self.impl, prune_tol=self.prune_tol,
            keys_in_order=self.keys_in_order))

    def kde_log_density(self, queries, data, bandwidth, weights):
        """Log of the weighted Gaussian KDE at each query: (n, d), (m, d), h, (m,) -> (n,); see
        `scalegp.ops.rbf_kde_density`."""
        if self.mesh is None:
            return rbf_kde_density(queries, data, bandwidth, weights, log=True, impl=self.impl,
                                   prune=self.prune, prune_tol=self.prune_tol,
                                   keys_in_order=self.keys_in_order)
        return sharded_kde_density(queries, data, bandwidth, weights, log=True, mesh=self.mesh,
                                   scheme=self.scheme, impl=self.impl)
