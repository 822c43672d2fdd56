"""One binary problem of `ScalableGPClassifier`: its objective for the optimiser, the fitting
strategy (exact on all points or a subset, then matrix-free steps on all of them) and the
fitted state predictions need. Every function takes its settings explicitly."""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np
from sklearn.exceptions import ConvergenceWarning

from scalegp import gp
from scalegp._lbfgsb import lbfgsb

#: float32 runs of L-BFGS-B end after three evaluations in a row gaining less than this
#: relative amount (`scalegp._lbfgsb.StallGuard`): about 100 roundings of log q.
FLOAT32_STALL_FTOL = 1e-5

#: The largest change of a log-hyperparameter on the first L-BFGS-B trial on all points
#: (`scalegp._lbfgsb.FirstStep`): the subset's optimum is near, while the full objective's
#: gradient, summed over all points, would send an unscaled first trial to the bounds' corners.
FULL_FIRST_STEP = 0.25


@dataclasses.dataclass
class LaplaceObjective:
    """``theta -> (-log q, -∂ log q/∂theta)`` (float64 numpy) of one binary problem at the
    kernel's log-hyperparameters ``theta``; each Newton run starts from the previous
    evaluation's mode when ``warm`` (the mode moves little between nearby ``theta``).

    A point met again (equal in the compute dtype) is answered from memory, not evaluated
    (``evaluations`` counts the new ones): a line search that fails near the optimum shrinks
    its steps below float32's resolution of theta, and L-BFGS-B evaluates its iterate again
    after it; with warm starts each such value would differ by the Newton tolerance and the
    trace estimate's dependence on the mode (noise to the optimiser), each a Newton run and
    an mBCG solve on all points.
    """

    solver: object
    spec: object
    x: object
    t: object
    warm: bool = False
    f: object = None
    evaluations: int = 0
    finite: tuple | None = None  # the best finite (theta, -log q) seen
    seen: dict = dataclasses.field(default_factory=dict)  # theta's bytes -> (value, grad)

    def params(self, theta):
        dtype = self.x.dtype
        return gp.KernelParams(mean=jnp.zeros((1,), dtype), theta=jnp.asarray(theta, dtype),
                               spec=self.spec)

    def mode(self, theta, gradient):
        mode = self.solver.mode(self.params(theta), self.x, self.t,
                                f0=self.f if self.warm else None, gradient=gradient)
        self.evaluations += 1
        if self.warm and np.isfinite(float(mode.value)):
            self.f = mode.f
        return mode

    def __call__(self, theta):
        theta = np.array(theta, np.float64)
        key = np.asarray(theta, self.x.dtype).tobytes()  # the model the compute dtype sees
        if key in self.seen:
            value, grad = self.seen[key]
            return value, grad.copy()
        mode = self.mode(theta, True)
        value = -float(mode.value)
        grad = -np.asarray(mode.grad.theta, np.float64)
        if not bool(mode.failed) and np.isfinite(value) and np.all(np.isfinite(grad)):
            if self.finite is None or value < self.finite[1]:
                self.finite = (theta, value)
            self.seen[key] = (value, grad.copy())
            return value, grad
        if self.finite is None:
            return np.inf, np.zeros(len(theta))
        # No mode (failed) or not finite: in float32 where K is a huge, nearly constant
        # matrix (the optimiser's first trial at the bounds' corner), Newton's steps carry
        # a's rounding times λ_max(K) and B's Cholesky may fail. A value above the best
        # finite one, sloping back to it, makes L-BFGS-B's line search step back (an
        # infinite value ends the run at its start; the garbage value, -log q = 2.8e10 with
        # a gradient of -5.7e9, sent its interpolation back to the start itself).
        best_theta, best_value = self.finite
        step = theta - best_theta
        penalty = 1e3 * (1.0 + abs(best_value))
        return best_value + penalty * (1.0 + float(step @ step)), 2 * penalty * step

    def sklearn(self, theta, eval_gradient=True):
        """scikit-learn's ``obj_func`` for a callable optimizer."""
        if eval_gradient:
            return self(theta)
        return -float(self.mode(np.asarray(theta, np.float64), False).value)


def optimise(objective, theta0, bounds, settings, rng):
    """``(theta, -log q)`` of the best run: from ``theta0`` and ``n_restarts_optimizer``
    starts drawn uniformly within ``bounds`` (as scikit-learn draws them), each run
    scikit-learn's callable ``optimizer`` (given theta in X's units, as ``kernel_`` has it:
    ``settings.shift`` added) or L-BFGS-B (``max_iter`` iterations)."""
    starts = [np.asarray(theta0, np.float64)]
    starts += [rng.uniform(bounds[:, 0], bounds[:, 1])
               for _ in range(settings.n_restarts_optimizer)]
    best = (None, np.inf)
    shift = 0.0 if settings.shift is None else settings.shift
    for start in starts:
        if callable(settings.optimizer):
            def obj_func(theta, eval_gradient=True):
                return objective.sklearn(np.asarray(theta, np.float64) - shift, eval_gradient)

            theta, value = settings.optimizer(obj_func, start + shift,
                                              bounds + np.reshape(shift, (-1, 1)))
            theta = np.asarray(theta, np.float64) - shift
        else:
            stall = FLOAT32_STALL_FTOL if objective.x.dtype == jnp.float32 else None
            theta, value, _ = lbfgsb(objective, start, settings.max_iter, bounds=bounds,
                                     stall_ftol=stall)
        if value < best[1] or best[0] is None:
            best = (np.asarray(theta, np.float64), float(value))
    return best


