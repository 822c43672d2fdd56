"""The xla backend: the products as blocked XLA loops (``lax.scan`` over query tiles and, inside,
over key tiles), memory-linear, with written-out backward passes; the CPU default. It compiles
on every platform; ``impl="auto"`` takes it off a GPU (and on a GPU for float64).

Modules: `_blocks` (the loops, its tiles and matmul precision), `_rbf` (the RBF's K v and the
KDE's log-sum-exp), `_expression` (any kernel expression), `_matern` (the hand-written Matérn
expansion), the pruned products over visit lists `_pruned_mv`, `_pruned_lse`,
`_pruned_expression` on `_pruned_tiles`, and `_planned` (the host-planned pruned KDE).

Library-internal (no ``__all__``): users reach it through `scalegp.ops`.
"""

from scalegp.ops._interface import (
    Backend,
    ExpressionCore,
    MaternExpansion,
    PlannedKde,
    PrunedCore,
    RbfCore,
)
from scalegp.ops._matmul import MATERN_EXPANSION_MEAN_LIMIT, matern_coordinate_limit
from scalegp.ops.backends.xla import (
    _expression,
    _matern,
    _planned,
    _pruned_expression,
    _rbf,
)
from scalegp.ops.backends.xla._blocks import PRECISION, block_sizes, shortened
from scalegp.ops.backends.xla._pruned_lse import pruned_kernel_logsumexp
from scalegp.ops.backends.xla._pruned_mv import pruned_kernel_mv
from scalegp.ops.pruning import PRUNE_BLOCK, reach_gate


def rbf_cores(plan, direct: bool) -> RbfCore:
    bs = plan.blocks
    lse = _rbf.kernel_logsumexp_differences if direct else _rbf.kernel_logsumexp
    return RbfCore(
        mv=lambda a, b, v: _rbf.kernel_mv(a, b, v, block_sizes=bs),
        lse=lambda a, b, w: lse(a, b, w, block_sizes=bs),
        mv_bwd=lambda a, b, v, g: _rbf.kernel_mv_bwd((a, b, v), (), g, bs),
        lse_pair=lambda a, b, w: _rbf.lse_forward(a, b, w, bs, direct),
        lse_bwd=lambda a, b, w, f_max, f_log_sum, g: _rbf.lse_backward(
            a, b, w, f_max, f_log_sum, g, bs, direct),
    )


def expression_cores(plan, direct_weights: bool) -> ExpressionCore:
    bs = plan.blocks
    forward = (_expression.expression_mv_direct_weights if direct_weights
               else _expression.expression_mv)
    full = plan.full_blocks  # the hand-written Matérn's one-column row sums: full tiles only
    return ExpressionCore(
        mv=lambda kernel, x, y, v: forward(kernel, x, y, v, bs),
        mv_bwd=lambda kernel, x, y, v, g: _expression.expression_mv_bwd(
            (kernel, x, y, v), (), g, bs, direct_weights),
        matern=MaternExpansion(
            mv=lambda a, b, v, nu, scale: _matern.matern_mv(a * scale, b * scale, v, nu, full),
            mean_limit=MATERN_EXPANSION_MEAN_LIMIT,
            coordinate_limit=matern_coordinate_limit),
    )


def pruned_core(plan) -> PrunedCore:
    del plan
    return PrunedCore(PRUNE_BLOCK, pruned_kernel_mv, pruned_kernel_logsumexp, query_block=True,
                      expression=_pruned_expression.pruned_product,
                      expression_auto_keys=_pruned_expression.auto_keys)


BACKEND = Backend(
    name="xla",
    compiles_on=frozenset({"cpu", "gpu", "tpu"}),
    auto_on=frozenset({"cpu", "gpu", "tpu"}),
    capabilities=frozenset({
        "expression", "backward", "differences", "matern_expansion", "pruned",
        "pruned_profiles", "prunes_under_auto", "planned_kde", "planned_loo", "mesh",
        "row_independent", "memory_linear", "float64"}),
    precision=PRECISION,
    tiles=block_sizes,
    shorten=shortened,
    rbf=rbf_cores,
    expression=expression_cores,
    pruned=pruned_core,
    planned=PlannedKde(density=_planned.PlannedDensity, block=_planned.planned_block,
                       reach_gate=reach_gate),
)
