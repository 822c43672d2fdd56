"""`ScalableGPRegressor`: scikit-learn's GaussianProcessRegressor surface on `scalegp.gp`: the
class, its parameters and its public methods, each a short driver of the modules beside it:
``_gpr_inputs`` (its settings and data checked, the units it is fitted in), ``_gpr_fit`` (how
it fits: the strategy and the optimisers), ``_gpr_predict`` (predictions, predict_fn and
sample_y) and ``_gpr_kernels`` (scikit-learn kernels as engine expressions).

Re-exported from `scalegp.estimators`.
"""

from __future__ import annotations

import jax
import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from scalegp import gp
from scalegp._runtime import search_host_blas_early
from scalegp._validation import as_compute_dtype, validate_data
from scalegp.estimators._gpr_fit import (
    FitProblem,
    Parametrisation,
    final_solve,
    fitted_log_marginal_likelihood,
    optimise,
)
from scalegp.estimators._gpr_inputs import (
    bbmm_solver,
    centred,
    check_kernel,
    check_n_targets,
    check_not_constant,
    check_settings,
    check_target,
    checked_alpha,
    compute_dtype,
    default_kernel,
    host_centred,
    initial_theta,
    input_centre,
    mean_setting,
    target_units,
    training_order,
)
from scalegp.estimators._gpr_kernels import kernel_spec
from scalegp.estimators._gpr_predict import (
    check_covariance_memory,
    fitted_state,
    n_outputs,
    predict_engine,
    predict_fn,
    predict_prior,
    sample_y,
    squeezed,
    test_noise,
    variance_posterior,
)
from scalegp.estimators._precision import (
    check_solver_memory,
    exact_on_host,
    host_scope,
    in_precision,
)
from scalegp.estimators._progress import FitProgress

__all__ = ["ScalableGPRegressor"]

