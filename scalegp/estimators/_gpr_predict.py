"""What `ScalableGPRegressor`'s predictions need besides `scalegp.gp.predict`: the prior before
any fit, the variance factors built on first use, the noise of y at new points, the memory
check of a covariance, and scikit-learn's result shapes. ``model`` is the estimator."""

from __future__ import annotations

import weakref

import jax.numpy as jnp
import numpy as np

from scalegp import gp
from scalegp._validation import check_int, validate_data
from scalegp.estimators._gpr_checks import (
    bbmm_solver,
    compute_dtype,
    default_model_start,
    fixed_mean,
    gp_engine,
)
from scalegp.estimators._gpr_kernels import kernel_spec
from scalegp.estimators._gpr_units import centred, input_centre
from scalegp.estimators._progress import FitProgress
from scalegp.ops import kernel_matrix


def n_outputs(model):
    """The targets of a prediction: the fitted ones; before fit, ``n_targets`` (None: 1)."""
    if hasattr(model, "X_train_"):
        return model._y_train_mean.shape[0]
    return 1 if model.n_targets is None else check_int("n_targets", model.n_targets, 1)


#: Per fitted model, what its predictions upload and rebuild on every call otherwise: the
#: fitted state and the variance factor on the device, each with the host values it came from
#: (`_cached`). A one-row prediction costs a few kernel rows; re-centring and re-uploading 10^5
#: training rows would be most of it (issue 42). Weak keys: the entry goes with the model, and
#: model files and pickles carry none of it.
_DEVICE_CACHE = weakref.WeakKeyDictionary()


def _cached(model, name, sources, build):
    """``build()``, kept for ``model`` under ``name`` while ``sources`` (the host values it
    is computed from) are the same objects (arrays: identity; anything else: equality)."""
    entries = _DEVICE_CACHE.setdefault(model, {})
    hit = entries.get(name)
    if hit is not None and len(hit[0]) == len(sources) and all(
            a is b if isinstance(b, np.ndarray) else _equal(a, b)
            for a, b in zip(hit[0], sources)):
        return hit[1]
    value = build()
    entries[name] = (sources, value)
    return value


def _equal(a, b):
    return type(a) is type(b) and bool(np.all(a == b))


def _state_sources(model, dtype):
    """The host values the fitted state in ``dtype`` is built from (`_cached`)."""
    return (model.X_train_, model.alpha_, model._y_train_mean,
            np.asarray(model.theta_, np.float64).tobytes(), model._fixed_mean,
            np.dtype(dtype).name)


def fitted_state(model):
    """``(params, x, alpha, dtype, centre)``: the fitted state in the compute dtype, with the
    training inputs ``x`` centred on ``centre``, their `input_centre` (recomputed rather than
    stored, so model files carry no extra state; queries are centred on it too). Built once
    per fitted model and compute dtype (`_DEVICE_CACHE`); a refit or new ``theta_`` rebuilds
    it."""
    dtype = compute_dtype(model)

    def build():
        o = model._y_train_mean.shape[0]
        params = model._parametrisation()(model.theta_, o, model.n_features_in_,
                                          model._fixed_mean, dtype)
        centre = input_centre(model.X_train_)
        x = centred(model.X_train_, centre, dtype)
        alpha = jnp.asarray(model.alpha_.reshape(x.shape[0], o), dtype)
        return params, x, alpha, dtype, centre

    return _cached(model, "state", _state_sources(model, dtype), build)


def predict_engine(model):
    """The engine of the fitted model's predictions: `gp_engine` with ``prune="auto"`` decided
    once for its training inputs and kernel (`scalegp.ops.Engine.decided`), not in every
    call."""
    engine = gp_engine(model)
    params, x, *_ = fitted_state(model)
    sources = _state_sources(model, x.dtype) + (engine,)
    return _cached(model, "engine", sources,
                   lambda: engine.decided(x, params.constrained().kernel))


def check_covariance_memory(model, m, o, extra=0):
    """`gp.check_covariance_memory` for a covariance of ``m`` query rows and ``o`` targets,
    before any work: the compute dtype's matrices of `gp.predict`, a float64 copy and the
    float64 ``(m, m, o)`` result, and ``extra`` float64 ``(m, m)`` matrices."""
    itemsize = np.dtype(compute_dtype(model)).itemsize
    per_entry = gp.COVARIANCE_MATRICES * itemsize + 8 * (1 + o + extra)
    gp.check_covariance_memory(m, m * m * per_entry)


