"""Matrix-free iterative linear algebra on any SPD operator given as ``matvec(V (..., n, t))``.

- :func:`cg`: batched preconditioned conjugate gradients with Lanczos coefficients (mBCG).
- :func:`cg_refined`: mixed-precision iterative refinement (float32 CG, float64 residuals).
- :func:`pivoted_cholesky`, :class:`LowRankPreconditioner`, :class:`DiagonalPreconditioner`.
- :func:`solve_and_logdet`, :func:`slq_logdet`, :func:`lanczos_quadrature`,
  :func:`hutchinson_trace`: stochastic log-determinants and traces.
- :func:`lanczos_decomposition`, :func:`love_cache`: LOVE predictive-variance cache.
"""

from scalegp.linalg.cg import CGResult, LanczosTridiagonal, cg, warn_if_not_converged
from scalegp.linalg.lanczos import (
    LanczosDecomposition,
    LoveCache,
    SolveLogdetResult,
    hutchinson_trace,
    lanczos_decomposition,
    lanczos_quadrature,
    love_cache,
    slq_logdet,
    solve_and_logdet,
)
from scalegp.linalg.preconditioners import (
    DiagonalPreconditioner,
    LowRankPreconditioner,
    PivotedCholesky,
    Preconditioner,
    pivoted_cholesky,
    sharded_row,
)
from scalegp.linalg.refine import RefinementResult, cg_refined

__all__ = [
    "CGResult",
    "DiagonalPreconditioner",
    "LanczosDecomposition",
    "LanczosTridiagonal",
    "LoveCache",
    "LowRankPreconditioner",
    "PivotedCholesky",
    "Preconditioner",
    "RefinementResult",
    "SolveLogdetResult",
    "cg",
    "cg_refined",
    "hutchinson_trace",
    "lanczos_decomposition",
    "lanczos_quadrature",
    "love_cache",
    "pivoted_cholesky",
    "sharded_row",
    "slq_logdet",
    "solve_and_logdet",
    "warn_if_not_converged",
]
