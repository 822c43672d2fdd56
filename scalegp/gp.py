"""Exact Gaussian-process regression: the model, its marginal likelihood, and prediction.

Model (one kernel shared by ``o`` outputs)::

    y[:, j] = m_j + f_j(x) + ε,   f_j ~ GP(0, s · k_l),   ε ~ N(0, σ² I),
    k_l(x, x') = exp(-½ Σ_d ((x_d - x'_d) / l_d)²),

with constant means ``m (o,)``, outputscale ``s``, ARD lengthscales ``l (d,)`` and noise variance
``σ² >= noise_lower_bound``. Writing ``A = s K + σ² I`` (``K (n, n)`` the kernel matrix of the
training inputs) and ``r_j = y_j - m_j``, the objective is the negative log marginal likelihood
summed over outputs::

    NLML = ½ Σ_j r_jᵀ A⁻¹ r_j + (o/2) log|A| + (n o / 2) log 2π.

Layout (tinygp style: the model never factorises anything itself):

- :class:`GPParams`: the hyperparameters as an unconstrained pytree (``softplus`` maps them to
  ``s``, ``l`` and ``σ² - noise_lower_bound``); :meth:`GPParams.constrained` gives the
  :class:`Hyperparameters` and :meth:`GPParams.from_constrained` inverts it.
- Solvers, interchangeable objects with the same two methods ``value_and_grad`` (objective
  and its gradient with respect to the unconstrained parameters, as an :class:`ObjectiveResult`)
  and ``posterior`` (the prediction cache, a :class:`Posterior`):

  * :class:`CholeskySolver`: dense Cholesky of ``A``, ``O(n²)`` memory and ``O(n³)`` time;
    exact to rounding. Used up to :data:`EXACT_MAX_N` points by :func:`default_solver`.
  * :class:`BBMMSolver`: black-box matrix–matrix inference (Gardner et al., 2018): one
    preconditioned mBCG call on ``[r, z₁ … z_t]`` (``z_i ~ N(0, P)``, ``P`` a rank-k pivoted
    Cholesky preconditioner), stochastic Lanczos quadrature for ``log|A|`` and the gradient::

        ∂NLML/∂θ = -½ Σ_j α_jᵀ (∂A/∂θ) α_j + (o/2t) Σ_i (A⁻¹z_i)ᵀ (∂A/∂θ) (P⁻¹z_i),
        ∂NLML/∂m_j = -1ᵀ α_j,       α = A⁻¹ r,

    whose quadratic forms come from one vector–Jacobian product of
    :func:`scalegp.ops.rbf_kernel_mv` (no ``n × n`` array in the forward or the gradient).
    Probes come from a fixed key, so the objective is a deterministic function of the
    parameters (what L-BFGS needs).

- :func:`predict`: mean ``m + s K(X*, X) α`` and, optionally, variance
  ``s - s² k*ᵀ A⁻¹ k* (+ σ²)`` and covariance, from a :class:`Posterior`. The exact posterior
  uses the Cholesky factor; the iterative one a LOVE-style cache ``A⁻¹ ≈ R Rᵀ`` (Pleiss et al.,
  2018) on a pivoted-Cholesky subspace (:meth:`BBMMSolver.love`), built lazily on the first
  variance request.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp import linalg
from scalegp.ops import rbf_kernel_matrix, rbf_kernel_mv, sharded

__all__ = [
    "EXACT_MAX_N",
    "BBMMSolver",
    "CholeskySolver",
    "GPParams",
    "Hyperparameters",
    "ObjectiveResult",
    "Posterior",
    "default_solver",
    "exact_nlml",
    "predict",
    "softplus_inverse",
]

#: Largest number of training points for which :func:`default_solver` picks the dense
#: :class:`CholeskySolver` (an ``n × n`` float64 matrix at this size is 134 MB); above it the
#: memory-linear :class:`BBMMSolver`.
EXACT_MAX_N = 4096

_HIGHEST = lax.Precision.HIGHEST


def softplus_inverse(x):
    """``softplus⁻¹(x) = log(expm1(x))`` for ``x > 0``, stable for large and small ``x``."""
    x = jnp.asarray(x)
    return jnp.where(x > 20.0, x, jnp.log(jnp.expm1(jnp.minimum(x, 20.0))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """Constrained hyperparameters.

    Attributes:
      mean: ``(o,)`` constant mean per output.
      outputscale: ``()`` kernel variance ``s > 0``.
      lengthscale: ``(d,)`` ARD lengthscales ``l > 0``.
      noise: ``()`` noise variance ``σ² > 0``.
    """

    mean: jax.Array
    outputscale: jax.Array
    lengthscale: jax.Array
    noise: jax.Array


@dataclasses.dataclass(frozen=True)
class GPParams:
    """Unconstrained hyperparameters (a pytree; ``noise_lower_bound`` is static).

    ``s = softplus(raw_outputscale)``, ``l = softplus(raw_lengthscale)``,
    ``σ² = noise_lower_bound + softplus(raw_noise)``, ``m = mean``.

    Attributes:
      mean: ``(o,)``.
      raw_outputscale: ``()``.
      raw_lengthscale: ``(d,)``.
      raw_noise: ``()``.
      noise_lower_bound: float, static.
    """

    mean: jax.Array
    raw_outputscale: jax.Array
    raw_lengthscale: jax.Array
    raw_noise: jax.Array
    noise_lower_bound: float = 1e-6

    def constrained(self) -> Hyperparameters:
        return Hyperparameters(
            mean=self.mean,
            outputscale=jax.nn.softplus(self.raw_outputscale),
            lengthscale=jax.nn.softplus(self.raw_lengthscale),
            noise=self.noise_lower_bound + jax.nn.softplus(self.raw_noise),
        )

    @classmethod
    def from_constrained(
        cls, mean, outputscale, lengthscale, noise, *, noise_lower_bound: float = 1e-6,
        dtype=None,
    ) -> "GPParams":
        """Inverse of :meth:`constrained`. ``noise`` must exceed ``noise_lower_bound``."""
        dtype = dtype or jnp.result_type(float)
        mean = jnp.atleast_1d(jnp.asarray(mean, dtype))
        if float(noise) <= noise_lower_bound:
            raise ValueError(
                f"noise must be > noise_lower_bound={noise_lower_bound}, got {float(noise)}; "
                "lower noise_lower_bound or raise the noise"
            )
        lengthscale = jnp.atleast_1d(jnp.asarray(lengthscale, dtype))
        return cls(
            mean=mean,
            raw_outputscale=softplus_inverse(jnp.asarray(outputscale, dtype)),
            raw_lengthscale=softplus_inverse(lengthscale),
            raw_noise=softplus_inverse(jnp.asarray(noise - noise_lower_bound, dtype)),
            noise_lower_bound=float(noise_lower_bound),
        )

    def flatten(self) -> np.ndarray:
        """float64 vector ``[mean (o), raw_outputscale, raw_lengthscale (d), raw_noise]``."""
        return np.concatenate([
            np.asarray(self.mean, np.float64).ravel(),
            np.asarray(self.raw_outputscale, np.float64).ravel(),
            np.asarray(self.raw_lengthscale, np.float64).ravel(),
            np.asarray(self.raw_noise, np.float64).ravel(),
        ])

    @classmethod
    def unflatten(cls, theta, num_outputs: int, num_features: int, *, noise_lower_bound: float,
                  dtype) -> "GPParams":
        """Inverse of :meth:`flatten`."""
        theta = np.asarray(theta, np.float64)
        o, d = num_outputs, num_features
        if theta.shape != (o + d + 2,):
            raise ValueError(
                f"theta must have shape ({o + d + 2},) = mean ({o}) + outputscale (1) + "
                f"lengthscale ({d}) + noise (1), got {theta.shape}"
            )
        return cls(
            mean=jnp.asarray(theta[:o], dtype),
            raw_outputscale=jnp.asarray(theta[o], dtype),
            raw_lengthscale=jnp.asarray(theta[o + 1: o + 1 + d], dtype),
            raw_noise=jnp.asarray(theta[-1], dtype),
            noise_lower_bound=noise_lower_bound,
        )


jax.tree_util.register_dataclass(
    GPParams,
    data_fields=["mean", "raw_outputscale", "raw_lengthscale", "raw_noise"],
    meta_fields=["noise_lower_bound"],
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ObjectiveResult:
    """Negative log marginal likelihood and its gradient.

    Attributes:
      value: ``()``, NLML (summed over outputs, not divided by n).
      grad: :class:`GPParams` of the same structure as the input, ``∂NLML/∂params``.
      cg_iterations: ``()`` int, largest mBCG iteration count (0 for the Cholesky solver).
      converged: ``()`` bool, whether every CG column reached the tolerance (True for Cholesky).
    """

    value: jax.Array
    grad: Any
    cg_iterations: jax.Array
    converged: jax.Array


# --------------------------------------------------------------------------------------------
# Dense exact objective


def _check_training(x, y):
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x must be (n, d) and y (n, o) with the same n; got x {x.shape}, y {y.shape} "
            "(reshape a single output y to (n, 1))"
        )


def exact_nlml(params: GPParams, x: jax.Array, y: jax.Array, jitter: float = 0.0) -> jax.Array:
    """NLML by dense Cholesky of ``A = s K + (σ² + jitter) I``; differentiable with ``jax.grad``.

    Args:
      params: :class:`GPParams` with ``mean (o,)``.
      x: ``(n, d)``; y: ``(n, o)``.

    Returns:
      ``()``; NaN if ``A`` is numerically not positive definite.
    """
    hp = params.constrained()
    n, o = y.shape
    a = hp.outputscale * rbf_kernel_matrix(x, x, hp.lengthscale)
    a = a + (hp.noise + jitter) * jnp.eye(n, dtype=a.dtype)
    chol = jnp.linalg.cholesky(a)
    r = y - hp.mean
    w = jax.scipy.linalg.solve_triangular(chol, r, lower=True)
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol)))
    return 0.5 * jnp.sum(w * w) + 0.5 * o * logdet + 0.5 * n * o * math.log(2 * math.pi)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Posterior:
    """Prediction cache for fixed hyperparameters.

    Attributes:
      alpha: ``(n, o)``, ``A⁻¹ (y - m)``.
      cholesky: ``(n, n)`` lower Cholesky factor of ``A`` (exact solver) or None.
      love_factor: ``(n, k)`` LOVE factor ``R`` with ``A⁻¹ ≈ R Rᵀ`` (iterative solver) or None
        until the first variance request (see :meth:`BBMMSolver.love`).
    """

    alpha: jax.Array
    cholesky: jax.Array | None = None
    love_factor: jax.Array | None = None


class NotPositiveDefiniteError(ValueError):
    """``K + σ²I`` failed a Cholesky even with jitter (raise the noise bound or use float64)."""


def _cholesky_with_jitter(a: np.ndarray | jax.Array, noise: float, max_tries: int = 4):
    """Cholesky of ``a``; on failure add jitter ``10^k · eps · max(diag)`` with a warning."""
    chol = jnp.linalg.cholesky(a)
    if bool(jnp.all(jnp.isfinite(chol))):
        return chol, 0.0
    eps = float(jnp.finfo(a.dtype).eps)
    scale = float(jnp.max(jnp.diagonal(a)))
    for k in range(max_tries):
        jitter = scale * eps * 10.0 ** (k + 1)
        chol = jnp.linalg.cholesky(a + jitter * jnp.eye(a.shape[0], dtype=a.dtype))
        if bool(jnp.all(jnp.isfinite(chol))):
            warnings.warn(
                f"K + noise·I (noise={noise:.3g}) is not numerically positive definite; added "
                f"jitter {jitter:.3g} to its diagonal. Raise noise_lower_bound (or use float64) "
                "to avoid this.",
                RuntimeWarning,
                stacklevel=3,
            )
            return chol, jitter
    raise NotPositiveDefiniteError(
        f"K + noise·I (noise={noise:.3g}) is not positive definite even with jitter "
        f"{jitter:.3g}: raise noise_lower_bound, use float64, or remove duplicated inputs"
    )


@dataclasses.dataclass(frozen=True)
class CholeskySolver:
    """Dense exact inference: NLML, gradient (autodiff through the Cholesky) and posterior.

    ``O(n²)`` memory: meant for ``n <=`` :data:`EXACT_MAX_N`. A matrix that is not numerically
    positive definite gets jitter with a warning, then a ValueError.
    """

    def value_and_grad(self, params: GPParams, x, y) -> ObjectiveResult:
        _check_training(x, y)
        value, grad = _exact_value_and_grad(params, x, y, 0.0)
        if not bool(jnp.isfinite(value)):
            hp = params.constrained()
            a = hp.outputscale * rbf_kernel_matrix(x, x, hp.lengthscale)
            a = a + hp.noise * jnp.eye(x.shape[0], dtype=a.dtype)
            _, jitter = _cholesky_with_jitter(a, float(hp.noise))
            value, grad = _exact_value_and_grad(params, x, y, jitter)
        return ObjectiveResult(value, grad, jnp.asarray(0), jnp.asarray(True))

    def posterior(self, params: GPParams, x, y) -> Posterior:
        _check_training(x, y)
        hp = params.constrained()
        a = hp.outputscale * rbf_kernel_matrix(x, x, hp.lengthscale)
        a = a + hp.noise * jnp.eye(x.shape[0], dtype=a.dtype)
        chol, _ = _cholesky_with_jitter(a, float(hp.noise))
        alpha = jax.scipy.linalg.cho_solve((chol, True), y - hp.mean)
        return Posterior(alpha=alpha, cholesky=chol)


_exact_value_and_grad = jax.jit(jax.value_and_grad(exact_nlml))


# --------------------------------------------------------------------------------------------
# BBMM


def _kernel_mv(x1, x2, v, lengthscale, impl, mesh=None, scheme="allgather"):
    """``K(x1, x2) v`` on one device, or with rows sharded over ``mesh`` (scalegp.ops.sharded)."""
    if mesh is None:
        return rbf_kernel_mv(x1, x2, v, lengthscale, impl=impl)
    return sharded.sharded_kernel_mv(x1, x2, v, lengthscale, mesh=mesh, scheme=scheme, impl=impl)


def _row_sharded(x, mesh):
    """x with its rows sharded over ``mesh`` (when they divide evenly), inside jit: CG vectors,
    inner products (then all-reduced) and the preconditioner's per-row work follow x's layout."""
    if mesh is None:
        return x
    axis, p = sharded.mesh_axis(mesh)
    if x.shape[0] % p:
        return x
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
    return lax.with_sharding_constraint(x, rows)


def _operator(hp: Hyperparameters, x, impl, mesh=None, scheme="allgather"):
    def matvec(v):
        kv = _kernel_mv(x, x, v, hp.lengthscale, impl, mesh, scheme)
        return hp.outputscale * kv + hp.noise * v

    return matvec


def _preconditioner(hp: Hyperparameters, x, rank: int, rel_tol=None, mesh=None):
    """``P = L Lᵀ + σ²I`` from a rank-``rank`` pivoted Cholesky of ``s K(x, x)``.

    With a mesh (and n a multiple of its size) it is built shard-wise, as the CG vectors are laid
    out: each device computes its rows of every kernel column and of the factor, and the QR is a
    tall-skinny QR (see `scalegp.linalg.preconditioners`), so no column, factor or basis is ever
    gathered onto one device; the basis comes back row-sharded.
    """
    rank = min(rank, x.shape[0])
    axis, p = sharded.mesh_axis(mesh) if mesh is not None else (None, 1)
    if mesh is None or x.shape[0] % p:
        return _local_preconditioner(hp, x, rank=rank, rel_tol=rel_tol, axis_name=None)
    rows, replicated = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
    build = sharded.shard_map(
        functools.partial(_local_preconditioner, rank=rank, rel_tol=rel_tol, axis_name=axis),
        mesh=mesh,
        in_specs=(replicated, rows),
        out_specs=linalg.LowRankPreconditioner(rows, replicated, rows),
    )
    return build(hp, x)


def _local_preconditioner(hp: Hyperparameters, x, *, rank, rel_tol, axis_name):
    """`_preconditioner` on the rows ``x`` of this device (all rows when ``axis_name`` is None)."""
    diag = jnp.full((x.shape[0],), hp.outputscale, x.dtype)

    def column(i):
        xi = linalg.sharded_row(x, i, axis_name)[None, :]
        return hp.outputscale * rbf_kernel_mv(x, xi, jnp.ones((1,), x.dtype), hp.lengthscale,
                                              impl="dense")

    piv = linalg.pivoted_cholesky(diag, column, max_rank=rank, rel_tol=rel_tol,
                                  axis_name=axis_name)
    return linalg.LowRankPreconditioner.from_factor(piv.factor, hp.noise, axis_name=axis_name)


@dataclasses.dataclass(frozen=True)
class BBMMSolver:
    """Memory-linear inference by preconditioned mBCG, SLQ and engine VJPs.

    Attributes:
      num_probes: ``t`` probe vectors for the log-determinant and trace estimates.
      preconditioner_rank: rank of the pivoted-Cholesky preconditioner ``P = L Lᵀ + σ² I``.
        The default, 768, leaves few CG iterations and lets the control variate of the
        gradient's trace term take over up to n = 4,000 at d = 4 (value and gradient within
        2% of the exact ones there; at rank 100 they were 5-25% off). Its cost, ``O(n k²)``
        once per objective, stays below that of the CG iterations it saves up to n ≈ 30,000
        on a CPU.
      cg_tol: relative-residual tolerance of the training solves.
      max_iters: CG iteration cap (a ConvergenceWarning-style RuntimeWarning names it).
      predict_tol: tolerance of the ``α`` solve behind predictions (tighter than training).
      love_rank: rank of the variance cache (see :meth:`love`).
      seed: seed of the fixed probes (the objective is deterministic given it).
      impl: engine implementation (see :mod:`scalegp.ops`).
      mesh: None (one device) or a ``jax.sharding.Mesh``: the kernel products, CG vectors and
        inner products are then sharded by rows over it (:mod:`scalegp.ops.sharded`).
      mesh_scheme: "allgather" or "ring", how the keys of each kernel product reach the devices.
    """

    num_probes: int = 30
    preconditioner_rank: int = 768
    cg_tol: float = 1e-3
    max_iters: int = 1000
    predict_tol: float = 1e-6
    love_rank: int = 1024
    seed: int = 0
    control_variate: bool | str = "auto"
    impl: str = "auto"
    mesh: Any = None
    mesh_scheme: str = "allgather"

    def value_and_grad(self, params: GPParams, x, y, *, warn: bool = True) -> ObjectiveResult:
        """NLML and its gradient by BBMM; jit-able (``warn`` is skipped on traced values)."""
        _check_training(x, y)
        result = _bbmm_value_and_grad(self, params, x, y)
        if warn:
            _warn_cg(result.converged, result.cg_iterations, "BBMM training solve", "max_iters")
        return result

    def posterior(self, params: GPParams, x, y) -> Posterior:
        _check_training(x, y)
        alpha, iters, converged = _bbmm_alpha(self, params, x, y)
        _warn_cg(converged, iters, "prediction solve alpha = A⁻¹(y - m)", "max_iters")
        return Posterior(alpha=alpha)

    def love(self, params: GPParams, x, posterior: Posterior) -> Posterior:
        """The posterior with its variance factor ``R (n, love_rank)``, ``A⁻¹ ≈ R Rᵀ``, filled in.

        The LOVE form of Pleiss et al. (2018), ``var* = s - s² ‖K(x*, X) R‖²``, on a different
        subspace: ``R = Q (QᵀAQ)^{-1/2}`` is the Galerkin projection of ``A⁻¹`` on the span ``Q``
        of a rank-``love_rank`` pivoted-Cholesky factor of ``K``, i.e. of the kernel columns at
        ``love_rank`` well-spread pivot points, which represent every smooth ``k* = K(X, x*)``.
        LOVE's Krylov space from one start vector resolves the top of ``A``'s spectrum instead
        and needs a rank near the number of eigenvalues of ``sK`` above ``σ²``, hundreds or
        thousands at ``d >= 4``: at n = 4,000, d = 4 rank 256 put the latent std off by a median
        60-116% where this basis at rank 1,024 is within 1e-4 (median 0.4% at n = 32,768).
        Cost: one pivoted Cholesky and one kernel product with ``love_rank`` columns (LOVE:
        ``love_rank`` sequential products). Variances from it are upper bounds (a projection
        under-estimates ``k*ᵀA⁻¹k*``).
        """
        if posterior.love_factor is not None:
            return posterior
        factor = _love_factor(self, params, x)
        return dataclasses.replace(posterior, love_factor=factor)


def _warn_cg(converged, iterations, what, setting):
    if isinstance(converged, jax.core.Tracer) or bool(converged):
        return
    from sklearn.exceptions import ConvergenceWarning

    warnings.warn(
        f"{what}: CG did not reach its tolerance in {int(iterations)} iterations; raise "
        f"{setting} (or preconditioner_rank), or loosen the tolerance",
        ConvergenceWarning,
        stacklevel=3,
    )


def bbmm_value_and_grad(solver: BBMMSolver, params: GPParams, x, y) -> ObjectiveResult:
    """Pure (jit-able) BBMM objective and gradient; see :class:`BBMMSolver`."""
    hp = params.constrained()
    n, o = y.shape
    t = solver.num_probes
    impl = solver.impl
    mesh, scheme = solver.mesh, solver.mesh_scheme
    x = _row_sharded(x, mesh)
    matvec = _operator(hp, x, impl, mesh, scheme)
    precond = _preconditioner(hp, x, solver.preconditioner_rank, mesh=mesh)
    r = _row_sharded(y - hp.mean, mesh)
    key = jax.random.PRNGKey(solver.seed)
    res = linalg.solve_and_logdet(
        matvec, r, key, num_probes=t, preconditioner=precond, tol=solver.cg_tol,
        max_iters=solver.max_iters,
    )
    alpha = lax.stop_gradient(res.solution)
    value = (
        0.5 * jnp.sum(r * alpha) + 0.5 * o * res.logdet + 0.5 * n * o * math.log(2 * math.pi)
    )
    # Quadratic forms u_iᵀ (∂A/∂θ) w_i from one VJP: f(θ) = Σ U ∘ A_θ W. The trace term uses
    # the preconditioner as a control variate:
    #   tr(A⁻¹∂A) = tr(P⁻¹∂A) + tr((A⁻¹ - P⁻¹)∂A),
    # the first exactly (P⁻¹ = σ⁻²(I - B D Bᵀ), B (n, k) orthonormal, so
    # tr(P⁻¹∂A) = σ⁻²(tr ∂A - Σ_k D_k b_kᵀ ∂A b_k)), the second by probes
    # (1/t) Σ_i (A⁻¹z_i - P⁻¹z_i)ᵀ ∂A (P⁻¹z_i), whose variance vanishes as P → A.
    whitened = precond.solve(res.probes)
    shrink = precond.scaled_eigenvalues / (1.0 + precond.scaled_eigenvalues)
    inv_noise = 1.0 / hp.noise
    def quadratic_form_grads(cv: bool):
        c = 1.0 if cv else 0.0
        us = [-0.5 * alpha, (0.5 * o / t) * (res.probe_solutions - c * whitened)]
        ws = [alpha, whitened]
        if cv:
            # The basis joins the VJP only when it is used: at large n its k columns cost more
            # than the probes.
            us.append((-0.5 * o) * inv_noise * shrink * precond.basis)
            ws.append(precond.basis)
        u = lax.stop_gradient(jnp.concatenate(us, axis=-1))
        w = lax.stop_gradient(jnp.concatenate(ws, axis=-1))

        def form(outputscale, lengthscale, noise):
            kw = _kernel_mv(x, x, w, lengthscale, impl, mesh, scheme)
            # tr(∂A)/σ² for the exact part: tr(∂A/∂s) = n (unit kernel diagonal),
            # tr(∂A/∂σ²) = n, tr(∂A/∂l) = 0.
            exact_trace = lax.stop_gradient(0.5 * o * c * inv_noise) * n * (outputscale + noise)
            return jnp.sum(u * (outputscale * kw + noise * w)) + exact_trace

        return jax.grad(form, argnums=(0, 1, 2))(hp.outputscale, hp.lengthscale, hp.noise)

    if solver.control_variate == "auto":
        probe_iters = jnp.max(res.cg.iterations[..., o:])
        g_s, g_l, g_n = lax.cond(probe_iters <= _CV_MAX_ITERS,
                                 lambda: quadratic_form_grads(True),
                                 lambda: quadratic_form_grads(False))
    else:
        g_s, g_l, g_n = quadratic_form_grads(bool(solver.control_variate))
    grad_hp = Hyperparameters(mean=-jnp.sum(alpha, axis=0), outputscale=g_s, lengthscale=g_l,
                              noise=g_n)
    _, pullback = jax.vjp(lambda p: p.constrained(), params)
    (grad,) = pullback(grad_hp)
    return ObjectiveResult(
        value=value,
        grad=grad,
        cg_iterations=jnp.max(res.cg.iterations),
        converged=jnp.all(res.cg.converged),
    )


#: ``control_variate="auto"`` uses the preconditioner control variate when the probe solves
#: converged within this many CG iterations (P close to A); otherwise the plain estimator.
_CV_MAX_ITERS = 5

_bbmm_value_and_grad = jax.jit(bbmm_value_and_grad, static_argnums=0)


def _bbmm_alpha_impl(solver, params, x, y):
    hp = params.constrained()
    x = _row_sharded(x, solver.mesh)
    precond = _preconditioner(hp, x, solver.preconditioner_rank, mesh=solver.mesh)
    res = linalg.cg(_operator(hp, x, solver.impl, solver.mesh, solver.mesh_scheme),
                    _row_sharded(y - hp.mean, solver.mesh), preconditioner=precond,
                    tol=solver.predict_tol, max_iters=solver.max_iters)
    return res.solution, jnp.max(res.iterations), jnp.all(res.converged)


_bbmm_alpha = jax.jit(_bbmm_alpha_impl, static_argnums=0)


def _love_factor_impl(solver, params, x):
    hp = params.constrained()
    x = _row_sharded(x, solver.mesh)
    rank = min(solver.love_rank, x.shape[0])
    # All `rank` columns (rel_tol=0). The default stop, 10·rank·eps·tr(K), is 1e-3·tr(K) in
    # float32 at rank 1,024: at n = 32,768 it ended the factor near rank 500 and the latent std
    # was off by a median 47% (0.4% with all columns, as in float64). Columns past the
    # rounding level are jittered, harmless to a Galerkin basis. (The preconditioner keeps the
    # early stop: a full factor there costs more per objective than the CG iterations it saves.)
    basis = _preconditioner(hp, x, rank, rel_tol=0.0, mesh=solver.mesh).basis
    matvec = _operator(hp, x, solver.impl, solver.mesh, solver.mesh_scheme)
    h = jnp.matmul(basis.T, matvec(basis), precision=_HIGHEST)
    eigenvalues, eigenvectors = jnp.linalg.eigh(0.5 * (h + h.T))
    # Eigenvalues of QᵀAQ lie in [σ², λ_max(A)]; the floor only guards rounding.
    inv_sqrt = lax.rsqrt(jnp.maximum(eigenvalues, hp.noise))
    return jnp.matmul(basis, eigenvectors * inv_sqrt, precision=_HIGHEST)


_love_factor = jax.jit(_love_factor_impl, static_argnums=0)


def default_solver(n: int, **bbmm_settings) -> CholeskySolver | BBMMSolver:
    """:class:`CholeskySolver` for ``n <=`` :data:`EXACT_MAX_N`, else :class:`BBMMSolver`."""
    return CholeskySolver() if n <= EXACT_MAX_N else BBMMSolver(**bbmm_settings)


# --------------------------------------------------------------------------------------------
# Prediction


#: Test rows per prediction block. Every block is padded to exactly this many rows, so each test
#: point's mean and variance come out of the same compiled arithmetic whatever else is predicted
#: with it (row independence: `scalegp.ops`); a multiple of the engine's query tile.
PREDICT_BLOCK = 512


def predict(
    params: GPParams,
    x_train,
    posterior: Posterior,
    x_test,
    *,
    return_std: bool = False,
    return_cov: bool = False,
    include_noise: bool = True,
    impl: str = "auto",
    mesh=None,
    mesh_scheme: str = "allgather",
):
    """Predictive mean, and optionally std or covariance, at ``x_test (m, d)``.

    ``mean = m + s K(X*, X) α``; ``var = s - s² diag(K* A⁻¹ K*ᵀ) (+ σ² if include_noise)``
    (from the Cholesky factor or the LOVE factor of ``posterior``, whichever it holds);
    ``cov = s K(X*, X*) - s² K* A⁻¹ K*ᵀ (+ σ² I)`` needs the Cholesky factor or forms an
    ``(m, m)`` matrix from the LOVE factor, so keep ``m`` small.

    Means and variances are computed in blocks of :data:`PREDICT_BLOCK` test rows, so a row's
    result does not depend on the other rows, and memory stays linear in ``m``.

    ``mesh``/``mesh_scheme``: shard the test rows of each kernel product over a mesh (see
    :class:`BBMMSolver`); None for one device.

    Returns:
      ``mean (m, o)``, plus ``std (m,)`` or ``cov (m, m)`` (shared by all outputs). Variances
      below 0 (rounding, or an under-ranked LOVE cache) are clipped to 0 with a RuntimeWarning
      when the clipping exceeds ``1e-6 · s``.
    """
    if (return_std or return_cov) and posterior.cholesky is None and posterior.love_factor is None:
        raise ValueError("posterior has no variance cache: call BBMMSolver.love first")
    hp = params.constrained()
    x_test = jnp.asarray(x_test, x_train.dtype)
    m = x_test.shape[0]
    means, variances = [], []
    for start in range(0, m, PREDICT_BLOCK):
        block = x_test[start: start + PREDICT_BLOCK]
        padded = jnp.pad(block, ((0, PREDICT_BLOCK - block.shape[0]), (0, 0)))
        mean, var = _predict_block(hp, x_train, posterior, padded, return_std, impl, mesh,
                                   mesh_scheme)
        means.append(mean[: block.shape[0]])
        if return_std:
            variances.append(var[: block.shape[0]])
    mean = jnp.concatenate(means, axis=0) if means else jnp.zeros((0,) + hp.mean.shape,
                                                                   x_train.dtype)
    if not (return_std or return_cov):
        return mean
    if return_cov:
        test_train = rbf_kernel_matrix(x_test, x_train, hp.lengthscale)
        if posterior.cholesky is not None:
            v = jax.scipy.linalg.solve_triangular(posterior.cholesky,
                                                  hp.outputscale * test_train.T, lower=True)
            reduction = v.T @ v
        else:
            rk = hp.outputscale * _kernel_mv(x_test, x_train, posterior.love_factor,
                                             hp.lengthscale, impl, mesh, mesh_scheme)
            reduction = rk @ rk.T
        cov = hp.outputscale * rbf_kernel_matrix(x_test, x_test, hp.lengthscale) - reduction
        if include_noise:
            cov = cov + hp.noise * jnp.eye(m, dtype=cov.dtype)
        diag = jnp.diagonal(cov)
        _warn_clip(diag, hp.outputscale)
        cov = cov.at[jnp.diag_indices(m)].set(jnp.maximum(diag, 0.0))
        return mean, cov
    var = jnp.concatenate(variances, axis=0) if variances else jnp.zeros((0,), x_train.dtype)
    _warn_clip(var + (hp.noise if include_noise else 0.0), hp.outputscale)
    var = jnp.maximum(var, 0.0) + (hp.noise if include_noise else 0.0)
    return mean, jnp.sqrt(jnp.maximum(var, 0.0))


@functools.partial(jax.jit, static_argnames=("return_std", "impl", "mesh", "mesh_scheme"))
def _predict_block(hp, x_train, posterior, xb, return_std, impl, mesh, mesh_scheme):
    """(mean (b, o), latent variance (b,) or None) for one padded block of test rows."""
    mean = hp.mean + hp.outputscale * _kernel_mv(xb, x_train, posterior.alpha, hp.lengthscale,
                                                 impl, mesh, mesh_scheme)
    if not return_std:
        return mean, None
    if posterior.cholesky is not None:
        cross = hp.outputscale * rbf_kernel_matrix(xb, x_train, hp.lengthscale).T
        v = jax.scipy.linalg.solve_triangular(posterior.cholesky, cross, lower=True)
        return mean, hp.outputscale - jnp.sum(v * v, axis=0)
    rk = _kernel_mv(xb, x_train, posterior.love_factor, hp.lengthscale, impl, mesh, mesh_scheme)
    return mean, hp.outputscale - hp.outputscale**2 * jnp.sum(rk * rk, axis=-1)


def _warn_clip(var, outputscale):
    worst = float(jnp.min(var))
    if worst < -1e-6 * float(outputscale):
        warnings.warn(
            f"predictive variances down to {worst:.3g} were clipped to 0 (outputscale "
            f"{float(outputscale):.3g}); with the iterative solver raise love_rank, otherwise "
            "raise noise_lower_bound or use float64",
            RuntimeWarning,
            stacklevel=3,
        )