def test_noise(spec, params):
    """The noise variance of y at a new point (normalised units): the default model's
    (``spec`` None) ``σ²``; with a kernel, its WhiteKernel terms (scikit-learn's
    ``kernel_.diag`` beyond f's), never ``alpha``, which belongs to the training points."""
    if spec is None:
        return params.constrained().noise
    return spec.build(params.theta)[1]


def variance_posterior(model, params, x, posterior, dtype):
    """``posterior`` with its variance factor, built on first use when missing (and kept on
    ``model``): the LOVE factor always, the Cholesky factor for a model loaded without it
    (model files store only what the mean needs unless asked)."""
    if model.solver_ == "exact":
        if model._cholesky is None:
            o = model._y_train_mean.shape[0]
            y2 = np.asarray(model.y_train_, np.float64).reshape(x.shape[0], o)
            yn = jnp.asarray((y2 - model._y_train_mean) / model._y_train_std, dtype)
            model._cholesky = np.asarray(gp.CholeskySolver().posterior(params, x, yn).cholesky)
        factor = model._cholesky
        return gp.Posterior(alpha=posterior.alpha, cholesky=_cached(
            model, "cholesky", (factor, np.dtype(dtype).name), lambda: jnp.asarray(factor, dtype)))
    if model._love_factor is None:
        solver = bbmm_solver(model, model._probe_seed)
        with FitProgress(model.verbose).phase("variance cache"):
            model._love_factor = np.asarray(solver.love(params, x, posterior).love_factor)
    factor = model._love_factor
    return gp.Posterior(alpha=posterior.alpha, love_factor=_cached(
        model, "love", (factor, np.dtype(dtype).name), lambda: jnp.asarray(factor, dtype)))


def prior(model, d, o, dtype):
    """``(hyperparameters, noise at new points)`` before any fit: the model at its starting
    values, the mean at ``mean`` (0 when None)."""
    mean = np.zeros(o) if model.mean is None else fixed_mean(model.mean, o)
    kernel = model._model_kernel()
    spec = kernel_spec(kernel, model.alpha, d)
    if spec is None:
        lengthscale, outputscale, noise = default_model_start(model, d)
        hp = gp.GPParams.from_constrained(
            mean, outputscale, lengthscale, noise,
            noise_lower_bound=model.noise_lower_bound, dtype=dtype).constrained()
        return hp, float(hp.noise)
    theta = jnp.asarray(kernel.theta, dtype)
    hp = gp.KernelParams(mean=jnp.asarray(mean, dtype), theta=theta, spec=spec).constrained()
    return hp, float(spec.build(theta)[1])


def predict_prior(model, X, return_std, return_cov):
    """`ScalableGPRegressor.predict` before `fit`: the prior (scikit-learn's, for a kernel)."""
    X = validate_data(model, X, reset=False, dtype=[np.float64, np.float32])
    o = n_outputs(model)
    if return_cov:
        check_covariance_memory(model, X.shape[0], o)
    dtype = compute_dtype(model)
    hp, noise = prior(model, X.shape[1], o, dtype)
    mean = np.broadcast_to(np.asarray(hp.mean, np.float64), (X.shape[0], o))
    if not (return_std or return_cov):
        return squeezed(mean)
    if return_std:
        std = np.sqrt(float(hp.kernel.at_zero()) + noise)  # stationary: k(x, x) = k(0)
        return squeezed(mean), squeezed(np.full((X.shape[0], o), std))
    x = centred(X, input_centre(X), dtype)
    cov = np.array(kernel_matrix(hp.kernel, x, x), np.float64)
    cov[np.diag_indices_from(cov)] += noise
    return squeezed(mean), squeezed(np.repeat(cov[:, :, None], o, axis=2))


def squeezed(values):
    """``(m, o, ...)`` results of one target as scikit-learn returns them: without the target
    axis (axis 1 for means and stds, 2 for covariances)."""
    axis = 2 if values.ndim == 3 else 1
    return values if values.shape[axis] != 1 else np.squeeze(values, axis=axis)
