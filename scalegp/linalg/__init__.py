"""Matrix-free iterative linear algebra on any SPD operator given as ``matvec(V (..., n, t))``.

- :func:`cg`: batched preconditioned conjugate gradients with Lanczos coefficients (mBCG);
  :func:`warn_if_not_converged` reports its columns that missed the tolerance.
- :func:`solve_and_logdet`: a solve and a stochastic log-determinant from one mBCG run.
- :func:`pivoted_cholesky` and :class:`LowRankPreconditioner`; :func:`sharded_row` fetches a row
  of a row-sharded array inside ``shard_map``.
- :func:`small_eigh`: the eigendecomposition of a small symmetric matrix, on the host where the
  platform's own compiles slowly (a TPU).

The implementation modules are private: ``_cg`` (mBCG and its results), ``_lanczos`` (Lanczos
quadrature, SLQ, Hutchinson traces), ``_preconditioners`` (pivoted Cholesky, low-rank and
diagonal preconditioners), ``_host`` (small dense steps on the host CPU through callbacks).
Only what the layers above use is exported; import from ``scalegp.linalg``.
"""

from scalegp.linalg._cg import cg, warn_if_not_converged
from scalegp.linalg._host import small_eigh
from scalegp.linalg._lanczos import solve_and_logdet
from scalegp.linalg._preconditioners import LowRankPreconditioner, pivoted_cholesky, sharded_row

__all__ = [
    "LowRankPreconditioner",
    "cg",
    "pivoted_cholesky",
    "sharded_row",
    "small_eigh",
    "solve_and_logdet",
    "warn_if_not_converged",
]
