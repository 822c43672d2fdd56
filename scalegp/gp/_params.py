"""The GP's parameters and results: unconstrained hyperparameters (`GPParams`), their
constrained values (`Hyperparameters`), the objective's result and the prediction cache."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalegp import ops


def softplus_inverse(x):
    """``softplus⁻¹(x) = log(expm1(x))`` for ``x > 0``, stable for large and small ``x``."""
    x = jnp.asarray(x)
    return jnp.where(x > 20.0, x, jnp.log(jnp.expm1(jnp.minimum(x, 20.0))))


def constrained(params):
    """``params.constrained()`` (their `Hyperparameters`) as one compiled program: eager, each
    of its steps (softplus, sums) compiles a program of its own, on a TPU each a compilation
    for the chip."""
    return _constrained(params)


_constrained = jax.jit(lambda params: params.constrained())


def _softplus_inverse_as(x, dtype):
    """`softplus_inverse` of ``x`` as a ``dtype`` array, by one compiled program for all its
    steps (eager, each step compiles a program of its own: a fit's start made a dozen), with
    the same arithmetic; a host value is cast on the host (a device cast is a program too)."""
    if isinstance(x, jax.Array):
        return _softplus_inverse_jit(jnp.asarray(x, dtype))
    return _softplus_inverse_jit(np.asarray(x, dtype))


_softplus_inverse_jit = jax.jit(softplus_inverse)


def _at_least_1d(x, dtype):
    """``x`` as a ``dtype`` array of at least one axis (cast on the host where concrete, then
    put on the device: JAX 0.10's ``jnp.asarray`` compiles a program for each shape)."""
    if isinstance(x, jax.core.Tracer):
        return jnp.atleast_1d(jnp.asarray(x, dtype))
    return jax.device_put(np.atleast_1d(np.asarray(x, dtype)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """Constrained hyperparameters: what the solvers and `predict` use.

    Attributes:
      mean: ``(o,)`` constant mean per output.
      kernel: the covariance of f, a `scalegp.ops` kernel expression (outputscales included).
      noise: the training points' noise variance, added to the diagonal: ``()`` (``σ² > 0``)
        or ``(n,)``, one per training point (`KernelParams` with a per-point ``fixed_noise``).
    """

    mean: jax.Array
    kernel: Any
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
        """The model ``s · RBF(l)`` with noise ``σ²``."""
        kernel = ops.Product((ops.Constant(jax.nn.softplus(self.raw_outputscale)),
                              ops.RBF(jax.nn.softplus(self.raw_lengthscale))))
        return Hyperparameters(
            mean=self.mean,
            kernel=kernel,
            noise=self.noise_lower_bound + jax.nn.softplus(self.raw_noise),
        )

    @classmethod
    def from_constrained(
        cls, mean, outputscale, lengthscale, noise, *, noise_lower_bound: float = 1e-6,
        dtype=None,
    ) -> "GPParams":
        """Inverse of :meth:`constrained`. ``noise`` must exceed ``noise_lower_bound``."""
        dtype = dtype or jnp.result_type(float)
        if float(noise) <= noise_lower_bound:
            raise ValueError(
                f"noise must be > noise_lower_bound={noise_lower_bound}, got {float(noise)}; "
                "lower noise_lower_bound or raise the noise"
            )
        return cls(
            mean=_at_least_1d(mean, dtype),
            raw_outputscale=_softplus_inverse_as(outputscale, dtype),
            raw_lengthscale=_softplus_inverse_as(_at_least_1d(lengthscale, dtype), dtype),
            raw_noise=_softplus_inverse_as(noise - noise_lower_bound, dtype),
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
        if not isinstance(theta, jax.Array):  # a traced vector stays traced
            theta = np.asarray(theta, np.float64)
        o, d = num_outputs, num_features
        if theta.shape != (o + d + 2,):
            raise ValueError(
                f"theta must have shape ({o + d + 2},) = mean ({o}) + outputscale (1) + "
                f"lengthscale ({d}) + noise (1), got {theta.shape}"
            )
        if isinstance(theta, jax.Array):
            part = functools.partial(jnp.asarray, dtype=dtype)
        else:  # cast on the host and put on the device: a device cast compiles a program
            theta, part = theta.astype(dtype), jax.device_put
        return cls(
            mean=part(theta[:o]),
            raw_outputscale=part(theta[o]),
            raw_lengthscale=part(theta[o + 1: o + 1 + d]),
            raw_noise=part(theta[-1]),
            noise_lower_bound=noise_lower_bound,
        )


jax.tree_util.register_dataclass(
    GPParams,
    data_fields=["mean", "raw_outputscale", "raw_lengthscale", "raw_noise"],
    meta_fields=["noise_lower_bound"],
)


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """Hyperparameters of any kernel expression, as a free vector ``theta`` and a static
    ``spec`` that builds the model from it (a pytree; ``spec`` is static).

    ``spec.build(theta) -> (kernel, noise)`` maps ``theta (k,)`` to a `scalegp.ops` kernel and
    the noise variance, differentiably; it must be hashable (it is a static argument of the
    solvers' jit). The estimators use it for scikit-learn kernels, with ``theta`` the logarithms
    of the free hyperparameters in scikit-learn's order.

    Attributes:
      mean: ``(o,)``.
      theta: ``(k,)``.
      spec: static, see above.
      fixed_noise: ``()`` or ``(n,)`` (one per training point), a fixed variance added to the
        training points' diagonal on top of the spec's noise (scikit-learn's ``alpha``). A data
        field rather than part of ``spec``: a per-point vector is no hashable static, and
        changing it needs no recompilation.
    """

    mean: jax.Array
    theta: jax.Array
    spec: Any
    fixed_noise: jax.Array | float = 0.0

    def constrained(self) -> Hyperparameters:
        kernel, noise = self.spec.build(self.theta)
        return Hyperparameters(mean=self.mean, kernel=kernel, noise=noise + self.fixed_noise)

    def flatten(self) -> np.ndarray:
        """float64 vector ``[mean (o), theta (k)]``."""
        return np.concatenate([np.asarray(self.mean, np.float64).ravel(),
                               np.asarray(self.theta, np.float64).ravel()])


jax.tree_util.register_dataclass(KernelParams, data_fields=["mean", "theta", "fixed_noise"],
                                 meta_fields=["spec"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ObjectiveResult:
    """Negative log marginal likelihood and its gradient.

    Attributes:
      value: ``()``, NLML (summed over outputs, not divided by n).
      grad: :class:`GPParams` of the same structure as the input, ``∂NLML/∂params``.
      cg: the mBCG call's `scalegp.linalg.CGResult` (per-column diagnostics), None for Cholesky.
      solution: ``(n, o)``, ``α = A⁻¹(y - m)`` as the solver found it on the way (to the
        training solve's tolerance for BBMM): a warm start for the posterior's solve.
    """

    value: jax.Array
    grad: Any
    cg: Any = None
    solution: Any = None

    @property
    def cg_iterations(self) -> jax.Array | np.integer:
        """``()`` int, the largest mBCG iteration count (0 for the Cholesky solver); read on
        the host (a numpy integer) when concrete: an eager device op compiles a program of its
        own."""
        if self.cg is None:
            return np.int32(0)
        iterations = self.cg.iterations
        if isinstance(iterations, jax.core.Tracer):
            return jnp.max(iterations)
        return np.max(np.asarray(iterations))

    @property
    def converged(self) -> jax.Array:
        """``()`` bool, whether every CG column reached its tolerance (True for Cholesky)."""
        return jnp.asarray(True) if self.cg is None else jnp.all(self.cg.converged)


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


def check_training(x, y):
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x must be (n, d) and y (n, o) with the same n; got x {x.shape}, y {y.shape} "
            "(reshape a single output y to (n, 1))"
        )
