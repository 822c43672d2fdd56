"""Matrix-free iterative linear algebra on any SPD operator given as ``matvec(V (..., n, t))``.

- :func:`cg`: batched preconditioned conjugate gradients with Lanczos coefficients (mBCG).
- :func:`pivoted_cholesky`, :class:`LowRankPreconditioner`, :class:`DiagonalPreconditioner`.
- :func:`solve_and_logdet`, :func:`slq_logdet`, :func:`lanczos_quadrature`,
  :func:`hutchinson_trace`: stochastic log-determinants and traces.
"""

from scalegp.linalg.cg import CGResult, LanczosTridiagonal, cg, warn_if_not_converged
from scalegp.linalg.lanczos import (
    SolveLogdetResult,
    hutchinson_trace,
    lanczos_quadrature,
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

__all__ = [
    "CGResult",
    "DiagonalPreconditioner",
    "LanczosTridiagonal",
    "LowRankPreconditioner",
    "PivotedCholesky",
    "Preconditioner",
    "SolveLogdetResult",
    "cg",
    "hutchinson_trace",
    "lanczos_quadrature",
    "pivoted_cholesky",
    "sharded_row",
    "slq_logdet",
    "solve_and_logdet",
    "warn_if_not_converged",
]
