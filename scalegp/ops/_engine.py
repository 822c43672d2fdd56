"""`Engine`: where and how gp and kde run the kernel reductions: the implementation, and one
device or a mesh with a scheme for the keys. The one door from the models into ops, so that no
model branches on ``mesh is None`` or carries ``impl, mesh, scheme`` through its signatures."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalegp.ops._expression import auto_prunes, kernel_mv
from scalegp.ops._plan import backend_of, check_impl, plan
from scalegp.ops._rbf import rbf_kde_density
from scalegp.ops.pruning import (
    check_prune,
    default_tolerance,
    host_kd_order,
    worth_ordering,
)
from scalegp.ops.sharding import (
    as_mesh,
    check_scheme,
    sharded_expression_mv,
    sharded_kde_density,
)


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

    def orders_keys(self, m: int, d: int, dtype) -> bool:
        """Whether a model with ``m`` keys of ``d`` features in ``dtype`` should keep them in
        `scalegp.ops.spatial_order` for this engine: when it may prune them (``prune=True``,
        or "auto" at these shapes on a backend whose products prune under "auto")."""
        if self.mesh is not None or not worth_ordering(self.prune, m, d):
            return False
        return self.prune is True or backend_of(self.impl, dtype).can("prunes_under_auto")

    def rows_independent(self, m: int, d: int, dtype) -> bool:
        """Whether this engine's products against ``m`` keys of ``d`` features in ``dtype``
        give a query row the same bits in a batch of any height: on one device, where the
        backend they run on declares "row_independent"."""
        return self.mesh is None and plan(self.impl, m, d, dtype).can("row_independent")

    def scores_planned(self, m: int, d: int, dtype) -> bool:
        """Whether this engine's KDE scoring of ``m`` keys of ``d`` features in ``dtype`` takes
        the host-planned pruned path when given one: one device, a backend that declares
        "planned_kde", pruning allowed (True, or "auto" at these shapes). Not tied to
        "prunes_under_auto", which is about the in-program pruned products: the Mosaic
        backend plans on the host under "auto" but does not prune in its programs."""
        if self.mesh is not None or not worth_ordering(self.prune, m, d):
            return False
        return backend_of(self.impl, dtype).can("planned_kde")

    def cross_validates_planned(self, m: int, d: int, dtype) -> bool:
        """Whether the KDE's bandwidth cross-validation on ``m`` keys takes the host-planned
        leave-one-out objective (`planned_loo`): `scores_planned`, on a backend that declares
        "planned_loo"."""
        return (self.scores_planned(m, d, dtype)
                and backend_of(self.impl, dtype).can("planned_loo"))

    def _planned(self, dtype):
        """The backend's `scalegp.ops._interface.PlannedKde`."""
        return backend_of(self.impl, dtype).planned

    def _interprets(self, m: int, d: int, dtype) -> bool:
        """Whether the backend's kernels run in interpret mode on this platform."""
        return plan(self.impl, m, d, dtype, family="pruned").interpret

    def planned_kde(self, data, bandwidth, weights=None, order=None, built=None):
        """The KDE's data (m, d) in k-d order with their tile tree (the backend's
        `PlannedKde.density`, at ``bandwidth``'s ratios across features, tiles of its
        ``block(d)``), built once for every later scoring (`kde_planned_log_density`), or None
        where this engine scores otherwise: `scores_planned` is False, or ``prune="auto"``
        finds that pruning does not pay for these data at this bandwidth (its ``reach_gate``,
        then the density's ``pays``: the in-jit path's test, decided from the keys and
        bandwidth alone, here once). Host code, not under jit; ``weights`` (m,) >= 0 or None;
        ``order``: optional (m,) permutation of the rows in k-d order (a cross-validation's,
        the density's ``order``), used instead of ordering them again; ``built``: a density
        already built on these data and weights (the cross-validation's `planned_loo`),
        returned instead of a new one under the same test (its gate has nothing left to save)."""
        data = np.asarray(data)  # host data: the density is built on the host
        (m, d), dtype = data.shape, jax.dtypes.canonicalize_dtype(data.dtype)
        if not self.scores_planned(m, d, dtype):
            return None
        tol = default_tolerance(dtype) if self.prune_tol is None else self.prune_tol
        bandwidth = np.asarray(bandwidth, dtype)
        kind = self._planned(dtype)
        if built is None:
            if self.prune == "auto" and not bool(kind.reach_gate(data, bandwidth, tol)):
                return None
            built = kind.density(data, weights, bandwidth, block=kind.block(d), order=order,
                                 interpret=self._interprets(m, d, dtype))
        if self.prune == "auto" and not built.pays(data, bandwidth, tol):
            return None
        return built

    def planned_order(self, data, scale) -> np.ndarray | None:
        """(m,) the rows of ``data`` (m, d) in the k-d order of `planned_kde`'s tiles at
        bandwidths of ``scale``'s ratios across features (a scalar: any scalar bandwidth), or
        None where this engine does not score on the planned path: host numpy, no program,
        safe in a thread, so that a fit can make it while its cross-validation runs and pass it
        as `planned_kde`'s ``order``."""
        data = np.asarray(data)
        (m, d), dtype = data.shape, jax.dtypes.canonicalize_dtype(data.dtype)
        if not self.scores_planned(m, d, dtype):
            return None
        perm = host_kd_order(data, scale, self._planned(dtype).block(d))
        return perm[perm < m]

    def planned_loo(self, data, weights, scale):
        """The data (m, d) in k-d order (at ``scale``'s ratios across features) with their tile
        tree, for the leave-one-out objective of bandwidth cross-validation
        (its ``loo_log_density``, every bandwidth reusing them): host code, for an engine
        whose `cross_validates_planned` holds."""
        data = jnp.asarray(data)
        (m, d), dtype = data.shape, data.dtype
        kind = self._planned(dtype)
        return kind.density(data, jnp.asarray(weights, dtype), scale, block=kind.block(d),
                            interpret=self._interprets(m, d, dtype))

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

    def kernel_columns(self, x, keys, kernel):
        """``K(x, keys)``: (n, d), (k, d) -> (n, k), a few kernel columns (a pivoted
        Cholesky's, one key at a time) on this device whatever the mesh, so that a caller
        may run it per device: the GP preconditioner's shard-wise build calls it inside
        ``shard_map`` on its own rows. The dense product (``K I``), whatever ``impl``: a tiled
        backend would pad the few keys to a whole tile, and there is nothing to prune."""
        eye = jnp.eye(keys.shape[0], dtype=x.dtype)
        return kernel_mv(kernel, x, keys, eye, impl="dense", prune=False)
