"""Dense exact inference: the Cholesky NLML, its gradient by autodiff, and the posterior."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from scalegp._ahead import compile_ahead
from scalegp._runtime import bounded_host_blas
from scalegp.gp._params import ObjectiveResult, Posterior, check_training
from scalegp.ops import kernel_matrix, lapack_on_host

#: Largest number of training points for which :func:`default_solver` picks the dense
#: :class:`CholeskySolver` (an ``n × n`` float64 matrix at this size is 134 MB); above it the
#: memory-linear :class:`BBMMSolver`.
EXACT_MAX_N = 4096


def exact_nlml(params, x: jax.Array, y: jax.Array, jitter: float = 0.0) -> jax.Array:
    """NLML by dense Cholesky of ``A = K + (σ² + jitter) I``; differentiable with ``jax.grad``.

    Args:
      params: :class:`GPParams` or :class:`KernelParams` with ``mean (o,)``.
      x: ``(n, d)``; y: ``(n, o)``.

    Returns:
      ``()``; NaN if ``A`` is numerically not positive definite.
    """
    hp = params.constrained()
    n, o = y.shape
    a = covariance(hp, x, jitter)
    chol = jnp.linalg.cholesky(a)
    r = y - hp.mean
    w = jax.scipy.linalg.solve_triangular(chol, r, lower=True)
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol)))
    return 0.5 * jnp.sum(w * w) + 0.5 * o * logdet + 0.5 * n * o * math.log(2 * math.pi)


def covariance(hp, x, jitter=0.0):
    """``A = K(x, x) + (σ² + jitter) I`` (n, n) for :class:`Hyperparameters` ``hp``; with a
    per-point noise ``(n,)``, ``K + diag(σ²) + jitter I``."""
    a = kernel_matrix(hp.kernel, x, x)
    if jnp.ndim(hp.noise) == 0:
        return a + (hp.noise + jitter) * jnp.eye(x.shape[0], dtype=a.dtype)
    return a + jnp.diag(jnp.broadcast_to(hp.noise + jitter, (x.shape[0],)).astype(a.dtype))


@jax.jit
def _checked_cholesky(a):
    """The lower Cholesky factor of ``a`` and whether it is finite, as one program."""
    chol = jnp.linalg.cholesky(a)
    return chol, jnp.all(jnp.isfinite(chol))


def _noise_level(noise) -> float:
    """The noise for messages: the smallest, for a per-point noise."""
    return float(jnp.min(noise))


class NotPositiveDefiniteError(ValueError):
    """``K + σ²I`` failed a Cholesky even with jitter (raise the noise bound or use float64)."""


def _cholesky_with_jitter(a: np.ndarray | jax.Array, noise, max_tries: int = 4):
    """Cholesky of ``a``; on failure add jitter ``10^k · eps · max(diag)`` with a warning.
    ``noise``: the noise level for the messages (read only where one is given)."""
    chol, finite = _checked_cholesky(a)
    if bool(finite):
        return chol, 0.0
    eps = float(jnp.finfo(a.dtype).eps)
    scale = float(jnp.max(jnp.diagonal(a)))
    for k in range(max_tries):
        jitter = scale * eps * 10.0 ** (k + 1)
        chol = jnp.linalg.cholesky(a + jitter * jnp.eye(a.shape[0], dtype=a.dtype))
        if bool(jnp.all(jnp.isfinite(chol))):
            warnings.warn(
                f"K + noise·I (noise={float(noise):.3g}) is not numerically positive definite; "
                f"added jitter {jitter:.3g} to its diagonal. Raise the noise floor "
                "(noise_lower_bound; with a kernel, alpha or a WhiteKernel) or use float64 to "
                "avoid this.",
                RuntimeWarning,
                stacklevel=3,
            )
            return chol, jitter
    raise NotPositiveDefiniteError(
        f"K + noise·I (noise={float(noise):.3g}) is not positive definite even with jitter "
        f"{jitter:.3g}: raise the noise floor (noise_lower_bound; with a kernel, alpha or a "
        "WhiteKernel), use float64, or remove duplicated inputs"
    )


@dataclasses.dataclass(frozen=True)
class CholeskySolver:
    """Dense exact inference: NLML, gradient (autodiff through the Cholesky) and posterior.

    ``O(n²)`` memory: meant for ``n <=`` :data:`EXACT_MAX_N`. A matrix that is not numerically
    positive definite gets jitter with a warning, then a ValueError.
    """

    def compile_ahead(self, params, x, y) -> list:
        """Starts compiling, in background threads (`scalegp._ahead`), the two programs of
        `value_and_grad` on ``x (n, d)`` and ``y (n, o)`` (arrays or shapes) at parameters
        shaped as ``params``, side by side; the futures. They compile for JAX's default device
        (the caller's scope)."""
        n, o = y.shape
        dtype = jax.dtypes.canonicalize_dtype(x.dtype)
        return [compile_ahead(_nlml_parts, params, x, y, 0.0),
                compile_ahead(_nlml_pullback, params, x, 0.0, jax.ShapeDtypeStruct((n, o), dtype),
                              jax.ShapeDtypeStruct((n, n), dtype))]

    def value_and_grad(self, params, x, y) -> ObjectiveResult:
        check_training(x, y)
        # Held until the value is read (JAX dispatches asynchronously): the Cholesky and
        # potri run in OpenBLAS.
        with bounded_host_blas():
            value, grad = _exact_value_and_grad(params, x, y, 0.0)
            if not np.isfinite(float(value)):
                hp = params.constrained()
                _, jitter = _cholesky_with_jitter(covariance(hp, x), _noise_level(hp.noise))
                value, grad = _exact_value_and_grad(params, x, y, jitter)
        return ObjectiveResult(value, grad)

    def posterior(self, params, x, y, initial=None) -> Posterior:
        """The Cholesky factor and ``α``; ``initial`` (a warm start, for the iterative
        solvers' interface) is not needed."""
        check_training(x, y)
        with bounded_host_blas():
            # the objective's own program (compiled already by an optimisation on these data)
            value, chol, alpha = _nlml_parts(params, x, y, 0.0)
            if not np.isfinite(float(value)):
                hp = params.constrained()
                _, jitter = _cholesky_with_jitter(covariance(hp, x), _noise_level(hp.noise))
                value, chol, alpha = _nlml_parts(params, x, y, jitter)
            jax.block_until_ready(alpha)
        return Posterior(alpha=alpha, cholesky=chol)


def _exact_value_and_grad(params, x, y, jitter):
    """NLML and its gradient from one Cholesky: ``∂NLML/∂A = ½(o A⁻¹ - Σ_j α_j α_jᵀ)`` and
    ``∂NLML/∂m_j = -1ᵀα_j`` pulled back through ``A(θ)`` and ``m(θ)`` by one VJP.

    Autodiff through the factorisation (JAX's Cholesky rule) costs several triangular solves
    and products with ``n × n`` right-hand sides; the explicit inverse (`_folded_inverse`)
    costs about one, and the pullback through the kernel is ``O(n²d)``. Two compiled programs
    (`_nlml_parts`, `_nlml_pullback`) around the inverse, which on CPU is LAPACK's ``potri`` on
    the host between them rather than a host callback inside one program: JAX keeps no program
    with a callback in its persistent cache, and the objective would compile in every process.
    The pullback forms ``A(θ)`` again for its VJP, ``O(n²d)`` beside the factorisation's
    ``O(n³)``. A factorisation that fails gives a NaN value and gradient (no inverse is
    formed); the caller retries with jitter.
    """
    value, chol, alpha = _nlml_parts(params, x, y, jitter)
    if not np.isfinite(float(value)):  # NaNs in the gradient's structure
        return value, _nlml_pullback(params, x, jitter, alpha, jnp.full_like(chol, jnp.nan))
    return value, _nlml_pullback(params, x, jitter, alpha, _folded_inverse(chol))


@jax.jit
def _nlml_parts(params, x, y, jitter):
    """``(NLML, L, α)``: the value, the lower Cholesky factor of ``A = K + (σ² + jitter) I``
    and ``α = A⁻¹(y - m)`` (n, o)."""
    hp = params.constrained()
    n, o = y.shape
    chol = jnp.linalg.cholesky(covariance(hp, x, jitter))
    r = y - hp.mean
    alpha = jax.scipy.linalg.cho_solve((chol, True), r)
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol)))
    value = 0.5 * jnp.sum(r * alpha) + 0.5 * o * logdet + 0.5 * n * o * math.log(2 * math.pi)
    return value, chol, alpha


