"""Batched preconditioned conjugate gradients that also returns Lanczos coefficients (mBCG).

Solves ``A X = B`` for a symmetric positive-definite ``A`` known only through a matrix-free
product ``matvec(V) = A V`` on blocks ``V: (..., n, t)``. All ``t`` right-hand sides advance
together, so each iteration costs exactly one call to ``matvec`` (Gardner et al., 2018,
"GPyTorch: Blackbox Matrix-Matrix Gaussian Process Inference", Algorithm 2).

Every column is an independent preconditioned CG run: only the matvec is shared. Leading
dimensions ``...`` are independent systems too, provided ``matvec`` maps ``(..., n, t)`` to
``(..., n, t)``; ``jax.vmap`` over :func:`cg` works as well.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Matvec = Callable[[jax.Array], jax.Array]


class SupportsSolve(Protocol):
    """Anything with ``solve(V) = P⁻¹ V`` on ``(..., n, t)`` blocks, for example
    :class:`~scalegp.linalg.LowRankPreconditioner` and
    :class:`~scalegp.linalg.DiagonalPreconditioner`."""

    def solve(self, v: jax.Array) -> jax.Array: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LanczosTridiagonal:
    """Symmetric tridiagonal matrices ``T`` (one per column), padded to a static size ``m``.

    Column ``i`` has a valid leading block of size ``num_steps[i]``; entries beyond it are zero.

    Attributes:
      diag: ``(..., t, m)``, ``T_jj``.
      offdiag: ``(..., t, m)``, ``T_{j,j+1}`` at position ``j``; valid for ``j < num_steps - 1``.
      num_steps: ``(..., t)`` int32, size of the valid block.
      start_norm_sq: ``(..., t)``, squared norm of the Lanczos start vector before
        normalisation. For mBCG this is ``r₀ᵀ P⁻¹ r₀`` (``= zᵀ P⁻¹ z`` for a probe ``z`` solved
        from ``x₀ = 0``), the weight of the quadrature ``‖r₀‖² e₁ᵀ f(T) e₁``.
    """

    diag: jax.Array
    offdiag: jax.Array
    num_steps: jax.Array
    start_norm_sq: jax.Array

    def dense(self) -> jax.Array:
        """The padded matrices ``(..., t, m, m)``. Padding is the identity, decoupled from the
        valid block, so it adds eigenvalues 1 whose eigenvectors have no weight on ``e₁``:
        ``e₁ᵀ f(T) e₁`` is that of the valid block alone."""
        m = self.diag.shape[-1]
        steps = jnp.arange(m)
        valid = steps < self.num_steps[..., None]
        coupled = steps < self.num_steps[..., None] - 1
        diag = jnp.where(valid, self.diag, 1.0)
        offdiag = jnp.where(coupled, self.offdiag, 0.0)
        return (
            diag[..., :, None] * jnp.eye(m, dtype=diag.dtype)
            + offdiag[..., :, None] * jnp.eye(m, k=1, dtype=diag.dtype)
            + offdiag[..., None, :] * jnp.eye(m, k=-1, dtype=diag.dtype)
        )

    def __getitem__(self, columns) -> "LanczosTridiagonal":
        """Select right-hand-side columns, e.g. ``tri[..., 1:]`` for the probe columns."""
        if not isinstance(columns, tuple):
            columns = (columns,)
        per_step = columns + (slice(None),)
        return LanczosTridiagonal(
            diag=self.diag[per_step],
            offdiag=self.offdiag[per_step],
            num_steps=self.num_steps[columns],
            start_norm_sq=self.start_norm_sq[columns],
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CGResult:
    """Outcome of :func:`cg`. A pytree: it can be returned from ``jit`` and ``vmap``.

    Attributes:
      solution: ``(..., n, t)``, the iterate ``X``.
      iterations: ``(..., t)`` int32, CG iterations each column took (one matvec each; all
        columns share the matvecs of the slowest one).
      relative_residual: ``(..., t)``, ``‖r‖ / ‖b‖`` for the CG residual recurrence ``r``
        (no extra matvec). It equals ``‖b - A x‖ / ‖b‖`` until the true residual stalls at the
        rounding level of the product, which in float32 can be well above ``tol``; see :func:`cg`.
      converged: ``(..., t)`` bool, ``relative_residual <= tol`` was reached.
      lanczos: :class:`LanczosTridiagonal` of each column when ``return_lanczos=True``, else None.
    """

    solution: jax.Array
    iterations: jax.Array
    relative_residual: jax.Array
    converged: jax.Array
    lanczos: LanczosTridiagonal | None = None


def cg(
    matvec: Matvec,
    b: jax.Array,
    *,
    preconditioner: SupportsSolve | Matvec | None = None,
    x0: jax.Array | None = None,
    tol: float | jax.Array = 1e-6,
    max_iter: int = 1000,
    return_lanczos: bool = False,
) -> CGResult:
    """Preconditioned CG on all columns of ``b`` at once (mBCG).

    For each column ``b`` (with ``r₀ = b - A x₀``, ``z₀ = P⁻¹ r₀``, ``p₀ = z₀``)::

        αⱼ = rⱼᵀzⱼ / pⱼᵀA pⱼ,   xⱼ₊₁ = xⱼ + αⱼ pⱼ,   rⱼ₊₁ = rⱼ - αⱼ A pⱼ,
        zⱼ₊₁ = P⁻¹ rⱼ₊₁,        βⱼ = rⱼ₊₁ᵀzⱼ₊₁ / rⱼᵀzⱼ,   pⱼ₊₁ = zⱼ₊₁ + βⱼ pⱼ,

    until ``‖rⱼ‖ <= tol ‖b‖``. The CG coefficients give the Lanczos tridiagonal of
    ``P^{-1/2} A P^{-1/2}`` started from ``P^{-1/2} r₀`` (Saad, "Iterative Methods for Sparse
    Linear Systems", §6.7.3)::

        T_jj = 1/αⱼ + βⱼ₋₁/αⱼ₋₁   (β₋₁ = 0),      T_{j,j+1} = √βⱼ / αⱼ.

    Args:
      matvec: ``V (..., n, t) -> A V (..., n, t)``; ``A`` symmetric positive definite.
      b: right-hand sides ``(..., n, t)`` (a single one is ``(n, 1)``).
      preconditioner: ``P`` with a ``solve(V) = P⁻¹ V`` method, or a callable ``V -> P⁻¹ V``;
        None for ``P = I``. Must be symmetric positive definite.
      x0: initial guess ``(..., n, t)``; zero by default (which saves one matvec). The Lanczos
        coefficients describe the Krylov space of ``r₀``, so stochastic Lanczos quadrature on
        ``b`` needs ``x0 = None``.
      tol: relative-residual tolerance, a scalar or an array broadcastable to ``(..., t)``.
      max_iter: static bound on iterations (the size of the Lanczos arrays).
      return_lanczos: also return :class:`LanczosTridiagonal` coefficients.

    Returns:
      :class:`CGResult`. Nothing is raised inside ``jit``: a column that did not reach ``tol``
      within ``max_iter`` (or broke down, see below) has ``converged = False``; use
      :func:`warn_if_not_converged` outside ``jit``.

    Departures from the textbook:
      - A column stops changing once converged (its updates are masked), rather than iterating
        into rounding noise with the others; ``iterations`` and the Lanczos length are per column.
      - Breakdown guard: if ``pᵀAp <= 0`` or ``rᵀz <= 0`` (A or P not positive definite, or
        precision lost) the column is frozen at its last iterate and reported as not converged,
        instead of producing NaNs.
      - The residual is the recurrence ``rⱼ``, not ``b - A xⱼ``: computing the true residual
        would cost a matvec per iteration. The true residual stalls near the rounding of the
        product, ``eps · ‖|A| |x|‖ / ‖b‖``, while the recurrence keeps falling; in float32 with
        small noise (``|x| ~ |b| / σ²``) that floor can lie far above ``tol``, which is then
        "reached" without a better ``x`` (tests/linalg/test_cg.py,
        ``test_float32_cg_when_ill_conditioned``).
    """
    if b.ndim < 2:
        raise ValueError(f"b must have shape (..., n, t); got {b.shape}")
    dtype = b.dtype
    # The iteration runs in b's dtype whatever the operators return (a float64 preconditioner
    # with float32 b would otherwise change the loop carry's type).
    solve_preconditioner = _in_dtype(_as_solve(preconditioner), dtype)
    matvec = _in_dtype(matvec, dtype)
    num_cols = b.shape[-1]
    batch_shape = b.shape[:-2] + (num_cols,)

    if x0 is None:
        x = jnp.zeros_like(b)
        r = b
    else:
        x = jnp.broadcast_to(x0, b.shape).astype(dtype)
        r = b - matvec(x)

    b_norm = _column_norm(b)
    # ‖b‖ = 0 has the exact solution 0 whatever the tolerance; dividing by 1 keeps the residual
    # well defined (and 0 when x0 = 0).
    b_norm_safe = jnp.where(b_norm > 0, b_norm, 1.0)
    threshold = jnp.broadcast_to(jnp.asarray(tol, dtype), batch_shape) * b_norm_safe

    z = solve_preconditioner(r)
    rz = _column_dot(r, z)
    r_norm = _column_norm(r)
    active = r_norm > threshold
    num_coeffs = max_iter if return_lanczos else 0

    state = _CGState(
        step=jnp.zeros((), jnp.int32),
        x=x,
        r=r,
        p=z,
        rz=rz,
        r_norm=r_norm,
        active=active,
        broken=jnp.zeros(batch_shape, bool),
        iterations=jnp.zeros(batch_shape, jnp.int32),
        prev_alpha=jnp.ones(batch_shape, dtype),
        prev_beta=jnp.zeros(batch_shape, dtype),
        diag=jnp.zeros(batch_shape + (num_coeffs,), dtype),
        offdiag=jnp.zeros(batch_shape + (num_coeffs,), dtype),
    )

    def keep_going(s: _CGState) -> jax.Array:
        return (s.step < max_iter) & jnp.any(s.active)

    def iterate(s: _CGState) -> _CGState:
        return _cg_step(s, matvec, solve_preconditioner, threshold, return_lanczos)

    state = lax.while_loop(keep_going, iterate, state)

    lanczos = None
    if return_lanczos:
        lanczos = LanczosTridiagonal(
            diag=state.diag,
            offdiag=state.offdiag,
            num_steps=state.iterations,
            start_norm_sq=rz,
        )
    return CGResult(
        solution=state.x,
        iterations=state.iterations,
        relative_residual=state.r_norm / b_norm_safe,
        converged=(state.r_norm <= threshold) & ~state.broken,
        lanczos=lanczos,
    )


def warn_if_not_converged(
    result: CGResult,
    what: str = "CG solve",
    *,
    setting: str = "max_iter",
    category: type[Warning] = RuntimeWarning,
    stacklevel: int = 2,
    max_iter: int | None = None,
) -> None:
    """Warn, outside ``jit``, when some column of ``result`` did not reach its tolerance.

    Args:
      result: a :class:`CGResult`, or anything with its ``converged``, ``iterations`` and
        ``relative_residual`` arrays (all of one shape).
      what: the solve, as the message should name it.
      setting: the caller's name for the iteration cap, which the message tells the user to
        raise (with a stronger preconditioner, or a looser ``tol``): ``max_iter`` is
        :func:`cg`'s; a caller that wraps it passes its own.
      category: the warning class, e.g. scikit-learn's ``ConvergenceWarning`` for an estimator.
      stacklevel: as in :func:`warnings.warn`; 2 points at the caller of this function.
      max_iter: the solve's iteration cap, when known: columns that stopped before it broke
        down (see :func:`cg`), and the message says so instead of asking for more iterations.

    Does nothing on traced values, so it is safe to leave in code that may be jitted.
    """
    converged = result.converged
    if isinstance(converged, jax.core.Tracer):
        return
    converged = np.asarray(converged)  # on the host: eager device ops compile a program each
    if converged.all():
        return
    residual = np.asarray(result.relative_residual)
    failed = int(converged.size - converged.sum())
    worst = float(np.max(np.where(converged, 0.0, residual)))
    most = int(np.max(np.asarray(result.iterations)))
    if max_iter is not None and most < max_iter:
        dtype = residual.dtype
        warnings.warn(
            f"{what}: {failed} of {converged.size} right-hand sides stopped after {most} "
            f"iterations at relative residual {worst:.3g}, short of the tolerance: the matrix is "
            f"no longer positive definite in {dtype.name} arithmetic (the rounding of its "
            "products exceeds its smallest eigenvalues: many points, small noise). The solution "
            "is the last good iterate; compute in float64 for a tighter solve, or loosen tol.",
            category,
            stacklevel=stacklevel,
        )
        return
    warnings.warn(
        f"{what}: {failed} of {converged.size} right-hand sides did not reach the tolerance "
        f"after {most} iterations (worst relative residual {worst:.3g}). Raise {setting}, use a "
        "stronger preconditioner (higher pivoted-Cholesky rank), or loosen tol.",
        category,
        stacklevel=stacklevel,
    )


# --------------------------------------------------------------------------------------------
# Internals


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _CGState:
    step: jax.Array
    x: jax.Array
    r: jax.Array
    p: jax.Array
    rz: jax.Array
    r_norm: jax.Array
    active: jax.Array
    broken: jax.Array
    iterations: jax.Array
    prev_alpha: jax.Array
    prev_beta: jax.Array
    diag: jax.Array
    offdiag: jax.Array


def _cg_step(
    s: _CGState,
    matvec: Matvec,
    solve_preconditioner: Matvec,
    threshold: jax.Array,
    record_lanczos: bool,
) -> _CGState:
    ap = matvec(s.p)
    p_ap = _column_dot(s.p, ap)
    healthy = s.active & (p_ap > 0) & (s.rz > 0)
    alpha = jnp.where(healthy, s.rz / jnp.where(healthy, p_ap, 1.0), 0.0)

    x = s.x + alpha[..., None, :] * s.p
    r = s.r - alpha[..., None, :] * ap
    r_norm = jnp.where(healthy, _column_norm(r), s.r_norm)
    continuing = healthy & (r_norm > threshold)

    z = solve_preconditioner(r)
    rz_new = _column_dot(r, z)
    beta = jnp.where(continuing, rz_new / jnp.where(healthy, s.rz, 1.0), 0.0)
    p = jnp.where(continuing[..., None, :], z + beta[..., None, :] * s.p, s.p)

    diag, offdiag = s.diag, s.offdiag
    if record_lanczos:
        safe_alpha = jnp.where(healthy, alpha, 1.0)
        t_jj = 1.0 / safe_alpha + s.prev_beta / s.prev_alpha
        t_next = jnp.sqrt(jnp.maximum(beta, 0.0)) / safe_alpha
        diag = diag.at[..., s.step].set(jnp.where(healthy, t_jj, 0.0))
        offdiag = offdiag.at[..., s.step].set(jnp.where(continuing, t_next, 0.0))

    return _CGState(
        step=s.step + 1,
        x=x,
        r=jnp.where(healthy[..., None, :], r, s.r),
        p=p,
        rz=jnp.where(continuing, rz_new, s.rz),
        r_norm=r_norm,
        active=continuing,
        broken=s.broken | (s.active & ~healthy),
        iterations=s.iterations + healthy.astype(jnp.int32),
        prev_alpha=jnp.where(healthy, alpha, s.prev_alpha),
        prev_beta=jnp.where(healthy, beta, s.prev_beta),
        diag=diag,
        offdiag=offdiag,
    )


def _as_solve(preconditioner: SupportsSolve | Matvec | None) -> Matvec:
    if preconditioner is None:
        return lambda v: v
    if hasattr(preconditioner, "solve"):
        return preconditioner.solve
    if callable(preconditioner):
        return preconditioner
    raise TypeError(
        "preconditioner must have a solve(V) method, be a callable V -> P⁻¹V, or be None; "
        f"got {type(preconditioner).__name__}"
    )


def _in_dtype(fn: Matvec, dtype) -> Matvec:
    return lambda v: fn(v).astype(dtype)


def _column_dot(u: jax.Array, v: jax.Array) -> jax.Array:
    return jnp.sum(u * v, axis=-2)


def _column_norm(u: jax.Array) -> jax.Array:
    return jnp.sqrt(_column_dot(u, u))
