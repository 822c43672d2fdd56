"""`ScalableGPClassifier`: scikit-learn's GaussianProcessClassifier surface on the Laplace
approximation of `scalegp.gp` (dense below ``exact_max_n`` points, matrix-free above).

Re-exported from `scalegp.estimators`.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.gaussian_process import kernels as sk
from sklearn.gaussian_process.kernels import RBF, CompoundKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C
from sklearn.utils import check_random_state
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted

from scalegp import gp
from scalegp._runtime import search_host_blas_early
from scalegp._validation import check_int, check_option, validate_data
from scalegp.estimators._gpc_binary import (
    LaplaceObjective,
    fit_binary,
    latent_mean,
    latent_moments,
)
from scalegp.estimators._gpr_inputs import (
    centred,
    check_kernel,
    compute_dtype,
    input_centre,
    input_scale,
)
from scalegp.estimators._gpr_kernels import KernelSpec
from scalegp.estimators._precision import (
    check_solver_memory,
    exact_on_host,
    float_dtype,
    host_scope,
    in_precision,
)
from scalegp.ops import Engine

__all__ = ["ScalableGPClassifier"]

#: Its ``optimizer`` settings besides a callable ("L-BFGS-B" is scipy's name).
OPTIMIZERS = ("fmin_l_bfgs_b", "L-BFGS-B", None)
MULTI_CLASS = ("one_vs_rest",)
SOLVERS = ("auto", "exact", "cg")
#: Training points up to which "auto" takes the dense solver: each Newton step is a Cholesky
#: of ``B`` (n × n), and an objective several steps.
EXACT_MAX_N = 2048
#: The hyperparameter of each kernel class that is a length in X's units.
_LENGTHS = {sk.RBF: "length_scale", sk.Matern: "length_scale",
            sk.RationalQuadratic: "length_scale", sk.ExpSineSquared: "periodicity"}


def in_units(kernel, factor):
    """A copy of a (checked) scikit-learn ``kernel`` with its lengths (`_LENGTHS`) and their
    bounds times ``factor``: the same model for inputs times ``factor`` (exactly, for a power
    of two)."""
    if isinstance(kernel, sk.KernelOperator):
        return type(kernel)(in_units(kernel.k1, factor), in_units(kernel.k2, factor))
    params = kernel.get_params(deep=False)
    name = _LENGTHS.get(type(kernel))
    if name is not None:
        value, bounds = params[name], params[name + "_bounds"]
        params[name] = float(value) * factor if np.ndim(value) == 0 else np.multiply(
            value, factor)
        if not isinstance(bounds, str):  # "fixed"
            bounds = np.multiply(bounds, factor)
            params[name + "_bounds"] = tuple(bounds.tolist()) if bounds.ndim == 1 else bounds
    return type(kernel)(**params)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What `fit_binary` reads of the estimator, checked."""

    optimizer: object
    n_restarts_optimizer: int
    max_iter: int
    max_iter_predict: int
    max_iter_full: int
    subset_size: int
    warm_start: bool
    num_probes: int
    preconditioner_rank: int
    cg_tol: float
    max_cg_iter: int
    engine: Engine
    #: X's log-hyperparameters minus the fitted units' (a callable optimizer sees X's)
    shift: np.ndarray | None = None

    def cg_solver(self, seed):
        """The matrix-free solver, its probes seeded by ``seed``."""
        return gp.LaplaceCG(max_iter=self.max_iter_predict, num_probes=self.num_probes,
                            preconditioner_rank=self.preconditioner_rank, cg_tol=self.cg_tol,
                            max_cg_iter=self.max_cg_iter, seed=seed, engine=self.engine)


