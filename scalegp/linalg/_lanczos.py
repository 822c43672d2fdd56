"""Log-determinants and traces from the Lanczos coefficients of an mBCG run.

- Stochastic Lanczos quadrature (Ubaru, Chen & Saad, 2017) on the tridiagonals of an mBCG run
  (Gardner et al., 2018): :func:`lanczos_quadrature`, :func:`slq_logdet`, and
  :func:`solve_and_logdet`, which solves ``A X = Y`` and estimates ``log|A|`` from one call to
  :func:`scalegp.linalg.cg`.
- Hutchinson's estimator of ``tr(A⁻¹ B)`` from the same probes: :func:`hutchinson_trace`.

Everything is matrix-free (``matvec(V (..., n, t)) -> A V``), jit-able and vmap-able.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from jax import lax

from scalegp.linalg._cg import CGResult, LanczosTridiagonal, Matvec, cg
from scalegp.linalg._host import host_call
from scalegp.linalg._preconditioners import (
    DiagonalPreconditioner,
    LowRankPreconditioner,
    Preconditioner,
)

# --------------------------------------------------------------------------------------------
# Stochastic Lanczos quadrature


def lanczos_quadrature(
    tridiagonal: LanczosTridiagonal,
    fn: Callable[[jax.Array], jax.Array] = jnp.log,
    *,
    method: str = "host",
) -> jax.Array:
    """Gauss quadrature ``‖r₀‖² e₁ᵀ f(T) e₁ ≈ r₀ᵀ M^{-1/2} f(M) M^{-1/2} r₀`` per column.

    With the eigendecomposition ``T = V diag(θ) Vᵀ`` of each tridiagonal (its valid block)::

        e₁ᵀ f(T) e₁ = Σₖ V₀ₖ² f(θₖ).

    For mBCG with preconditioner ``P`` the operator is ``M = P^{-1/2} A P^{-1/2}`` and the weight
    ``‖r₀‖² = r₀ᵀ P⁻¹ r₀``.

    Args:
      tridiagonal: from ``cg(..., return_lanczos=True).lanczos``, fields ``(..., t, m)``.
      fn: elementwise spectral function; ``jnp.log`` for log-determinants.
      method: how the small eigenproblems are solved.
        ``"host"`` (default): LAPACK's tridiagonal solver (``scipy.linalg.eigh_tridiagonal``,
        ``O(s²)`` for a valid length ``s``) through ``jax.pure_callback``, on each column's valid
        block only. Works under ``jit`` and ``vmap``; costs one small host transfer on GPUs.
        A program with it is not kept in JAX's persistent compilation cache.
        ``"dense"``: ``jnp.linalg.eigh`` of the padded ``m×m`` matrices inside the graph,
        ``O(t m³)`` whatever the valid lengths, for backends without host callbacks.

    Returns:
      ``(..., t)``.
    """
    ritz_values, weights = _ritz_nodes(tridiagonal, method)
    # Zero-weight nodes (the padding) may sit where fn is undefined; they must not leak NaNs.
    has_weight = weights > 0
    values = jnp.where(has_weight, fn(jnp.where(has_weight, ritz_values, 1.0)), 0.0)
    return tridiagonal.start_norm_sq * jnp.sum(weights * values, axis=-1)


def _ritz_nodes(tridiagonal: LanczosTridiagonal, method: str) -> tuple[jax.Array, jax.Array]:
    """Ritz values ``θ`` and Gauss weights ``V₀ₖ²``, ``(..., m)`` each; zero weight on padding."""
    if method == "dense":
        # The padding is an identity block decoupled from the valid one: its eigenvectors have
        # no weight on e₁ (see LanczosTridiagonal.dense).
        ritz_values, ritz_vectors = jnp.linalg.eigh(tridiagonal.dense())
        return ritz_values, ritz_vectors[..., 0, :] ** 2
    if method == "host":
        like = jax.ShapeDtypeStruct(tridiagonal.diag.shape, tridiagonal.diag.dtype)
        return host_call(_ritz_nodes_numpy, (like, like), tridiagonal.diag,
                         tridiagonal.offdiag, tridiagonal.num_steps)
    raise ValueError(f"method must be 'host' or 'dense', got {method!r}")


def _ritz_nodes_numpy(diag, offdiag, num_steps):
    diag, offdiag, num_steps = (np.asarray(t) for t in (diag, offdiag, num_steps))
    ritz_values = np.ones_like(diag)
    weights = np.zeros_like(diag)
    flat_values = ritz_values.reshape(-1, diag.shape[-1])
    flat_weights = weights.reshape(-1, diag.shape[-1])
    for i, (d, e, s) in enumerate(
        zip(diag.reshape(flat_values.shape), offdiag.reshape(flat_values.shape), num_steps.ravel())
    ):
        if s > 0:
            flat_values[i, :s], first_row = _tridiagonal_eigh(d[:s], e[: s - 1])
            flat_weights[i, :s] = first_row**2
    return ritz_values, weights


def _tridiagonal_eigh(d: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues and first eigenvector components; never raises (exceptions inside a
    ``pure_callback`` are undefined behaviour), falling back to dense LAPACK, then to NaN."""
    try:
        values, vectors = scipy.linalg.eigh_tridiagonal(d, e)
    except (np.linalg.LinAlgError, ValueError):
        try:
            values, vectors = np.linalg.eigh(np.diag(d) + np.diag(e, 1) + np.diag(e, -1))
        except np.linalg.LinAlgError:
            return np.full_like(d, np.nan), np.full_like(d, np.nan)
    return values, vectors[0]


