"""`ScalableGPRegressor.predict_fn`: the fitted model's predictions as a pure JAX function of
the query points, for ``jax.grad``, ``jax.jit`` and ``jax.vmap`` (Bayesian optimisation,
sensitivity analysis).

It is `ScalableGPRegressor.predict` without the host steps: the same fitted state
(`_gpr_predict.fitted_state`, the variance cache of `_gpr_predict.variance_posterior`), the
same block of kernel arithmetic (`scalegp.gp.predict_moments`), the same noise at new
points (`_gpr_predict.test_noise`), with the input centring and the target scaling that
`predict` does in float64 on the host done in the compute dtype inside the function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.utils.validation import check_is_fitted

from scalegp import gp
from scalegp.estimators._gpr_predict import (
    fitted_state,
    predict_engine,
    test_noise,
    variance_posterior,
)


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