class ScalableGPClassifier(ClassifierMixin, BaseEstimator):
    """Gaussian-process classification by the Laplace approximation, for large n.

    The latent function ``f ~ GP(0, k)`` passes through the logistic function,
    ``p(y = 1 | f) = σ(f)``; the posterior of ``f`` is approximated by a Gaussian at its mode
    (Rasmussen & Williams, 2006, §3.4), as scikit-learn's GaussianProcessClassifier does, whose
    constructor, methods and attributes this estimator has. Up to ``exact_max_n`` training
    points the algorithm is scikit-learn's (dense Cholesky factors; the same mode and log
    marginal likelihood to rounding). Above, it is matrix-free (:class:`scalegp.gp.LaplaceCG`):
    each Newton step one preconditioned conjugate-gradient solve with
    ``B = I + W^½ K W^½`` through the engine's kernel products, the log marginal likelihood by
    stochastic Lanczos quadrature and its gradient by stochastic trace estimates; memory linear
    in n. Its hyperparameters then come from an exact fit on a random subset of ``subset_size``
    points, refined by ``max_iter_full`` L-BFGS-B iterations on all of them.

    Probabilities: ``E[σ(f*)]`` over the Gaussian latent predictive distribution, by
    scikit-learn's approximation of σ as five error functions, whose Gaussian average is closed
    form (not the probit approximation ``σ(μ/√(1 + πs²/8))``).

    Several classes: one-vs-rest, one binary problem per class (each with its own
    hyperparameters, fitted one after another; ``kernel_`` is then a CompoundKernel), whose
    probabilities are normalised to sum to 1.

    Parameters
    ----------
    kernel : scikit-learn kernel or None, default=None
        The latent covariance, built from ConstantKernel, RBF, Matern (ν = 0.5, 1.5, 2.5),
        RationalQuadratic, ExpSineSquared, WhiteKernel, ``+`` and ``*`` (WhiteKernel only as a
        term of the top-level sum: a variance added to the latent function at each point);
        its lengths (lengthscales, periods) in X's units. None:
        ``ConstantKernel(1.0) * RBF(np.ones(n_features))``, learnt (ARD), bounds (1e-5, 1e5),
        lengths in units of X's spread (see Notes). (scikit-learn's None is
        ``1.0 * RBF(1.0)`` with both fixed.)
    optimizer : "fmin_l_bfgs_b", "L-BFGS-B", callable or None, default="fmin_l_bfgs_b"
        L-BFGS-B on the log-hyperparameters within the kernel's bounds, scikit-learn's callable
        ``optimizer(obj_func, initial_theta, bounds) -> (theta, value)``, or None to keep the
        kernel's values.
    n_restarts_optimizer : int, default=0
        Extra runs from log-hyperparameters drawn uniformly within the bounds.
    max_iter_predict : int, default=100
        Newton steps at most for the mode.
    warm_start : bool, default=False
        Start each Newton run of the optimiser from the previous mode (the matrix-free path
        always does so), and the first from the previous fit's mode when the data have the
        same size.
    copy_X_train : bool, default=True
        Store a copy of X (``X_train_``); False may keep a reference.
    random_state : int, RandomState instance or None, default=None
        Seeds the restarts, the subset and the probes.
    multi_class : "one_vs_rest", default="one_vs_rest"
        scikit-learn's "one_vs_one" is refused: it gives no probabilities.
    n_jobs : int or None, default=None
        Accepted for scikit-learn's signature; the binary problems run one after another, each
        using every core through XLA.
    solver : {"auto", "exact", "cg"}, default="auto"
        "auto" is "exact" for up to ``exact_max_n`` training points. On a TPU the exact
        solver's fit and predictions run on the host CPU, as "float64" does.
    exact_max_n : int, default=2048
    subset_size : int, default=2048
        Points of the exact hyperparameter fit that starts the matrix-free one.
    max_iter : int, default=200
        L-BFGS-B iterations per run.
    max_iter_full : int, default=3
        L-BFGS-B iterations on all points after the subset fit (matrix-free only; 0 skips them).
    num_probes, preconditioner_rank, cg_tol, max_cg_iter :
        Settings of :class:`scalegp.gp.LaplaceCG` (defaults 30, 256, 1e-3, 1000).
    dtype : None or a float32/float64 dtype, default=None
        Compute dtype; None is float64 when JAX x64 is enabled, float32 otherwise. float64
        with x64 off turns it on for the duration of each method.
    impl : str, default="auto"
        Engine implementation (:mod:`scalegp.ops`).

    Notes
    -----
    Inputs are fitted centred (their median) and over their spread, a power of two near their
    root mean variance, both in float64 before the cast to the compute dtype: no kernel
    arithmetic meets the squares of inputs of 1e30 or 1e-30 (float32 overflows and
    underflows), and the default model's lengths follow the data's scale. A kernel's lengths
    are converted to those units and ``kernel_``'s back to X's, exactly; so the fit of X
    times a power of two is that of X, bit for bit.

    Attributes
    ----------
    kernel_ : kernel
        The fitted kernel, in X's units; a CompoundKernel of one kernel per class for several
        classes.
    log_marginal_likelihood_value_ : float
        Of the fitted kernel (the mean over classes for several).
    classes_ : ndarray of shape (n_classes,)
    n_classes_ : int
    X_train_ : ndarray of shape (n_samples, n_features)
    solver_ : {"exact", "cg"}
    n_features_in_ : int
    """

    def __init__(
        self,
        kernel=None,
        *,
        optimizer="fmin_l_bfgs_b",
        n_restarts_optimizer=0,
        max_iter_predict=100,
        warm_start=False,
        copy_X_train=True,
        random_state=None,
        multi_class="one_vs_rest",
        n_jobs=None,
        solver="auto",
        exact_max_n=EXACT_MAX_N,
        subset_size=2048,
        max_iter=200,
        max_iter_full=3,
        num_probes=30,
        preconditioner_rank=256,
        cg_tol=1e-3,
        max_cg_iter=1000,
        dtype=None,
        impl="auto",
    ):
        self.kernel = kernel
        self.optimizer = optimizer
        self.n_restarts_optimizer = n_restarts_optimizer
        self.max_iter_predict = max_iter_predict
        self.warm_start = warm_start
        self.copy_X_train = copy_X_train
        self.random_state = random_state
        self.multi_class = multi_class
        self.n_jobs = n_jobs
        self.solver = solver
        self.exact_max_n = exact_max_n
        self.subset_size = subset_size
        self.max_iter = max_iter
        self.max_iter_full = max_iter_full
        self.num_probes = num_probes
        self.preconditioner_rank = preconditioner_rank
        self.cg_tol = cg_tol
        self.max_cg_iter = max_cg_iter
        self.dtype = dtype
        self.impl = impl

    def _model_kernel(self, n_features, scale=1.0):
        """The model in the units it is fitted in, X's over ``scale``: ``kernel`` converted
        (`in_units`), or the default one, whose lengths are in those units."""
        if self.kernel is None:
            return C(1.0, (1e-5, 1e5)) * RBF(np.ones(n_features), (1e-5, 1e5))
        return in_units(self.kernel, 1.0 / scale)

    def _fitted_kernel(self):
        """``kernel_``: the model at each binary problem's ``theta``, in X's units."""
        model = self._model_kernel(self.n_features_in_, self._scale)
        kernels = [in_units(model.clone_with_theta(theta), self._scale)
                   for theta in self._thetas]
        return kernels[0] if len(kernels) == 1 else CompoundKernel(kernels)

    def _settings(self):
        if not callable(self.optimizer):
            check_option("optimizer", self.optimizer, OPTIMIZERS)
        check_option("multi_class", self.multi_class, MULTI_CLASS)
        check_option("solver", self.solver, SOLVERS)
        for name, minimum in (("n_restarts_optimizer", 0), ("max_iter_predict", 1),
                              ("max_iter", 0), ("max_iter_full", 0), ("exact_max_n", 1),
                              ("subset_size", 2), ("num_probes", 1),
                              ("preconditioner_rank", 1), ("max_cg_iter", 1)):
            check_int(name, getattr(self, name), minimum)
        for name in ("warm_start", "copy_X_train"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not (isinstance(self.cg_tol, numbers.Real) and 0 < self.cg_tol < 1):
            raise ValueError(f"cg_tol must be a number in (0, 1), got {self.cg_tol!r}")
        if self.dtype is not None:
            float_dtype(self.dtype)
        return _Settings(
            optimizer=self.optimizer, n_restarts_optimizer=self.n_restarts_optimizer,
            max_iter=self.max_iter, max_iter_predict=self.max_iter_predict,
            max_iter_full=self.max_iter_full, subset_size=self.subset_size,
            warm_start=bool(self.warm_start), num_probes=self.num_probes,
            preconditioner_rank=self.preconditioner_rank, cg_tol=float(self.cg_tol),
            max_cg_iter=self.max_cg_iter, engine=Engine.create(self.impl))

    def _solver_for(self, n: int) -> str:
        """The solver a fit on ``n`` points runs: ``solver``, or for "auto" "exact" up to
        ``exact_max_n`` points and "cg" above."""
        if self.solver != "auto":
            return self.solver
        return "exact" if n <= self.exact_max_n else "cg"

    @in_precision
    def fit(self, X, y):
        """Fit the hyperparameters (unless ``optimizer=None``), the mode of each binary problem
        and the prediction caches.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : array-like of shape (n_samples,)
            Class labels.

        Returns
        -------
        self
        """
        if isinstance(self.kernel, CompoundKernel):
            raise ValueError("kernel cannot be a CompoundKernel")
        settings = self._settings()
        X, y = validate_data(self, X, y=y, dtype=[np.float64, np.float32])
        check_classification_targets(y)
        n, d = X.shape
        check_kernel(self, self.kernel)
        search_host_blas_early()  # the Laplace steps bound it; the data's setup runs first
        # fitted in units of X's spread: the default model's lengths follow it, and no
        # kernel's arithmetic meets the squares of 1e30 or 1e-30 (float32's overflow and
        # underflow)
        self._centre = input_centre(X)
        self._scale = input_scale(X, self._centre)
        kernel = self._model_kernel(d, self._scale)
        spec = KernelSpec.from_sklearn(kernel)
        settings = dataclasses.replace(
            settings, shift=in_units(kernel, self._scale).theta - kernel.theta)
        self.classes_, codes = np.unique(y, return_inverse=True)
        self.n_classes_ = len(self.classes_)
        if self.n_classes_ == 1:
            raise ValueError(
                "ScalableGPClassifier requires 2 or more distinct classes; got 1 class (only "
                f"class {self.classes_[0]} is present): pass labels of at least two classes")
        dtype = compute_dtype(self)
        rng = check_random_state(self.random_state)
        self.solver_ = self._solver_for(n)
        if self.solver_ == "cg":
            check_solver_memory(settings.cg_solver(0), n, dtype, settings.engine,
                                "a Laplace fit by CG", "fit a random subset of the points, or "
                                "lower preconditioner_rank")
        with host_scope(self.solver_ == "exact"):  # on a TPU, the exact solver on the host
            self._probe_seed = int(rng.randint(2**31 - 1))
            x = centred(X, self._centre, dtype, scale=self._scale)
            problems = [codes == 1] if self.n_classes_ == 2 else [
                codes == c for c in range(self.n_classes_)]
            previous = getattr(self, "_modes", None) if self.warm_start else None
            fits = []
            for i, positive in enumerate(problems):
                f0 = None
                if previous is not None and len(previous) == len(problems) and \
                        previous[i].shape == (n,):
                    f0 = jnp.asarray(previous[i], dtype)
                fits.append(fit_binary(x, jnp.asarray(positive, dtype), kernel, spec, settings,
                                       rng, self._probe_seed, self.solver_ == "exact", f0))
            self._spec = spec
            self._codes = codes
            self._thetas = [fit.theta for fit in fits]
            self._alphas = [fit.alpha for fit in fits]
            self._factors = [fit.factor for fit in fits]
            self._modes = [fit.f for fit in fits]
            self._values = [fit.value for fit in fits]
            self.kernel_ = self._fitted_kernel()
            if self.optimizer is not None and kernel.n_dims:
                # scikit-learn's ConvergenceWarning for values close to a bound
                for k in self.kernel_.kernels if len(fits) > 1 else [self.kernel_]:
                    k._check_bounds_params()
            self.log_marginal_likelihood_value_ = float(np.mean(self._values))
            self.n_iter_ = int(sum(fit.evaluations for fit in fits))
            self.X_train_ = np.array(X, copy=True) if self.copy_X_train else np.asarray(X)
            return self

    def _fitted(self, X):
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        dtype = compute_dtype(self)
        x_train = centred(self.X_train_, self._centre, dtype, scale=self._scale)
        return (x_train, centred(X, self._centre, dtype, scale=self._scale),
                Engine.create(self.impl))

    @in_precision
    @exact_on_host
    def latent_mean_and_variance(self, X):
        """Mean and variance of the latent function ``f`` at X (binary problems only).

        Returns
        -------
        latent_mean, latent_var : ndarrays of shape (n_samples,)
        """
        check_is_fitted(self)
        if self.n_classes_ != 2:
            raise ValueError(
                "Returning the mean and variance of the latent function f is only supported "
                f"for binary classification, received {self.n_classes_} classes.")
        x_train, x, engine = self._fitted(X)
        return latent_moments(self._spec, self._thetas[0], x_train, self._alphas[0],
                              self._factors[0], x, engine)

    @in_precision
    @exact_on_host
    def predict_proba(self, X):
        """Probabilities of the classes, ``E[σ(f)]`` per binary problem (one-vs-rest ones
        normalised), columns in the order of ``classes_``.

        Returns
        -------
        ndarray of shape (n_samples, n_classes)
        """
        x_train, x, engine = self._fitted(X)
        probabilities = np.stack([
            gp.averaged_sigmoid(*latent_moments(self._spec, theta, x_train, alpha, factor, x,
                                                engine))
            for theta, alpha, factor in zip(self._thetas, self._alphas, self._factors)],
            axis=1)
        if self.n_classes_ == 2:
            return np.hstack([1.0 - probabilities, probabilities])
        total = np.sum(probabilities, axis=1, keepdims=True)
        return probabilities / np.where(total > 0, total, 1.0)

    @in_precision
    @exact_on_host
    def predict(self, X):
        """Classes at X: the sign of the latent mean for two classes (as scikit-learn), the
        most probable one-vs-rest class otherwise.

        Returns
        -------
        ndarray of shape (n_samples,)
        """
        check_is_fitted(self)
        if self.n_classes_ == 2:
            x_train, x, engine = self._fitted(X)
            mean = latent_mean(self._spec, self._thetas[0], x_train, self._alphas[0], x, engine)
            return np.where(mean > 0, self.classes_[1], self.classes_[0])
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]

    @in_precision
    @exact_on_host
    def log_marginal_likelihood(self, theta=None, eval_gradient=False, clone_kernel=True):
        """Laplace-approximate log marginal likelihood at the log-hyperparameters ``theta``.

        Parameters
        ----------
        theta : array-like or None
            ``kernel_.theta`` layout: for several classes either one vector for all of them
            or their concatenation (the mean over classes is returned). None returns
            ``log_marginal_likelihood_value_``.
        eval_gradient : bool
            Also return the gradient (two classes only, as scikit-learn).
        clone_kernel : bool, default=True
            False sets ``kernel_``'s hyperparameters to ``theta`` (predictions keep the fitted
            ones: refit to predict with others).
        """
        check_is_fitted(self)
        if theta is None:
            if eval_gradient:
                raise ValueError("Gradient can only be evaluated for theta!=None")
            return np.float64(self.log_marginal_likelihood_value_)
        theta = np.asarray(theta, np.float64)
        per_class = len(self._thetas[0])
        count = len(self._thetas)
        if count > 1 and eval_gradient:
            raise ValueError(
                "Gradient of log-marginal-likelihood not implemented for multi-class GPC.")
        if theta.shape == (per_class,):
            thetas = [theta] * count
        elif count > 1 and theta.shape == (per_class * count,):
            thetas = list(theta.reshape(count, per_class))
        else:
            shapes = f"{per_class}" + (f" or {per_class * count}" if count > 1 else "")
            raise ValueError(f"Shape of theta must be either {shapes}. Obtained theta with "
                             f"shape {theta.shape}.")
        kernels = self.kernel_.kernels if count > 1 else [self.kernel_]
        if not clone_kernel:
            for k, th in zip(kernels, thetas):
                k.theta = th
        # theta is in X's units, the model's own in X's over _scale
        thetas = [in_units(k.clone_with_theta(th), 1.0 / self._scale).theta
                  for k, th in zip(kernels, thetas)]
        x_train, _, _ = self._fitted(self.X_train_[:1])
        results = []
        for i, th in enumerate(thetas):
            positive = self._codes == (1 if count == 1 else i)
            objective = LaplaceObjective(self._solver(), self._spec, x_train,
                                         jnp.asarray(positive, x_train.dtype))
            if eval_gradient:
                value, grad = objective(th)
                results.append((-value, -grad))
            else:
                results.append(-objective.sklearn(th, eval_gradient=False))
        if eval_gradient:
            return np.float64(results[0][0]), np.asarray(results[0][1], np.float64)
        return np.float64(np.mean(results))

    def _solver(self):
        settings = self._settings()
        if self.solver_ == "exact":
            return gp.LaplaceCholesky(max_iter=self.max_iter_predict)
        return settings.cg_solver(seed=self._probe_seed)
