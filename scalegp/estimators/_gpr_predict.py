"""What `ScalableGPRegressor`'s predictions need besides `scalegp.gp.predict`: the prior before
any fit, the variance factors built on first use, the noise of y at new points, the memory
check of a covariance, and scikit-learn's result shapes. ``model`` is the estimator."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from scalegp import gp
from scalegp._validation import check_int, validate_data
from scalegp.estimators._gpr_checks import (
    bbmm_solver,
    compute_dtype,
    default_model_start,
    fixed_mean,
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


def fitted_state(model):
    """``(params, x, alpha, dtype, centre)``: the fitted state in the compute dtype, with the
    training inputs ``x`` centred on ``centre``, their `input_centre` (recomputed rather than
    stored, so model files carry no extra state; queries are centred on it too)."""
    dtype = compute_dtype(model)
    o = model._y_train_mean.shape[0]
    params = model._parametrisation()(model.theta_, o, model.n_features_in_, model._fixed_mean,
                                      dtype)
    centre = input_centre(model.X_train_)
    x = centred(model.X_train_, centre, dtype)
    alpha = jnp.asarray(model.alpha_.reshape(x.shape[0], o), dtype)
    return params, x, alpha, dtype, centre


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
        return gp.Posterior(alpha=posterior.alpha,
                            cholesky=jnp.asarray(model._cholesky, dtype))
    if model._love_factor is None:
        solver = bbmm_solver(model, model._probe_seed)
        with FitProgress(model.verbose).phase("variance cache"):
            model._love_factor = np.asarray(solver.love(params, x, posterior).love_factor)
    return gp.Posterior(alpha=posterior.alpha,
                        love_factor=jnp.asarray(model._love_factor, dtype))


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
