"""Matrix-free iterative linear algebra on any SPD operator given as ``matvec(V (..., n, t))``.

- :func:`cg`: batched preconditioned conjugate gradients with Lanczos coefficients (mBCG);
  :func:`warn_if_not_converged` reports its columns that missed the tolerance.
- :func:`pivoted_cholesky`, :class:`LowRankPreconditioner`, :class:`DiagonalPreconditioner`.
- :func:`solve_and_logdet`, :func:`slq_logdet`, :func:`lanczos_quadrature`,
  :func:`hutchinson_trace`: stochastic log-determinants and traces.

The implementation modules (``_cg``, ``_lanczos``, ``_preconditioners``) are private; import
from ``scalegp.linalg``.
"""

from scalegp.linalg._cg import CGResult, LanczosTridiagonal, cg, warn_if_not_converged
from scalegp.linalg._lanczos import (
    SolveLogdetResult,
    hutchinson_trace,
    lanczos_quadrature,
    slq_logdet,
    solve_and_logdet,
)
from scalegp.linalg._preconditioners import (
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
