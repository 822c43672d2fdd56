"""`ScalableGPRegressor`: scikit-learn's GaussianProcessRegressor surface on `scalegp.gp`.

Re-exported from `scalegp.estimators`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.gaussian_process import kernels as sk_kernels
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from scalegp import gp
from scalegp._validation import as_compute_dtype, check_int, check_option, validate_data
from scalegp.estimators._gpr_fit import (
    Objective,
    centred,
    check_distances_fit,
    check_not_constant,
    check_positive,
    check_target,
    minimize,
    restart_points,
)
from scalegp.estimators._gpr_kernels import kernel_spec
from scalegp.ops import SCHEMES, Engine

__all__ = ["ScalableGPRegressor"]

_SOLVERS = ("auto", "exact", "bbmm")


class ScalableGPRegressor(RegressorMixin, BaseEstimator):
    """Exact Gaussian-process regression for large n (constant mean, Gaussian noise).

    The default model (``kernel=None``) is ``y = m + f(x) + ε`` with
    ``f ~ GP(0, s·exp(-½ Σ_d ((x_d - x'_d)/l_d)²))`` and ``ε ~ N(0, σ²)``, i.e. scikit-learn's
    ``ConstantKernel(s) * RBF(l) + WhiteKernel(σ²)`` plus a constant mean ``m``. With
    ``kernel=`` a scikit-learn kernel object, the covariance is that kernel, run on the same
    memory-linear engine (never evaluated through scikit-learn). Up to
    ``exact_max_n`` training points it uses a dense Cholesky (:class:`scalegp.gp.CholeskySolver`);
    beyond, BBMM (:class:`scalegp.gp.BBMMSolver`: preconditioned conjugate gradients, stochastic
    Lanczos quadrature, memory linear in n) and the recipe of Wang et al. (2019): hyperparameters
    by L-BFGS-B on a random subset of ``subset_size`` points with the exact objective, then
    ``max_iter_full`` L-BFGS-B iterations on all data with the BBMM objective (fixed probes, so
    deterministic). Predictions use ``alpha = (K + σ²I)⁻¹(y - m)`` solved once after fit and,
    for the iterative solver, a LOVE-style variance cache (:meth:`scalegp.gp.BBMMSolver.love`)
    built on the first ``return_std``.

    Parameters
    ----------
    kernel : scikit-learn kernel or None, default=None
        None: the default model above, set by ``lengthscale``, ``outputscale``, ``noise`` and
        ``noise_lower_bound``. Otherwise a kernel built from ConstantKernel, RBF, Matern
        (ν = 0.5, 1.5, 2.5), RationalQuadratic, ExpSineSquared, WhiteKernel, ``+`` and ``*``
        (WhiteKernel only as a term of the top-level sum, alone or times constants: it is the
        noise). Its values are the starting point (or, with ``optimizer=None``, the model), its
        bounds bound the optimiser (in log space, as scikit-learn's), "fixed" hyperparameters
        stay; restarts are drawn uniformly within the bounds. Any other kernel is a ValueError
        that lists what is supported.
    lengthscale : float or array of shape (n_features,), default=1.0
        Initial (or, with ``optimizer=None``, fixed) RBF lengthscales of the default model; a
        float is broadcast to every feature (the kernel is always ARD).
    outputscale : float, default=1.0
        Initial kernel variance ``s``.
    noise : float, default=0.1
        Initial noise variance ``σ²`` (must exceed ``noise_lower_bound``).
    noise_lower_bound : float, default=1e-6
        ``σ² >= noise_lower_bound`` during optimisation; raise it if a fit warns about jitter.
        (Default model only.)
    alpha : float, default=1e-10
        With ``kernel``: a fixed value added to the diagonal, as scikit-learn's ``alpha`` (it
        counts as noise in ``noise_`` and in the predictive std). Raise it, or add a
        WhiteKernel, if a fit warns about jitter; float32 needs far more than 1e-10.
    mean : float, array of shape (n_targets,) or None, default=None
        Constant mean. None: learnt (initialised at the mean of y); a number fixes it (0 with
        ``normalize_y=True`` reproduces scikit-learn's zero-mean GP on normalised targets).
    normalize_y : bool, default=False
        Standardise y (per output) before fitting, as scikit-learn does.
    optimizer : {"L-BFGS-B", "adam"} or None, default="L-BFGS-B"
        "L-BFGS-B" (scipy) suits the deterministic objectives used here (exact, or BBMM with
        fixed probes). "adam" takes ``max_iter`` (then ``max_iter_full``) Adam steps of size
        ``learning_rate`` and keeps the best iterate; it needs no line search, so each step
        costs exactly one objective evaluation. None keeps the given hyperparameters.
    learning_rate : float, default=0.05
        Adam step size, in the unconstrained parameters (``softplus⁻¹`` of ``s``, ``l`` and
        ``σ²``, and the mean in normalised units): each step moves each of them by about this
        much at first. Only used with ``optimizer="adam"``.
    n_restarts_optimizer : int, default=0
        Extra optimisations from random initial values (default model: each of ``log s``,
        ``log l_d``, ``log σ²`` shifted by U(-2, 2); with ``kernel``: uniform within its
        bounds, which must then be finite); the best marginal likelihood wins.
    max_iter : int, default=200
        L-BFGS-B iterations (on the subset for large n).
    solver : {"auto", "exact", "bbmm"}, default="auto"
        "auto" is "exact" for ``n_samples <= exact_max_n``.
    exact_max_n : int, default=4096
        Switch point of "auto" (:data:`scalegp.gp.EXACT_MAX_N`).
    subset_size : int, default=2048
        Random subset for the first phase of BBMM training.
    max_iter_full : int, default=10
        Optimiser iterations (L-BFGS-B) or steps (Adam) on all data with BBMM after the subset
        phase (0 to skip).
    num_probes, preconditioner_rank, cg_tol, max_cg_iter, love_rank :
        Settings of :class:`scalegp.gp.BBMMSolver` (defaults 30, 768, 1e-3, 1000, 1024).
    dtype : {None, "float32", "float64"}, default=None
        Compute dtype; None is float64 when JAX x64 is enabled, float32 otherwise.
    impl : str, default="auto"
        Engine implementation (:mod:`scalegp.ops`).
    mesh : None, jax.sharding.Mesh, "all", int or list of devices, default=None
        Devices for the BBMM solver and predictions: None uses one device (nothing changes);
        otherwise kernel products, CG vectors and inner products are sharded by rows over the
        mesh ("all": every device of every process; an int k: the first k devices), see
        :func:`scalegp.ops.sharded_kernel_mv`. The exact (Cholesky) solver runs on one device.
        Pass "all" or an int, not a Mesh, for an estimator that must be pickled.
    mesh_scheme : {"allgather", "ring"}, default="allgather"
        How each kernel product's keys reach the devices (gathered, or passed around a ring).
    verbose : int, default=0
        >0 reports each optimiser iteration (objective, CG iterations): always to logger
        "scalegp.gp" at INFO level, and on screen as a progress bar when stderr is a terminal
        and tqdm is installed (``pip install scalegp[progress]``), otherwise as printed lines.
    random_state : int, RandomState instance or None, default=None
        Seeds the subset, the probe vectors and the restarts.

    Attributes
    ----------
    kernel_ : scikit-learn kernel
        The fitted kernel, of ``kernel``'s structure (for the default model
        ``ConstantKernel * RBF + WhiteKernel``), in normalised units when ``normalize_y``.
    lengthscale_ : ndarray of shape (n_features,)
        Default model only.
    outputscale_ : float
        Default model only.
    noise_ : float
        Fitted noise variance (in normalised units when ``normalize_y``); with ``kernel``, the
        WhiteKernel levels plus ``alpha``.
    mean_ : ndarray of shape (n_targets,)
        Fitted constant mean in the units of y.
    theta_ : ndarray
        The optimised vector: ``[mean (if learnt), raw s, raw l (d), raw σ²]``
        (``raw = softplus⁻¹``) for the default model, the input of
        :meth:`log_marginal_likelihood`; with ``kernel``, ``[mean (if learnt), kernel_.theta]``.
    alpha_ : ndarray of shape (n_samples,) or (n_samples, n_targets)
        ``(K + σ²I)⁻¹ (y - m)`` in normalised units.
    log_marginal_likelihood_value_ : float
    n_iter_ : int
        Optimiser iterations of the best run (0 with ``optimizer=None``).
    solver_ : {"exact", "bbmm"}
    X_train_, y_train_ : ndarray
    n_features_in_ : int
    """

    def __init__(
        self,
        kernel=None,
        lengthscale=1.0,
        outputscale=1.0,
        noise=0.1,
        *,
        noise_lower_bound=1e-6,
        alpha=1e-10,
        mean=None,
        normalize_y=False,
        optimizer="L-BFGS-B",
        learning_rate=0.05,
        n_restarts_optimizer=0,
        max_iter=200,
        solver="auto",
        exact_max_n=gp.EXACT_MAX_N,
        subset_size=2048,
        max_iter_full=10,
        num_probes=30,
        preconditioner_rank=768,
        cg_tol=1e-3,
        max_cg_iter=1000,
        love_rank=1024,
        dtype=None,
        impl="auto",
        mesh=None,
        mesh_scheme="allgather",
        verbose=0,
        random_state=None,
    ):
        self.kernel = kernel
        self.lengthscale = lengthscale
        self.outputscale = outputscale
        self.noise = noise
        self.noise_lower_bound = noise_lower_bound
        self.alpha = alpha
        self.mean = mean
        self.normalize_y = normalize_y
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.n_restarts_optimizer = n_restarts_optimizer
        self.max_iter = max_iter
        self.solver = solver
        self.exact_max_n = exact_max_n
        self.subset_size = subset_size
        self.max_iter_full = max_iter_full
        self.num_probes = num_probes
        self.preconditioner_rank = preconditioner_rank
        self.cg_tol = cg_tol
        self.max_cg_iter = max_cg_iter
        self.love_rank = love_rank
        self.dtype = dtype
        self.impl = impl
        self.mesh = mesh
        self.mesh_scheme = mesh_scheme
        self.verbose = verbose
        self.random_state = random_state

    # ---------------------------------------------------------------------------------------
    # helpers

    def _dtype(self):
        check_option("dtype", self.dtype, (None, "float32", "float64"))
        if self.dtype is None:
            return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError(
                'dtype="float64" needs JAX x64: call jax.config.update("jax_enable_x64", True) '
                "first, or use dtype=None/float32"
            )
        return jnp.dtype(self.dtype)

    def _engine(self):
        return Engine.create(self.impl, self.mesh, self.mesh_scheme)

    def _bbmm(self, seed):
        return gp.BBMMSolver(
            num_probes=self.num_probes, preconditioner_rank=self.preconditioner_rank,
            cg_tol=float(self.cg_tol), max_cg_iter=self.max_cg_iter, love_rank=self.love_rank,
            seed=int(seed), engine=self._engine(),
        )

    def _unpack(self, theta, o, d, fixed_mean, dtype):
        theta = np.asarray(theta, np.float64)
        if fixed_mean is not None:
            theta = np.concatenate([fixed_mean, theta])
        if self._spec is not None:
            return gp.KernelParams(mean=jnp.asarray(theta[:o], dtype),
                                   theta=jnp.asarray(theta[o:], dtype), spec=self._spec)
        return gp.GPParams.unflatten(theta, o, d, noise_lower_bound=self.noise_lower_bound,
                                     dtype=dtype)

    # ---------------------------------------------------------------------------------------
    # fit

    def fit(self, X, y):
        """Fit hyperparameters (unless ``optimizer=None``) and the prediction cache.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : array-like of shape (n_samples,) or (n_samples, n_targets)

        Returns
        -------
        self
        """
        X, y = validate_data(self, X, y=y, multi_output=True, y_numeric=True,
                             ensure_min_samples=2, dtype=[np.float64, np.float32])
        n, d = X.shape
        self._check_settings()
        self._spec = kernel_spec(self.kernel, self.alpha, d)
        dtype = self._dtype()
        rng = check_random_state(self.random_state)
        yn = self._normalised_target(y)
        o = yn.shape[1]
        fixed_mean, mean0 = self._mean_setting(yn)
        self.solver_ = self.solver if self.solver != "auto" else (
            "exact" if n <= self.exact_max_n else "bbmm")
        self._probe_seed = int(rng.randint(2**31 - 1))
        x = centred(X, np.mean(X, axis=0, dtype=np.float64), dtype)
        yj = jnp.asarray(as_compute_dtype(yn, dtype, "y"))
        if self._spec is None:
            lengthscale, outputscale, noise = self._default_model_start(d)
            check_distances_fit(x, lengthscale)
            theta0 = gp.GPParams.from_constrained(
                mean0, outputscale, lengthscale, noise, noise_lower_bound=self.noise_lower_bound,
                dtype=dtype).flatten()
        else:
            check_distances_fit(x, 1.0)  # the expression path measures distances unscaled
            theta0 = np.concatenate([mean0, self.kernel.theta])
        if fixed_mean is not None:
            theta0 = theta0[o:]
        self._fixed_mean = fixed_mean
        theta, final_value, n_iter = self._optimise(theta0, x, yj, rng)
        self._store_fit(X, y, theta, final_value, n_iter, x, yj)
        return self

    def _check_settings(self):
        """Checks every setting but the model's starting values."""
        check_option("optimizer", self.optimizer, ("L-BFGS-B", "adam", None))
        if self.optimizer == "adam":
            check_positive("learning_rate", self.learning_rate)
        check_option("solver", self.solver, _SOLVERS)
        check_option("mesh_scheme", self.mesh_scheme, SCHEMES)
        self._engine()
        for name, minimum in (("n_restarts_optimizer", 0), ("max_iter", 0), ("max_iter_full", 0),
                              ("exact_max_n", 1), ("subset_size", 2), ("num_probes", 1),
                              ("preconditioner_rank", 1), ("max_cg_iter", 1), ("love_rank", 1)):
            check_int(name, getattr(self, name), minimum)

    def _default_model_start(self, d):
        """The default model's checked start: ``(lengthscale (d,), outputscale, noise)``."""
        lengthscale = np.broadcast_to(check_positive("lengthscale", self.lengthscale, (d,)), (d,))
        outputscale = float(check_positive("outputscale", self.outputscale))
        noise = float(check_positive("noise", self.noise))
        if not (isinstance(self.noise_lower_bound, numbers.Real)
                and 0 <= self.noise_lower_bound < noise):
            raise ValueError(
                f"noise_lower_bound must be a number in [0, noise={noise}), got "
                f"{self.noise_lower_bound!r}"
            )
        return lengthscale.copy(), outputscale, noise

    def _normalised_target(self, y):
        """y as (n, o) float64, checked, and normalised when ``normalize_y`` (the statistics are
        kept in ``_y_train_mean`` and ``_y_train_std``)."""
        self._y_1d = y.ndim == 1
        y2 = y.reshape(y.shape[0], -1).astype(np.float64)
        check_target(y2, self.noise_lower_bound, self.normalize_y)
        if self.optimizer is not None:
            check_not_constant(y2)
        o = y2.shape[1]
        if self.normalize_y:
            self._y_train_mean = y2.mean(axis=0)
            std = y2.std(axis=0)
            self._y_train_std = np.where(std > 0, std, 1.0)
        else:
            self._y_train_mean, self._y_train_std = np.zeros(o), np.ones(o)
        return (y2 - self._y_train_mean) / self._y_train_std

    def _mean_setting(self, yn):
        """``(fixed mean or None, initial mean)`` in normalised units, both (o,)."""
        o = yn.shape[1]
        if self.mean is None:
            return None, yn.mean(axis=0)
        m = np.broadcast_to(np.asarray(self.mean, np.float64), (o,)) if np.ndim(self.mean) < 2 \
            else None
        if m is None or not np.all(np.isfinite(m)):
            raise ValueError(f"mean must be None, a finite float or {o} floats, got {self.mean!r}")
        fixed = (m - self._y_train_mean) / self._y_train_std
        return fixed, fixed

    def _minimize(self, objective, theta0, maxiter, phase, warn_maxiter=True):
        return minimize(objective, theta0, maxiter, phase, optimizer=self.optimizer,
                        learning_rate=self.learning_rate, verbose=self.verbose,
                        warn_maxiter=warn_maxiter, bounds=self._bounds(len(theta0)))

    def _kernel_theta(self, theta):
        """The scikit-learn kernel's part of the optimised vector (after the free means)."""
        return np.asarray(theta, np.float64)[len(theta) - self.kernel.n_dims:]

    def _bounds(self, size):
        """L-BFGS-B bounds of the optimised vector: None for the default model (unconstrained
        parameters); the kernel's own (log) bounds after the free means otherwise."""
        if self._spec is None:
            return None
        kernel_bounds = np.asarray(self.kernel.bounds, np.float64).reshape(-1, 2)
        free_means = size - kernel_bounds.shape[0]
        return [(None, None)] * free_means + [tuple(b) for b in kernel_bounds]

    def _starts(self, theta0, n_free_start, rng):
        """``theta0`` and ``n_restarts_optimizer`` random starts: for a scikit-learn kernel,
        drawn uniformly within its (log) bounds as scikit-learn draws them."""
        if self._spec is None:
            return restart_points(theta0, self.n_restarts_optimizer, n_free_start, rng)
        bounds = np.asarray(self.kernel.bounds, np.float64).reshape(-1, 2)
        if self.n_restarts_optimizer and not np.all(np.isfinite(bounds)):
            raise ValueError(
                "n_restarts_optimizer > 0 draws starting points within the kernel's bounds, so "
                "every free hyperparameter needs finite bounds; set them (e.g. "
                "RBF(length_scale_bounds=(1e-2, 1e3))) or use n_restarts_optimizer=0"
            )
        starts = [theta0]
        for _ in range(self.n_restarts_optimizer):
            start = theta0.copy()
            start[n_free_start:] = rng.uniform(bounds[:, 0], bounds[:, 1])
            starts.append(start)
        return starts

    def _optimise(self, theta0, x, yj, rng):
        """``(theta, NLML at theta or None, iterations)``: exact fits from ``theta0`` and the
        restarts (on a random subset for BBMM), then a few BBMM steps on all data."""
        if self.optimizer is None:
            return theta0, None, 0
        n, o = yj.shape
        x_fit, y_fit = x, yj
        if self.solver_ == "bbmm":
            idx = np.sort(rng.choice(n, size=min(self.subset_size, n), replace=False))
            x_fit, y_fit = x[idx], yj[idx]
        objective = Objective(gp.CholeskySolver(), x_fit, y_fit, self._fixed_mean, self._unpack)
        n_free_start = 0 if self._fixed_mean is not None else o
        best = None
        for i, start in enumerate(self._starts(theta0, n_free_start, rng)):
            theta, value, nit = self._minimize(objective, start, self.max_iter,
                                               f"exact fit (start {i})")
            if best is None or value < best[1]:
                best = (theta, value, nit)
        theta, value, n_iter = best
        if self.solver_ == "exact":
            return theta, value, n_iter
        if self.max_iter_full == 0:
            return theta, None, n_iter  # the subset's objective is not the full data's
        objective = Objective(self._bbmm(self._probe_seed), x, yj, self._fixed_mean, self._unpack)
        # A planned, small number of steps (Wang et al., 2019): reaching it is expected.
        theta, value, nit = self._minimize(objective, theta, self.max_iter_full,
                                           "BBMM fit on all data", warn_maxiter=False)
        return theta, value, n_iter + nit

    def _store_fit(self, X, y, theta, final_value, n_iter, x, yj):
        """The fitted attributes and the prediction cache at ``theta``."""
        o, d = yj.shape[1], x.shape[1]
        params = self._unpack(theta, o, d, self._fixed_mean, x.dtype)
        solver = (gp.CholeskySolver() if self.solver_ == "exact"
                  else self._bbmm(self._probe_seed))
        if final_value is None or not np.isfinite(final_value):
            final_value = float(solver.value_and_grad(params, x, yj).value)
        posterior = solver.posterior(params, x, yj)
        hp = params.constrained()
        self.theta_ = np.asarray(theta, np.float64)
        self.log_marginal_likelihood_value_ = -final_value
        if self._spec is None:
            outputscale, lengthscale = hp.kernel.terms
            self.lengthscale_ = np.asarray(lengthscale.lengthscale, np.float64)
            self.outputscale_ = float(outputscale.value)
            self.kernel_ = (sk_kernels.ConstantKernel(self.outputscale_)
                            * sk_kernels.RBF(self.lengthscale_)
                            + sk_kernels.WhiteKernel(float(hp.noise)))
        else:
            self.kernel_ = self.kernel.clone_with_theta(self._kernel_theta(self.theta_))
        self.noise_ = float(hp.noise)
        self.mean_ = np.asarray(hp.mean, np.float64) * self._y_train_std + self._y_train_mean
        self.n_iter_ = int(n_iter)
        self.X_train_ = np.asarray(X)
        self.y_train_ = np.asarray(y)
        alpha = np.asarray(posterior.alpha)
        self.alpha_ = alpha[:, 0] if self._y_1d else alpha
        self._cholesky = None if posterior.cholesky is None else np.asarray(posterior.cholesky)
        self._love_factor = None

    # ---------------------------------------------------------------------------------------
    # predict

    def _state(self):
        """``(params, x, alpha, dtype, centre)``: the fitted state in the compute dtype, with the
        training inputs ``x`` centred on ``centre``, their float64 mean (recomputed rather than
        stored, so model files carry no extra state; queries are centred on it too)."""
        dtype = self._dtype()
        o = self._y_train_mean.shape[0]
        params = self._unpack(self.theta_, o, self.n_features_in_, self._fixed_mean, dtype)
        centre = np.mean(self.X_train_, axis=0, dtype=np.float64)
        x = centred(self.X_train_, centre, dtype)
        alpha = jnp.asarray(self.alpha_.reshape(x.shape[0], o), dtype)
        return params, x, alpha, dtype, centre

    def _variance_posterior(self, params, x, posterior, dtype):
        """``posterior`` with its variance factor, built on first use when missing: the LOVE
        factor always, the Cholesky factor for a model loaded without it (model files store
        only what the mean needs unless asked)."""
        if self.solver_ == "exact":
            if self._cholesky is None:
                o = self._y_train_mean.shape[0]
                y2 = np.asarray(self.y_train_, np.float64).reshape(x.shape[0], o)
                yn = jnp.asarray((y2 - self._y_train_mean) / self._y_train_std, dtype)
                self._cholesky = np.asarray(gp.CholeskySolver().posterior(params, x, yn).cholesky)
            return gp.Posterior(alpha=posterior.alpha,
                                cholesky=jnp.asarray(self._cholesky, dtype))
        if self._love_factor is None:
            solver = self._bbmm(self._probe_seed)
            self._love_factor = np.asarray(solver.love(params, x, posterior).love_factor)
        return gp.Posterior(alpha=posterior.alpha,
                            love_factor=jnp.asarray(self._love_factor, dtype))

    def predict(self, X, return_std=False, return_cov=False):
        """Predictive mean, and optionally the std or covariance of y (noise included).

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        return_std, return_cov : bool
            At most one. ``return_cov`` forms an (n_queries, n_queries) matrix: keep it small.

        Returns
        -------
        y_mean : ndarray of shape (n_queries,) or (n_queries, n_targets)
        y_std : ndarray of shape (n_queries,) or (n_queries, n_targets), if return_std
        y_cov : ndarray of shape (n_queries, n_queries) or (n_queries, n_queries, n_targets),
            if return_cov
        """
        if return_std and return_cov:
            raise RuntimeError(
                "At most one of return_std or return_cov can be requested."
            )
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        params, x, alpha, dtype, centre = self._state()
        posterior = gp.Posterior(alpha=alpha)
        if return_std or return_cov:
            posterior = self._variance_posterior(params, x, posterior, dtype)
        out = gp.predict(params, x, posterior, centred(X, centre, dtype),
                         return_std=return_std,
                         return_cov=return_cov, engine=self._engine())
        mean = np.asarray(out[0] if (return_std or return_cov) else out, np.float64)
        mean = mean * self._y_train_std + self._y_train_mean
        if self._y_1d:
            mean = mean[:, 0]
        if not (return_std or return_cov):
            return mean
        spread = np.asarray(out[1], np.float64)
        if return_std:
            std = spread[:, None] * self._y_train_std
            return mean, (std[:, 0] if self._y_1d else std)
        cov = spread[:, :, None] * self._y_train_std**2
        return mean, (cov[:, :, 0] if self._y_1d else cov)

    def sample_y(self, X, n_samples=1, random_state=0):
        """Draw samples of y at X from the predictive distribution (noise included).

        Returns
        -------
        ndarray of shape (n_queries, n_samples) or (n_queries, n_targets, n_samples)
        """
        rng = check_random_state(random_state)
        mean, cov = self.predict(X, return_cov=True)
        if mean.ndim == 1:
            return rng.multivariate_normal(mean, cov, n_samples).T
        return np.stack([
            rng.multivariate_normal(mean[:, j], cov[..., j], n_samples).T
            for j in range(mean.shape[1])
        ], axis=1)

    def log_marginal_likelihood(self, theta=None, eval_gradient=False):
        """Log marginal likelihood (normalised units) at ``theta``.

        Parameters
        ----------
        theta : array-like or None
            With ``kernel`` given, scikit-learn's layout: the logarithms of the kernel's free
            hyperparameters (``kernel_.theta``), the mean held at its fitted value. With
            ``kernel=None``, the layout of ``theta_``. None returns
            ``log_marginal_likelihood_value_``.
        eval_gradient : bool
            Also return the gradient with respect to ``theta``.
        """
        check_is_fitted(self)
        if theta is None:
            if eval_gradient:
                raise ValueError("gradient can only be evaluated for theta!=None")
            return self.log_marginal_likelihood_value_
        theta = np.asarray(theta, np.float64)
        fixed_mean = self._fixed_mean
        expected = self.theta_.shape
        if self._spec is not None:
            o = self._y_train_mean.shape[0]
            fixed_mean = self.theta_[:o] if fixed_mean is None else fixed_mean
            expected = (self.kernel.n_dims,)
        if theta.shape != expected:
            raise ValueError(f"theta must have shape {expected}, got {theta.shape}")
        _, x, _, dtype, _ = self._state()
        o = self._y_train_mean.shape[0]
        y2 = np.asarray(self.y_train_, np.float64).reshape(x.shape[0], o)
        yj = jnp.asarray((y2 - self._y_train_mean) / self._y_train_std, dtype)
        solver = gp.CholeskySolver() if self.solver_ == "exact" else self._bbmm(self._probe_seed)
        value, grad = Objective(solver, x, yj, fixed_mean, self._unpack)(theta)
        return (-value, -grad) if eval_gradient else -value

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.single_output = False
        tags.target_tags.multi_output = True
        return tags
