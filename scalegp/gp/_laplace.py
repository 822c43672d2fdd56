"""Binary GP classification by the Laplace approximation, dense and matrix-free.

Model (Rasmussen & Williams, 2006, "Gaussian Processes for Machine Learning", §3.4): labels
``t_i ∈ {0, 1}``, ``p(t_i = 1 | f_i) = σ(f_i)`` (the logistic function), ``f ~ GP(0, K)`` with
``K`` the kernel expression of a :class:`KernelParams` plus its noise (a WhiteKernel) on the
training diagonal. The Laplace approximation is the Gaussian at the mode ``f̂`` of
``Ψ(f) = log p(t|f) - ½ fᵀK⁻¹f``, with ``W = -∇∇ log p(t|f̂) = diag(π(1 - π))``,
``π = σ(f̂)`` and ``B = I + W^½ K W^½`` (eigenvalues in ``[1, 1 + λ_max(K)/4]``: well
conditioned whatever the kernel, the reason R&W solve with ``B`` rather than ``K + W⁻¹``).

- Mode (Algorithm 3.1): Newton steps ``b = W f + ∇log p``, ``a = b - W^½ B⁻¹ W^½ K b``,
  ``f = K a`` until ``Ψ`` gains less than a tolerance. At the mode ``a = K⁻¹f̂ = ∇log p(t|f̂)``.
  A step that lowers ``Ψ`` is halved; one that still does ends the run, ``failed`` (in float32
  on a huge, almost constant ``K`` there is no mode to find: ``f = K a`` carries a's rounding
  times ``λ_max(K)``).
- Approximate log marginal likelihood (Algorithm 3.2)::

      log q(t|θ) = Ψ(f̂) - ½ log|B|.

- Its gradient (Algorithm 5.1), with ``R = W^½ B⁻¹ W^½ = (K + W⁻¹)⁻¹``,
  ``Σ = (K⁻¹ + W)⁻¹`` and ``s₂ = -½ diag(Σ) ∂W/∂f̂`` (the derivative of ``-½ log|B|`` through
  the mode)::

      ∂ log q/∂θ_j = ½ aᵀ ∂K a - ½ tr(R ∂K) + vᵀ ∂K ∇log p,     v = (I + WK)⁻¹ s₂
                                                               = s₂ - R K s₂.

  The last term is R&W's ``s₂ᵀ s₃`` with ``s₃ = (I + KW)⁻¹ ∂K ∇log p`` (how the mode moves
  with ``θ_j``) turned around: one adjoint solve ``v`` serves every hyperparameter, instead of
  one solve per hyperparameter. All three terms are ``Σ U ∘ (∂K W)`` for a few columns, so the
  gradient is one vector-Jacobian product of the kernel.

Solvers, as the regressor's (tinygp style: the model never factorises itself), each with
``mode``, ``value_and_grad`` and ``posterior``:

- :class:`LaplaceCholesky`: dense ``K`` and Cholesky factors of ``B`` (``O(n²)`` memory,
  ``O(n³)`` per Newton step); the exact answer (scikit-learn's GaussianProcessClassifier's),
  for a few thousand points.
- :class:`LaplaceCG`: matrix-free. Each Newton step is one preconditioned CG solve with ``B``
  through the engine's kernel products, for the step's correction to ``a``; the
  preconditioner is ``P = I + W^½ L Lᵀ W^½`` from one rank-k pivoted Cholesky ``L`` of ``K``
  per ``θ`` (only ``W`` changes between steps: an ``O(n k²)`` QR per step). At the mode, one
  mBCG call on ``[W^½ K s₂, z₁ … z_t]`` (``z ~ N(0, P)``) gives ``v``, ``log|B|`` by
  stochastic Lanczos quadrature, and the probes' solves for the Hutchinson estimate
  ``tr(R ∂K) ≈ (1/t) Σ_i (W^½B⁻¹z_i)ᵀ ∂K (W^½P⁻¹z_i)``. ``diag(Σ)``, needed only for the
  implicit term, is the projection ``D + L (I + LᵀWL)⁻¹ Lᵀ`` onto the factor (``D`` the
  factor's residual diagonal), exact when ``K = LLᵀ``. Memory linear in n.

Predictions (R&W 3.21, 3.24): latent mean ``K(X*, X) ∇log p(t|f̂)`` and variance
``k(x*, x*) - k*ᵀ (K + W⁻¹)⁻¹ k*``; `posterior` returns a `Posterior` whose ``love_factor``
``F`` has ``(K + W⁻¹)⁻¹ ≈ F Fᵀ`` (dense: ``F = W^½ L_B⁻ᵀ`` exactly; matrix-free: the Galerkin
projection of ``B⁻¹`` on the span of ``W^½ L``, ``F = W^½ Q (QᵀBQ)^{-½}``), so
`scalegp.gp.predict` computes both with the noise left out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp import linalg
from scalegp._runtime import bounded_host_blas
from scalegp.gp._exact import covariance
from scalegp.gp._params import Hyperparameters, Posterior
from scalegp.ops import Engine, dense_products

_HIGHEST = lax.Precision.HIGHEST

#: Halvings of a Newton step that lowers ``Ψ`` before the run ends at the last iterate.
MAX_HALVINGS = 10

#: scikit-learn's stopping rule for Newton's method: a gain of ``Ψ`` below this (absolute) ends
#: it; in float32 the rounding of ``Ψ`` sets a looser one (`_newton_tol`).
NEWTON_TOL = 1e-10


def log_likelihood(t, f):
    """``log p(t|f) = Σ log σ((2t - 1) f)`` for labels ``t (n,)`` in {0, 1}, stably."""
    return -jnp.sum(jax.nn.softplus(-(2.0 * t - 1.0) * f))


def likelihood_terms(t, f):
    """``(π, W, ∇log p)`` at ``f``: ``π = σ(f)``, ``W = π(1 - π)``, ``∇log p = t - π``."""
    pi = jax.nn.sigmoid(f)
    return pi, pi * (1.0 - pi), t - pi


def _newton_tol(value, dtype):
    eps = float(jnp.finfo(dtype).eps)
    return max(NEWTON_TOL, 100.0 * eps * max(abs(float(value)), 1.0)) if eps > 1e-10 else \
        NEWTON_TOL


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LaplaceMode:
    """The mode of ``Ψ`` and what the objective and predictions need of it.

    Attributes:
      f: ``(n,)``, the mode ``f̂``.
      a: ``(n,)``, ``K⁻¹f̂`` (as Newton's last step left it; ``= t - π`` at convergence).
      value: ``()``, ``log q(t|θ) = Ψ(f̂) - ½ log|B|`` (SLQ estimate for `LaplaceCG`).
      grad: the gradient of ``value`` with respect to the parameters (their pytree), or None.
      iterations: ``()``, Newton steps taken.
      converged: ``()`` bool, Newton's gain fell below its tolerance within the step limit.
      failed: ``()`` bool, the run ended at a step that lowered ``Ψ`` beyond rounding however
        much it was shortened: ``f`` is not the mode, nor ``value`` log q at one.
      cg: the last CG result (`scalegp.linalg.CGResult`), None for the dense solver.
    """

    f: jax.Array
    a: jax.Array
    value: jax.Array
    grad: object = None
    iterations: jax.Array | int = 0
    converged: jax.Array | bool = True
    failed: jax.Array | bool = False
    cg: object = None


def _psi(t, f, a):
    return -0.5 * jnp.dot(a, f, precision=_HIGHEST) + log_likelihood(t, f)


# ------------------------------------------------------------------------------------------
# Dense


def _dense_step(kmat, t, f):
    """One Newton step from ``f`` (Algorithm 3.1): ``(f_new, a_new, ½ log|B|)``, ``B`` at
    ``f`` (scikit-learn's log q of the step has it there)."""
    eye = jnp.eye(t.shape[0], dtype=kmat.dtype)
    _, w, grad = likelihood_terms(t, f)
    sw = jnp.sqrt(w)
    chol = jnp.linalg.cholesky(eye + sw[:, None] * kmat * sw[None, :])
    b = w * f + grad
    c = sw * jnp.matmul(kmat, b, precision=_HIGHEST)
    a = b - sw * jax.scipy.linalg.cho_solve((chol, True), c)
    f_new = jnp.matmul(kmat, a, precision=_HIGHEST)
    return f_new, a, jnp.sum(jnp.log(jnp.diagonal(chol)))


def _dense_tols(dtype):
    """(absolute, relative) gain below which Newton stops: scikit-learn's 1e-10 in float64,
    100 roundings of ``log q`` in float32."""
    if jnp.dtype(dtype) == jnp.float64:
        return NEWTON_TOL, 0.0
    return 0.0, 100.0 * float(jnp.finfo(dtype).eps)


def _damped(t, f, a, f_new, a_new, psi):
    """The step from ``(f, a)`` to ``(f_new, a_new)``, halved (at most `MAX_HALVINGS` times)
    while ``Ψ`` there is below ``psi``: ``(f, a, Ψ)``. ``f = K a`` is linear in ``a``, so a
    halved step stays on that line."""

    def lower(state):
        return (state[0] < MAX_HALVINGS) & (state[3] < psi)

    def halve(state):
        j, f_half, a_half, _ = state
        f_half, a_half = 0.5 * (f + f_half), 0.5 * (a + a_half)
        return j + 1, f_half, a_half, _psi(t, f_half, a_half)

    _, f_new, a_new, psi_new = lax.while_loop(lower, halve,
                                              (0, f_new, a_new, _psi(t, f_new, a_new)))
    return f_new, a_new, psi_new


@functools.partial(jax.jit, static_argnums=(3, 4))
def _dense_newton(kmat, t, f0, max_iter, tols, psi0):
    """Newton's method from ``f0`` (``Ψ`` there ``psi0``; -inf where unknown, a warm start's)
    until ``log q`` gains less than ``tols`` (absolute, relative) allow, at most ``max_iter``
    steps: ``(f, a, iterations, converged, failed)``.

    A step that lowers ``Ψ`` is halved first (as `LaplaceCG`'s); one that still lowers it
    beyond the tolerance ends the run at the last iterate, ``failed``. In float32 on a huge,
    almost constant ``K`` (the bounds' corner, outputscale 1e5) ``f = K a`` carries a's
    rounding times ``λ_max(K)``: undamped steps went downhill and stopped "converged" at
    ``log q`` = -2.8e10 where float64 has -646, with a gradient as wrong."""

    def small(value, previous):
        return value - previous < tols[0] + tols[1] * jnp.abs(value)

    def keep_going(state):
        i, _, _, value, previous, _, failed = state
        return (i < max_iter) & ~small(value, previous) & ~failed

    def step(state):
        i, f, a, value, _, psi, _ = state
        f_new, a_new, half_logdet = _dense_step(kmat, t, f)
        f_new, a_new, psi_new = _damped(t, f, a, f_new, a_new, psi)
        new_value = psi_new - half_logdet
        # A mode far out (a huge outputscale: |f| grows by about 1 a step) ends in float32
        # overflow after tens of steps; the last finite iterate is kept, as converged.
        finite = jnp.isfinite(new_value) & jnp.all(jnp.isfinite(f_new))
        failed = finite & (psi_new < psi - tols[0] - tols[1] * jnp.abs(psi))
        take = finite & ~failed
        return (i + 1, jnp.where(take, f_new, f), jnp.where(take, a_new, a),
                jnp.where(take, new_value, value), value, jnp.where(take, psi_new, psi),
                failed)

    inf = jnp.asarray(jnp.inf, kmat.dtype)
    state = (0, f0, jnp.zeros_like(f0), -inf, -inf, jnp.asarray(psi0, kmat.dtype), False)
    i, f, a, value, previous, _, failed = lax.while_loop(keep_going, step, state)
    return f, a, i, small(value, previous) & ~failed, failed


def _dense_objective(params, x, t, f, a):
    """``log q`` at the mode ``(f, a)`` and its gradient (Algorithm 5.1, with the adjoint
    ``v``), pulled back through ``K(θ)`` by one VJP."""
    kmat, pullback = jax.vjp(lambda p: covariance(p.constrained(), x), params)
    n = t.shape[0]
    eye = jnp.eye(n, dtype=kmat.dtype)
    pi, w, grad_lik = likelihood_terms(t, f)
    sw = jnp.sqrt(w)
    chol = jnp.linalg.cholesky(eye + sw[:, None] * kmat * sw[None, :])
    value = _psi(t, f, a) - jnp.sum(jnp.log(jnp.diagonal(chol)))
    # R = W^½ B⁻¹ W^½
    r = sw[:, None] * jax.scipy.linalg.cho_solve((chol, True), jnp.diag(sw))
    c = jax.scipy.linalg.solve_triangular(chol, sw[:, None] * kmat, lower=True)
    sigma_diag = jnp.diagonal(kmat) - jnp.sum(c * c, axis=0)
    s2 = -0.5 * sigma_diag * w * (1.0 - 2.0 * pi)  # ∂W/∂f = π(1-π)(1-2π)
    v = s2 - jnp.matmul(r, jnp.matmul(kmat, s2, precision=_HIGHEST), precision=_HIGHEST)
    cotangent = 0.5 * jnp.outer(a, a) - 0.5 * r + jnp.outer(v, grad_lik)
    (grad,) = pullback(cotangent)
    return value, grad


_dense_value_and_grad = jax.jit(_dense_objective)


@jax.jit
def _dense_value(params, x, t, f, a):
    kmat = covariance(params.constrained(), x)
    _, w, _ = likelihood_terms(t, f)
    sw = jnp.sqrt(w)
    chol = jnp.linalg.cholesky(jnp.eye(t.shape[0], dtype=kmat.dtype)
                               + sw[:, None] * kmat * sw[None, :])
    return _psi(t, f, a) - jnp.sum(jnp.log(jnp.diagonal(chol)))


@jax.jit
def _dense_factor(params, x, f, t):
    """``F = W^½ L_B⁻ᵀ`` (n, n): ``(K + W⁻¹)⁻¹ = W^½ B⁻¹ W^½ = F Fᵀ``."""
    kmat = covariance(params.constrained(), x)
    _, w, _ = likelihood_terms(t, f)
    sw = jnp.sqrt(w)
    eye = jnp.eye(t.shape[0], dtype=kmat.dtype)
    chol = jnp.linalg.cholesky(eye + sw[:, None] * kmat * sw[None, :])
    inv = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)  # L⁻¹
    return sw[:, None] * inv.T


@dataclasses.dataclass(frozen=True)
class LaplaceCholesky:
    """Dense Laplace approximation: scikit-learn's algorithm, ``O(n²)`` memory.

    Attributes:
      max_iter: Newton steps at most (scikit-learn's ``max_iter_predict``).
    """

    max_iter: int = 100

    def mode(self, params, x, t, f0=None, *, gradient: bool = False) -> LaplaceMode:
        """The mode from ``f0`` (zeros by default), ``log q`` there and, with ``gradient``,
        its gradient with respect to ``params``."""
        with bounded_host_blas():
            kmat = jax.jit(covariance)(params.constrained(), x)
            # Ψ at f0 needs a = K⁻¹f0: known (0) for the cold start only
            psi0 = -jnp.inf if f0 is not None else log_likelihood(t, jnp.zeros_like(t))
            f0 = jnp.zeros_like(t) if f0 is None else jnp.asarray(f0, t.dtype)
            f, a, iterations, converged, failed = _dense_newton(
                kmat, t, f0, self.max_iter, _dense_tols(t.dtype), psi0)
            if gradient:
                value, grad = _dense_value_and_grad(params, x, t, f, a)
            else:
                value, grad = _dense_value(params, x, t, f, a), None
            value = jax.block_until_ready(value)
        return LaplaceMode(f=f, a=a, value=value, grad=grad, iterations=iterations,
                           converged=converged, failed=failed)

    def posterior(self, params, x, t, mode: LaplaceMode) -> Posterior:
        """``alpha = a`` (n, 1) and the exact variance factor (see `LaplaceCG.posterior`
        for why ``a`` rather than ``∇log p(t|f̂)``: equal at the exact mode)."""
        with bounded_host_blas():
            factor = jax.block_until_ready(_dense_factor(params, x, mode.f, t))
        return Posterior(alpha=mode.a[:, None], love_factor=factor)


# ------------------------------------------------------------------------------------------
# Matrix-free


def _latent_mv(hp: Hyperparameters, x, engine: Engine):
    def matvec(v):
        return engine.kernel_mv(x, x, v, hp.kernel) + hp.noise * v

    return matvec


def _b_operator(hp, x, engine, sw):
    """``V -> B V = V + W^½ K W^½ V`` on ``(n, t)`` blocks."""
    latent = _latent_mv(hp, x, engine)
    return lambda v: v + sw[:, None] * latent(sw[:, None] * v)


def _kernel_factor(hp: Hyperparameters, x, rank: int, engine: Engine):
    """A rank-``rank`` pivoted-Cholesky factor ``L (n, k)`` of ``K`` (without the noise), its
    columns from ``engine`` (`scalegp.ops.Engine.kernel_columns`)."""
    rank = min(rank, x.shape[0])
    diag = jnp.full((x.shape[0],), hp.kernel.at_zero(), x.dtype)

    def column(i):
        return engine.kernel_columns(x, x[i][None, :], hp.kernel)[:, 0]

    return linalg.pivoted_cholesky(diag, column, max_rank=rank).factor


def _b_preconditioner(hp, factor, w, engine: Engine):
    """``P = I + W^½ (L Lᵀ + σ²I) W^½ = W^½ L Lᵀ W^½ + diag(1 + σ² W)``, its products the
    engine's (`scalegp.ops.dense_products` of its mesh)."""
    sw = jnp.sqrt(w)
    return linalg.LowRankPreconditioner.from_factor(sw[:, None] * factor, 1.0 + hp.noise * w,
                                                    products=dense_products(engine.mesh))


def _cg_newton_step(solver, params, x, t, factor, f, a, first):
    """One Newton step with a preconditioned CG solve of ``B``, in the incremental form:
    ``(f_new, a_new, Ψ(f_new, a_new), cg result)``.

    R&W's step ``a_new = (I + WK)⁻¹ b``, ``b = W f + ∇log p``, written as a correction,
    ``a_new = a + (I + WK)⁻¹ g = a + g - W^½ B⁻¹ W^½ K g`` with ``g = W (f - K a) + ∇log p - a``
    (``= b`` on the ``first`` step, where ``a = 0`` and ``f`` may be a warm start; ``= ∇log p -
    a`` after it, where ``f = K a``): the same step, but the solve's error is relative to ``g``,
    which vanishes at the mode, not to ``b``, which does not. A relative residual of
    ``newton_cg_tol`` on ``b`` becomes, through ``f = K a``, an error up to ``λ_max(K)`` times
    larger in ``f``; in float32 on 50,000 points that left the final iterate far below the
    mode's ``log q`` (docs/decisions.md #38)."""
    hp = params.constrained()
    latent = _latent_mv(hp, x, solver.engine)
    _, w, grad_lik = likelihood_terms(t, f)
    sw = jnp.sqrt(w)
    g = jnp.where(first, w * f + grad_lik, grad_lik - a)
    kg = latent(g[:, None])[:, 0]
    res = linalg.cg(_b_operator(hp, x, solver.engine, sw), (sw * kg)[:, None],
                    preconditioner=_b_preconditioner(hp, factor, w, solver.engine),
                    tol=solver.newton_cg_tol, max_iter=solver.max_cg_iter)
    a_new = a + g - sw * res.solution[:, 0]
    f_new = latent(a_new[:, None])[:, 0]
    return f_new, a_new, _psi(t, f_new, a_new), res


def projected_variances(factor, w, products=None):
    """``diag(L (I + Lᵀ W L)⁻¹ Lᵀ)`` (n,) for a factor L (n, k) and weights w (n,) >= 0: the
    k × k inverse by its eigendecomposition (`scalegp.linalg.small_eigh`, on the host on a
    TPU, where XLA's Cholesky factor and triangular solve compiled slowly; docs/decisions.md
    #54). ``I + Lᵀ W L >= I``, so its eigenvalues are clamped at 1. ``products``: the dense
    products (default `scalegp.ops.dense_products`)."""
    matmul, matmul_tn = products or dense_products()
    k = factor.shape[1]
    inner = jnp.eye(k, dtype=factor.dtype) + matmul_tn(factor, w[:, None] * factor)
    values, vectors = linalg.small_eigh(0.5 * (inner + inner.T))
    projected = matmul(factor, vectors)  # (n, k)
    return jnp.sum(projected * projected / jnp.maximum(values, 1.0), axis=1)


def _cg_objective(solver, params, x, t, factor, f, a, key, gradient):
    """``log q`` at the mode ``(f, a)`` by SLQ and, with ``gradient``, its gradient: one mBCG
    call on ``[W^½ K s₂, probes]`` and one VJP of the kernel product."""
    hp = params.constrained()
    latent = _latent_mv(hp, x, solver.engine)
    pi, w, grad_lik = likelihood_terms(t, f)
    sw = jnp.sqrt(w)
    precond = _b_preconditioner(hp, factor, w, solver.engine)
    # diag(Σ), Σ = (K⁻¹ + W)⁻¹, projected on the factor: D + L (I + LᵀWL)⁻¹ Lᵀ.
    residual = jnp.maximum(hp.kernel.at_zero() - jnp.sum(factor * factor, axis=1), 0.0)
    sigma_diag = residual + hp.noise + projected_variances(factor, w, precond.products)
    s2 = -0.5 * sigma_diag * w * (1.0 - 2.0 * pi)
    ks2 = latent(s2[:, None])
    res = linalg.solve_and_logdet(
        _b_operator(hp, x, solver.engine, sw), sw[:, None] * ks2, key,
        num_probes=solver.num_probes, preconditioner=precond, tol=solver.cg_tol,
        max_iter=solver.max_cg_iter)
    value = _psi(t, f, a) - 0.5 * res.logdet
    if not gradient:
        return value, None, res.cg
    v = s2 - sw * res.solution[:, 0]
    num = solver.num_probes
    whitened = precond.solve(res.probes)
    u = lax.stop_gradient(jnp.concatenate(
        [0.5 * a[:, None], (-0.5 / num) * sw[:, None] * res.probe_solutions, v[:, None]],
        axis=1))
    cols = lax.stop_gradient(jnp.concatenate(
        [a[:, None], sw[:, None] * whitened, grad_lik[:, None]], axis=1))

    def form(kernel, noise):
        kw = solver.engine.kernel_mv(x, x, cols, kernel) + noise * cols
        return jnp.sum(u * kw)

    g_kernel, g_noise = jax.grad(form, argnums=(0, 1))(hp.kernel, hp.noise)
    _, pullback = jax.vjp(lambda p: p.constrained(), params)
    (grad,) = pullback(Hyperparameters(mean=jnp.zeros_like(hp.mean), kernel=g_kernel,
                                       noise=g_noise))
    return value, grad, res.cg


def _cg_factor(solver, params, x, t, factor, f):
    """``F = W^½ Q (QᵀBQ)^{-½}`` (n, k), ``Q`` an orthonormal basis of ``W^½ L``: the
    Galerkin projection of ``B⁻¹``, so ``(K + W⁻¹)⁻¹ ≈ F Fᵀ`` for the kernel columns
    ``k*``, which the factor's span represents (as the regressor's variance cache)."""
    hp = params.constrained()
    _, w, _ = likelihood_terms(t, f)
    sw = jnp.sqrt(w)
    precond = _b_preconditioner(hp, factor, w, solver.engine)
    matmul, matmul_tn = precond.products
    h = matmul_tn(precond.basis, _b_operator(hp, x, solver.engine, sw)(precond.basis))
    eigenvalues, eigenvectors = linalg.small_eigh(0.5 * (h + h.T))
    inv_sqrt = lax.rsqrt(jnp.maximum(eigenvalues, 1.0))  # B >= I
    return sw[:, None] * matmul(precond.basis, eigenvectors * inv_sqrt)


_cg_newton_step_jit = jax.jit(_cg_newton_step, static_argnums=0)
_cg_objective_jit = jax.jit(_cg_objective, static_argnums=(0, 8))
_cg_factor_jit = jax.jit(_cg_factor, static_argnums=0)
_kernel_factor_jit = jax.jit(
    lambda params, x, rank, engine: _kernel_factor(params.constrained(), x, rank, engine),
    static_argnums=(2, 3))


@dataclasses.dataclass(frozen=True)
class LaplaceCG:
    """Matrix-free Laplace approximation (see the module docstring); memory linear in n.

    Attributes:
      max_iter: Newton steps at most.
      num_probes: probes ``t`` for ``log|B|`` and the trace term.
      preconditioner_rank: rank ``k`` of the pivoted Cholesky of ``K`` behind the
        preconditioner ``I + W^½LLᵀW^½``, ``diag(Σ)`` and the variance factor. ``B``'s spectrum
        is ``1 + λ(W^½KW^½)`` with ``W <= ¼``: far fewer eigenvalues stand above 1 than above
        a regression noise, so a lower rank than the regressor's serves.
      cg_tol: relative residual of the objective's mBCG solves (the adjoint and the probes).
      newton_cg_tol: relative residual of each Newton step's solve.
      max_cg_iter: iteration cap of every solve.
      seed: the probes' seed (fixed probes: a deterministic objective for L-BFGS-B).
      engine: where the kernel products run.
    """

    max_iter: int = 100
    num_probes: int = 30
    preconditioner_rank: int = 256
    cg_tol: float = 1e-3
    newton_cg_tol: float = 1e-5
    max_cg_iter: int = 1000
    seed: int = 0
    engine: Engine = Engine()

    def _static(self):
        return dataclasses.replace(self, seed=0)

    def memory_bytes(self, n: int, itemsize: int) -> int:
        """A lower bound of the bytes a fit on ``n`` points holds at once: two ``(n, k)``
        arrays of ``itemsize`` bytes, ``k = min(preconditioner_rank, n)``: the
        pivoted-Cholesky factor and the preconditioner's basis made from it."""
        return 2 * n * min(self.preconditioner_rank, n) * itemsize

    def factor(self, params, x):
        """The pivoted-Cholesky factor ``L (n, k)`` of ``K`` at ``params``."""
        return _kernel_factor_jit(params, x, self.preconditioner_rank, self.engine)

    def mode(self, params, x, t, f0=None, *, gradient: bool = False, factor=None
             ) -> LaplaceMode:
        """Newton's method from ``f0`` (zeros by default), each step one CG solve of ``B``
        (`_cg_newton_step`); a step that lowers ``Ψ`` is halved (up to 10 times) before it is
        taken, and one that still does, by more than rounding, ends the run at the last
        iterate with ``converged`` False and ``failed``. Then ``log q`` by SLQ and, with
        ``gradient``, its gradient."""
        static = self._static()
        factor = self.factor(params, x) if factor is None else factor
        f = jnp.zeros_like(t) if f0 is None else jnp.asarray(f0, t.dtype)
        # Ψ at f0 needs a = K⁻¹f0: unknown for a warm start, so its first step is always taken.
        a = jnp.zeros_like(t)
        psi = -np.inf if f0 is not None else float(log_likelihood(t, f))
        converged, failed, res, iterations = False, False, None, 0
        for iterations in range(1, self.max_iter + 1):
            f_new, a_new, psi_new, res = _cg_newton_step_jit(
                static, params, x, t, factor, f, a, iterations == 1)
            psi_new = float(psi_new)
            for _ in range(MAX_HALVINGS):  # Ψ is concave: a short enough step gains
                if not psi_new < psi:
                    break
                f_new, a_new = 0.5 * (f + f_new), 0.5 * (a + a_new)
                psi_new = float(_psi(t, f_new, a_new))
            gain = psi_new - psi
            if gain > 0:
                f, a, psi = f_new, a_new, psi_new
            tol = _newton_tol(psi, t.dtype)
            if gain < tol:
                # at the mode a step gains nothing, or loses to rounding; one that still loses
                # more after the halvings failed (an inexact solve's direction), and the run
                # ends at the last iterate, not converged
                converged = gain > -tol
                failed = not converged
                break
        _warn_if_not_converged(res, "Laplace Newton step solve", self.max_cg_iter)
        value, grad, cg = _cg_objective_jit(static, params, x, t, factor, f, a,
                                            jax.random.PRNGKey(self.seed), gradient)
        return LaplaceMode(f=f, a=a, value=value, grad=grad, iterations=iterations,
                           converged=converged, failed=failed, cg=cg)

    def posterior(self, params, x, t, mode: LaplaceMode, factor=None) -> Posterior:
        """``alpha = a`` (n, 1), the Newton iterate with ``f̂ = K a``, and the Galerkin
        variance factor (n, k). At the exact mode ``a = ∇log p(t|f̂)``; away from it (float32,
        the solves' tolerance) ``∇log p(t|f̂)`` is off by ``W δf``, which ``K(X*, X)`` sums
        over every neighbour (a latent mean off by several units at an outputscale of 100),
        while ``a`` keeps the predictions at the training points equal to ``f̂``."""
        factor = self.factor(params, x) if factor is None else factor
        return Posterior(alpha=mode.a[:, None],
                         love_factor=_cg_factor_jit(self._static(), params, x, t, factor,
                                                    mode.f))


def _warn_if_not_converged(result, what, max_iter):
    from sklearn.exceptions import ConvergenceWarning

    linalg.warn_if_not_converged(result, what, setting="max_cg_iter",
                                 category=ConvergenceWarning, stacklevel=4, max_iter=max_iter)


# ------------------------------------------------------------------------------------------
# Predictive probabilities

#: scikit-learn's (and R&W §3.9's) approximation of the logistic function by a combination
#: of five error functions, ``σ(z) ≈ ½ Σ c_k + ½ Σ c_k erf(λ_k z)`` (Williams & Barber, 1998):
#: its average over ``z ~ N(μ, s²)`` is closed form.
_LAMBDAS = np.array([0.41, 0.4, 0.37, 0.44, 0.39])
_COEFS = np.array([-1854.8214151, 3516.89893646, 221.29346712, 128.12323805, -2010.49422654])


def averaged_sigmoid(mean, variance):
    """``E[σ(f)]`` for ``f ~ N(mean, variance)`` (float64 numpy, any shape):
    ``½ Σ c_k + ½ Σ c_k erf(λ_k μ / √(1 + 2 λ_k² s²))``, clipped to [0, 1]."""
    from scipy.special import erf

    mean = np.asarray(mean, np.float64)[..., None]
    variance = np.maximum(np.asarray(variance, np.float64), 0.0)[..., None]
    terms = 0.5 * erf(_LAMBDAS * mean / np.sqrt(1.0 + 2.0 * _LAMBDAS**2 * variance))
    return np.clip(np.sum(_COEFS * terms, axis=-1) + 0.5 * np.sum(_COEFS), 0.0, 1.0)
