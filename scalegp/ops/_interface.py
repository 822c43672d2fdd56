"""What a backend is to the engine, as types: `Backend` (the platforms it runs on, what it can
do, its tiles, launch parameters and matmul precision, its tile cores), the cores it hands the
products (`RbfCore`, `ExpressionCore`, `MaternExpansion`, `PrunedCore`, `PlannedKde`), and the
`Plan` of one call. The list of backends and `plan` are in `scalegp.ops._plan`; each backend is
a sub-package of `scalegp.ops.backends` exporting one `Backend` as ``BACKEND``.

The cores take prepared inputs (centred on the keys' centre; divided by the lengthscale for the
RBF) and are differentiable; ``*_bwd`` fields are their written-out backward passes where the
products need them apart (the mesh schemes), None where autodiff of the forward is the backward
(the dense oracle).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from jax import lax

from scalegp.ops._matmul import MATERN_EXPANSION_MEAN_LIMIT, matern_coordinate_limit
from scalegp.ops._tiling import BlockSizes

#: The platforms a backend may compile or interpret on: JAX's platform names.
PLATFORMS = ("cpu", "gpu", "tpu")

#: What a backend may declare (`Backend.capabilities`); the products and the conformance suite
#: (tests/ops/test_conformance.py) ask these, never a backend's name.
CAPABILITIES = frozenset({
    "expression",          # kernel expressions' K v (every backend has the RBF's K v and KDE)
    "backward",            # written-out backward passes (the mesh schemes need them)
    "differences",         # coordinate-differences tiles for keys spread over many
                           # lengthscales (d <= `scalegp.ops._kernels.DIRECT_MAX_D`)
    "matern_expansion",    # c · Matern(ν = 3/2, 5/2) by a hand-written distance expansion
    "pruned",              # the pruned RBF products over visit lists (`PrunedCore`)
    "pruned_profiles",     # ... for every decaying profile and expression, not only the RBF
    "prunes_under_auto",   # prune="auto" may prune on it (its pruned path was timed)
    "planned_kde",         # the host-planned pruned KDE's scoring (`PlannedKde`)
    "planned_loo",         # ... and its leave-one-out objective (cross-validation)
    "mesh",                # the per-device products of `scalegp.ops.sharded_kernel_mv` & co.
    "row_independent",     # a query row's result is bitwise the same in any batch
    "memory_linear",       # O((n + m)(d + o)) memory forward and backward (tiled)
    "float64",             # float64 inputs computed in float64 (else refused: float32 only)
    "dense_products",      # float32-accurate products of dense operands (`DenseProducts`)
})


class DenseProducts(NamedTuple):
    """Float32-accurate products of 2-D float32 operands, for the layers above the engine (the
    GP's preconditioner and variance cache: `scalegp.ops.dense_products`)."""

    matmul: Callable  # (a (n, k), s (k, t)) -> a @ s
    matmul_tn: Callable  # (a (n, k), b (n, t)) -> aᵀ @ b


class RbfCore(NamedTuple):
    """The RBF tile products on prepared inputs (``a = (x1 - c) / l``, ``b = (x2 - c) / l``)."""

    mv: Callable  # (a, b, v) -> K v, differentiable
    lse: Callable  # (a, b, w) -> log sum_j w_j K_ij, differentiable
    mv_bwd: Callable | None = None  # (a, b, v, g) -> (da, db, dv)
    # (a, b, v, scale) -> K(scale · a, scale · b) v for a scalar scale (the caller's l₀ / l, 1
    # in value), where the backend takes its gradient from the tiles' second moments rather
    # than by the chain rule through da and db (which cancels there: split products)
    scaled_mv: Callable | None = None
    scaled_lse: Callable | None = None  # (a, b, w, scale): `lse` as `scaled_mv` is `mv`
    lse_pair: Callable | None = None  # (a, b, w) -> (M, L), f = M + L
    lse_bwd: Callable | None = None  # (a, b, w, M, L, g) -> (da, db, dw) for f = M + L


class MaternExpansion(NamedTuple):
    """A hand-written ``K v`` of one Matérn profile (ν = 3/2 or 5/2) by the distance expansion,
    on points centred and divided by ``l / √(2ν)``, and the limits of its accuracy: the keys'
    mean squared norm per ν (``mean_limit``) and the coordinates' bound (``coordinate_limit(d,
    dtype)``) under which it may run."""

    # (a, b, v, nu, scale) -> K(scale · a, scale · b) v, differentiable; ``scale`` a scalar
    # (the caller's l₀ / l, 1 in value) through which a scalar lengthscale's gradient flows
    mv: Callable
    mean_limit: dict
    coordinate_limit: Callable


class ExpressionCore(NamedTuple):
    """The kernel-expression tile product on centred, unscaled points."""

    mv: Callable  # (kernel, x, y, v) -> K v, differentiable
    mv_bwd: Callable | None = None  # (kernel, x, y, v, g) -> (dkernel, dx, dy, dv)
    matern: MaternExpansion | None = None  # where "matern_expansion" is declared


def fused_expression_cores(expression_mv, expression_mv_bwd, matern_mv=None) -> Callable:
    """`Backend.expression` of a fused backend whose expression kernels take the plan's tiles
    and interpret flag, ``expression_mv(kernel, x, y, v, blocks, interpret)`` and
    ``expression_mv_bwd((kernel, x, y, v), (), g, blocks, interpret)``; they take the
    gradients from the coordinate differences whatever ``direct_weights`` says. Where given,
    ``matern_mv(a, b, v, nu, scale, blocks, interpret)`` is its hand-written Matérn
    (`MaternExpansion`, with the expansion's limits of `scalegp.ops._matmul`)."""

    def cores(plan, direct_weights: bool) -> ExpressionCore:
        del direct_weights
        bs, interpret = plan.blocks, plan.interpret
        matern = None if matern_mv is None else MaternExpansion(
            mv=lambda a, b, v, nu, scale: matern_mv(a, b, v, nu, scale, bs, interpret),
            mean_limit=MATERN_EXPANSION_MEAN_LIMIT,
            coordinate_limit=matern_coordinate_limit)
        return ExpressionCore(
            mv=lambda kernel, x, y, v: expression_mv(kernel, x, y, v, bs, interpret),
            mv_bwd=lambda kernel, x, y, v, g: expression_mv_bwd((kernel, x, y, v), (), g, bs,
                                                                interpret),
            matern=matern,
        )

    return cores


class PrunedCore(NamedTuple):
    """The pruned products on raw coordinates in k-d order (`scalegp.ops.pruning`): the tile
    height and the cores over ordered tiles.

    ``mv(x, y, v, inv_scale, tol, profile)``: x (tq, block_q, d), y (tk, block, d), v (tk,
    block, o) -> (tq, block_q, o); ``lse(x, y, w, inv_scale, tol)`` -> (tq, block_q). With
    ``query_block`` the query tiles' height may differ from the keys' (the KDE's sparse
    queries take shorter ones, `scalegp.ops.pruning.query_block`); without, it is the keys'.
    ``expression``: for "pruned_profiles", ``(kernel, product, always, tol, keys_in_order,
    self_product, block) -> single(x1, x2, v)`` and its ``auto_keys(kernel, b, tol,
    keys_in_order, block)``, the pruned product of any decaying expression."""

    block: int
    mv: Callable
    lse: Callable
    query_block: bool = False
    expression: Callable | None = None
    expression_auto_keys: Callable | None = None


class PlannedKde(NamedTuple):
    """The host-planned pruned KDE: ``density(data, weights, scale, block, order, interpret)``
    builds the data's k-d order and tile tree once (a `scalegp.ops.pruning.PlannedDensity`:
    ``log_density``, ``loo_log_density`` where "planned_loo" is declared, and ``pays``);
    ``block(d)`` its tile height; ``reach_gate(data, bandwidth, tol)`` the cheap test before
    building it (prune="auto")."""

    density: Callable
    block: Callable
    reach_gate: Callable


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: what it declares and the cores it gives a `Plan`.

    Attributes:
      name: the ``impl`` value that selects it.
      compiles_on: platforms it compiles on.
      interprets_on: platforms where it runs in interpret mode (correct, slow: for tests).
      fused: its kernels are the platform's fused ones: ``impl="pallas"`` selects it where it
        compiles (or, where no fused backend compiles, where it interprets).
      auto_on: platforms where ``impl="auto"`` may pick it, for keys in ``auto_dtypes``.
      capabilities: a subset of `CAPABILITIES`.
      precision: its float32 matmul precision (a policy: full float32 on CPU and GPU).
      tiles: ``(family, n, m, d) -> BlockSizes or None``, its default tiles (n None on one
        device, a shard's rows on a mesh); None: untiled (the dense oracle).
      shorten: ``(blocks, queries, columns) -> blocks``, the tiles of a small unbatched call
        of ``queries`` rows and ``columns`` value columns (None for a log-sum-exp), where its
        rows round as in a full tile; None: the same tiles at every size.
      rbf, expression: ``(plan, variant) -> core`` (`Plan.rbf`, `Plan.expression`).
      pruned: ``plan -> PrunedCore``, where "pruned" is declared.
      planned: the `PlannedKde`, where "planned_kde" is declared.
      dense: its `DenseProducts`, where "dense_products" is declared (compiled only: taken
        where the backend compiles).
      compiler: what compiles its kernels, where it names one ("Triton", "Mosaic"): the
        backend's line in `scalegp.ops.available_implementations` (`describe`).
    """

    name: str
    compiles_on: frozenset
    capabilities: frozenset
    tiles: Callable
    rbf: Callable
    expression: Callable
    interprets_on: frozenset = frozenset()
    fused: bool = False
    auto_on: frozenset = frozenset()
    auto_dtypes: tuple = ("float32", "float64")
    precision: Any = lax.Precision.HIGHEST
    shorten: Callable | None = None
    pruned: Callable | None = None
    planned: PlannedKde | None = None
    dense: DenseProducts | None = None
    compiler: str | None = None

    def __post_init__(self):
        unknown = set(self.capabilities) - CAPABILITIES
        if unknown:
            raise ValueError(f"backend {self.name!r} declares unknown capabilities "
                             f"{sorted(unknown)}; known: {sorted(CAPABILITIES)}")
        for field in ("compiles_on", "interprets_on", "auto_on"):
            if not set(getattr(self, field)) <= set(PLATFORMS):
                raise ValueError(f"backend {self.name!r}: {field} must name platforms of "
                                 f"{PLATFORMS}, got {sorted(getattr(self, field))}")
        if ("pruned" in self.capabilities) != (self.pruned is not None):
            raise ValueError(f"backend {self.name!r}: 'pruned' declared without a pruned core, "
                             "or the reverse")
        if ("planned_kde" in self.capabilities) != (self.planned is not None):
            raise ValueError(f"backend {self.name!r}: 'planned_kde' declared without a "
                             "PlannedKde, or the reverse")
        if ("dense_products" in self.capabilities) != (self.dense is not None):
            raise ValueError(f"backend {self.name!r}: 'dense_products' declared without "
                             "DenseProducts, or the reverse")
        if "planned_loo" in self.capabilities and "planned_kde" not in self.capabilities:
            raise ValueError(f"backend {self.name!r}: 'planned_loo' declared without "
                             "'planned_kde'")

    def can(self, capability: str) -> bool:
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}; known: {sorted(CAPABILITIES)}")
        return capability in self.capabilities

    def runs_on(self, platform: str) -> bool:
        return platform in self.compiles_on or platform in self.interprets_on

    def describe(self, platform: str) -> str:
        """How it runs on ``platform`` (where it `runs_on` it)."""
        if platform not in self.compiles_on:
            return "interpret mode (correct but slow: for tests)"
        return f"compiled ({self.compiler})" if self.compiler else "compiled"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs for one call; hashable, so it can be a static argument of ``jit``.

    Attributes:
      backend: the `Backend` ("auto" and "pallas" resolved).
      family: what the tiles are for (`scalegp.ops._plan.FAMILIES`).
      blocks: the tile sizes (None: untiled).
      full_blocks: the tile sizes before a small call's shortening (`Backend.shorten`).
      interpret: the backend runs in interpret mode on this platform.
      differences: keys spread over many lengthscales may take the coordinate differences
        ("differences" declared, d <= `scalegp.ops._kernels.DIRECT_MAX_D`), chosen at run
        time (`scalegp.ops._plan.expansion_or_differences`).
    """

    backend: Backend
    family: str
    blocks: BlockSizes | None
    interpret: bool
    differences: bool
    full_blocks: BlockSizes | None = None

    @property
    def impl(self) -> str:
        return self.backend.name

    def can(self, capability: str) -> bool:
        return self.backend.can(capability)

    def rbf(self, direct: bool = False) -> RbfCore:
        """The RBF cores; ``direct``: the log-sum-exp's exponents from the coordinate
        differences."""
        return self.backend.rbf(self, direct)

    def expression(self, direct_weights: bool = False) -> ExpressionCore:
        """The expression cores; ``direct_weights``: the lengthscale gradients from the
        coordinate differences, accurate at short lengthscales (backends whose tiles take them
        so anyway ignore it)."""
        return self.backend.expression(self, direct_weights)

    def pruned(self) -> PrunedCore:
        if self.backend.pruned is None:
            raise ValueError(f"backend {self.impl!r} has no pruned products")
        return self.backend.pruned(self)
