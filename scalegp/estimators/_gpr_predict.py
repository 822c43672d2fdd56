"""How `ScalableGPRegressor` predicts and samples, besides `scalegp.gp.predict`: the fitted
state on the device and its cache, the prediction engine, the prior before any fit, the variance
factors built on first use, the noise of y at new points, the memory check of a covariance,
scikit-learn's result shapes; `predict_fn`, the predictions as a pure JAX function; and
`sample_y`, exact or pathwise draws. ``model`` is the estimator.

`predict_fn` is `ScalableGPRegressor.predict` without the host steps: the same fitted state
(`fitted_state`, the variance cache of `variance_posterior`), the same block of kernel
arithmetic (`scalegp.gp.predict_moments`), the same noise at new points (`test_noise`), with
the input centring and the target scaling that `predict` does in float64 on the host done in
the compute dtype inside the function.

`sample_y` draws exactly (the covariance and numpy's ``multivariate_normal``, as scikit-learn)
or pathwise (the fitted state handed to `scalegp.gp.sample_paths`, before fit
`scalegp.gp.sample_prior`, then the predictive mean, the test points' noise and y's units).
The pathwise draw (Wilson et al. 2020, Matheron's rule) is
``mean(x*) + f(x*) - K(x*, X) A⁻¹ (f(X) + ε) + noise``, ``f`` a random-feature prior draw of
``n_features`` frequencies per term of the kernel's sum, fresh ones per sample, ``A⁻¹`` applied
to all samples' columns by one batched solve with the fitted solver (its Cholesky factor, or
preconditioned CG), then one kernel product: memory linear in the query rows and samples.
Each sample is exactly Gaussian at each point and the samples' covariance is exact on average
over them; a single sample's covariance errs by at most ``k(0)/√n_features`` (sd) per entry
(`scalegp.gp._prior_features`). ExpSineSquared on more than one feature has no random-feature
prior (a ValueError that names method="exact"). Draws that need more memory than this process
can hold are refused before any work (`check_sample_memory`), with the size, the limit and the
fix, instead of numpy's MemoryError part-way (``n_samples=10**8``: 763 GiB of prior
frequencies).
"""

from __future__ import annotations

import numbers
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from scalegp import gp
from scalegp._validation import check_int, check_memory, validate_data
from scalegp.estimators._gpr_inputs import (
    bbmm_solver,
    centred,
    compute_dtype,
    default_model_start,
    fixed_mean,
    gp_engine,
    input_centre,
)
from scalegp.estimators._gpr_kernels import kernel_spec
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
                   lambda: engine.decided(x, gp.constrained(params).kernel))


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
        # on the settings' engine, equal to the fit's: its compiled programs serve
        solver = bbmm_solver(model, model._probe_seed, gp_engine(model))
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


# ------------------------------------------------------------------------------------------
# The predictions as a JAX function


