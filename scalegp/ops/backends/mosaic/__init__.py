"""The Mosaic backend: fused Pallas kernels compiled by Mosaic on a TPU (a grid of query tiles
by key tiles, the keys streamed through VMEM, running sums in VMEM scratch, float32 accuracy
from split bfloat16 matrix-unit passes); on a CPU they run in interpret mode (tests).
``impl="auto"`` and ``impl="pallas"`` take it on a TPU; "mosaic" names it.

Modules: `_blocks` (tiles and parameters `MosaicParams`, compiler parameters, the split
bfloat16 products, the tile exponents), `_rbf` (the RBF's K v and the KDE's log-sum-exp; the
smooth Matérn's K v, the same kernels with another profile),
`_expression` (any kernel expression), `_pruned` (the RBF's pruned products over
scalar-prefetched visit lists, planned in the program: ``prune=True``; ``prune="auto"`` does
not take them, since on the chip the unpruned kernels were faster on the problems timed:
docs/decisions.md #48), `_planned` (the KDE's scoring over visit lists planned on the host,
`scalegp.ops.pruning.PlannedDensity`'s passes), `_dense` (float32-accurate products of dense
operands, which compile far faster than XLA's ``HIGHEST`` dots for a TPU).

Library-internal (no ``__all__``): users reach it through `scalegp.ops`.
"""

import functools

from scalegp.ops._interface import (
    Backend,
    DenseProducts,
    PlannedKde,
    RbfCore,
    fused_expression_cores,
)
from scalegp.ops._matmul import MATERN_EXPANSION_MEAN_LIMIT, RBF_EXPANSION_MEAN_LIMIT
from scalegp.ops._tiling import BlockSizes
from scalegp.ops.backends.mosaic import _dense, _expression, _planned, _pruned, _rbf
from scalegp.ops.backends.mosaic._blocks import LSE_EXPANSION_MEAN_LIMIT, distances, either
from scalegp.ops.pruning import reach_gate

#: The expressions' tiles: a tile's VJP and tangents keep several (block_q, block_k) arrays
#: live, so smaller than the RBF's.
EXPRESSION_BLOCKS = BlockSizes(block_q=256, block_k=1024)


def block_sizes(family, n, m, d):
    del n, m
    if family == "pruned":
        return _pruned.default_block_sizes(d)
    return EXPRESSION_BLOCKS if family == "expression" else _rbf.default_block_sizes(d)


def rbf_cores(plan, direct: bool) -> RbfCore:
    del direct  # the kernels choose the differences themselves (`_blocks.distances`)
    bs, interpret = plan.blocks, plan.interpret

    def chosen(fn, limit=RBF_EXPANSION_MEAN_LIMIT):
        return lambda a, b, *rest: either(distances(bs, b, limit), fn, a, b, *rest, bs,
                                          interpret)

    def lse_chosen(fn):
        return chosen(fn, LSE_EXPANSION_MEAN_LIMIT)

    def mv_bwd(a, b, v, g):
        return either(distances(bs, b), _rbf.kernel_mv_bwd, (a, b, v), (), g, bs, interpret)

    def lse_bwd(a, b, w, f_max, f_log_sum, g):
        return either(distances(bs, b, LSE_EXPANSION_MEAN_LIMIT), _rbf.lse_backward, a, b, w,
                      f_max, f_log_sum, g, bs, interpret)

    return RbfCore(mv=chosen(_rbf.kernel_mv), lse=lse_chosen(_rbf.kernel_logsumexp),
                   mv_bwd=mv_bwd, lse_pair=lse_chosen(_rbf.lse_forward), lse_bwd=lse_bwd,
                   scaled_mv=chosen(_rbf.scaled_kernel_mv),
                   scaled_lse=lse_chosen(_rbf.scaled_logsumexp))


def matern_mv(a, b, v, nu, scale, bs, interpret):
    """A lone Matérn ν = 3/2 or 5/2 on points scaled by ``√(2ν) / l`` (`MaternExpansion`): the
    RBF's kernels with the Matérn's profile, the differences or the expansion chosen as the
    RBF's by the Matérn's own limit; the scale's gradient from the second moments."""
    differences = distances(bs, b, MATERN_EXPANSION_MEAN_LIMIT[nu])
    return either(differences, functools.partial(_rbf.scaled_kernel_mv, nu=nu), a, b, v, scale,
                  bs, interpret)


BACKEND = Backend(
    name="mosaic",
    compiles_on=frozenset({"tpu"}),
    interprets_on=frozenset({"cpu"}),
    fused=True,
    auto_on=frozenset({"tpu"}),
    auto_dtypes=("float32",),
    capabilities=frozenset({"expression", "backward", "matern_expansion", "mesh",
                            "row_independent", "memory_linear", "pruned", "planned_kde",
                            "dense_products"}),
    tiles=block_sizes,
    rbf=rbf_cores,
    expression=fused_expression_cores(_expression.expression_mv,
                                      _expression.expression_mv_bwd, matern_mv),
    pruned=_pruned.pruned_core,
    planned=PlannedKde(density=_planned.PlannedDensity, block=_planned.planned_block,
                       reach_gate=reach_gate),
    dense=DenseProducts(matmul=_dense.matmul, matmul_tn=_dense.matmul_tn),
    compiler="Mosaic",
)
