"""The backend table: one entry per implementation, and `plan`, the one function that decides,
for a call, the backend, whether Pallas runs interpreted, the tiles, whether keys spread over
many lengthscales may take the coordinate differences, and the tile cores to call. The products
on one device (`_rbf`, `_expression`, the pruned paths) and on a mesh (`_sharded`) all ask it.

What an implementation means, everywhere:

- ``"dense"``: the whole kernel matrix at once, by the distance expansion (the test oracle,
  `_reference`). No tiles to override, no coordinate differences, no pruning. On a mesh, a
  device's shard runs the blocked code in one tile covering all of it (the same dense
  computation, and it gives the ring the (M, L) pairs of its log-sum-exp).
- ``"xla"``: the blocked products (`_xla_rbf`, `_xla_expression`), the CPU default.
- ``"pallas"``: the fused kernels (`_pallas`, `_pallas_expression`, `_pallas_pruning`), compiled
  by Triton on a GPU and run in interpret mode elsewhere.
- ``"auto"``: `auto_config`, decided from the keys alone (row independence).

A new backend is one `Backend` entry in `BACKENDS` (plus its tile module).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from scalegp.ops import (
    _pallas,
    _pallas_expression,
    _pallas_pruning,
    _pallas_pruning_lse,
    _pallas_pruning_mv,
    _pruning,
    _reference,
    _xla_expression,
    _xla_rbf,
)
from scalegp.ops._kernels import DIRECT_MAX_D
from scalegp.ops._prepare import prepare
from scalegp.ops._tiling import FULL_TILE_ROWS, BlockSizes, even_block, round_up

# Height of the xla path's query tile: fixed, so that a row's arithmetic does not depend on how
# many queries share the call. As tall as the tiles large problems had before (512 rows cost the
# kernel product up to a tenth more).
XLA_BLOCK_Q = FULL_TILE_ROWS
XLA_MAX_BLOCK_K = 1024
#: Small batches, up to `XLA_SHORT_ROWS` queries on one device, take query tiles of
#: `XLA_SHORT_BLOCK_Q` rows instead (`short_tiles`), so that one query does not pay for 1,024:
#: where a row's arithmetic in such a tile is that of a full tile, bitwise (the same key tiles in
#: the same order, and per row the same reductions: see `short_tiles`).
XLA_SHORT_BLOCK_Q = 8
XLA_SHORT_ROWS = 64
#: ... and only against key tiles of at least this many rows: against shorter ones XLA's CPU
#: backend reduced a short tile's rows apart from a full tile's (the log-sum-exp and the
#: expressions, rows off by an ulp at 64 to 304 keys; none from 512 in the same sweep).
XLA_SHORT_MIN_BLOCK_K = 512

#: The tile families a plan is made for: the RBF products, the kernel-expression products, and
#: the pruned RBF products.
FAMILIES = ("rbf", "expression", "pruned")


class RbfCore(NamedTuple):
    """The RBF tile products on prepared inputs (``a = (x1 - c) / l``, ``b = (x2 - c) / l``).
    The backward parts are None where autodiff is the backward (the dense oracle)."""

    mv: Callable  # (a, b, v) -> K v, differentiable
    lse: Callable  # (a, b, w) -> log sum_j w_j K_ij, differentiable
    mv_bwd: Callable | None = None  # (a, b, v, g) -> (da, db, dv)
    lse_pair: Callable | None = None  # (a, b, w) -> (M, L), f = M + L (see _xla_rbf.py)
    lse_bwd: Callable | None = None  # (a, b, w, M, L, g) -> (da, db, dw) for f = M + L


class ExpressionCore(NamedTuple):
    """The kernel-expression tile product on centred, unscaled points."""

    mv: Callable  # (kernel, x, y, v) -> K v, differentiable
    mv_bwd: Callable | None = None  # (kernel, x, y, v, g) -> (dkernel, dx, dy, dv)


class PrunedCore(NamedTuple):
    """The pruned RBF path: its tile height, and its tile cores (None: the xla scan's own)."""

    block: int
    mv: Callable | None  # (x, y, v, inv_scale, tol) -> K v
    lse: Callable | None  # (x, y, w, inv_scale, tol) -> log sum_j w_j K_ij


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs for one call; hashable, so it can be a static argument of ``jit``.

    Attributes:
      impl: "dense", "xla" or "pallas" ("auto" resolved).
      family: what the tiles are for (`FAMILIES`).
      blocks: the tile sizes (None: the dense oracle, untiled).
      interpret: Pallas in interpret mode (off a GPU).
      differences: keys spread over many lengthscales may take the coordinate differences
        (xla and pallas, d <= `DIRECT_MAX_D`), chosen at run time by `expansion_or_differences`.
    """

    impl: str
    family: str
    blocks: BlockSizes | None
    interpret: bool
    differences: bool

    @property
    def matern_expansion(self) -> bool:
        """``c · Matern(l, ν)`` may take the hand-written Matérn expansion (`Backend`)."""
        return BACKENDS[self.impl].matern_expansion

    def rbf(self, direct: bool = False) -> RbfCore:
        """The RBF cores; ``direct``: the log-sum-exp's exponents from the coordinate
        differences."""
        return BACKENDS[self.impl].rbf(self, direct)

    def expression(self, direct_weights: bool = False) -> ExpressionCore:
        """The expression cores; ``direct_weights``: on xla, the lengthscale gradients from the
        coordinate differences (`_xla_expression.expression_mv_direct_weights`), accurate at
        short lengthscales; the Pallas tiles take them so anyway."""
        return BACKENDS[self.impl].expression(self, direct_weights)

    def pruned(self) -> PrunedCore:
        return BACKENDS[self.impl].pruned(self)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of the table.

    Attributes:
      name: the ``impl`` value that selects it.
      describe: ``platform -> how it runs there`` (`available_implementations`).
      tiles: ``(family, n, m, d) -> BlockSizes`` its default tiles, n None on one device (a
        shard's queries on a mesh); None: untiled.
      interpreted_off_gpu: runs in interpret mode on every platform but a GPU.
      differences: has coordinate-differences variants for d <= `DIRECT_MAX_D`.
      rbf, expression, pruned: ``(plan, ...) -> cores`` (`Plan.rbf`, `Plan.expression`,
        `Plan.pruned`); pruned None: it does not prune.
      prunes_under_auto: ``prune="auto"`` may prune on it (where its pruned path is timed).
      matern_expansion: ``c · Matern(l, ν)`` takes the hand-written Matérn expansion
        (`scalegp.ops._xla_matern`) on it where the keys allow.
    """

    name: str
    describe: Callable
    tiles: Callable
    interpreted_off_gpu: bool
    differences: bool
    rbf: Callable
    expression: Callable
    pruned: Callable | None = None
    prunes_under_auto: bool = False
    matern_expansion: bool = False


def xla_block_sizes(m: int) -> BlockSizes:
    """The xla path's tiles for ``m`` keys: a fixed query height, keys in near-equal tiles."""
    return BlockSizes(block_q=XLA_BLOCK_Q, block_k=even_block(m, XLA_MAX_BLOCK_K))


def short_tiles(queries: int | None, columns: int | None) -> bool:
    """Whether a one-device xla product of ``queries`` rows (None: unknown, or a batch) against
    ``columns`` value columns (None: a log-sum-exp, which has none) takes query tiles of
    `XLA_SHORT_BLOCK_Q` rows: a small batch (`XLA_SHORT_ROWS`), and a product whose per-row
    arithmetic does not depend on the tile's height. That holds for the log-sum-exp (its row
    reductions are over the key tile) and for one column of values (a matrix-vector product per
    tile, reduced row by row), but not for a product with two or more columns: XLA's CPU matrix
    products split their reduction by the number of rows (rows of 8 to 64 rounded apart from
    rows of 1,024 in a (1024, 1024) x (1024, 2) product), so those keep the full tile, and a
    lone query then pays for 1,024 rows. `plan` takes them against key tiles of
    `XLA_SHORT_MIN_BLOCK_K` rows or more only. tests/ops/test_row_independence.py holds the
    tiles to it at 1, 7, 8, 1023, 1024 and 1025 rows."""
    return (queries is not None and queries <= XLA_SHORT_ROWS
            and (columns is None or columns == 1))


def full_height(blocks: BlockSizes, block_q=None) -> BlockSizes:
    """``blocks`` with the full query tile (`XLA_BLOCK_Q`) unless the caller gave ``block_q``:
    for a tile product that `short_tiles` does not cover, the hand-written Matérn's one-column
    row sums (a reduction that XLA vectorises by the tile's height: rows of a short tile
    rounded apart)."""
    return blocks if block_q is not None else dataclasses.replace(blocks, block_q=XLA_BLOCK_Q)


def _dense_tiles(family, n, m, d):
    # one device: the oracle builds K; a shard on a mesh: one tile of the blocked code
    del family, d
    return None if n is None else BlockSizes(block_q=round_up(n, 8), block_k=round_up(m, 8))


def _dense_rbf(plan, direct):
    if plan.blocks is not None:  # a shard on a mesh: one tile of the blocked code
        return _xla_rbf_cores(plan, direct)
    return RbfCore(mv=_reference.kernel_mv, lse=_reference.kernel_logsumexp)


def _dense_expression(plan, direct_weights):
    if plan.blocks is not None:
        return _xla_expression_cores(plan, direct_weights)
    return ExpressionCore(mv=_reference.expression_mv)


def _xla_rbf_cores(plan, direct):
    bs = plan.blocks
    lse = _xla_rbf.kernel_logsumexp_differences if direct else _xla_rbf.kernel_logsumexp
    return RbfCore(
        mv=lambda a, b, v: _xla_rbf.kernel_mv(a, b, v, block_sizes=bs),
        lse=lambda a, b, w: lse(a, b, w, block_sizes=bs),
        mv_bwd=lambda a, b, v, g: _xla_rbf.kernel_mv_bwd(bs, (a, b, v), g),
        lse_pair=lambda a, b, w: _xla_rbf.lse_forward(a, b, w, bs, direct),
        lse_bwd=lambda a, b, w, f_max, f_log_sum, g: _xla_rbf.lse_backward(
            a, b, w, f_max, f_log_sum, g, bs, direct),
    )


def _xla_expression_cores(plan, direct_weights):
    bs = plan.blocks
    forward = (_xla_expression.expression_mv_direct_weights if direct_weights
               else _xla_expression.expression_mv)
    return ExpressionCore(
        mv=lambda kernel, x, y, v: forward(kernel, x, y, v, bs),
        mv_bwd=lambda kernel, x, y, v, g: _xla_expression.expression_mv_bwd(
            bs, (kernel, x, y, v), g, direct_weights),
    )


def _xla_pruned(plan):
    del plan
    return PrunedCore(_pruning.PRUNE_BLOCK, None, None)


def _pallas_tiles(family, n, m, d):
    del n, m
    return {"rbf": _pallas.default_block_sizes, "pruned": _pallas_pruning.default_block_sizes,
            "expression": _pallas_expression.default_block_sizes}[family](d)


def _pallas_rbf_cores(plan, direct):
    bs, interpret = plan.blocks, plan.interpret
    lse = _pallas.kernel_logsumexp_differences if direct else _pallas.kernel_logsumexp
    return RbfCore(
        mv=lambda a, b, v: _pallas.kernel_mv(a, b, v, block_sizes=bs, interpret=interpret),
        lse=lambda a, b, w: lse(a, b, w, block_sizes=bs, interpret=interpret),
        mv_bwd=lambda a, b, v, g: _pallas.kernel_mv_bwd(bs, interpret, (a, b, v), g),
        lse_pair=lambda a, b, w: _pallas.lse_forward(a, b, w, bs, interpret, direct),
        lse_bwd=lambda a, b, w, f_max, f_log_sum, g: _pallas.lse_backward(
            a, b, w, f_max, f_log_sum, g, bs, interpret, direct),
    )


def _pallas_expression_cores(plan, direct_weights):
    del direct_weights  # the Pallas tiles take the gradients from the differences anyway
    bs, interpret = plan.blocks, plan.interpret
    return ExpressionCore(
        mv=lambda kernel, x, y, v: _pallas_expression.expression_mv(kernel, x, y, v, bs,
                                                                    interpret),
        mv_bwd=lambda kernel, x, y, v, g: _pallas_expression.expression_mv_bwd(
            bs, interpret, (kernel, x, y, v), g),
    )


def _pallas_pruned(plan):
    bs, interpret = plan.blocks, plan.interpret
    block = _pallas_pruning.check_block_sizes(bs)

    def mv(x, y, v, inv_scale, tol):
        return _pallas_pruning_mv.pruned_kernel_mv(x, y, v, inv_scale, tol, bs, interpret)

    def lse(x, y, w, inv_scale, tol):
        return _pallas_pruning_lse.pruned_kernel_logsumexp(x, y, w, inv_scale, tol, bs, interpret)

    return PrunedCore(block, mv, lse)


def _pallas_description(platform):
    if platform == "gpu":
        return "compiled (Triton)"
    return "interpret mode (correct but slow: for tests)"


BACKENDS = {
    "dense": Backend("dense", lambda platform: "compiled", _dense_tiles, False, False,
                     _dense_rbf, _dense_expression),
    "xla": Backend("xla", lambda platform: "compiled", lambda f, n, m, d: xla_block_sizes(m),
                   False, True, _xla_rbf_cores, _xla_expression_cores, _xla_pruned,
                   prunes_under_auto=True, matern_expansion=True),
    "pallas": Backend("pallas", _pallas_description, _pallas_tiles, True, True,
                      _pallas_rbf_cores, _pallas_expression_cores, _pallas_pruned),
}

IMPLEMENTATIONS = tuple(BACKENDS)


def _platform(backend: str | None) -> str:
    return backend or jax.default_backend()


def available_implementations(backend: str | None = None) -> dict[str, str]:
    """Which implementations run on ``backend`` (default: JAX's default backend), and how."""
    platform = _platform(backend)
    return {name: entry.describe(platform) for name, entry in BACKENDS.items()}


def auto_config(m: int, d: int, *, dtype=jnp.float32, backend: str | None = None
                ) -> tuple[str, BlockSizes]:
    """The implementation and tile sizes that ``impl="auto"`` picks for ``m`` keys of ``d``
    features.

    The choice depends on the keys only, never on the number of queries, so that each query
    row's result is bitwise the same in any batch. Hence no dense path under auto: its
    ``(n, m)`` products round differently for different n. Pallas on a GPU in float32, else xla.

    Returns ``(impl, block_sizes)``.
    """
    if _platform(backend) == "gpu" and jnp.dtype(dtype) == jnp.float32:
        return "pallas", _pallas.default_block_sizes(d)
    return "xla", xla_block_sizes(m)


def check_impl(impl) -> None:
    if impl not in IMPLEMENTATIONS + ("auto",):
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS + ('auto',)}, got {impl!r}")