def predict_fn(self, return_std=False):  # ScalableGPRegressor.predict_fn, defined here
    """The fitted model's `predict` as a pure JAX function of the query points, for
    ``jax.grad``, ``jax.jit`` and ``jax.vmap`` (e.g. an acquisition function maximised by
    gradient).

    ``f(X)``: ``X`` a JAX or numpy array of shape (n_queries, n_features) in the units of the
    training inputs (the estimator's centring is inside ``f``; a scaler in front of the
    estimator, as a Pipeline's, is not), cast to the compute dtype. It returns the predictive
    mean in y's units (``normalize_y`` undone), of shape (n_queries,) for one target,
    (n_queries, n_targets) otherwise; with ``return_std``, also the std of y at each point, of
    the same shape, noise included (as `predict`'s). Results are JAX arrays in the compute
    dtype (``dtype``); they equal `predict`'s up to that dtype's rounding (`predict` centres
    and scales in float64 on the host, and forms its rows in fixed blocks). Rows are
    independent: the gradient of ``f(X).sum()`` holds each row's own gradient.

    The fitted state (and, with ``return_std``, the variance cache: built here on first use,
    as by `predict`, and kept) is made once, by this call, and held by ``f``: refit and call
    ``predict_fn`` again for a new model. For ``dtype="float64"`` with JAX's x64 mode off,
    call ``f`` (and transform it) inside ``with jax.enable_x64(True):``
    (``jax.experimental.enable_x64()`` before jax 0.8), where it computes; outside, it raises
    RuntimeError rather than compute in float32.

    Gradients are with respect to X only (the hyperparameters are fixed in ``f``); a Matérn
    kernel, a function of the distance, has none where a query meets a training point.

    Parameters
    ----------
    return_std : bool, default=False

    Returns
    -------
    f : callable
        ``X -> mean``, or ``X -> (mean, std)`` with ``return_std``.
    """
    check_is_fitted(self, "X_train_")
    params, x, alpha, dtype, centre = fitted_state(self)
    posterior = gp.Posterior(alpha=alpha)
    if return_std:  # built now, once (and kept on the model), not at every call
        posterior = variance_posterior(self, params, x, posterior, dtype)
    # σ² for the default model, the WhiteKernel terms of a kernel: what `predict` adds
    noise = jnp.asarray(test_noise(self._spec, params), dtype)
    # The centre in two parts of the compute dtype: X - high is exact for queries within a
    # factor 2 of it (Sterbenz), so (X - high) - low rounds once, as predict's float64
    # centring does; in float64, low is 0.
    high = np.asarray(centre, dtype)
    low = jnp.asarray(centre - high.astype(np.float64), dtype)
    high = jnp.asarray(high)
    y_mean = jnp.asarray(self._y_train_mean, dtype)
    y_std = jnp.asarray(self._y_train_std, dtype)
    single = y_mean.shape[0] == 1  # one target: 1-D results, as predict's `squeezed`
    d = self.n_features_in_
    engine = predict_engine(self)
    float64 = np.dtype(dtype) == np.float64

    def predict(X):
        X = jnp.asarray(X)
        if float64 and not jax.config.jax_enable_x64:
            raise RuntimeError(
                'this model computes in float64 (dtype="float64"), and JAX\'s x64 mode is off '
                "here: call the function (and jit or grad it) inside "
                "`with jax.enable_x64(True):`, or fit with dtype=None/float32")
        if X.ndim != 2 or X.shape[1] != d:
            raise ValueError(
                f"X must have shape (n_queries, {d}) (the model's n_features_in_), got "
                f"{X.shape}: use X[None, :] for one point, jax.vmap for batches of sets")
        xq = (X.astype(dtype) - high) - low
        mean, var = gp.predict_moments(params, x, posterior, xq, return_std=return_std,
                                       engine=engine)
        mean = mean * y_std + y_mean
        mean = mean[:, 0] if single else mean
        if not return_std:
            return mean
        # predict's clip of rounding (and an under-ranked LOVE cache) below zero, silently
        std = jnp.sqrt(jnp.maximum(var, 0.0) + noise)[:, None] * y_std
        return mean, std[:, 0] if single else std

    return predict


# ------------------------------------------------------------------------------------------
# Draws


def sample_y(model, X, n_samples, random_state, method, n_features):
    """`ScalableGPRegressor.sample_y` (its docstring): the settings checked, then the exact draw
    (the covariance and numpy's ``multivariate_normal``, as scikit-learn) or `sample_pathwise`."""
    if method not in ("auto", "exact", "pathwise"):
        raise ValueError(f'method must be "auto", "exact" or "pathwise", got {method!r}')
    n_samples = check_int("n_samples", n_samples, 1)
    rng = check_random_state(random_state)
    X = validate_data(model, X, reset=False, dtype=[np.float64, np.float32])
    if method == "auto":
        method = "exact" if X.shape[0] <= gp.SAMPLE_EXACT_MAX_ROWS else "pathwise"
    check_sample_memory(model, X.shape, n_samples, method, n_features)
    if method == "pathwise":
        return sample_pathwise(model, X, n_samples, rng, n_features)
    # multivariate_normal's SVD: three more (m, m) float64 matrices, one target at a time
    check_covariance_memory(model, X.shape[0], n_outputs(model), extra=3)
    mean, cov = model.predict(X, return_cov=True)
    if mean.ndim == 1:
        return rng.multivariate_normal(mean, cov, n_samples).T
    return np.stack([
        rng.multivariate_normal(mean[:, j], cov[..., j], n_samples).T
        for j in range(mean.shape[1])
    ], axis=1)


