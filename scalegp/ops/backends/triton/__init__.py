"""The Triton backend: fused Pallas kernels compiled by Triton on a GPU (a grid over query
tiles, a loop over key tiles, float32 accumulators, backward passes as two tiled kernels, the
pruned products over visit lists); on a CPU they run in interpret mode (tests). ``impl="auto"``
takes it on a GPU in float32; ``impl="pallas"`` means it there.

Modules: `_blocks` (tiles, launch parameters `TritonLaunch`, matmul precision, BlockSpecs),
`_rbf` (the RBF's K v and the KDE's log-sum-exp), `_expression` (kernel expressions),
`_pruned` with `_pruned_mv` and `_pruned_lse` (the pruned RBF products).

Library-internal (no ``__all__``): users reach it through `scalegp.ops`.
"""

from scalegp.ops._interface import Backend, PrunedCore, RbfCore, fused_expression_cores
from scalegp.ops._kernels import RBF
from scalegp.ops.backends.triton import _expression, _pruned, _rbf
from scalegp.ops.backends.triton._blocks import PRECISION, TritonLaunch
from scalegp.ops.backends.triton._pruned_lse import pruned_kernel_logsumexp
from scalegp.ops.backends.triton._pruned_mv import pruned_kernel_mv


def block_sizes(family, n, m, d):
    del n, m
    return {"rbf": _rbf.default_block_sizes, "pruned": _pruned.default_block_sizes,
            "expression": _expression.default_block_sizes}[family](d)


def rbf_cores(plan, direct: bool) -> RbfCore:
    bs, interpret = plan.blocks, plan.interpret
    lse = _rbf.kernel_logsumexp_differences if direct else _rbf.kernel_logsumexp
    return RbfCore(
        mv=lambda a, b, v: _rbf.kernel_mv(a, b, v, block_sizes=bs, interpret=interpret),
        lse=lambda a, b, w: lse(a, b, w, block_sizes=bs, interpret=interpret),
        mv_bwd=lambda a, b, v, g: _rbf.kernel_mv_bwd((a, b, v), (), g, bs, interpret),
        lse_pair=lambda a, b, w: _rbf.lse_forward(a, b, w, bs, interpret, direct),
        lse_bwd=lambda a, b, w, f_max, f_log_sum, g: _rbf.lse_backward(
            a, b, w, f_max, f_log_sum, g, bs, interpret, direct),
    )


def pruned_core(plan) -> PrunedCore:
    bs, interpret = plan.blocks, plan.interpret
    block = _pruned.check_block_sizes(bs)

    def mv(x, y, v, inv_scale, tol, profile):
        if profile != RBF.profile:  # the products ask "pruned_profiles" first
            raise ValueError("the Triton pruned kernels take the RBF only")
        return pruned_kernel_mv(x, y, v, inv_scale, tol, bs, interpret)

    def lse(x, y, w, inv_scale, tol):
        return pruned_kernel_logsumexp(x, y, w, inv_scale, tol, bs, interpret)

    return PrunedCore(block, mv, lse)


BACKEND = Backend(
    name="triton",
    compiles_on=frozenset({"gpu"}),
    interprets_on=frozenset({"cpu"}),
    fused=True,
    auto_on=frozenset({"gpu"}),
    auto_dtypes=("float32",),
    capabilities=frozenset({"expression", "backward", "differences", "pruned", "mesh",
                            "row_independent", "memory_linear", "float64"}),
    precision=PRECISION,
    tiles=block_sizes,
    rbf=rbf_cores,
    expression=fused_expression_cores(_expression.expression_mv,
                                      _expression.expression_mv_bwd),
    pruned=pruned_core,
    compiler="Triton",
)
