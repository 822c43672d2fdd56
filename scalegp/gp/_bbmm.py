"""Memory-linear inference: BBMM (mBCG, stochastic Lanczos quadrature, engine VJPs), the
pivoted-Cholesky preconditioner and the variance cache."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp import linalg
from scalegp._ahead import compile_ahead
from scalegp.gp._exact import EXACT_MAX_N, CholeskySolver
from scalegp.gp._params import GPParams, Hyperparameters, ObjectiveResult, Posterior, check_training
from scalegp.ops import Engine, dense_products, mesh_axis, shard_map


#: Columns of the variance basis per kernel product in `_galerkin_factor`. Its ``(n, block)``
#: temporaries are half a basis at 256, against a whole one at 512, for twice the kernel
#: evaluations (docs/decisions.md #42).
_GALERKIN_BLOCK = 256


def _row_sharded(x, mesh):
    """x with its rows sharded over ``mesh`` (when they divide evenly), inside jit: CG vectors,
    inner products (then all-reduced) and the preconditioner's per-row work follow x's layout."""
    if mesh is None:
        return x
    axis, p = mesh_axis(mesh)
    if x.shape[0] % p:
        return x
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
    return lax.with_sharding_constraint(x, rows)


def _times_noise(noise, v):
    """``diag(noise) v`` for a noise ``()`` or ``(n,)`` (one per row of ``v (n, t)``)."""
    return (noise[:, None] if jnp.ndim(noise) else noise) * v


def _operator(hp: Hyperparameters, x, engine: Engine):
    def matvec(v):
        return engine.kernel_mv(x, x, v, hp.kernel) + _times_noise(hp.noise, v)

    return matvec


def _preconditioner(hp: Hyperparameters, x, rank: int, engine: Engine, rel_tol=None,
                    noise=None):
    """``P = L Lᵀ + D`` from a rank-``rank`` pivoted Cholesky of ``K(x, x)``, ``D`` the noise
    (``noise``, default ``hp.noise``: ``σ²I``, or ``diag(σ²)`` for a per-point noise); the
    kernel columns from ``engine`` (`scalegp.ops.Engine.kernel_columns`).

    With the engine's mesh (and n a multiple of its size) it is built shard-wise, as the CG
    vectors are laid out: each device computes its rows of every kernel column and of the
    factor, and the QR is a tall-skinny QR (see
    `scalegp.linalg.LowRankPreconditioner.from_factor`), so no column, factor or basis is ever
    gathered onto one device; the basis comes back row-sharded.
    """
    rank = min(rank, x.shape[0])
    noise = hp.noise if noise is None else noise
    mesh = engine.mesh
    axis, p = mesh_axis(mesh) if mesh is not None else (None, 1)
    # The kernels' products on one device; over a mesh XLA's, which it partitions by rows.
    products = dense_products(mesh)
    if mesh is None or x.shape[0] % p:
        return _local_preconditioner(hp, x, noise, rank=rank, rel_tol=rel_tol, axis_name=None,
                                     engine=engine, products=products)
    rows, replicated = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
    build = shard_map(
        functools.partial(_local_preconditioner, rank=rank, rel_tol=rel_tol, axis_name=axis,
                          engine=engine, products=products),
        mesh=mesh,
        in_specs=(replicated, rows, rows if jnp.ndim(noise) else replicated),
        out_specs=linalg.LowRankPreconditioner(rows, replicated, rows, products),
    )
    return build(hp, x, noise)


def _local_preconditioner(hp: Hyperparameters, x, noise, *, rank, rel_tol, axis_name, engine,
                          products):
    """`_preconditioner` on the rows ``x`` (and ``noise``, when per point) of this device (all
    rows when ``axis_name`` is None)."""
    diag = jnp.full((x.shape[0],), hp.kernel.at_zero(), x.dtype)  # stationary: k(x, x) = k(0)

    def column(i):
        xi = linalg.sharded_row(x, i, axis_name)[None, :]
        return engine.kernel_columns(x, xi, hp.kernel)[:, 0]

    piv = linalg.pivoted_cholesky(diag, column, max_rank=rank, rel_tol=rel_tol,
                                  axis_name=axis_name)
    return linalg.LowRankPreconditioner.from_factor(piv.factor, noise, axis_name=axis_name,
                                                    products=products)


@dataclasses.dataclass(frozen=True)
class BBMMSolver:
    """Memory-linear inference by preconditioned mBCG, SLQ and engine VJPs.

    Attributes:
      num_probes: ``t`` probe vectors for the log-determinant and trace estimates.
      preconditioner_rank: rank of the pivoted-Cholesky preconditioner ``P = L Lᵀ + σ² I``.
        The default, 768, is high enough that few CG iterations remain and that the control
        variate of the gradient's trace term takes over on problems of a few thousand points
        (the accuracy is checked against the exact gradient in tests/gp/test_bbmm.py); its cost,
        ``O(n k²)`` once per objective, is repaid by the CG iterations it saves
        (`benchmarks/gp_scale.py`).
      cg_tol: relative-residual tolerance of the training solves.
      max_cg_iter: CG iteration cap (a ConvergenceWarning names it when a solve reaches it).
      predict_tol: tolerance of the ``α`` solve behind predictions (tighter than training).
        A residual ``r = (y - m) - Aα`` moves the predictive mean at the training points by
        ``K A⁻¹ r``, and ``‖K A⁻¹‖ <= 1``: at most ``predict_tol`` in RMS, in units of the
        targets' RMS (docs/decisions.md #37).
      love_rank: rank of the variance cache (see :meth:`love`).
      seed: seed of the fixed probes (the objective is deterministic given it).
      engine: where the kernel products run (`scalegp.ops.Engine`); with a mesh, the CG vectors
        and inner products are sharded by rows over it as well.
    """

    num_probes: int = 30
    preconditioner_rank: int = 768
    cg_tol: float = 1e-3
    max_cg_iter: int = 1000
    predict_tol: float = 1e-4
    love_rank: int = 1024
    seed: int = 0
    control_variate: bool | str = "auto"
    engine: Engine = Engine()

    def value_and_grad(self, params: GPParams, x, y, *, warn: bool = True) -> ObjectiveResult:
        """NLML and its gradient by BBMM; jit-able (``warn`` is skipped on traced values)."""
        check_training(x, y)
        leaves = jax.tree_util.tree_leaves((params, x, y))
        static, key = _static_part(self), _probe_key(self)
        if any(isinstance(a, jax.core.Tracer) for a in leaves):
            result = _bbmm_value_and_grad(static, params, x, y, key)
        else:
            # Two compiled halves, the control variate chosen on the host between them: under
            # one jit both branches of the choice are compiled and XLA reserves the larger
            # one's buffers, about six (n, preconditioner_rank) arrays, even where the plain
            # estimator is taken, as it is at large n (docs/decisions.md #14).
            value, res, precond = _bbmm_solve(static, params, x, y, key)
            use = bool(_uses_control_variate(self, res))
            result = _bbmm_gradient(static, params, x, value, res, precond, use)
        if warn:
            _warn_if_not_converged(result.cg, "BBMM training solve", self.max_cg_iter)
        return result

    def compile_ahead(self, params: GPParams, x, y, posterior: bool = True) -> list:
        """Starts compiling, in background threads (`scalegp._ahead`), the programs that
        `value_and_grad` and (with ``posterior``) `posterior` with ``variance`` and a warm start
        run on ``x (n, d)`` and ``y (n, o)`` (arrays or shapes) at parameters shaped as
        ``params``: the solves, the gradient with and without the control variate, the
        prediction solve with its variance basis, and the Galerkin factor. Returns at once the
        futures of the first (or first two), whose results are the futures of the programs that
        take their outputs; those calls then find their programs compiled, or wait for them.
        Only shapes are kept. Nothing where the engine has a mesh (the arguments' placements
        are then the caller's to choose)."""
        if self.engine.mesh is not None:
            return []
        static = _static_part(self)
        n, o = y.shape

        def gradients(solved):
            return [compile_ahead(_bbmm_gradient, static, params, x, *solved, use)
                    for use in (False, True)]

        def galerkin(solved):
            return [compile_ahead(_galerkin, static, params, x, solved[1])]

        started = [compile_ahead(_bbmm_solve, static, params, x, y, _probe_key(self),
                                 then=gradients)]
        if posterior:
            started.append(compile_ahead(_solve_with_variance_basis, static, params, x, y,
                                         jax.ShapeDtypeStruct((n, o), y.dtype), then=galerkin))
        return started

    def memory_bytes(self, n: int, itemsize: int) -> int:
        """A lower bound of the bytes a fit on ``n`` points holds at once, its variance cache
        included: two ``(n, k)`` arrays of ``itemsize`` bytes, ``k`` the larger of the ranks
        (at most ``n``): the pivoted-Cholesky factor and the basis made from it (the
        preconditioner's eigen-form, the Galerkin factor). Everything else a fit holds grows
        as ``n`` times the columns of its solves, fewer."""
        k = min(max(self.preconditioner_rank, self.love_rank), n)
        return 2 * n * k * itemsize

    def posterior(self, params: GPParams, x, y, initial=None, variance: bool = False
                  ) -> Posterior:
        """``α = A⁻¹(y - m)`` to ``predict_tol``; ``initial (n, o)``: a warm start, e.g. the
        training solve's ``α`` at the same parameters (ObjectiveResult.solution).

        With ``variance``, the variance factor (:meth:`love`) as well, from the same pivoted
        Cholesky (rank ``love_rank``), which then preconditions the solve: one factorisation
        instead of two, and (at the default ranks) a stronger preconditioner for the tightest
        solve."""
        check_training(x, y)
        if variance:
            static = _static_part(self)
            res, basis = _solve_with_variance_basis(static, params, x, y, initial)
            factor = _galerkin(static, params, x, basis)
        else:
            res, factor = _bbmm_alpha(_static_part(self), params, x, y, initial), None
        _warn_if_not_converged(res, "prediction solve alpha = A⁻¹(y - m)", self.max_cg_iter)
        return Posterior(alpha=res.solution, love_factor=factor)

    def love(self, params: GPParams, x, posterior: Posterior) -> Posterior:
        """The posterior with its variance factor ``R (n, love_rank)``, ``A⁻¹ ≈ R Rᵀ``, filled in.

        The LOVE form of Pleiss et al. (2018), ``var* = s - s² ‖K(x*, X) R‖²``, on a different
        subspace: ``R = Q (QᵀAQ)^{-1/2}`` is the Galerkin projection of ``A⁻¹`` on the span ``Q``
        of a rank-``love_rank`` pivoted-Cholesky factor of ``K``, i.e. of the kernel columns at
        ``love_rank`` well-spread pivot points, which represent every smooth ``k* = K(X, x*)``.
        LOVE's Krylov space from one start vector resolves the top of ``A``'s spectrum instead
        and needs a rank near the number of eigenvalues of ``sK`` above ``σ²``, hundreds or
        thousands at ``d >= 4``, where this basis is accurate at the default rank (variance
        errors are reported by `benchmarks/gp_scale.py`). Cost: one pivoted Cholesky and one
        kernel product with ``love_rank`` columns (LOVE: ``love_rank`` sequential products).
        Variances from it are upper bounds (a projection under-estimates ``k*ᵀA⁻¹k*``).
        """
        if posterior.love_factor is not None:
            return posterior
        static = _static_part(self)
        factor = _galerkin(static, params, x, _basis(static, params, x))
        return dataclasses.replace(posterior, love_factor=factor)


def _warn_if_not_converged(result, what, max_iter):
    from sklearn.exceptions import ConvergenceWarning

    linalg.warn_if_not_converged(result, what, setting="max_cg_iter",
                                 category=ConvergenceWarning, stacklevel=4, max_iter=max_iter)


def _static_part(solver: BBMMSolver) -> BBMMSolver:
    """``solver`` as the static argument of the jitted functions: without its seed, whose
    probes enter as an argument (`_probe_key`). A static seed would compile every program again
    for every seed, and an estimator with ``random_state=None`` draws one per fit."""
    return dataclasses.replace(solver, seed=0)


def _probe_key(solver: BBMMSolver):
    """The PRNG key of the solver's probes (uint32 (2,)), made outside the compiled code from
    the seed as an integer (any size: ``PRNGKey`` of a traced seed would take its dtype)."""
    return jax.random.PRNGKey(solver.seed)


def _solve(solver: BBMMSolver, params: GPParams, x, y, key):
    """The BBMM objective's solves: ``(value, res, precond)``, the NLML, the mBCG and SLQ result
    on ``[y - m, probes]`` (probes from ``key``) and the preconditioner behind it."""
    hp = params.constrained()
    n, o = y.shape
    mesh = solver.engine.mesh
    x = _row_sharded(x, mesh)
    precond = _preconditioner(hp, x, solver.preconditioner_rank, solver.engine)
    r = _row_sharded(y - hp.mean, mesh)
    res = linalg.solve_and_logdet(
        _operator(hp, x, solver.engine), r, key,
        num_probes=solver.num_probes, preconditioner=precond, tol=solver.cg_tol,
        max_iter=solver.max_cg_iter,
    )
    alpha = lax.stop_gradient(res.solution)
    value = (
        0.5 * jnp.sum(r * alpha) + 0.5 * o * res.logdet + 0.5 * n * o * math.log(2 * math.pi)
    )
    return value, res, precond


def _quadratic_form_grads(solver: BBMMSolver, hp: Hyperparameters, x, res, precond,
                          use_control_variate: bool):
    """``(∂/∂kernel, ∂/∂noise)`` of the NLML's quadratic and trace terms, from one VJP.

    Quadratic forms u_iᵀ (∂A/∂θ) w_i from one VJP: f(θ) = Σ U ∘ A_θ W. The trace term uses the
    preconditioner as a control variate:
      tr(A⁻¹∂A) = tr(P⁻¹∂A) + tr((A⁻¹ - P⁻¹)∂A),
    the first exactly (P⁻¹ = σ⁻²(I - B D Bᵀ), B (n, k) orthonormal, so
    tr(P⁻¹∂A) = σ⁻²(tr ∂A - Σ_k D_k b_kᵀ ∂A b_k)), the second by probes
    (1/t) Σ_i (A⁻¹z_i - P⁻¹z_i)ᵀ ∂A (P⁻¹z_i), whose variance vanishes as P → A.
    With a per-point noise (P = LLᵀ + Σ, Σ = diag(σ²_i)): P⁻¹ = Σ^{-½}(I - B D Bᵀ)Σ^{-½} and
    tr(P⁻¹∂A) = Σ_i ∂A_ii/σ²_i - Σ_k D_k (Σ^{-½}b_k)ᵀ ∂A (Σ^{-½}b_k).
    """
    n, o = res.solution.shape
    t = solver.num_probes
    x = _row_sharded(x, solver.engine.mesh)
    alpha = lax.stop_gradient(res.solution)
    whitened = precond.solve(res.probes)
    inv_noise = 1.0 / hp.noise
    per_point = jnp.ndim(hp.noise) > 0
    c = 1.0 if use_control_variate else 0.0
    us = [-0.5 * alpha, (0.5 * o / t) * (res.probe_solutions - c * whitened)]
    ws = [alpha, whitened]
    if use_control_variate:
        # The basis joins the VJP only when it is used: at large n its k columns cost more
        # than the probes.
        shrink = precond.scaled_eigenvalues / (1.0 + precond.scaled_eigenvalues)
        if per_point:
            basis = lax.rsqrt(precond.noise)[:, None] * precond.basis
            us.append((-0.5 * o) * shrink * basis)
        else:
            basis = precond.basis
            us.append((-0.5 * o) * inv_noise * shrink * basis)
        ws.append(basis)
    u = lax.stop_gradient(jnp.concatenate(us, axis=-1))
    w = lax.stop_gradient(jnp.concatenate(ws, axis=-1))

    def form(kernel, noise):
        kw = solver.engine.kernel_mv(x, x, w, kernel)
        # tr(∂A)/σ² for the exact part: the kernel is stationary, so its diagonal is k(0)
        # everywhere and tr(∂A/∂θ) = n ∂(k(0) + σ²)/∂θ (per point:
        # Σ_i ∂(k(0) + σ²_i)/∂θ / σ²_i).
        if per_point:
            weights = lax.stop_gradient(0.5 * o * c * inv_noise)
            exact_trace = kernel.at_zero() * jnp.sum(weights) + jnp.sum(weights * noise)
        else:
            exact_trace = lax.stop_gradient(0.5 * o * c * inv_noise) * n * (
                kernel.at_zero() + noise)
        return jnp.sum(u * (kw + _times_noise(noise, w))) + exact_trace

    return jax.grad(form, argnums=(0, 1))(hp.kernel, hp.noise)


def _objective(params: GPParams, value, res, grads) -> ObjectiveResult:
    """The `ObjectiveResult` from the NLML, the solves and ``_quadratic_form_grads``."""
    g_k, g_n = grads
    alpha = lax.stop_gradient(res.solution)
    grad_hp = Hyperparameters(mean=-jnp.sum(alpha, axis=0), kernel=g_k, noise=g_n)
    _, pullback = jax.vjp(lambda p: p.constrained(), params)
    (grad,) = pullback(grad_hp)
    return ObjectiveResult(value=value, grad=grad, cg=res.cg, solution=alpha)


def _uses_control_variate(solver: BBMMSolver, res):
    """Whether the gradient's trace term takes the preconditioner control variate: as
    ``solver.control_variate`` says, or for "auto" when the probe solves converged within
    `_CONTROL_VARIATE_MAX_CG_ITER` iterations (P close to A). A traced bool for "auto"."""
    if solver.control_variate == "auto":
        o = res.solution.shape[-1]
        iterations = res.cg.iterations
        # concrete counts are read on the host: eager device ops compile a program each
        xp = jnp if isinstance(iterations, jax.core.Tracer) else np
        return xp.max(xp.asarray(iterations)[..., o:]) <= _CONTROL_VARIATE_MAX_CG_ITER
    return bool(solver.control_variate)


def bbmm_value_and_grad(solver: BBMMSolver, params: GPParams, x, y) -> ObjectiveResult:
    """Pure (jit-able) BBMM objective and gradient; see :class:`BBMMSolver`. The control
    variate's choice is a ``lax.cond`` here (both branches compiled); `BBMMSolver.value_and_grad`
    on concrete inputs makes it between two compiled halves instead (less memory)."""
    return _value_and_grad(solver, params, x, y, _probe_key(solver))


def _value_and_grad(solver: BBMMSolver, params: GPParams, x, y, key) -> ObjectiveResult:
    value, res, precond = _solve(solver, params, x, y, key)
    hp = params.constrained()
    use = _uses_control_variate(solver, res)
    if isinstance(use, bool):
        grads = _quadratic_form_grads(solver, hp, x, res, precond, use)
    else:
        grads = lax.cond(use,
                         lambda: _quadratic_form_grads(solver, hp, x, res, precond, True),
                         lambda: _quadratic_form_grads(solver, hp, x, res, precond, False))
    return _objective(params, value, res, grads)


def _gradient_half(solver, params, x, value, res, precond, use_control_variate):
    grads = _quadratic_form_grads(solver, params.constrained(), x, res, precond,
                                  use_control_variate)
    return _objective(params, value, res, grads)


_bbmm_solve = jax.jit(_solve, static_argnums=0)
_bbmm_gradient = jax.jit(_gradient_half, static_argnums=(0, 6))


#: ``control_variate="auto"`` uses the preconditioner control variate when the probe solves
#: converged within this many CG iterations (P close to A); otherwise the plain estimator.
_CONTROL_VARIATE_MAX_CG_ITER = 5

_bbmm_value_and_grad = jax.jit(_value_and_grad, static_argnums=0)


def _bbmm_alpha_impl(solver, params, x, y, initial=None):
    hp = params.constrained()
    x = _row_sharded(x, solver.engine.mesh)
    precond = _preconditioner(hp, x, solver.preconditioner_rank, solver.engine)
    return _alpha_solve(solver, hp, x, y, precond, initial)


def _alpha_solve(solver, hp, x, y, precond, initial):
    """The prediction solve ``α = A⁻¹(y - m)`` to ``predict_tol``, from ``initial`` or 0."""
    mesh = solver.engine.mesh
    if initial is not None:
        initial = _row_sharded(initial.astype(y.dtype), mesh)
    return linalg.cg(_operator(hp, x, solver.engine), _row_sharded(y - hp.mean, mesh),
                     preconditioner=precond, x0=initial, tol=solver.predict_tol,
                     max_iter=solver.max_cg_iter)


_bbmm_alpha = jax.jit(_bbmm_alpha_impl, static_argnums=0)


def _variance_basis(solver, hp, x, rank=None, preconditioner=None):
    """The orthonormal basis ``Q`` of the variance factor: the span of a rank-``rank``
    (default ``love_rank``) pivoted-Cholesky factor of ``K``, taken from ``preconditioner``
    (built with ``rel_tol=0`` and that rank) when its noise is a scalar."""
    # All `rank` columns (rel_tol=0). The default stop, 10·rank·eps·tr(K), is 1e-3·tr(K) in
    # float32 at rank 1,024: it ends the factor early, and the variances lose far more than
    # rounding. Columns past the rounding level are jittered, harmless to a Galerkin basis.
    # (The training preconditioner keeps the early stop: a full factor there costs more per
    # objective than the CG iterations it saves.)
    # The basis spans the factor's columns, the kernel columns at the pivots: for a scalar
    # noise it is the preconditioner's own basis (a per-point noise tilts that one by Σ^{-½},
    # so the factor is taken again with the scalar floor).
    if preconditioner is not None and jnp.ndim(hp.noise) == 0:
        return preconditioner.basis
    rank = min(solver.love_rank if rank is None else rank, x.shape[0])
    return _preconditioner(hp, x, rank, solver.engine, rel_tol=0.0,
                           noise=jnp.min(hp.noise)).basis


def _galerkin_factor(hp, x, basis, engine, block: int = _GALERKIN_BLOCK):
    """``R = Q (QᵀAQ)^{-1/2}`` for the orthonormal ``basis`` ``Q (n, k)``: the kernel product
    with its columns and an eigendecomposition of the small ``QᵀAQ``.

    ``QᵀAQ`` is formed ``block`` columns at a time, so that besides ``Q`` and ``R`` only
    ``(n, block)`` arrays are live (a block's copy of ``Q``'s columns and its product): ``AQ``
    whole would be two more ``(n, k)`` arrays (the product and its sum with the noise term).
    The kernel is evaluated ``k / block`` times instead of once, beside the ``2 n² k`` flops
    of the products.
    """
    n, k = basis.shape
    block = min(block, k)
    operator = _operator(hp, x, engine)
    matmul, matmul_tn = dense_products(engine.mesh)

    def columns(j, h):
        # The last block ends at column k: it overlaps the one before when block ∤ k and
        # writes the same values there again.
        start = jnp.minimum(j * block, k - block)
        q = lax.dynamic_slice_in_dim(basis, start, block, axis=1)
        part = matmul_tn(basis, operator(q))
        return lax.dynamic_update_slice_in_dim(h, part, start, axis=1)

    h = lax.fori_loop(0, -(-k // block), columns, jnp.zeros((k, k), basis.dtype))
    floor = jnp.min(hp.noise)
    eigenvalues, eigenvectors = linalg.small_eigh(0.5 * (h + h.T))
    # Eigenvalues of QᵀAQ lie in [min σ², λ_max(A)]; the floor only guards rounding.
    inv_sqrt = lax.rsqrt(jnp.maximum(eigenvalues, floor))
    return matmul(basis, eigenvectors * inv_sqrt)


# The variance cache is two programs, the basis and then the Galerkin factor. As one, XLA's
# buffers came to four (n, love_rank) arrays; apart, each holds under three (compiled memory
# analysis: docs/decisions.md #42, tests/gp/test_bbmm.py).
def _solve_with_variance_basis_impl(solver, params, x, y, initial=None):
    """The prediction solve with the rank-``love_rank`` preconditioner, whose basis
    (`_variance_basis`) it returns too: ``(res, basis)``."""
    hp = params.constrained()
    x = _row_sharded(x, solver.engine.mesh)
    rank = min(solver.love_rank, x.shape[0])
    precond = _preconditioner(hp, x, rank, solver.engine, rel_tol=0.0)
    res = _alpha_solve(solver, hp, x, y, precond, initial)
    return res, _variance_basis(solver, hp, x, rank, precond)


def _basis_impl(solver, params, x):
    hp = params.constrained()
    return _variance_basis(solver, hp, _row_sharded(x, solver.engine.mesh))


def _galerkin_impl(solver, params, x, basis):
    hp = params.constrained()
    return _galerkin_factor(hp, _row_sharded(x, solver.engine.mesh), basis, solver.engine)


_solve_with_variance_basis = jax.jit(_solve_with_variance_basis_impl, static_argnums=0)
_basis = jax.jit(_basis_impl, static_argnums=0)
_galerkin = jax.jit(_galerkin_impl, static_argnums=0)


def default_solver(n: int, **bbmm_settings) -> CholeskySolver | BBMMSolver:
    """:class:`CholeskySolver` for ``n <=`` :data:`EXACT_MAX_N`, else :class:`BBMMSolver`."""
    return CholeskySolver() if n <= EXACT_MAX_N else BBMMSolver(**bbmm_settings)