@jax.jit
def _nlml_pullback(params, x, jitter, alpha, folded_inverse):
    """The NLML's gradient in ``params`` from ``α`` and ``A⁻¹`` folded (`_folded_inverse`)."""
    o = alpha.shape[1]

    def model(p):
        hp = p.constrained()
        return covariance(hp, x, jitter), hp.mean

    _, pullback = jax.vjp(model, params)
    d_a = 0.5 * (o * folded_inverse
                 - jnp.matmul(alpha, alpha.T, precision=jax.lax.Precision.HIGHEST))
    (grad,) = pullback((d_a, -jnp.sum(alpha, axis=0)))
    return grad


def _folded_inverse(chol):
    """``A⁻¹`` from the lower Cholesky factor of ``A``, folded: a matrix ``G`` with
    ``Σ G ∘ S = tr(A⁻¹S)`` for every symmetric ``S`` (all a gradient needs).

    On CPU, LAPACK's ``potri`` forms the lower triangle of ``A⁻¹`` (the triangular inverse and
    ``L⁻ᵀL⁻¹`` in one call, half the work of XLA's triangular solve with an identity and a
    product; it is most of an exact objective's cost); ``G`` is that triangle with its
    off-diagonal doubled, which spares mirroring it. ``chol`` is zero above its diagonal, as
    JAX's ``cholesky`` returns it. Elsewhere ``G = A⁻¹`` by those two.
    """
    if not lapack_on_host():
        return _xla_inverse(chol)
    # potri leaves the upper triangle as it found it, and JAX's factor is zero there: no
    # np.tril (a pass and a copy of n²)
    folded = _lapack_inverse(np.asarray(chol))
    folded *= 2  # in place (a pass over n² less): the diagonal halved back, exactly
    np.fill_diagonal(folded, 0.5 * np.diagonal(folded))
    return jax.device_put(folded)  # not jnp.asarray: JAX 0.10 compiles a program per shape