def implementation(impl, m, d, dtype) -> str:
    """"dense", "xla" or "pallas": ``impl`` with "auto" resolved (`auto_config`)."""
    check_impl(impl)
    return auto_config(m, d, dtype=dtype)[0] if impl == "auto" else impl


def overridden(default: BlockSizes, block_q=None, block_k=None, block_o=None) -> BlockSizes:
    """``default`` with the tile sizes the caller gave (None: keep)."""
    overrides = {k: int(v) for k, v in (("block_q", block_q), ("block_k", block_k),
                                        ("block_o", block_o)) if v is not None}
    return BlockSizes(**{**vars(default), **overrides})


def _pruned_overrides(block_q, block_k):
    """The pruned Pallas kernels take one tile height for queries and keys: ``block_k`` (or
    ``block_q`` alone) sets both unless ``block_q`` is given too (then they must agree,
    `_pallas_pruning.check_block_sizes`)."""
    block = block_k if block_k is not None else block_q
    if block is None:
        return None, None
    return (block_q if block_q is not None else block), block


def plan(impl, m: int, d: int, dtype, *, family: str = "rbf", n: int | None = None,
         queries: int | None = None, columns: int | None = None, block_q=None, block_k=None,
         block_o=None, backend: str | None = None) -> Plan:
    """The `Plan` of one call: ``impl`` ("auto" resolved from the keys, `auto_config`) for
    ``m`` keys of ``d`` features in ``dtype``, its tiles for ``family`` with the caller's
    overrides (none for the dense oracle), interpret mode, and whether the coordinate
    differences may run. ``n``: the queries of one shard on a mesh (None on one device).
    ``queries`` and ``columns``: on one device and unbatched, the call's query rows and value
    columns (None for a log-sum-exp), from which the xla path may take short query tiles
    (`short_tiles`); None: the full tile."""
    name = implementation(impl, m, d, dtype)
    entry = BACKENDS[name]
    if family == "pruned":
        block_q, block_k = _pruned_overrides(block_q, block_k)
    blocks = entry.tiles(family, n, m, d)
    if blocks is not None and name != "dense":
        blocks = overridden(blocks, None, block_k, block_o)
        if (name == "xla" and family != "pruned" and short_tiles(queries, columns)
                and blocks.block_k >= XLA_SHORT_MIN_BLOCK_K):
            blocks = dataclasses.replace(blocks, block_q=XLA_SHORT_BLOCK_Q)
        blocks = overridden(blocks, block_q)
    interpret = entry.interpreted_off_gpu and _platform(backend) != "gpu"
    return Plan(name, family, blocks, interpret, entry.differences and d <= DIRECT_MAX_D)