def check_sample_memory(model, shape, n_samples, method, n_features):
    """A MemoryError (`scalegp._validation.check_memory`), before any work, where ``n_samples``
    draws at the query points, of ``shape`` (m, d), need more memory than this process can
    hold. Counted: the float64 arrays of the draws' size held at once (exact: the normals and
    their product per target, the targets' draws and their stack; pathwise: the mean, the
    latent draws, the noise and their sum), and for the pathwise draw the prior's frequencies
    and weights (one kernel term's ``n_features``, in float64 and the compute dtype) and the
    training rows' noise, right-hand sides and solutions, ``(n, o, S)`` each."""
    (m, d), o = shape, n_outputs(model)
    draws = m * o * n_samples
    if method == "exact":
        needed = 8 * m * n_samples * (2 + (2 * o if o > 1 else 0))
    else:
        # an invalid n_features gets its own error from the draw
        valid = isinstance(n_features, numbers.Integral) and n_features > 0
        features = int(n_features) if valid else 1
        size = np.dtype(compute_dtype(model)).itemsize
        n = model.X_train_.shape[0] if hasattr(model, "X_train_") else 0
        prior_draws = n_samples * features * (d + 2 * o)
        needed = ((8 + size) * prior_draws + (16 + 3 * size) * n * o * n_samples
                  + (32 + size) * draws)
    check_memory(needed, f"{n_samples:,} draws at {m:,} query rows ({o} target(s), "
                 f"{method})", "draw fewer samples at a time (draws with other seeds are "
                 "independent), or at fewer rows")


def sample_pathwise(model, X, n_samples, rng, n_features):
    """Draws of y at the validated ``X (m, d)``: ``(m, S)`` for a single target, else
    ``(m, o, S)``; the normalised draw
    ``mean + f_post + √noise·ε*`` taken to y's units as `predict`'s mean is."""
    m = X.shape[0]
    if not hasattr(model, "X_train_"):
        o = n_outputs(model)
        dtype = compute_dtype(model)
        hp, noise = prior(model, X.shape[1], o, dtype)
        x = centred(X, input_centre(X), dtype)
        latent = gp.sample_prior(hp.kernel, x, o, n_samples, rng, n_features=n_features)
        mean = np.broadcast_to(np.asarray(hp.mean, np.float64), (m, o))
        scale, shift = 1.0, 0.0
    else:
        params, x, alpha, dtype, centre = fitted_state(model)
        posterior = gp.Posterior(alpha=alpha)
        solver = None
        if model.solver_ == "exact":
            posterior = variance_posterior(model, params, x, posterior, dtype)  # the Cholesky
        else:
            solver = bbmm_solver(model, model._probe_seed, gp_engine(model))
        xq = centred(X, centre, dtype)
        engine = predict_engine(model)
        latent = gp.sample_paths(params, x, posterior, xq, n_samples, rng, solver=solver,
                                 n_features=n_features, engine=engine)
        mean = np.asarray(gp.predict(params, x, gp.Posterior(alpha=alpha), xq,
                                     include_noise=False, engine=engine), np.float64)
        noise = float(test_noise(model._spec, params))
        scale, shift = model._y_train_std, model._y_train_mean
    o = mean.shape[1]
    draws = (mean[:, :, None] + np.asarray(latent, np.float64)
             + np.sqrt(noise) * rng.standard_normal((m, o, n_samples)))
    draws = draws * np.reshape(scale, (1, -1, 1)) + np.reshape(shift, (1, -1, 1))
    return draws[:, 0, :] if o == 1 else draws  # a single target: 2-D, as `predict`'s