@dataclasses.dataclass
class BinaryFit:
    """A fitted binary problem: ``theta (p,)``, ``log q`` there, the mode ``f (n,)``, the
    prediction cache ``alpha = t - π (n,)`` and variance factor ``(n, k)`` (numpy), and the
    optimiser's evaluations."""

    theta: np.ndarray
    value: float
    f: np.ndarray
    alpha: np.ndarray
    factor: np.ndarray
    evaluations: int


def fit_binary(x, t, kernel, spec, settings, rng, seed, exact, f0=None):
    """Hyperparameters, mode and prediction cache of one binary problem ``t (n,)`` in {0, 1}.

    ``exact``: the dense solver on all points. Otherwise the exact objective on a random
    subset of ``subset_size`` points, then at most ``max_iter_full`` L-BFGS-B iterations of the
    matrix-free objective on all of them (fixed probes, seeded by ``seed``: a deterministic
    objective), each Newton run warm-started from the last mode; ``f0``: a start for the
    first mode (``warm_start``).
    """
    n = x.shape[0]
    dense = gp.LaplaceCholesky(max_iter=settings.max_iter_predict)
    solver = dense if exact else settings.cg_solver(seed)
    theta = np.asarray(kernel.theta, np.float64)
    evaluations = 0
    if settings.optimizer is not None and kernel.n_dims:
        bounds = np.asarray(kernel.bounds, np.float64)
        if exact:
            start = LaplaceObjective(dense, spec, x, t, warm=settings.warm_start, f=f0)
        else:
            subset = np.sort(rng.choice(n, size=min(settings.subset_size, n), replace=False))
            start = LaplaceObjective(dense, spec, x[subset], t[subset])
        theta, _ = optimise(start, theta, bounds, settings, rng)
        evaluations += start.evaluations
        if not exact and settings.max_iter_full:
            full = LaplaceObjective(solver, spec, x, t, warm=True, f=f0)
            theta, _, _ = lbfgsb(full, theta, settings.max_iter_full, bounds=bounds,
                                 stall_ftol=FLOAT32_STALL_FTOL if x.dtype == jnp.float32
                                 else None, first_step=FULL_FIRST_STEP)
            evaluations += full.evaluations
    # The final mode from zeros, as log_marginal_likelihood(theta) computes it.
    objective = LaplaceObjective(solver, spec, x, t)
    params = objective.params(theta)
    mode = objective.mode(theta, False)
    if bool(mode.failed):
        _warn_no_mode(theta, x.dtype)
    posterior = solver.posterior(params, x, t, mode)
    return BinaryFit(theta=np.asarray(theta, np.float64), value=float(mode.value),
                     f=np.asarray(mode.f), alpha=np.asarray(posterior.alpha)[:, 0],
                     factor=np.asarray(posterior.love_factor), evaluations=evaluations)


def _warn_no_mode(theta, dtype):
    warnings.warn(
        f"Newton's method found no Laplace mode in {jnp.dtype(dtype).name} at the kernel's "
        f"log-hyperparameters {np.round(theta, 3).tolist()}: a step that could not gain ended "
        "it (a huge outputscale on an almost constant kernel, whose products carry the "
        "rounding of their inputs far beyond the likelihood's scale), and predictions use its "
        'last iterate. Compute in float64 (dtype="float64"), or lower the outputscale',
        ConvergenceWarning, stacklevel=4)


def latent_moments(spec, theta, x_train, alpha, factor, x, engine):
    """Latent mean and variance ``(m,)`` each (float64 numpy) at centred ``x (m, d)``: through
    `scalegp.gp.predict` (in fixed blocks of rows), the kernel's noise (WhiteKernel) added to
    the variance as scikit-learn's ``kernel_.diag`` has it."""
    dtype = x_train.dtype
    params = gp.KernelParams(mean=jnp.zeros((1,), dtype), theta=jnp.asarray(theta, dtype),
                             spec=spec)
    posterior = gp.Posterior(alpha=jnp.asarray(alpha, dtype)[:, None],
                             love_factor=jnp.asarray(factor, dtype))
    mean, std = gp.predict(params, x_train, posterior, x, return_std=True,
                           include_noise=False, engine=engine)
    white = float(spec.build(jnp.asarray(theta, dtype))[1])
    return (np.asarray(mean, np.float64)[:, 0],
            np.asarray(std, np.float64) ** 2 + white)


def latent_mean(spec, theta, x_train, alpha, x, engine):
    """The latent mean alone ``(m,)``: what `predict` needs."""
    dtype = x_train.dtype
    params = gp.KernelParams(mean=jnp.zeros((1,), dtype), theta=jnp.asarray(theta, dtype),
                             spec=spec)
    mean = gp.predict(params, x_train, gp.Posterior(alpha=jnp.asarray(alpha, dtype)[:, None]),
                      x, engine=engine)
    return np.asarray(mean, np.float64)[:, 0]
