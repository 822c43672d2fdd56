"""`ScalableGPRegressor.sample_y`: the exact draw, or the pathwise one (the fitted state handed to
`scalegp.gp.sample_paths`, before fit `scalegp.gp.sample_prior`, then the predictive mean, the
test points' noise and y's units). ``model`` is the estimator.

The pathwise draw (Wilson et al. 2020, Matheron's rule) is
``mean(x*) + f(x*) - K(x*, X) A⁻¹ (f(X) + ε) + noise``, ``f`` a random-feature prior draw of
``n_features`` frequencies per term of the kernel's sum, fresh ones per sample, ``A⁻¹`` applied
to all samples' columns by one batched solve with the fitted solver (its Cholesky factor, or
preconditioned CG), then one kernel product: memory linear in the query rows and samples.
Each sample is exactly Gaussian at each point and the samples' covariance is exact on average
over them; a single sample's covariance errs by at most ``k(0)/√n_features`` (sd) per entry
(`scalegp.gp._prior_features`). ExpSineSquared on more than one feature has no random-feature
prior (a ValueError that names method="exact").

Draws that need more memory than this process can hold are refused before any work
(`check_sample_memory`), with the size, the limit and the fix, instead of numpy's MemoryError
part-way (``n_samples=10**8``: 763 GiB of prior frequencies).
"""

from __future__ import annotations

import numbers

import numpy as np
from sklearn.utils import check_random_state

from scalegp import gp
from scalegp._validation import check_int, check_memory, validate_data
from scalegp.estimators._gpr_checks import bbmm_solver, compute_dtype
from scalegp.estimators._gpr_predict import (
    check_covariance_memory,
    fitted_state,
    n_outputs,
    predict_engine,
    prior,
    test_noise,
    variance_posterior,
)
from scalegp.estimators._gpr_units import centred, input_centre


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
            solver = bbmm_solver(model, model._probe_seed)
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
