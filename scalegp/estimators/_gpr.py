"""`ScalableGPRegressor`: scikit-learn's GaussianProcessRegressor surface on `scalegp.gp`.

Re-exported from `scalegp.estimators`.
"""

from __future__ import annotations

import logging
import numbers
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from scalegp import gp
from scalegp._validation import as_compute_dtype, check_int, check_option, validate_data
from scalegp.ops import SCHEMES, Engine

__all__ = ["ScalableGPRegressor"]

logger = logging.getLogger("scalegp.gp")

_SOLVERS = ("auto", "exact", "bbmm")


def _positive(name, value, shape=None):
    arr = np.asarray(value, dtype=np.float64) if not isinstance(value, str) else None
    if arr is None or not np.all(np.isfinite(arr)) or not np.all(arr > 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    if shape is not None and arr.ndim == 1 and arr.shape != shape:
        raise ValueError(
            f"{name} must be a scalar or have {shape[0]} entries (one per feature), "
            f"got shape {arr.shape}"
        )
    if arr.ndim > 1:
        raise ValueError(f"{name} must be a scalar or 1-D, got shape {arr.shape}")
    return arr


def _check_not_constant(y2):
    """A target column without variation leaves noise and outputscale unidentifiable: with
    its mean removed (learnt, or by normalize_y) it is all zeros, and the likelihood grows
    without bound as both shrink toward noise_lower_bound. Rounding-level spread counts as
    constant."""
    spread = np.ptp(y2, axis=0)
    scale = np.maximum(np.max(np.abs(y2), axis=0), np.finfo(np.float64).tiny)
    constant = np.flatnonzero(spread <= 8 * np.finfo(np.float64).eps * scale)
    if constant.size:
        j = int(constant[0])
        where = "y" if y2.shape[1] == 1 else f"y[:, {j}]"
        if constant.size > 1:
            where += f" (and {constant.size - 1} more target column(s))"
        raise ValueError(
            f"{where} is constant (every value is {y2[0, j]:g}): a Gaussian process cannot "
            "estimate its noise and outputscale from a target without variation. Predict the "
            "constant instead (sklearn.dummy.DummyRegressor), drop that target, or fit with "
            "fixed hyperparameters (optimizer=None)."
        )


def _centred(X, centre, dtype, name="X"):
    """``X - centre`` (the training inputs' mean), formed in float64 before the cast to the
    compute dtype: offset inputs keep their digits, and each row depends on itself alone."""
    return jnp.asarray(as_compute_dtype(np.asarray(X, np.float64) - centre, dtype, name))


def _check_distances_fit(x, lengthscale):
    """Squared scaled distances of the centred training inputs ``x`` must be finite in their
    dtype: otherwise every kernel value is 0 and the fit fails for a reason no message names."""
    x = np.asarray(x)
    worst = float(np.max(np.sum((x.astype(np.float64) / lengthscale) ** 2, axis=1)))
    limit = float(np.finfo(x.dtype).max) / 4  # |a|^2 + |b|^2 - 2ab must not overflow
    if worst > limit:
        raise ValueError(
            f"X spans up to {np.sqrt(worst):.3g} lengthscales from its mean, and squared "
            f"distances that large overflow {x.dtype.name} (largest finite "
            f"{float(np.finfo(x.dtype).max):.3g}): rescale the features (e.g. "
            "sklearn.preprocessing.StandardScaler in a Pipeline, or set lengthscale to the "
            'features\' scale), or compute in float64 (jax.config.update("jax_enable_x64", '
            'True) and dtype="float64")'
        )


def _check_target(y2, noise_lower_bound, normalize_y):
    """y after numeric conversion (an object array holding None becomes NaN): finite, and on a
    scale that the absolute ``noise_lower_bound`` suits."""
    bad = ~np.isfinite(y2)
    if bad.any():
        rows = np.unique(np.nonzero(bad)[0])
        raise ValueError(
            f"y contains NaN or infinity in {rows.size} row(s) (first: row {rows[0]}), after "
            "conversion to numbers (None and missing values become NaN): remove or impute them "
            "first"
        )
    if normalize_y:
        return
    variance = float(np.min(np.var(y2, axis=0)))
    if 0 < variance < 100 * noise_lower_bound:
        warnings.warn(
            f"y has variance {variance:.3g}, below 100 x noise_lower_bound={noise_lower_bound:g}"
            " (an absolute bound on the noise variance): the noise cannot go below the signal, "
            "and predictions shrink to the mean. Use normalize_y=True, or lower "
            "noise_lower_bound, noise and outputscale to y's scale",
            UserWarning,
            stacklevel=3,
        )


class _Progress:
    """Reports of an optimisation, one per iteration, when ``verbose``: an INFO record on logger
    "scalegp.gp" always, plus a tqdm bar when stderr is a terminal and tqdm is installed, else a
    printed line."""

    def __init__(self, verbose, total, phase):
        self.verbose, self.phase, self.iteration, self.bar = verbose, phase, 0, None
        stderr = sys.stderr
        if verbose and stderr is not None and hasattr(stderr, "isatty") and stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # optional extra "progress": fall back to printed lines
                pass
            else:
                self.bar = tqdm(total=total, desc=phase, file=stderr, leave=True)

    def update(self, value, cg_iterations):
        self.iteration += 1
        if not self.verbose:
            return
        msg = (f"{self.phase} iter {self.iteration}: NLML {value:.6g}, "
               f"CG iterations {cg_iterations}")
        logger.info(msg)
        if self.bar is not None:
            self.bar.set_postfix(NLML=f"{value:.6g}", CG=cg_iterations, refresh=False)
            self.bar.update(1)
        else:
            print(msg)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


class ScalableGPRegressor(RegressorMixin, BaseEstimator):
    """Exact Gaussian-process regression for large n (RBF kernel, constant mean, Gaussian noise).

    The model is ``y = m + f(x) + ε`` with ``f ~ GP(0, s·exp(-½ Σ_d ((x_d - x'_d)/l_d)²))`` and
    ``ε ~ N(0, σ²)``, i.e. scikit-learn's
    ``ConstantKernel(s) * RBF(l) + WhiteKernel(σ²)`` plus a constant mean ``m``. Up to
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
    lengthscale : float or array of shape (n_features,), default=1.0
        Initial (or, with ``optimizer=None``, fixed) RBF lengthscales; a float is broadcast to
        every feature (the kernel is always ARD).
    outputscale : float, default=1.0
        Initial kernel variance ``s``.
    noise : float, default=0.1
        Initial noise variance ``σ²`` (must exceed ``noise_lower_bound``).
    noise_lower_bound : float, default=1e-6
        ``σ² >= noise_lower_bound`` during optimisation; raise it if a fit warns about jitter.
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
        Extra optimisations from random initial values (each of ``log s``, ``log l_d``,
        ``log σ²`` shifted by U(-2, 2)); the best marginal likelihood wins.
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
        :func:`scalegp.ops.sharded_kernel_mv`. The exact (Cholesky) solver runs on one device. Pass "all"
        or an int, not a Mesh, for an estimator that must be pickled.
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
    lengthscale_ : ndarray of shape (n_features,)
    outputscale_ : float
    noise_ : float
        Fitted noise variance (in normalised units when ``normalize_y``).
    mean_ : ndarray of shape (n_targets,)
        Fitted constant mean in the units of y.
    theta_ : ndarray
        Unconstrained parameter vector ``[mean (if learnt), raw s, raw l (d), raw σ²]``
        (``raw = softplus⁻¹``), the input of :meth:`log_marginal_likelihood`.
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
        lengthscale=1.0,
        outputscale=1.0,
        noise=0.1,
        *,
        noise_lower_bound=1e-6,
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
        self.lengthscale = lengthscale
        self.outputscale = outputscale
        self.noise = noise
        self.noise_lower_bound = noise_lower_bound
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
        return gp.GPParams.unflatten(theta, o, d, noise_lower_bound=self.noise_lower_bound,
                                     dtype=dtype)

    def _objective(self, solver, x, y, fixed_mean):
        """theta -> (NLML, gradient) in float64 numpy for scipy."""
        o, d = y.shape[1], x.shape[1]
        # The last evaluation, for progress reports without evaluating the objective again.
        history = {"cg": 0, "theta": None, "value": np.inf}

        def fun(theta):
            params = self._unpack(theta, o, d, fixed_mean, x.dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                try:
                    result = solver.value_and_grad(params, x, y)
                except gp.NotPositiveDefiniteError:
                    # A trial point of the line search where K + σ²I is numerically singular
                    # (e.g. float32, tiny noise): infinite, so the optimiser backs off. At the
                    # final hyperparameters the error is raised with its advice.
                    history["theta"], history["value"] = np.array(theta, np.float64), np.inf
                    return np.inf, np.zeros(len(theta))
            value = float(result.value)
            grad = result.grad.flatten()
            if fixed_mean is not None:
                grad = grad[o:]
            history["cg"] = int(result.cg_iterations)
            history["theta"] = np.array(theta, np.float64)
            if not np.isfinite(value) or not np.all(np.isfinite(grad)):
                history["value"] = np.inf
                return np.inf, np.zeros_like(grad)
            history["value"] = value
            return value, grad

        return fun, history

    def _minimize(self, fun, history, theta0, maxiter, phase, warn_maxiter=True):
        """Minimise ``fun`` from ``theta0``; returns ``(theta, value, iterations)``."""
        with _Progress(self.verbose, maxiter, phase) as progress:
            if self.optimizer == "adam":
                return self._adam(fun, history, theta0, maxiter, progress)

            def callback(xk):
                value = history["value"] if np.array_equal(xk, history["theta"]) \
                    else fun(xk)[0]
                progress.update(value, history["cg"])

            res = scipy.optimize.minimize(fun, theta0, jac=True, method="L-BFGS-B",
                                          options={"maxiter": maxiter}, callback=callback)
        if (res.status == 1 and warn_maxiter) or (not res.success and res.status != 1):
            warnings.warn(
                f"L-BFGS-B ({phase}) stopped: {res.message}. Raise max_iter or rescale the data "
                "(e.g. StandardScaler and normalize_y=True)",
                ConvergenceWarning,
                stacklevel=3,
            )
        return res.x, float(res.fun), int(res.nit)

    def _adam(self, fun, history, theta0, steps, progress):
        """Adam (Kingma & Ba, 2015) with the default moments (0.9, 0.999); the best iterate
        wins, so a step that overshoots late in the run costs nothing."""
        lr, b1, b2, eps = float(self.learning_rate), 0.9, 0.999, 1e-8
        theta = np.array(theta0, np.float64)
        m = np.zeros_like(theta)
        v = np.zeros_like(theta)
        best = (theta.copy(), np.inf)
        for k in range(1, steps + 1):
            value, grad = fun(theta)
            if value < best[1]:
                best = (theta.copy(), value)
            progress.update(value, history["cg"])
            m = b1 * m + (1 - b1) * grad
            v = b2 * v + (1 - b2) * grad**2
            theta = theta - lr * (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)
        value, _ = fun(theta)
        if value < best[1]:
            best = (theta, value)
        return best[0], float(best[1]), int(steps)

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
        check_option("optimizer", self.optimizer, ("L-BFGS-B", "adam", None))
        if self.optimizer == "adam":
            _positive("learning_rate", self.learning_rate)
        check_option("solver", self.solver, _SOLVERS)
        check_option("mesh_scheme", self.mesh_scheme, SCHEMES)
        self._engine()
        check_int("n_restarts_optimizer", self.n_restarts_optimizer, 0)
        check_int("max_iter", self.max_iter, 0)
        check_int("max_iter_full", self.max_iter_full, 0)
        check_int("exact_max_n", self.exact_max_n, 1)
        check_int("subset_size", self.subset_size, 2)
        check_int("num_probes", self.num_probes, 1)
        check_int("preconditioner_rank", self.preconditioner_rank, 1)
        check_int("max_cg_iter", self.max_cg_iter, 1)
        check_int("love_rank", self.love_rank, 1)
        n, d = X.shape
        lengthscale = _positive("lengthscale", self.lengthscale, (d,))
        lengthscale = np.broadcast_to(lengthscale, (d,)).copy()
        outputscale = float(_positive("outputscale", self.outputscale))
        noise = float(_positive("noise", self.noise))
        if not (isinstance(self.noise_lower_bound, numbers.Real)
                and 0 <= self.noise_lower_bound < noise):
            raise ValueError(
                f"noise_lower_bound must be a number in [0, noise={noise}), got "
                f"{self.noise_lower_bound!r}"
            )
        dtype = self._dtype()
        rng = check_random_state(self.random_state)

        self._y_1d = y.ndim == 1
        y2 = y.reshape(n, -1).astype(np.float64)
        _check_target(y2, self.noise_lower_bound, self.normalize_y)
        o = y2.shape[1]
        if self.optimizer is not None:
            _check_not_constant(y2)
        if self.normalize_y:
            self._y_train_mean = y2.mean(axis=0)
            std = y2.std(axis=0)
            self._y_train_std = np.where(std > 0, std, 1.0)
        else:
            self._y_train_mean = np.zeros(o)
            self._y_train_std = np.ones(o)
        yn = (y2 - self._y_train_mean) / self._y_train_std

        if self.mean is None:
            fixed_mean = None
            mean0 = yn.mean(axis=0)
        else:
            m = np.broadcast_to(np.asarray(self.mean, np.float64), (o,)) if np.ndim(self.mean) < 2 \
                else None
            if m is None or not np.all(np.isfinite(m)):
                raise ValueError(f"mean must be None, a finite float or {o} floats, got {self.mean!r}")
            fixed_mean = (m - self._y_train_mean) / self._y_train_std
            mean0 = fixed_mean

        solver_name = self.solver
        if solver_name == "auto":
            solver_name = "exact" if n <= self.exact_max_n else "bbmm"
        self.solver_ = solver_name
        probe_seed = int(rng.randint(2**31 - 1))

        x = _centred(X, np.mean(X, axis=0, dtype=np.float64), dtype)
        _check_distances_fit(x, lengthscale)
        yj = jnp.asarray(as_compute_dtype(yn, dtype, "y"))
        params0 = gp.GPParams.from_constrained(mean0, outputscale, lengthscale, noise,
                                               noise_lower_bound=self.noise_lower_bound,
                                               dtype=dtype)
        theta0 = params0.flatten()
        if fixed_mean is not None:
            theta0 = theta0[o:]
        n_iter = 0
        final_value = None  # NLML at theta0 when the optimiser already evaluated it there
        if self.optimizer is not None:
            if solver_name == "exact":
                x_fit, y_fit = x, yj
            else:
                idx = np.sort(rng.choice(n, size=min(self.subset_size, n), replace=False))
                x_fit, y_fit = x[idx], yj[idx]
            fun, history = self._objective(gp.CholeskySolver(), x_fit, y_fit, fixed_mean)
            starts = [theta0]
            for _ in range(self.n_restarts_optimizer):
                t = theta0.copy()
                k = 0 if fixed_mean is not None else o
                constrained = np.log1p(np.exp(np.clip(t[k:], -50, 50)))
                constrained = constrained * np.exp(rng.uniform(-2, 2, size=constrained.shape))
                t[k:] = np.asarray(gp.softplus_inverse(constrained))
                starts.append(t)
            best = None
            for i, start in enumerate(starts):
                theta, value, nit = self._minimize(fun, history, start, self.max_iter,
                                                   f"exact fit (start {i})")
                if best is None or value < best[1]:
                    best = (theta, value, nit)
            theta0, final_value, n_iter = best
            if solver_name == "bbmm":
                final_value = None  # a subset's objective, not the full data's
            if solver_name == "bbmm" and self.max_iter_full > 0:
                fun, history = self._objective(self._bbmm(probe_seed), x, yj, fixed_mean)
                # A planned, small number of steps (Wang et al., 2019): reaching it is expected.
                theta0, final_value, nit = self._minimize(fun, history, theta0,
                                                          self.max_iter_full,
                                                "BBMM fit on all data", warn_maxiter=False)
                n_iter += nit

        params = self._unpack(theta0, o, d, fixed_mean, dtype)
        self.theta_ = np.asarray(theta0, np.float64)
        self._fixed_mean = fixed_mean
        solver = gp.CholeskySolver() if solver_name == "exact" else self._bbmm(probe_seed)
        if final_value is None or not np.isfinite(final_value):
            final_value = float(solver.value_and_grad(params, x, yj).value)
        self.log_marginal_likelihood_value_ = -final_value
        posterior = solver.posterior(params, x, yj)
        self._probe_seed = probe_seed

        hp = params.constrained()
        self.lengthscale_ = np.asarray(hp.lengthscale, np.float64)
        self.outputscale_ = float(hp.outputscale)
        self.noise_ = float(hp.noise)
        self.mean_ = np.asarray(hp.mean, np.float64) * self._y_train_std + self._y_train_mean
        self.n_iter_ = int(n_iter)
        self.X_train_ = np.asarray(X)
        self.y_train_ = np.asarray(y)
        alpha = np.asarray(posterior.alpha)
        self.alpha_ = alpha[:, 0] if self._y_1d else alpha
        self._cholesky = None if posterior.cholesky is None else np.asarray(posterior.cholesky)
        self._love_factor = None
        return self

    # ---------------------------------------------------------------------------------------
    # predict

    def _state(self):
        dtype = self._dtype()
        o = self._y_train_mean.shape[0]
        params = self._unpack(self.theta_, o, self.n_features_in_, self._fixed_mean, dtype)
        x = _centred(self.X_train_, self._x_centre(), dtype)
        alpha = jnp.asarray(self.alpha_.reshape(x.shape[0], o), dtype)
        return params, x, alpha, dtype

    def _x_centre(self):
        """The training inputs' mean (float64): inputs are centred on it before the cast to the
        compute dtype (recomputed rather than stored: model files carry no extra state)."""
        return np.mean(self.X_train_, axis=0, dtype=np.float64)

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
        params, x, alpha, dtype = self._state()
        posterior = gp.Posterior(alpha=alpha)
        if return_std or return_cov:
            posterior = self._variance_posterior(params, x, posterior, dtype)
        out = gp.predict(params, x, posterior, _centred(X, self._x_centre(), dtype),
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
        """Log marginal likelihood (normalised units) at ``theta`` (see ``theta_``).

        Parameters
        ----------
        theta : array-like or None
            None returns ``log_marginal_likelihood_value_``.
        eval_gradient : bool
            Also return the gradient with respect to ``theta``.
        """
        check_is_fitted(self)
        if theta is None:
            if eval_gradient:
                raise ValueError("gradient can only be evaluated for theta!=None")
            return self.log_marginal_likelihood_value_
        theta = np.asarray(theta, np.float64)
        if theta.shape != self.theta_.shape:
            raise ValueError(f"theta must have shape {self.theta_.shape} like theta_, got "
                             f"{theta.shape}")
        _, x, _, dtype = self._state()
        o = self._y_train_mean.shape[0]
        y2 = np.asarray(self.y_train_, np.float64).reshape(x.shape[0], o)
        yj = jnp.asarray((y2 - self._y_train_mean) / self._y_train_std, dtype)
        solver = gp.CholeskySolver() if self.solver_ == "exact" else self._bbmm(self._probe_seed)
        fun, _ = self._objective(solver, x, yj, self._fixed_mean)
        value, grad = fun(theta)
        return (-value, -grad) if eval_gradient else -value

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.single_output = False
        tags.target_tags.multi_output = True
        return tags
