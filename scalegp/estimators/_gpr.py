"""`ScalableGPRegressor`: scikit-learn's GaussianProcessRegressor surface on `scalegp.gp`.

Re-exported from `scalegp.estimators`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.gaussian_process import kernels as sk_kernels
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from scalegp import gp
from scalegp._validation import as_compute_dtype, check_int, validate_data
from scalegp.estimators._gpr_checks import (
    check_distances_fit,
    check_n_targets,
    check_not_constant,
    check_positive,
    check_restart_bounds,
    SOLVERS,
    check_settings,
    check_target,
    checked_alpha,
    compute_dtype,
    default_model_start,
    fixed_mean,
    gp_engine,
)
from scalegp.estimators._gpr_fit import (
    Objective,
    centred,
    input_centre,
    minimize,
    objective_tolerance,
    restart_points,
    scoring_steps,
)
from scalegp.estimators._gpr_kernels import KernelSpec, check_size, kernel_spec
from scalegp.estimators._progress import FitProgress
from scalegp.ops import kernel_matrix, spatial_order

__all__ = ["ScalableGPRegressor"]

_SOLVERS = SOLVERS  # until persistence imports SOLVERS from scalegp.estimators (issue 37)


class ScalableGPRegressor(RegressorMixin, BaseEstimator):
    """Exact Gaussian-process regression for large n (constant mean, Gaussian noise).

    The default model (``kernel=None``) is ``y = m + f(x) + ε`` with
    ``f ~ GP(0, s·exp(-½ Σ_d ((x_d - x'_d)/l_d)²))`` and ``ε ~ N(0, σ²)``, i.e. scikit-learn's
    ``ConstantKernel(s) * RBF(l) + WhiteKernel(σ²)`` plus a constant mean ``m``. With
    ``kernel=`` a scikit-learn kernel object, the covariance is that kernel, run on the same
    memory-linear engine (never evaluated through scikit-learn); with ``mean=0.0`` as well it
    is a drop-in for scikit-learn's GaussianProcessRegressor (its constructor arguments, fit,
    predict, the prior before fit, sample_y, log_marginal_likelihood; the README lists what
    differs). Up to
    ``exact_max_n`` training points it uses a dense Cholesky (:class:`scalegp.gp.CholeskySolver`;
    with more than ``subset_size`` points, L-BFGS-B on a random half of them and then scoring
    steps on all of them, to L-BFGS-B's tolerance); beyond, BBMM
    (:class:`scalegp.gp.BBMMSolver`: preconditioned conjugate gradients, stochastic
    Lanczos quadrature, memory linear in n) and the recipe of Wang et al. (2019), refined:
    hyperparameters by L-BFGS-B on a random subset of ``subset_size`` points with the exact
    objective, then scoring steps with the BBMM objective (fixed probes, so deterministic) on
    nested random subsets four times larger each time, while they hold at most a third of the
    data, and last on all data (at most ``max_iter_full`` steps per stage; see
    `scalegp.estimators._gpr_fit.scoring_steps`). The steps start from the subset's Fisher
    information, so each costs one objective evaluation when it succeeds, and each stage starts
    closer to the full-data optimum than the last. Predictions use
    ``alpha = (K + σ²I)⁻¹(y - m)`` solved once at the end of fit and, for the iterative solver,
    a LOVE-style variance cache (:meth:`scalegp.gp.BBMMSolver.love`) built with it, from the
    pivoted Cholesky factor that preconditions that solve.

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
        Initial kernel variance ``s``, in y's units (normalised ones with ``normalize_y``).
        When the optimiser runs and ``s + σ²`` starts more than 100 times off y's variance,
        both start scaled alike to it (the noise above ``noise_lower_bound``).
    noise : float, default=0.1
        Initial noise variance ``σ²`` (must exceed ``noise_lower_bound``).
    noise_lower_bound : float, default=1e-6
        ``σ² >= noise_lower_bound`` during optimisation; raise it if a fit warns about jitter.
        (Default model only.) Without ``normalize_y`` the default model is fitted in units of
        ``y / 2^k``, ``2^k`` near y's std, with these three settings and ``mean`` converted:
        the same model, whose float32 fit does not depend on y's scale (predictions of ``c·y``
        with the settings in units of ``c`` are ``c`` times those of ``y``, bit for bit for
        ``c`` a power of two).
    alpha : float or array of shape (n_samples,), default=1e-10
        With ``kernel``: as scikit-learn's ``alpha``, a fixed value added to the diagonal of the
        training points' kernel matrix, one per point for an array (known measurement noise
        variances; a one-element array is a scalar). It is not part of the predictive std or
        covariance at new points (a WhiteKernel term is). Raise it, or add a WhiteKernel, if a
        fit warns about jitter; float32 needs far more than 1e-10. Not used by the default
        model (``kernel=None``, learnt noise): a value other than 1e-10 warns there.
    mean : float, array of shape (n_targets,) or None, default=None
        Constant prior mean, in y's units (normalised ones with ``normalize_y=True``). None:
        learnt (initialised at the mean of y); a number fixes it:
        0 is scikit-learn's zero-mean prior (with ``normalize_y=True``, a prior mean at the
        training mean of y).
    normalize_y : bool, default=False
        Standardise y (per output) before fitting, as scikit-learn does.
    copy_X_train : bool, default=True
        Store copies of the training X and y (``X_train_``, ``y_train_``); False may keep
        references to the caller's arrays, which must then stay unchanged.
    n_targets : int or None, default=None
        The number of targets: checked against y at fit, and the shape of predictions before
        fit (from the prior). None: any at fit, one before.
    optimizer : {"L-BFGS-B", "fmin_l_bfgs_b", "adam"} or None, default="L-BFGS-B"
        "L-BFGS-B" (scipy; "fmin_l_bfgs_b", scikit-learn's name, is the same) suits the
        deterministic objectives used here (exact, or BBMM with fixed probes); it stops after
        ``max_iter`` iterations, with a ConvergenceWarning. Callables (scikit-learn's custom
        optimizers) are not taken. "adam" takes ``max_iter`` (then ``max_iter_full``) Adam
        steps of size
        ``learning_rate`` and keeps the best iterate; it needs no line search, so each step
        costs exactly one objective evaluation. None keeps the given hyperparameters.
    learning_rate : float, default=0.05
        Adam step size, in the unconstrained parameters (``softplus⁻¹`` of ``s``, ``l`` and
        ``σ²``, and the mean, in the units of ``theta_``): each step moves each of them by
        about this much at first. Only used with ``optimizer="adam"``.
    n_restarts_optimizer : int, default=0
        Extra optimisations from random initial values (default model: each of ``log s``,
        ``log l_d``, ``log σ²`` shifted by U(-2, 2); with ``kernel``: uniform within its
        bounds, which must then be finite); the best marginal likelihood wins.
    max_iter : int, default=200
        L-BFGS-B iterations (on the subset for large n). In float32 a run stops after three
        evaluations in a row that gain less than 100 roundings of the NLML (≈ 1.2e-5 of it);
        in float64 at L-BFGS-B's own ``ftol`` (scipy's default); on the subset that starts
        BBMM, after three that gain less than 1e-4 of it. A run that stops so (or whose line
        search fails) is followed by a fresh one from its best point while runs gain more
        than that tolerance; ``max_iter`` counts the iterations of all of them.
    solver : {"auto", "exact", "bbmm"}, default="auto"
        "auto" is "exact" for ``n_samples <= exact_max_n``.
    exact_max_n : int, default=4096
        Switch point of "auto" (:data:`scalegp.gp.EXACT_MAX_N`).
    subset_size : int, default=2048
        Random subset for the first phase of BBMM training; an exact fit on more points starts
        on a random half of them (at most ``subset_size``).
    max_iter_full : int, default=10
        Scoring steps per BBMM stage (the growing subsets, then all data), or Adam steps on all
        data with ``optimizer="adam"`` (0 skips them all). A stage ends earlier when the step it
        would take is predicted to gain under ½ nat (within one standard error of the
        estimate; on all data under p/2 nats for p free parameters, within their joint
        confidence region), or, on all data, when a step fails to lower the NLML.
    num_probes, preconditioner_rank, cg_tol, max_cg_iter, love_rank :
        Settings of :class:`scalegp.gp.BBMMSolver` (defaults 30, 768, 1e-3, 1000, 1024).
    dtype : None or a float32/float64 dtype, default=None
        Compute dtype, anything numpy reads as float32 or float64 ("float64", np.float64, ...);
        None is float64 when JAX x64 is enabled, float32 otherwise.
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
    prune : {"auto", True, False}, default="auto"
        Skip the kernel tiles that cannot matter (one device; kernels whose values fall to 0
        with distance: RBF, Matérn and rational-quadratic terms and their sums and products,
        a periodic factor included; see :func:`scalegp.ops.kernel_mv`). "auto"
        considers it from 16,384 training points in at most 8 features and prunes when their
        tile bounds say it pays (lengthscales short against the data's extent). Where it may
        prune, ``fit`` stores the training data in :func:`scalegp.ops.spatial_order`
        (``X_train_``, ``y_train_`` and ``alpha_`` in that order; not with a per-point
        ``alpha``).
    prune_tol : float or None, default=None
        With pruning, each kernel product's skipped part is at most ``prune_tol`` times the sum
        of the absolute values multiplied; None: half the float epsilon (under rounding).
    verbose : int, default=0
        >0 reports the fit's phases (the subset fit, each BBMM stage, the final solve with the
        variance cache) with their elapsed time, and each optimiser iteration (objective, CG
        iterations, the phase's time and an upper bound on what it has left at the same pace):
        always to logger "scalegp.gp" at INFO level, and on screen as a progress bar per phase
        when stderr is a terminal and tqdm is installed (``pip install scalegp[progress]``),
        otherwise as printed lines (on stderr when it is a terminal).
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
        Fitted noise variance of y at any point (in normalised units when ``normalize_y``): the
        default model's ``σ²``; with ``kernel``, the sum of its WhiteKernel terms (0 without
        any; ``alpha`` is not included).
    mean_ : ndarray of shape (n_targets,)
        Fitted constant mean in the units of y.
    theta_ : ndarray
        The optimised vector: ``[mean (if learnt), raw s, raw l (d), raw σ²]``
        (``raw = softplus⁻¹``) for the default model, the input of
        :meth:`log_marginal_likelihood`, in the units the model is fitted in (without
        ``normalize_y``, y over ``2^k``: the mean over ``2^k``, ``s`` and ``σ² -
        noise_lower_bound`` over ``4^k``); with ``kernel``,
        ``[mean (if learnt), kernel_.theta]``.
    alpha_ : ndarray of shape (n_samples,) or (n_samples, n_targets)
        ``(K + σ²I)⁻¹ (y - m)`` in the units the model is fitted in (those of ``theta_``).
    log_marginal_likelihood_value_ : float
        Of y (of the normalised y with ``normalize_y``).
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
        copy_X_train=True,
        n_targets=None,
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
        prune="auto",
        prune_tol=None,
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
        self.copy_X_train = copy_X_train
        self.n_targets = n_targets
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
        self.prune = prune
        self.prune_tol = prune_tol
        self.verbose = verbose
        self.random_state = random_state

    # ---------------------------------------------------------------------------------------
    # helpers

    def _dtype(self):
        return compute_dtype(self)

    def _model_kernel(self):
        """The scikit-learn kernel of the model (None: the default model)."""
        return self.kernel

    def _engine(self):
        return gp_engine(self)

    def _training_order(self, X):
        """The permutation `fit` applies to the training rows (None: keep them): their
        `scalegp.ops.spatial_order` where the engine may prune them, so that every kernel
        product with them as keys (training and prediction) need not sort them again. A
        per-point ``alpha`` keeps the rows as given (it is tied to their order)."""
        n, d = X.shape
        if np.ndim(self.alpha) or not self._engine().orders_keys(n, d):
            return None
        scale = 1.0 if self._model_kernel() is not None else np.broadcast_to(
            check_positive("lengthscale", self.lengthscale, (d,)), (d,))
        return spatial_order(X, scale)

    def _bbmm(self, seed):
        return gp.BBMMSolver(
            num_probes=self.num_probes, preconditioner_rank=self.preconditioner_rank,
            cg_tol=float(self.cg_tol), max_cg_iter=self.max_cg_iter, love_rank=self.love_rank,
            seed=int(seed), engine=self._engine(),
        )

    def _unpack(self, theta, o, d, fixed_mean, dtype, fixed_noise=None):
        """The solvers' parameters from the optimised vector; ``fixed_noise``: alpha for the
        training rows in use (default: all of them)."""
        if isinstance(theta, jax.Array):  # traced: the Fisher information differentiates this
            xp = jnp
            theta = theta.astype(dtype)
        else:
            xp, theta = np, np.asarray(theta, np.float64)
        if fixed_mean is not None:
            theta = xp.concatenate([xp.asarray(fixed_mean, theta.dtype), theta])
        if getattr(self, "_spec", None) is not None:
            fixed_noise = self._fixed_noise if fixed_noise is None else fixed_noise
            return gp.KernelParams(mean=jnp.asarray(theta[:o], dtype),
                                   theta=jnp.asarray(theta[o:], dtype), spec=self._spec,
                                   fixed_noise=jnp.asarray(fixed_noise, dtype))
        return gp.GPParams.unflatten(theta, o, d, dtype=dtype,
                                     noise_lower_bound=self.noise_lower_bound / self._unit())

    def _unit(self):
        """The variance of the fitted units in y's: ``σ²`` for the default model without
        ``normalize_y``, fitted in ``y / σ`` (`_normalised_target`), where ``outputscale``,
        ``noise``, ``noise_lower_bound`` and a fixed ``mean`` (over ``σ``) are in y's units;
        1 otherwise (with ``normalize_y`` they are in the normalised units, with a kernel in
        y's, as scikit-learn's)."""
        if (getattr(self, "_spec", None) is not None or self.normalize_y
                or not hasattr(self, "_y_train_std")):  # a kernel, normalize_y or before fit
            return 1.0
        return float(self._y_train_std[0]) ** 2

    def _lml_offset(self, size):
        """What turns the log marginal likelihood of ``size`` target values in the fitted units
        into y's: the density of ``y = σ·u`` is that of ``u`` over ``σ`` per value."""
        return -0.5 * size * np.log(self._unit())

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
        kernel = self._model_kernel()
        if kernel is not None:
            # before anything reads kernel.bounds: scikit-learn's Sum and Product read each
            # operand's bounds twice, 2**depth work for a deep kernel
            check_size(kernel)
        check_restart_bounds(self, kernel)
        if kernel is not None:
            KernelSpec.from_sklearn(kernel)  # a kernel refused by design, before X is read
        X, y = validate_data(self, X, y=y, multi_output=True, y_numeric=True,
                             ensure_min_samples=2, dtype=[np.float64, np.float32])
        n, d = X.shape
        check_settings(self)
        check_n_targets(self.n_targets, y)
        order = self._training_order(X)
        if order is not None:
            X, y = X[order], y[order]
        self._spec = kernel_spec(kernel, self.alpha, d)
        self._fixed_noise = checked_alpha(self.alpha, n, self._spec is None)
        dtype = self._dtype()
        rng = check_random_state(self.random_state)
        yn = self._normalised_target(y, dtype)
        o = yn.shape[1]
        fixed_mean, mean0 = self._mean_setting(yn)
        self.solver_ = self.solver if self.solver != "auto" else (
            "exact" if n <= self.exact_max_n else "bbmm")
        self._probe_seed = int(rng.randint(2**31 - 1))
        x = centred(X, input_centre(X), dtype)
        yj = jnp.asarray(as_compute_dtype(yn, dtype, "y"))
        if self._spec is None:
            lengthscale, outputscale, noise = default_model_start(self, d)
            check_distances_fit(x, lengthscale)
            unit = self._unit()
            outputscale, noise, floor = (outputscale / unit, noise / unit,
                                         self.noise_lower_bound / unit)
            if self.optimizer is not None:
                outputscale, noise = _start_at_scale(outputscale, noise, floor,
                                                     float(np.mean(np.var(yn, axis=0))))
            theta0 = gp.GPParams.from_constrained(
                mean0, outputscale, lengthscale, noise, noise_lower_bound=floor,
                dtype=dtype).flatten()
        else:
            check_distances_fit(x, 1.0)  # the expression path measures distances unscaled
            theta0 = np.concatenate([mean0, kernel.theta])
        if fixed_mean is not None:
            theta0 = theta0[o:]
        self._fixed_mean = fixed_mean
        progress = FitProgress(self.verbose)
        theta, final_value, n_iter, alpha0 = self._optimise(theta0, x, yj, rng, progress)
        self._store_fit(X, y, theta, final_value, n_iter, x, yj, alpha0, progress)
        return self

    def _check_settings(self):  # until persistence calls check_settings (issue 37)
        check_settings(self)

    def _default_model_start(self, d):  # until persistence calls default_model_start
        return default_model_start(self, d)

    def _normalised_target(self, y, dtype):
        """y as (n, o) float64, checked for the compute ``dtype``, in the units it is fitted in:
        normalised when ``normalize_y``; for the default model otherwise, over ``σ``, a power of
        two near its std (one for all targets, which share the outputscale and the noise), so
        that the float32 objective and the softplus parameters see the same numbers at any
        scale (in y's units a fit far from unit scale stopped far from the optimum:
        docs/decisions.md #2). Dividing
        by a power of two is exact: c·y for c a power of two gives the same fit, bit for bit.
        The statistics are kept, float64, in ``_y_train_mean`` and ``_y_train_std``, and
        applied in float64 at predict."""
        self._y_1d = y.ndim == 1
        y2 = y.reshape(y.shape[0], -1).astype(np.float64)
        check_target(y2, self.noise_lower_bound, self.normalize_y, self._spec is None, dtype)
        if self.optimizer is not None and self._spec is None:
            # the default model's hyperparameters are unbounded; a kernel's are bounded
            check_not_constant(y2)
        o = y2.shape[1]
        if self.normalize_y:
            self._y_train_mean = y2.mean(axis=0)
            std = y2.std(axis=0)
            # a constant column (up to the rounding of its mean) keeps its scale, as
            # scikit-learn's; "constant" relative to its values, not below an absolute 10 eps
            # as scikit-learn's: that took targets of 1e-30 for constant and fitted them unscaled
            eps = np.finfo(np.float64).eps
            tiny = std <= 10 * eps * np.max(np.abs(y2), axis=0)
            self._y_train_std = np.where(tiny, 1.0, std)
        else:
            self._y_train_mean, self._y_train_std = np.zeros(o), np.ones(o)
            if self._spec is None:  # not centred: the model stays the same with a fixed mean
                self._y_train_std[:] = _power_of_two_scale(y2)
        return (y2 - self._y_train_mean) / self._y_train_std

    def _mean_setting(self, yn):
        """``(fixed mean or None, initial mean)`` in normalised units, both (o,)."""
        o = yn.shape[1]
        if self.mean is None:
            return None, yn.mean(axis=0)
        # normalised units with normalize_y, y's otherwise
        fixed = fixed_mean(self.mean, o) / np.sqrt(self._unit())
        return fixed, fixed

    def _minimize(self, objective, theta0, maxiter, phase, progress, warn_maxiter=True,
                  ftol=None):
        return minimize(objective, theta0, maxiter, phase, optimizer=self.optimizer,
                        learning_rate=self.learning_rate, progress=progress, ftol=ftol,
                        warn_maxiter=warn_maxiter, bounds=self._bounds(len(theta0)))

    def _kernel_theta(self, theta):
        """The scikit-learn kernel's part of the optimised vector (after the free means)."""
        return np.asarray(theta, np.float64)[len(theta) - self._model_kernel().n_dims:]

    def _bounds(self, size):
        """L-BFGS-B bounds of the optimised vector: None for the default model (unconstrained
        parameters); the kernel's own (log) bounds after the free means otherwise."""
        if self._spec is None:
            return None
        kernel_bounds = np.asarray(self._model_kernel().bounds, np.float64).reshape(-1, 2)
        free_means = size - kernel_bounds.shape[0]
        return [(None, None)] * free_means + [tuple(b) for b in kernel_bounds]

    def _starts(self, theta0, n_free_start, rng):
        """``theta0`` and ``n_restarts_optimizer`` random starts: for a scikit-learn kernel,
        drawn uniformly within its (log) bounds as scikit-learn draws them."""
        if self._spec is None:
            return restart_points(theta0, self.n_restarts_optimizer, n_free_start, rng)
        bounds = np.asarray(self._model_kernel().bounds, np.float64).reshape(-1, 2)
        starts = [theta0]
        for _ in range(self.n_restarts_optimizer):
            start = theta0.copy()
            start[n_free_start:] = rng.uniform(bounds[:, 0], bounds[:, 1])
            starts.append(start)
        return starts

    def _optimise(self, theta0, x, yj, rng, progress):
        """``(theta, NLML at theta or None, iterations, α at theta or None)``: exact fits from
        ``theta0`` and the restarts (on a random subset for BBMM), then a few BBMM steps on all
        data."""
        if self.optimizer is None or theta0.size == 0:  # nothing to optimise
            return theta0, None, 0, None
        n, o = yj.shape
        x_fit, y_fit, unpack = x, yj, self._unpack
        # An exact fit on more than subset_size points starts on a random half (at most
        # subset_size) of them, where an evaluation costs a quarter to an eighth (n² to n³),
        # and finishes by scoring steps on all of them (`_refine_exact`).
        refine = (self.solver_ == "exact" and self.optimizer != "adam"
                  and n > self.subset_size)
        if self.solver_ == "bbmm" or refine:
            size = min(self.subset_size, n if self.solver_ == "bbmm" else n // 2)
            idx = np.sort(rng.choice(n, size=size, replace=False))
            x_fit, y_fit, unpack = x[idx], yj[idx], self._subset_unpack(idx)
        objective = Objective(gp.CholeskySolver(), x_fit, y_fit, self._fixed_mean, unpack)
        n_free_start = 0 if self._fixed_mean is not None else o
        best = None
        # A subset fit only starts the stages on more data, which move on to the full-data
        # optimum: it stops once an iteration gains under 1e-4 of the NLML.
        ftol = _SUBSET_FTOL if x_fit.shape[0] < n else None
        for i, start in enumerate(self._starts(theta0, n_free_start, rng)):
            theta, value, nit = self._minimize(objective, start, self.max_iter,
                                               f"exact fit (start {i})", progress, ftol=ftol)
            if best is None or value < best[1]:
                best = (theta, value, nit)
        theta, value, n_iter = best
        if refine:
            theta, value, nit = self._refine_exact(theta, x, yj, idx, rng, progress)
            return theta, value, n_iter + nit, None
        if self.solver_ == "exact":
            return theta, value, n_iter, None
        if self.max_iter_full == 0:
            return theta, None, n_iter, None  # the subset's objective is not the full data's
        objective = Objective(self._bbmm(self._probe_seed), x, yj, self._fixed_mean, self._unpack)
        # A planned, small number of steps (Wang et al., 2019): reaching it is expected.
        phase = "BBMM fit on all data"
        if self.optimizer == "adam":
            theta, value, nit = self._minimize(objective, theta, self.max_iter_full, phase,
                                               progress, warn_maxiter=False)
        else:
            theta, value, nit = self._scoring_stages(theta, x, yj, idx, objective, rng,
                                                     progress)
        value, _ = objective(theta)  # remembered: sets the solution at theta
        return theta, value, n_iter + nit, objective.solution

    def _subset_unpack(self, idx):
        """`_unpack` for the training points ``idx`` (their own per-point noise, if any)."""
        if np.ndim(self._fixed_noise):
            return functools.partial(self._unpack, fixed_noise=self._fixed_noise[idx])
        return self._unpack

    def _information(self, theta, x, subset, size=None):
        """The exact Fisher information of ``theta`` on ``x[subset]``, or on its first ``size``
        points when given."""
        o, d = self._y_train_mean.shape[0], x.shape[1]
        subset = subset if size is None else subset[:size]
        unpack = functools.partial(self._subset_unpack(subset), o=o, d=d,
                                   fixed_mean=self._fixed_mean, dtype=x.dtype)
        return gp.fisher_information(unpack, theta, x[subset], o)

    def _refine_exact(self, theta, x, yj, subset, rng, progress):
        """Scoring steps (`scoring_steps`) of the exact objective on all data from ``theta``,
        the optimum on ``subset``, to L-BFGS-B's tolerance; ``(theta, value, steps)``.

        The curvature is the Fisher information of 1,024 of the subset's points scaled to
        ``n`` (its cost grows as the cube of the points, an evaluation's as the cube of ``n``);
        from the subset's optimum, a few quasi-Newton steps reach the full-data one where
        L-BFGS-B, started anew, spends its first evaluations learning each parameter's scale.
        A failed step is halved once only: near the optimum of a float32 objective, further
        halvings evaluate its rounding noise.
        """
        n = yj.shape[0]
        size = min(len(subset), _CURVATURE_POINTS)
        information = self._information(theta, x, rng.permutation(subset), size) * (n / size)
        objective = Objective(gp.CholeskySolver(), x, yj, self._fixed_mean, self._unpack)
        theta, value, steps, _ = scoring_steps(
            objective, theta, information, self.max_iter, "exact fit on all data",
            progress=progress, bounds=self._bounds(len(theta)), min_decrease=0.0, halvings=1,
            ftol=objective_tolerance(x.dtype))
        return theta, value, steps

    def _scoring_stages(self, theta, x, yj, subset, objective, rng, progress):
        """Scoring steps (`scoring_steps`) on nested random subsets growing fourfold from
        ``subset`` (the exact fit's) while they hold at most a third of the data, then on all
        data (``objective``); ``(theta, value, steps)``.

        The first curvature is the exact subset's Fisher information; each stage hands its
        BFGS-updated curvature to the next, scaled by the ratio of sizes. A subset's optimum is
        off the full-data one by its sampling error, which shrinks as the subset grows, so each
        stage starts closer and the full-data stage, where an evaluation costs the most, needs
        the fewest steps (the estimate there is the full-data one all the same)."""
        n = yj.shape[0]
        m = len(subset)
        information = self._information(theta, x, subset)
        bounds = self._bounds(len(theta))
        rest = rng.permutation(np.setdiff1d(np.arange(n), subset))
        steps = 0
        size = 4 * m
        while size <= n // 3:
            # The subset and the first size - |subset| of the rest: each stage holds the last.
            stage = np.sort(np.concatenate([subset, rest[:size - len(subset)]]))
            stage_objective = Objective(self._bbmm(self._probe_seed), x[stage], yj[stage],
                                        self._fixed_mean, self._subset_unpack(stage))
            theta, _, nit, information = scoring_steps(
                stage_objective, theta, information * (size / m), self.max_iter_full,
                f"BBMM fit on {size:,} of the points", progress=progress, bounds=bounds)
            steps, m, size = steps + nit, size, 4 * size
        # On all data, where an evaluation costs the most, a step must promise more than p/2
        # nats (p free parameters): a point from which the optimum is nearer lies inside the
        # estimate's joint confidence region (2ΔNLML below the mean of χ²_p), and the stochastic
        # gradient's own noise makes a predicted gain of that size. A step that fails to lower
        # the NLML is not halved, for the same reason.
        theta, value, nit, _ = scoring_steps(
            objective, theta, information * (n / m), self.max_iter_full, "BBMM fit on all data",
            progress=progress, bounds=bounds, halvings=0,
            min_decrease=max(0.5, 0.5 * len(theta)))
        return theta, value, steps + nit

    def _store_fit(self, X, y, theta, final_value, n_iter, x, yj, alpha0, progress):
        """The fitted attributes and the prediction cache at ``theta`` (``alpha0``: a warm
        start for its solve, or None)."""
        o, d = yj.shape[1], x.shape[1]
        params = self._unpack(theta, o, d, self._fixed_mean, x.dtype)
        solver = (gp.CholeskySolver() if self.solver_ == "exact"
                  else self._bbmm(self._probe_seed))
        with progress.phase("final solve" + ("" if self.solver_ == "exact"
                                             else " and variance cache")):
            if final_value is None or not np.isfinite(final_value):
                result = solver.value_and_grad(params, x, yj)
                final_value, alpha0 = float(result.value), result.solution
            if self.solver_ == "exact":
                posterior = solver.posterior(params, x, yj)
            else:  # the variance cache comes with the solve's own preconditioner
                posterior = solver.posterior(params, x, yj, initial=alpha0, variance=True)
            jax.block_until_ready(posterior)
        hp = params.constrained()
        self.theta_ = np.asarray(theta, np.float64)
        self.log_marginal_likelihood_value_ = -final_value + self._lml_offset(yj.size)
        if self._spec is None:
            outputscale, lengthscale = hp.kernel.terms
            self.lengthscale_ = np.asarray(lengthscale.lengthscale, np.float64)
            self.outputscale_ = float(outputscale.value) * self._unit()
            self.noise_ = float(hp.noise) * self._unit()
            self.kernel_ = _default_kernel(hp, self._unit())
        else:
            kernel = self._model_kernel()
            self.kernel_ = kernel.clone_with_theta(self._kernel_theta(self.theta_))
            if self.optimizer is not None and kernel.n_dims:
                # scikit-learn's ConvergenceWarning for values close to a bound
                check_bounds = getattr(self.kernel_, "_check_bounds_params", None)
                if check_bounds is not None:
                    check_bounds()
            self.noise_ = float(self._test_noise(params))
        self.mean_ = np.asarray(hp.mean, np.float64) * self._y_train_std + self._y_train_mean
        self.n_iter_ = int(n_iter)
        self.X_train_ = np.array(X, copy=True) if self.copy_X_train else np.asarray(X)
        self.y_train_ = np.array(y, copy=True) if self.copy_X_train else np.asarray(y)
        alpha = np.asarray(posterior.alpha)
        self.alpha_ = alpha[:, 0] if self._y_1d else alpha
        self._cholesky = None if posterior.cholesky is None else np.asarray(posterior.cholesky)
        self._love_factor = (None if posterior.love_factor is None
                             else np.asarray(posterior.love_factor))

    # ---------------------------------------------------------------------------------------
    # predict

    def _state(self):
        """``(params, x, alpha, dtype, centre)``: the fitted state in the compute dtype, with the
        training inputs ``x`` centred on ``centre``, their `input_centre` (recomputed rather than
        stored, so model files carry no extra state; queries are centred on it too)."""
        dtype = self._dtype()
        o = self._y_train_mean.shape[0]
        params = self._unpack(self.theta_, o, self.n_features_in_, self._fixed_mean, dtype)
        centre = input_centre(self.X_train_)
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
            with FitProgress(self.verbose).phase("variance cache"):
                self._love_factor = np.asarray(solver.love(params, x, posterior).love_factor)
        return gp.Posterior(alpha=posterior.alpha,
                            love_factor=jnp.asarray(self._love_factor, dtype))

    def _test_noise(self, params):
        """The noise variance of y at a new point (normalised units): the default model's
        ``σ²``; with a kernel, its WhiteKernel terms (scikit-learn's ``kernel_.diag`` beyond
        f's), never ``alpha``, which belongs to the training points."""
        if self._spec is None:
            return params.constrained().noise
        return self._spec.build(params.theta)[1]

    def predict(self, X, return_std=False, return_cov=False):
        """Predictive mean, and optionally the std or covariance of y, as scikit-learn's.

        The noise of y at the query points is included: the default model's ``σ²``; with
        ``kernel``, its WhiteKernel terms (``alpha`` is not: it belongs to the training points).
        Before ``fit``, the prior: mean ``mean`` (0 when None), the covariance of the kernel
        (the default model's at its starting values), for ``n_targets`` targets.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        return_std, return_cov : bool
            At most one. ``return_cov`` forms (n_queries, n_queries) matrices: keep it small; one
            beyond the memory this process can hold is a MemoryError before any work.

        Returns
        -------
        y_mean : ndarray of shape (n_queries,) or (n_queries, n_targets)
        y_std : ndarray of shape (n_queries,) or (n_queries, n_targets), if return_std
        y_cov : ndarray of shape (n_queries, n_queries) or (n_queries, n_queries, n_targets),
            if return_cov

        A single target, as y of shape (n_samples,) or (n_samples, 1), gives the 1-D and 2-D
        shapes.
        """
        if return_std and return_cov:
            raise RuntimeError(
                "At most one of return_std or return_cov can be requested."
            )
        if not hasattr(self, "X_train_"):
            return self._predict_prior(X, return_std, return_cov)
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        if return_cov:
            self._check_covariance_memory(X.shape[0], self._n_outputs())
        params, x, alpha, dtype, centre = self._state()
        posterior = gp.Posterior(alpha=alpha)
        if return_std or return_cov:
            posterior = self._variance_posterior(params, x, posterior, dtype)
        # the default model's noise is σ² everywhere; a kernel's at new points is its
        # WhiteKernel terms, added below (the training diagonal also holds alpha)
        out = gp.predict(params, x, posterior, centred(X, centre, dtype),
                         return_std=return_std, return_cov=return_cov,
                         include_noise=self._spec is None, engine=self._engine())
        mean = np.asarray(out[0] if (return_std or return_cov) else out, np.float64)
        mean = mean * self._y_train_std + self._y_train_mean
        if not (return_std or return_cov):
            return _squeezed(mean)
        spread = np.array(out[1], np.float64)  # a writable copy (the diagonal below)
        white = 0.0 if self._spec is None else float(self._test_noise(params))
        if return_std:
            if white:
                spread = np.sqrt(spread**2 + white)
            return _squeezed(mean), _squeezed(spread[:, None] * self._y_train_std)
        spread[np.diag_indices_from(spread)] += white  # in place: no (m, m) identity
        return _squeezed(mean), _squeezed(spread[:, :, None] * self._y_train_std**2)

    def _n_outputs(self):
        """The targets of a prediction: the fitted ones; before fit, ``n_targets`` (None: 1)."""
        if hasattr(self, "X_train_"):
            return self._y_train_mean.shape[0]
        return 1 if self.n_targets is None else check_int("n_targets", self.n_targets, 1)

    def _check_covariance_memory(self, m, o, extra=0):
        """`gp.check_covariance_memory` for a covariance of ``m`` query rows and ``o`` targets,
        before any work: the compute dtype's matrices of `gp.predict`, a float64 copy and the
        float64 ``(m, m, o)`` result, and ``extra`` float64 ``(m, m)`` matrices."""
        itemsize = np.dtype(self._dtype()).itemsize
        per_entry = gp.COVARIANCE_MATRICES * itemsize + 8 * (1 + o + extra)
        gp.check_covariance_memory(m, m * m * per_entry)

    def _prior(self, d, o, dtype):
        """``(hyperparameters, noise at new points)`` before any fit: the model at its starting
        values, the mean at ``mean`` (0 when None)."""
        mean = np.zeros(o) if self.mean is None else fixed_mean(self.mean, o)
        kernel = self._model_kernel()
        spec = kernel_spec(kernel, self.alpha, d)
        if spec is None:
            lengthscale, outputscale, noise = default_model_start(self, d)
            hp = gp.GPParams.from_constrained(
                mean, outputscale, lengthscale, noise,
                noise_lower_bound=self.noise_lower_bound, dtype=dtype).constrained()
            return hp, float(hp.noise)
        theta = jnp.asarray(kernel.theta, dtype)
        hp = gp.KernelParams(mean=jnp.asarray(mean, dtype), theta=theta, spec=spec).constrained()
        return hp, float(spec.build(theta)[1])

    def _predict_prior(self, X, return_std, return_cov):
        """`predict` before `fit`: the prior (scikit-learn's, for a kernel)."""
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        o = self._n_outputs()
        if return_cov:
            self._check_covariance_memory(X.shape[0], o)
        dtype = self._dtype()
        hp, noise = self._prior(X.shape[1], o, dtype)
        mean = np.broadcast_to(np.asarray(hp.mean, np.float64), (X.shape[0], o))
        if not (return_std or return_cov):
            return _squeezed(mean)
        if return_std:
            std = np.sqrt(float(hp.kernel.at_zero()) + noise)  # stationary: k(x, x) = k(0)
            return _squeezed(mean), _squeezed(np.full((X.shape[0], o), std))
        x = centred(X, input_centre(X), dtype)
        cov = np.array(kernel_matrix(hp.kernel, x, x), np.float64)
        cov[np.diag_indices_from(cov)] += noise
        return _squeezed(mean), _squeezed(np.repeat(cov[:, :, None], o, axis=2))

    def sample_y(self, X, n_samples=1, random_state=0):
        """Draw samples of y at X from the predictive distribution (noise included, as in
        `predict`; before `fit`, from the prior).

        Returns
        -------
        ndarray of shape (n_queries, n_samples) or (n_queries, n_targets, n_samples)
        """
        rng = check_random_state(random_state)
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        # multivariate_normal's SVD: three more (m, m) float64 matrices, one target at a time
        self._check_covariance_memory(X.shape[0], self._n_outputs(), extra=3)
        mean, cov = self.predict(X, return_cov=True)
        if mean.ndim == 1:
            return rng.multivariate_normal(mean, cov, n_samples).T
        return np.stack([
            rng.multivariate_normal(mean[:, j], cov[..., j], n_samples).T
            for j in range(mean.shape[1])
        ], axis=1)

    def log_marginal_likelihood(self, theta=None, eval_gradient=False, clone_kernel=True):
        """Log marginal likelihood of y (of the normalised y with ``normalize_y``) at ``theta``.

        Parameters
        ----------
        theta : array-like or None
            With ``kernel`` given, scikit-learn's layout: the logarithms of the kernel's free
            hyperparameters (``kernel_.theta``), the mean held at its fitted value. With
            ``kernel=None``, the layout of ``theta_``. None returns
            ``log_marginal_likelihood_value_``.
        eval_gradient : bool
            Also return the gradient with respect to ``theta``.
        clone_kernel : bool, default=True
            False sets ``kernel_`` to the hyperparameters ``theta`` gives, as scikit-learn does
            (predictions keep the fitted ones, ``theta_``: refit to predict with others).
        """
        check_is_fitted(self, "X_train_")  # check_is_fitted(self) passes: requires_fit=False
        if theta is None:
            if eval_gradient:
                raise ValueError("Gradient can only be evaluated for theta!=None")
            return np.float64(self.log_marginal_likelihood_value_)
        theta = np.asarray(theta, np.float64)
        fixed_mean = self._fixed_mean
        expected = self.theta_.shape
        o = self._y_train_mean.shape[0]
        if self._spec is not None:
            fixed_mean = self.theta_[:o] if fixed_mean is None else fixed_mean
            expected = (self._model_kernel().n_dims,)
        if theta.shape != expected:
            raise ValueError(f"theta must have shape {expected}, got {theta.shape}")
        params, x, _, dtype, _ = self._state()
        y2 = np.asarray(self.y_train_, np.float64).reshape(x.shape[0], o)
        yj = jnp.asarray((y2 - self._y_train_mean) / self._y_train_std, dtype)
        solver = gp.CholeskySolver() if self.solver_ == "exact" else self._bbmm(self._probe_seed)
        value, grad = Objective(solver, x, yj, fixed_mean, self._unpack)(theta)
        if not clone_kernel:
            if self._spec is not None:
                self.kernel_.theta = theta
            else:
                self.kernel_ = _default_kernel(self._unpack(
                    theta, o, x.shape[1], fixed_mean, dtype).constrained(), self._unit())
        value = np.float64(-value + self._lml_offset(yj.size))  # float64, as scikit-learn's
        return (value, -np.asarray(grad, np.float64)) if eval_gradient else value

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = False  # predict and sample_y before fit give the prior
        tags.target_tags.multi_output = True  # and single output
        return tags


#: L-BFGS-B's ftol for the exact fit on a subset that starts the fit on more data.
_SUBSET_FTOL = 1e-4

#: Points of the Fisher information that starts the exact scoring steps on all data.
_CURVATURE_POINTS = 1024

#: How far (a factor either way) the default model's prior variance may start from y's.
_START_RANGE = 100.0


def _default_kernel(hp, unit):
    """The default model's parameters ``hp`` as a scikit-learn kernel, its variances in units
    of ``unit`` (`ScalableGPRegressor._unit`)."""
    outputscale, lengthscale = hp.kernel.terms
    return (sk_kernels.ConstantKernel(float(outputscale.value) * unit)
            * sk_kernels.RBF(np.asarray(lengthscale.lengthscale, np.float64))
            + sk_kernels.WhiteKernel(float(hp.noise) * unit))


def _start_at_scale(outputscale, noise, floor, variance):
    """The default model's start ``(outputscale, noise)``, moved to the scale of targets of
    ``variance`` (both scaled alike, the noise above ``floor``) when its prior variance is
    more than `_START_RANGE` times off: from there the optimiser stopped far from the optimum
    (docs/decisions.md #2)."""
    prior = outputscale + noise
    if variance <= 0 or variance / _START_RANGE <= prior <= variance * _START_RANGE:
        return outputscale, noise
    factor = variance / prior
    return outputscale * factor, floor + (noise - floor) * factor


def _power_of_two_scale(y2):
    """A power of two near the standard deviation of the (n, o) targets ``y2`` (their root
    mean variance; 1 when they are constant)."""
    std = np.sqrt(np.mean(np.var(y2, axis=0)))
    return 2.0 ** np.round(np.log2(std)) if std > 0 else 1.0


def _squeezed(values):
    """``(m, o, ...)`` results of one target as scikit-learn returns them: without the target
    axis (axis 1 for means and stds, 2 for covariances)."""
    axis = 2 if values.ndim == 3 else 1
    return values if values.shape[axis] != 1 else np.squeeze(values, axis=axis)