# ----------------------------------------------------------------------------------------------
# the expansion or the differences, at run time


def mean_sq(b):
    """``mean_j |b_j|²`` of prepared keys b (m, d), as one sum over all entries: the per-row
    norms first (`feature_sum`) made XLA's CPU backend reduce d columns of (m, 1) in one YNN
    fusion that cost most of a one-query product (docs/decisions.md #41). It feeds a
    threshold only, so its rounding may differ from the rows' norms."""
    return jnp.sum(b * b) / b.shape[0]


def keys_mean_sq(x2, scaled, batch_shape, dtype):
    """The keys' mean squared norm ``mean_j |b_j|²`` with ``b = scaled(x2)`` (prepared keys),
    the largest over a batch, without gradient: what decides between a product's distance
    expansion and its coordinate differences (`scalegp.ops._xla_rbf.RBF_EXPANSION_MEAN_LIMIT`).
    It depends on the keys alone (row independence) and is one unbatched number, so that a
    ``lax.cond`` on it stays a branch under the engine's ``vmap`` (a batched predicate would
    make it a select, which runs both paths); across a batch the largest chooses for all."""
    keys = x2.astype(dtype)
    if batch_shape:
        keys = jnp.reshape(keys, (-1,) + keys.shape[-2:])
        return lax.stop_gradient(jnp.max(jax.vmap(lambda x2: mean_sq(scaled(x2)))(keys)))
    return lax.stop_gradient(mean_sq(scaled(keys)))