def slq_logdet(
    tridiagonal: LanczosTridiagonal,
    preconditioner_logdet: float | jax.Array = 0.0,
    *,
    method: str = "host",
) -> jax.Array:
    """Stochastic Lanczos quadrature of ``log|A|`` from probe columns ``zᵢ ~ N(0, P)``::

        log|A| = log|P| + tr log(P^{-1/2} A P^{-1/2})
               ≈ log|P| + (1/t) Σᵢ ‖zᵢ‖²_{P⁻¹} e₁ᵀ log(Tᵢ) e₁.

    The probes must have been solved by :func:`scalegp.linalg.cg` with ``x0 = None`` and the same
    ``P``; pass only their columns (e.g. ``result.lanczos[..., 1:]``).

    ``method`` is that of :func:`lanczos_quadrature`.

    Returns:
      ``(...)``, the estimate; its standard error over probes shrinks as ``1/√t``.
    """
    quadrature = lanczos_quadrature(tridiagonal, jnp.log, method=method)
    return preconditioner_logdet + jnp.mean(quadrature, axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SolveLogdetResult:
    """Outcome of :func:`solve_and_logdet`.

    Attributes:
      solution: ``(..., n, s)``, ``A⁻¹ Y``.
      logdet: ``(...)``, SLQ estimate of ``log|A|``.
      probes: ``(..., n, t)``, the probes ``zᵢ ~ N(0, P)``.
      probe_solutions: ``(..., n, t)``, ``A⁻¹ zᵢ`` (for :func:`hutchinson_trace`).
      cg: the :class:`CGResult` of the joint solve ``[Y, z₁ … z_t]`` (convergence diagnostics).
    """

    solution: jax.Array
    logdet: jax.Array
    probes: jax.Array
    probe_solutions: jax.Array
    cg: CGResult


def solve_and_logdet(
    matvec: Matvec,
    y: jax.Array,
    key: jax.Array,
    *,
    num_probes: int = 10,
    preconditioner: Preconditioner | None = None,
    tol: float | jax.Array = 1e-6,
    max_iter: int = 1000,
    quadrature_method: str = "host",
) -> SolveLogdetResult:
    """Solve ``A X = Y`` and estimate ``log|A|`` with one mBCG run on ``[Y, z₁ … z_t]``.

    Args:
      matvec: ``V (..., n, t) -> A V``, ``A`` symmetric positive definite.
      y: ``(..., n, s)`` right-hand sides.
      key: PRNG key for the probes ``zᵢ ~ N(0, P)``.
      num_probes: ``t``.
      preconditioner: ``P`` (solve, logdet, sample); None for ``P = I``.
      tol, max_iter: as in :func:`scalegp.linalg.cg`, for all columns. The quadrature is only as
        accurate as the Krylov space the probes built: stop them early and ``log|A|`` is biased.
      quadrature_method: ``method`` of :func:`lanczos_quadrature`.

    Returns:
      :class:`SolveLogdetResult`.
    """
    if preconditioner is None:
        preconditioner = DiagonalPreconditioner(jnp.ones(y.shape[:-1], y.dtype))
    probes = preconditioner.sample(key, num_probes).astype(y.dtype)
    probes = jnp.broadcast_to(probes, y.shape[:-1] + (num_probes,))
    num_targets = y.shape[-1]
    result = cg(
        matvec,
        jnp.concatenate([y, probes], axis=-1),
        preconditioner=preconditioner,
        tol=tol,
        max_iter=max_iter,
        return_lanczos=True,
    )
    logdet = slq_logdet(
        result.lanczos[..., num_targets:], preconditioner.logdet(), method=quadrature_method
    )
    return SolveLogdetResult(
        solution=result.solution[..., :num_targets],
        logdet=logdet,
        probes=probes,
        probe_solutions=result.solution[..., num_targets:],
        cg=result,
    )


def hutchinson_trace(
    matvec_b: Matvec,
    probes: jax.Array,
    probe_solutions: jax.Array,
    preconditioner: Preconditioner | None = None,
    *,
    diag_b: jax.Array | None = None,
) -> jax.Array:
    """Hutchinson estimate of ``tr(A⁻¹ B)`` from probes ``zᵢ ~ N(0, P)`` and ``A⁻¹ zᵢ``::

        tr(A⁻¹ B) ≈ (1/t) Σᵢ (A⁻¹ zᵢ)ᵀ B (P⁻¹ zᵢ),

    unbiased because ``E[zzᵀ] = P``. The probes of :func:`solve_and_logdet` serve both its
    log-determinant and this trace, as the GP marginal-likelihood gradient needs
    (``B = ∂A/∂θ``). Its variance is ``2 ‖sym M‖²_F / t`` with ``M = P^{1/2} A⁻¹ B P^{-1/2}``:
    unlike the log-determinant, whose bulk ``log|P|`` is exact, nothing here is computed exactly,
    so the relative error is about ``√(2/t) ‖M‖_F / |tr M|`` (figures for a GP gradient in
    docs/decisions.md #15).

    With ``diag_b`` and a :class:`~scalegp.linalg.LowRankPreconditioner`, the preconditioner is a
    control variate::

        tr(A⁻¹ B) = tr(P⁻¹ B) + (1/t) Σᵢ (A⁻¹ zᵢ - P⁻¹ zᵢ)ᵀ B (P⁻¹ zᵢ),

    the first term exact (``P⁻¹ = D^{-1/2} (I - Q diag(s²/(1+s²)) Qᵀ) D^{-1/2}``, so it needs
    ``diag(B)`` and ``B`` times the k basis columns, in the same call as the probes). Still
    unbiased; its variance vanishes as ``P → A`` but exceeds the plain estimator's when ``P`` is
    far from ``A``, so use it when preconditioned CG converges in a few iterations.

    Args:
      matvec_b: ``V (..., n, t) -> B V``; ``B`` need not be symmetric.
      probes: ``(..., n, t)``.
      probe_solutions: ``(..., n, t)``, ``A⁻¹ zᵢ``.
      preconditioner: the ``P`` the probes were drawn from; None for ``N(0, I)`` probes.
      diag_b: ``(..., n)``, the diagonal of ``B``: turns on the control variate (needs a
        :class:`~scalegp.linalg.LowRankPreconditioner`).

    Returns:
      ``(...)``.
    """
    whitened = probes if preconditioner is None else preconditioner.solve(probes)
    if diag_b is None:
        return jnp.mean(jnp.sum(probe_solutions * matvec_b(whitened), axis=-2), axis=-1)
    if not isinstance(preconditioner, LowRankPreconditioner):
        raise TypeError(
            "diag_b (the control variate) needs the LowRankPreconditioner the probes were drawn "
            f"from, got {type(preconditioner).__name__}; pass diag_b=None for the plain estimator"
        )
    t = probes.shape[-1]
    inv_sqrt_noise = lax.rsqrt(preconditioner.noise)
    scaled_basis = preconditioner.basis * inv_sqrt_noise[..., None]
    products = matvec_b(jnp.concatenate([whitened, scaled_basis], axis=-1))
    shrink = preconditioner.scaled_eigenvalues / (1.0 + preconditioner.scaled_eigenvalues)
    exact = jnp.sum(diag_b / preconditioner.noise, axis=-1) - jnp.sum(
        shrink * jnp.sum(scaled_basis * products[..., t:], axis=-2), axis=-1)
    residual = jnp.sum((probe_solutions - whitened) * products[..., :t], axis=-2)
    return exact + jnp.mean(residual, axis=-1)