@jax.jit
def _xla_inverse(chol):
    eye = jnp.eye(chol.shape[0], dtype=chol.dtype)
    inv_chol = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)
    return jnp.matmul(inv_chol.T, inv_chol, precision=jax.lax.Precision.HIGHEST)


def _lapack_inverse(chol):
    """The lower triangle of ``A⁻¹`` by LAPACK ``potri`` from the lower factor ``chol`` (above
    the diagonal: ``chol``'s own entries, which potri does not touch), with the host BLAS
    bounded (it runs beside XLA's threads)."""
    chol = np.asarray(chol)
    (potri,) = scipy.linalg.lapack.get_lapack_funcs(("potri",), (chol,))
    with bounded_host_blas():
        inverse, info = potri(chol, lower=1)
    if info != 0:  # a zero or NaN pivot: the value is not finite either, and is retried
        return np.full(chol.shape, np.nan, chol.dtype)
    return inverse.astype(chol.dtype, copy=False)


def fisher_information(unpack, theta, x, num_outputs: int) -> np.ndarray:
    """Expected information ``F (p, p)`` of the free vector ``theta (p,)`` (``unpack(theta)``
    gives the parameters) for ``num_outputs`` independent outputs sharing ``A``:

        F_ij = Σ_k ∂_i m_kᵀ A⁻¹ ∂_j m_k + (o/2) tr(A⁻¹ ∂_iA A⁻¹ ∂_jA),

    by a dense Cholesky of ``A`` and ``∂A/∂θ`` (``p`` arrays of ``n × n``): for subsets of a few
    thousand points. Positive semi-definite by construction (unlike the Hessian away from the
    optimum), so it serves as the curvature of a scoring step.

    ``unpack`` is a static argument of the compiled program: calls with equal ``unpack`` (a
    hashable value, such as a frozen dataclass of hashable fields) and the same shapes share
    one program; a new closure each call compiles it again.
    """
    (a, _), (d_a, d_mean), noise = _covariance_and_jacobian(unpack, num_outputs, theta, x)
    with bounded_host_blas():
        chol, _ = _cholesky_with_jitter(a, noise)
        return np.asarray(_fisher(chol, d_a, d_mean), np.float64)