def expansion_ok(b):
    """Whether the RBF's distance expansion is accurate enough for prepared keys b (m, d): their
    mean squared norm (`mean_sq`, no gradient) against `_xla_rbf.RBF_EXPANSION_MEAN_LIMIT`."""
    return lax.stop_gradient(mean_sq(b)) <= _xla_rbf.RBF_EXPANSION_MEAN_LIMIT


def rbf_expansion_ok(x2, lengthscale, batch_shape, dtype):
    """Whether the xla RBF product's distance expansion is accurate enough for these keys
    (`keys_mean_sq` of the keys prepared as `prepare` does, against
    `_xla_rbf.RBF_EXPANSION_MEAN_LIMIT`)."""
    def scaled(x2):
        return prepare(x2[:1], x2, lengthscale)[1]

    return keys_mean_sq(x2, scaled, batch_shape, dtype) <= _xla_rbf.RBF_EXPANSION_MEAN_LIMIT


def expansion_or_differences(ok, expansion, differences, *operands):
    """``expansion(*operands)`` where ``ok`` (a traced boolean, or True: always), else
    ``differences(*operands)``, by ``lax.cond``: only the branch taken runs. The one place the
    products choose between the distance expansion and the coordinate differences."""
    if ok is True:
        return expansion(*operands)
    return lax.cond(ok, expansion, differences, *operands)


def pruning_mode(prune, prune_tol, impl, m, d, dtype, batched, block_q=None, block_k=None):
    """None (no pruning), or ``(always, tol, cores)``: prune unconditionally, or as
    ``prune="auto"`` decides at run time (`_pruning.pruning_pays`); ``cores`` the
    implementation's `PrunedCore` (`Plan.pruned`)."""
    _pruning.check_prune(prune, prune_tol)
    if prune is False:
        return None
    tol = _pruning.default_tolerance(dtype) if prune_tol is None else float(prune_tol)
    resolved = implementation(impl, m, d, dtype)
    pruned = plan(resolved, m, d, dtype, family="pruned", block_q=block_q, block_k=block_k)
    if prune is True:
        if BACKENDS[resolved].pruned is None:
            raise ValueError(
                f"prune=True runs the blocked CPU path or the pruned Pallas kernels, which "
                f"impl={impl!r} does not select here; pass impl='xla' or 'pallas', or "
                "prune=False")
        return True, tol, pruned.pruned()
    # "auto" prunes on the xla path only: the pruned Pallas kernels are untimed on a GPU
    if not BACKENDS[resolved].prunes_under_auto or not _pruning.considered_by_auto(m, d, batched):
        return None
    return False, tol, pruned.pruned()