class ScalableGPRegressor(RegressorMixin, BaseEstimator):
    """Exact Gaussian-process regression for large n (constant mean, Gaussian noise).

    The default model (``kernel=None``) is ``y = m + f(x) + ε`` with
    ``f ~ GP(0, s·exp(-½ Σ_d ((x_d - x'_d)/l_d)²))`` and ``ε ~ N(0, σ²)``, i.e. scikit-learn's
    ``ConstantKernel(s) * RBF(l) + WhiteKernel(σ²)`` plus a constant mean ``m``. With
    ``kernel=`` a scikit-learn kernel object, the covariance is that kernel, run on the same
    memory-linear engine (never evaluated through scikit-learn); with ``mean=0.0`` as well it
    is a drop-in for scikit-learn's GaussianProcessRegressor (its constructor arguments, fit,
    predict, the prior before fit, sample_y, log_marginal_likelihood; the README lists what
    differs).

    Up to ``exact_max_n`` training points it uses a dense Cholesky
    (:class:`scalegp.gp.CholeskySolver`), beyond, BBMM (:class:`scalegp.gp.BBMMSolver`:
    preconditioned conjugate gradients, stochastic Lanczos quadrature, memory linear in n).
    Hyperparameters: L-BFGS-B with the exact objective, on a random subset of ``subset_size``
    points for BBMM (a random half, at most ``subset_size``, for an exact fit on more; for BBMM
    with a stationary kernel on many more points, a compact subset of the same size competes
    where the random one's fit fails a score test on it: docs/decisions.md #40), then
    scoring steps from the subset's Fisher information: on all points for the exact solver; for
    BBMM (fixed probes, so deterministic) on nested random subsets four times larger each time
    while they hold at most a third of the data, and last on all data (Wang et al. (2019),
    refined; `scalegp.estimators._gpr_fit`, docs/decisions.md #11). Predictions use
    ``alpha = (K + σ²I)⁻¹(y - m)`` solved once at the end of fit and, for BBMM, a LOVE-style
    variance cache (:meth:`scalegp.gp.BBMMSolver.love`) from the pivoted Cholesky factor that
    preconditions that solve.

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
        ``y / 2^k``, ``2^k`` near y's std, with these settings and ``mean`` converted: the same
        model, whose float32 fit does not depend on y's scale (docs/decisions.md #2).
    alpha : float or array of shape (n_samples,), default=1e-10
        With ``kernel``: as scikit-learn's ``alpha``, a fixed value added to the diagonal of the
        training points' kernel matrix, one per point for an array (known measurement noise
        variances; a one-element array is a scalar). It is not part of the predictive std or
        covariance at new points (a WhiteKernel term is). Raise it, or add a WhiteKernel, if a
        fit warns about jitter; float32 needs far more than 1e-10. Not used by the default
        model (``kernel=None``, learnt noise): a value other than 1e-10 warns there.
    mean : float, array of shape (n_targets,) or None, default=None
        Constant prior mean, in y's units (normalised ones with ``normalize_y=True``). None:
        learnt (initialised at the mean of y); a number fixes it: 0 is scikit-learn's zero-mean
        prior (with ``normalize_y=True``, a prior mean at the training mean of y).
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
        steps of size ``learning_rate`` and keeps the best iterate; it needs no line search, so
        each step costs exactly one objective evaluation. None keeps the given hyperparameters.
    learning_rate : float, default=0.05
        Adam step size, in the unconstrained parameters (``softplus⁻¹`` of ``s``, ``l`` and
        ``σ²``, and the mean, in the units of ``theta_``): each step moves each of them by
        about this much at first. Only used with ``optimizer="adam"``.
    n_restarts_optimizer : int, default=0
        Extra optimisations from random initial values (default model: each of ``log s``,
        ``log l_d``, ``log σ²`` shifted by U(-2, 2); with ``kernel``: uniform within its
        bounds, which must then be finite); the best marginal likelihood wins.
    max_iter : int, default=200
        L-BFGS-B iterations (on the subset for large n), all its runs counted: in float32 a
        run stops after three evaluations in a row that gain less than 100 roundings of the
        NLML, and a run that stops so (or whose line search fails) is followed by a fresh one
        from its best point while runs gain more than that (docs/decisions.md #12).
    solver : {"auto", "exact", "bbmm"}, default="auto"
        "auto" is "exact" for ``n_samples <= exact_max_n``. On a TPU the exact solver's fit
        and predictions run on the host CPU (small dense factorisations: see ``dtype``).
    exact_max_n : int, default=4096
        Switch point of "auto" (:data:`scalegp.gp.EXACT_MAX_N`).
    subset_size : int, default=2048
        Random subset for the first phase of BBMM training; an exact fit on more points starts
        on a random half of them (at most ``subset_size``).
    max_iter_full : int, default=10
        Scoring steps per BBMM stage (the growing subsets, then all data), or Adam steps on all
        data with ``optimizer="adam"`` (0 skips them all). A stage ends earlier when its next
        step is predicted to gain under p/2 nats (p free parameters; at least ½), the size of
        the BBMM objective's own noise, or, on all data, when a step fails to lower the NLML.
    full_data_tol : float, default=1e-3
        BBMM fits take scoring steps on all data only when the full-data optimum is expected
        to gain more than this many nats per training point over the last subset stage's
        (``½ p (1/m - 1/n)``, the m-point estimate's sampling error, plus that stage's
        unfinished step): a second-order loss of held-out log-likelihood per point. The
        default is far below what a test set resolves (per-point log-likelihoods of a
        Gaussian prediction spread by about 0.7 nats: a difference of 1e-3 needs some
        500,000 test points to show). It usually skips the steps on all data from 24,576
        points in a few features, where the stages first reach 8,192 (docs/decisions.md
        #42). Then ``fit`` does not evaluate the NLML on all data:
        ``log_marginal_likelihood_value_`` evaluates it when first read. 0 always takes the
        steps (the full-data maximum-likelihood estimate).
    num_probes, preconditioner_rank, cg_tol, max_cg_iter, love_rank :
        Settings of :class:`scalegp.gp.BBMMSolver` (defaults 30, 768, 1e-3, 1000, 1024).
    dtype : None or a float32/float64 dtype, default=None
        Compute dtype, anything numpy reads as float32 or float64 ("float64", np.float64, ...);
        None is float64 when JAX x64 is enabled, float32 otherwise. With x64 off, float64
        methods turn it on for their duration: the results of a process with x64 on. Where
        JAX's default backend is a TPU (no float64 hardware), "float64" runs on the host CPU,
        as does the exact solver in any dtype.
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
        a periodic factor included; see :func:`scalegp.ops.kernel_mv`). "auto" considers it
        from 16,384 training points in at most 8 features and prunes when their tile bounds
        say it pays (lengthscales short against the data's extent). Where it may
        prune, ``fit`` stores the training data in :func:`scalegp.ops.spatial_order`
        (``X_train_``, ``y_train_`` and ``alpha_`` in that order; not with a per-point
        ``alpha``).
    prune_tol : float or None, default=None
        With pruning, each kernel product's skipped part is at most ``prune_tol`` times the sum
        of the absolute values multiplied; None: half the float epsilon (under rounding).
    verbose : int, default=0
        >0 reports the fit's phases (the subset fit, each BBMM stage, the final solve) with
        their elapsed time, and each optimiser iteration: to logger "scalegp.gp" at INFO level,
        and on screen (a tqdm bar per phase on a terminal, else printed lines).
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
        Of y (of the normalised y with ``normalize_y``). A BBMM fit that took no step on all
        data (``full_data_tol``, ``max_iter_full=0``) evaluates it when it is first read (one
        BBMM evaluation on all data); a model saved before then is saved without it.
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
        full_data_tol=1e-3,
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
        self.full_data_tol = full_data_tol
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

    def _model_kernel(self):
        """The scikit-learn kernel of the model (None: the default model)."""
        return self.kernel

    def __getattr__(self, name):
        # Only for a missing attribute: a fitted model without its NLML (a BBMM fit with no
        # step on all data) evaluates it when first read, and keeps it where saving finds it.
        if name == "log_marginal_likelihood_value_" and "theta_" in self.__dict__:
            theta = self.theta_
            if self.__dict__.get("_spec") is not None:  # the kernel's part, after free means
                theta = theta[theta.size - self._model_kernel().n_dims:]
            self.__dict__[name] = float(self.log_marginal_likelihood(theta))
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _parametrisation(self):
        """The `Parametrisation` of the fitted (or loaded) model's optimised vector."""
        spec = getattr(self, "_spec", None)
        if spec is not None:
            return Parametrisation(spec, self._fixed_noise, None)
        return Parametrisation(None, None, self.noise_lower_bound / self._unit())

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

    def _solver_for(self, n: int) -> str:
        """The solver a fit on ``n`` points runs: ``solver``, or for "auto" "exact" up to
        ``exact_max_n`` points and "bbmm" above."""
        if self.solver != "auto":
            return self.solver
        return "exact" if n <= self.exact_max_n else "bbmm"

    @in_precision
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
        check_kernel(self, kernel)
        X, y = validate_data(self, X, y=y, multi_output=True, y_numeric=True,
                             ensure_min_samples=2, dtype=[np.float64, np.float32])
        n, d = X.shape
        engine = check_settings(self)  # the fit's one engine, handed to all it runs
        check_n_targets(self.n_targets, y)
        search_host_blas_early()  # the exact objectives bound it; the data's setup runs first
        dtype = compute_dtype(self)
        solver = self._solver_for(n)
        if solver == "bbmm":  # before the work: the training order sorts the points
            check_solver_memory(
                bbmm_solver(self, 0, engine), n, dtype, engine, "a BBMM fit",
                "fit a random subset of the points, or lower preconditioner_rank and love_rank")
        order = training_order(X, self.alpha, engine, kernel, self.lengthscale, dtype)
        if order is not None:
            X, y = X[order], y[order]
        self._spec = kernel_spec(kernel, self.alpha, d)
        self._fixed_noise = checked_alpha(self.alpha, n, self._spec is None)
        rng = check_random_state(self.random_state)
        yn = self._normalised_target(y, dtype)
        o = yn.shape[1]
        fixed_mean, mean0 = mean_setting(self.mean, yn, self._unit())
        self.solver_ = solver
        self._probe_seed = int(rng.randint(2**31 - 1))
        with host_scope(self.solver_ == "exact"):  # on a TPU, the exact solver on the host
            x = centred(X, input_centre(X), dtype)
            yj = jax.device_put(as_compute_dtype(yn, dtype, "y"))  # as `centred` puts x
            theta0 = initial_theta(self, kernel, x, yn, mean0, dtype)
            if fixed_mean is not None:
                theta0 = theta0[o:]
            self._fixed_mean = fixed_mean
            progress = FitProgress(self.verbose)
            problem = FitProblem.of_estimator(self, x, yj, engine)
            theta, final_value, n_iter, alpha0 = optimise(problem, theta0, rng, progress)
            params, final_value, posterior = final_solve(problem, theta, final_value, alpha0,
                                                         progress)
            self._store_fit(X, y, theta, params, final_value, n_iter, posterior)
        return self

    def _normalised_target(self, y, dtype):
        """y as (n, o) float64, checked for the compute ``dtype``, in the units it is fitted in
        (`target_units`), whose statistics are kept, float64, in ``_y_train_mean`` and
        ``_y_train_std``, and applied in float64 at predict."""
        self._y_1d = y.ndim == 1
        y2 = y.reshape(y.shape[0], -1).astype(np.float64)
        check_target(y2, self.noise_lower_bound, self.normalize_y, self._spec is None, dtype)
        if self.optimizer is not None and self._spec is None:
            # the default model's hyperparameters are unbounded; a kernel's are bounded
            check_not_constant(y2)
        self._y_train_mean, self._y_train_std = target_units(y2, self.normalize_y,
                                                             self._spec is None)
        return (y2 - self._y_train_mean) / self._y_train_std

    def _store_fit(self, X, y, theta, params, final_value, n_iter, posterior):
        """The fitted attributes and the prediction cache at ``theta`` (``params``), whose
        NLML is ``final_value`` (None: not evaluated)."""
        hp = gp.constrained(params)
        self.theta_ = np.asarray(theta, np.float64)
        if final_value is None:  # evaluated when read (__getattr__)
            self.__dict__.pop("log_marginal_likelihood_value_", None)
        else:
            self.log_marginal_likelihood_value_ = -final_value + self._lml_offset(
                np.size(posterior.alpha))
        if self._spec is None:
            outputscale, lengthscale = hp.kernel.terms
            self.lengthscale_ = np.asarray(lengthscale.lengthscale, np.float64)
            self.outputscale_ = float(outputscale.value) * self._unit()
            self.noise_ = float(hp.noise) * self._unit()
            self.kernel_ = default_kernel(hp, self._unit())
        else:
            kernel = self._model_kernel()
            # the kernel's part of the optimised vector, after the free means
            self.kernel_ = kernel.clone_with_theta(self.theta_[len(theta) - kernel.n_dims:])
            if self.optimizer is not None and kernel.n_dims:
                # scikit-learn's ConvergenceWarning for values close to a bound
                check_bounds = getattr(self.kernel_, "_check_bounds_params", None)
                if check_bounds is not None:
                    check_bounds()
            self.noise_ = float(test_noise(self._spec, params))
        self.mean_ = np.asarray(hp.mean, np.float64) * self._y_train_std + self._y_train_mean
        self.n_iter_ = int(n_iter)
        self.X_train_ = np.array(X, copy=True) if self.copy_X_train else np.asarray(X)
        self.y_train_ = np.array(y, copy=True) if self.copy_X_train else np.asarray(y)
        alpha = np.asarray(posterior.alpha)
        self.alpha_ = alpha[:, 0] if self._y_1d else alpha
        self._cholesky = None if posterior.cholesky is None else np.asarray(posterior.cholesky)
        self._love_factor = (None if posterior.love_factor is None
                             else np.asarray(posterior.love_factor))

    @in_precision
    @exact_on_host
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
            return predict_prior(self, X, return_std, return_cov)
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        if return_cov:
            check_covariance_memory(self, X.shape[0], n_outputs(self))
        params, x, alpha, dtype, centre = fitted_state(self)
        posterior = gp.Posterior(alpha=alpha)
        if return_std or return_cov:
            posterior = variance_posterior(self, params, x, posterior, dtype)
        # the default model's noise is σ² everywhere; a kernel's at new points is its
        # WhiteKernel terms, added below (the training diagonal also holds alpha)
        out = gp.predict(params, x, posterior, host_centred(X, centre, dtype),
                         return_std=return_std, return_cov=return_cov,
                         include_noise=self._spec is None, engine=predict_engine(self))
        mean = np.asarray(out[0] if (return_std or return_cov) else out, np.float64)
        mean = mean * self._y_train_std + self._y_train_mean
        if not (return_std or return_cov):
            return squeezed(mean)
        spread = np.array(out[1], np.float64)  # a writable copy (the diagonal below)
        white = 0.0 if self._spec is None else float(test_noise(self._spec, params))
        if return_std:
            if white:
                spread = np.sqrt(spread**2 + white)
            return squeezed(mean), squeezed(spread[:, None] * self._y_train_std)
        spread[np.diag_indices_from(spread)] += white  # in place: no (m, m) identity
        return squeezed(mean), squeezed(spread[:, :, None] * self._y_train_std**2)

    predict_fn = in_precision(exact_on_host(predict_fn))  # documented in _gpr_predict

    @in_precision
    @exact_on_host
    def sample_y(self, X, n_samples=1, random_state=0, *, method="auto",
                 n_features=gp.PRIOR_FEATURES):
        """Draw samples of y at X from the predictive distribution (noise included, as in
        `predict`; before `fit`, from the prior); the same ``random_state``, the same draws.

        ``method``: "exact" (``predict(return_cov=True)`` and an SVD, as scikit-learn: (m, m)
        matrices), "pathwise" (Matheron's rule on random-feature prior draws of ``n_features``
        frequencies per kernel term, one batched solve; memory linear in m; its error is in
        `scalegp.estimators._gpr_predict`) or "auto": exact up to
        :data:`scalegp.gp.SAMPLE_EXACT_MAX_ROWS` (1,000) query rows, pathwise beyond.

        Returns
        -------
        ndarray of shape (n_queries, n_samples) or (n_queries, n_targets, n_samples)
        """
        return sample_y(self, X, n_samples, random_state, method, n_features)

    @in_precision
    @exact_on_host
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
        return fitted_log_marginal_likelihood(self, theta, eval_gradient, clone_kernel)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.requires_fit = False  # predict and sample_y before fit give the prior
        tags.target_tags.multi_output = True  # and single output
        return tags
