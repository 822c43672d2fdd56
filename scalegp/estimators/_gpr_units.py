"""The units `ScalableGPRegressor` is fitted in: inputs centred in float64 before the cast to
the compute dtype (`ScalableGPClassifier`'s also over their `input_scale`), targets
normalised (``normalize_y``) or, for the default model, over a power of two near their std
(docs/decisions.md #2), and the default model's start moved to the targets' scale."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from sklearn.gaussian_process import kernels as sk_kernels

from scalegp import gp
from scalegp._validation import as_compute_dtype
from scalegp.estimators._gpr_checks import (
    check_distances_fit,
    check_positive,
    default_model_start,
    fixed_mean,
)
from scalegp.ops import spatial_order

#: How far (a factor either way) the default model's prior variance may start from y's.
START_RANGE = 100.0


def input_centre(X):
    """The centre of inputs X (n, d), float64 (d,): their per-feature median, which one far
    outlier does not move (a mean would take every other point that far from the centre, and
    their float32 coordinates would lose their digits). Not yet `scalegp.ops.host_centre_of`
    (the engine's lower median): with it, the float32 fit from a plateau in
    tests/estimators/test_gpr.py stops at an LML of 111.5, not 134.4."""
    return np.median(np.asarray(X, np.float64), axis=0)


def input_scale(X, centre):
    """A power of two near the spread of inputs X (n, d) about their ``centre``: their root
    mean variance (`power_of_two_scale`; 1 for constant inputs), float64, taken after an exact
    division by a power of two near their largest offset, so that no square overflows or
    underflows in float64 (inputs of 1e-200 or 1e200)."""
    x = np.asarray(X, np.float64) - centre
    peak = float(np.max(np.abs(x), initial=0.0))
    if not 0.0 < peak < np.inf:
        return 1.0
    unit = 2.0 ** np.floor(np.log2(peak))
    return float(unit * power_of_two_scale(x / unit))


def host_centred(X, centre, dtype, name="X", scale=1.0):
    """``(X - centre) / scale`` (the training inputs' `input_centre`, and `input_scale` where
    the model is fitted in units of it), formed in float64 before the cast to the compute
    dtype: offset inputs keep their digits, and each row depends on itself alone. A numpy
    array (`centred`: on the device)."""
    return as_compute_dtype((np.asarray(X, np.float64) - centre) / scale, dtype, name)


def centred(X, centre, dtype, name="X", scale=1.0):
    """`host_centred` on the device."""
    return jnp.asarray(host_centred(X, centre, dtype, name, scale))


def training_order(X, alpha, engine, kernel, lengthscale):
    """The permutation `fit` applies to the training rows X (n, d) (None: keep them): their
    `scalegp.ops.spatial_order` where the ``engine`` may prune them, so that every kernel
    product with them as keys (training and prediction) need not sort them again; scaled by
    the default model's ``lengthscale`` (``kernel`` None). A per-point ``alpha`` keeps the rows
    as given (it is tied to their order)."""
    n, d = X.shape
    if np.ndim(alpha) or not engine.orders_keys(n, d):
        return None
    scale = 1.0 if kernel is not None else np.broadcast_to(
        check_positive("lengthscale", lengthscale, (d,)), (d,))
    return spatial_order(X, scale)


def target_units(y2, normalize_y, default_model):
    """``(mean (o,), std (o,))``, float64, of the units the (n, o) targets ``y2`` are fitted
    in, ``(y2 - mean) / std``: with ``normalize_y`` their mean and std; for the default model
    otherwise no shift and a power of two near their std (one for all targets, which share
    the outputscale and the noise), so that the float32 objective and the softplus parameters
    see the same numbers at any scale (docs/decisions.md #2; dividing by a power of two is
    exact: c·y for c a power of two gives the same fit, bit for bit); for a kernel, y's own."""
    o = y2.shape[1]
    if normalize_y:
        mean = y2.mean(axis=0)
        std = y2.std(axis=0)
        # a constant column (up to the rounding of its mean) keeps its scale, as
        # scikit-learn's; "constant" relative to its values, not below an absolute 10 eps
        # as scikit-learn's: that took targets of 1e-30 for constant and fitted them unscaled
        eps = np.finfo(np.float64).eps
        tiny = std <= 10 * eps * np.max(np.abs(y2), axis=0)
        return mean, np.where(tiny, 1.0, std)
    mean, std = np.zeros(o), np.ones(o)
    if default_model:  # not centred: the model stays the same with a fixed mean
        std[:] = power_of_two_scale(y2)
    return mean, std


def mean_setting(mean, yn, unit):
    """``(fixed mean or None, initial mean)`` in the fitted units, both (o,), of the setting
    ``mean`` for the targets ``yn`` (n, o) in those units; ``unit``: their variance in y's."""
    o = yn.shape[1]
    if mean is None:
        return None, yn.mean(axis=0)
    # normalised units with normalize_y, y's otherwise
    fixed = fixed_mean(mean, o) / np.sqrt(unit)
    return fixed, fixed


def initial_theta(model, kernel, x, yn, mean0, dtype):
    """The optimiser's start ``[mean0 (o,), parameters]`` in the fitted units, after the check
    that the centred inputs ``x`` have finite squared distances: the default model's settings
    converted (moved to the targets' scale, `start_at_scale`, when optimised), or the theta of
    the scikit-learn ``kernel``. ``model`` is the estimator, ``yn`` its targets (n, o)."""
    if model._spec is not None:
        check_distances_fit(x, 1.0)  # the expression path measures distances unscaled
        return np.concatenate([mean0, kernel.theta])
    lengthscale, outputscale, noise = default_model_start(model, x.shape[1])
    check_distances_fit(x, lengthscale)
    unit = model._unit()
    outputscale, noise, floor = (outputscale / unit, noise / unit,
                                 model.noise_lower_bound / unit)
    if model.optimizer is not None:
        outputscale, noise = start_at_scale(outputscale, noise, floor,
                                            float(np.mean(np.var(yn, axis=0))))
    return gp.GPParams.from_constrained(
        mean0, outputscale, lengthscale, noise, noise_lower_bound=floor, dtype=dtype).flatten()


def power_of_two_scale(y2):
    """A power of two near the standard deviation of the (n, o) targets ``y2`` (their root
    mean variance; 1 when they are constant)."""
    std = np.sqrt(np.mean(np.var(y2, axis=0)))
    return 2.0 ** np.round(np.log2(std)) if std > 0 else 1.0


def start_at_scale(outputscale, noise, floor, variance):
    """The default model's start ``(outputscale, noise)``, moved to the scale of targets of
    ``variance`` (both scaled alike, the noise above ``floor``) when its prior variance is
    more than `START_RANGE` times off: from there the optimiser stopped far from the optimum
    (docs/decisions.md #2)."""
    prior = outputscale + noise
    if variance <= 0 or variance / START_RANGE <= prior <= variance * START_RANGE:
        return outputscale, noise
    factor = variance / prior
    return outputscale * factor, floor + (noise - floor) * factor


def default_kernel(hp, unit):
    """The default model's parameters ``hp`` as a scikit-learn kernel, its variances in units
    of ``unit`` (`ScalableGPRegressor._unit`)."""
    outputscale, lengthscale = hp.kernel.terms
    return (sk_kernels.ConstantKernel(float(outputscale.value) * unit)
            * sk_kernels.RBF(np.asarray(lengthscale.lengthscale, np.float64))
            + sk_kernels.WhiteKernel(float(hp.noise) * unit))