def fisher_information_ahead(unpack, theta, x, num_outputs: int) -> list:
    """Starts compiling, in background threads (`scalegp._ahead`), the three programs of
    `fisher_information` with these arguments (arrays or shapes); their futures."""
    n, p = x.shape[0], theta.shape[0]
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    square = jax.ShapeDtypeStruct((n, n), dtype)
    return [compile_ahead(_covariance_and_jacobian, unpack, num_outputs, theta, x),
            compile_ahead(_checked_cholesky, square),
            compile_ahead(_fisher, square, jax.ShapeDtypeStruct((n, n, p), dtype),
                          jax.ShapeDtypeStruct((num_outputs, p), dtype))]


# One compiled program: op by op, the Jacobian's many small primitives took seconds to compile,
# several times the information's own cost at a thousand points. The points are an argument,
# not a constant of the program: as a constant, XLA would fold what depends on them alone while
# compiling (the engine's sort of the keys for their centre among it).
@functools.partial(jax.jit, static_argnums=(0, 1))
def _covariance_and_jacobian(unpack, num_outputs: int, theta, points):
    """``((A, m), (∂A/∂θ, ∂m/∂θ), noise)``: A (n, n), m (o,), ∂A/∂θ (n, n, p), ∂m/∂θ (o, p),
    and the smallest noise, for messages (`_noise_level`'s)."""

    def model(t):
        hp = unpack(t).constrained()
        return covariance(hp, points), jnp.broadcast_to(hp.mean, (num_outputs,))

    return model(theta), jax.jacfwd(model)(theta), jnp.min(unpack(theta).constrained().noise)


@jax.jit
def _fisher(chol, d_a, d_mean):
    # C_i = L⁻¹ ∂_iA L⁻ᵀ (symmetric), so tr(A⁻¹∂_iA A⁻¹∂_jA) = Σ C_i ∘ C_j.
    d_a = jnp.moveaxis(d_a, -1, 0)  # (p, n, n)
    half = jax.vmap(lambda m: jax.scipy.linalg.solve_triangular(chol, m, lower=True))(d_a)
    c = jax.vmap(lambda m: jax.scipy.linalg.solve_triangular(chol, m.T, lower=True))(half)
    o = d_mean.shape[0]
    flat = c.reshape(c.shape[0], -1)
    covariance_part = 0.5 * o * jnp.matmul(flat, flat.T, precision=jax.lax.Precision.HIGHEST)
    ones = jnp.ones((chol.shape[0], 1), chol.dtype)
    w = jax.scipy.linalg.cho_solve((chol, True), ones)
    mean_part = jnp.sum(w) * jnp.matmul(d_mean.T, d_mean, precision=jax.lax.Precision.HIGHEST)
    return covariance_part + mean_part
