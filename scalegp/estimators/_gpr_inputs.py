"""What `ScalableGPRegressor` makes of its inputs, its settings and its data, before the GP
layer sees them: the settings checked and converted (the compute dtype, the one
`scalegp.ops.Engine` of a fit and the BBMM solver on it, the default model's start, a fixed
mean), the data checked, and the units the model is fitted in: inputs centred in float64 before
the cast to the compute dtype (`ScalableGPClassifier`'s also over their `input_scale`), targets
normalised (``normalize_y``) or, for the default model, over a power of two near their std
(docs/decisions.md #2), and the default model's start moved to the targets' scale. Each check
raises ValueError (or warns) with the advice the user needs; none reads more of X or y than its
checks need. The classifier and `scalegp.persistence` (a model file's checks) use them too."""

from __future__ import annotations

import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.gaussian_process import kernels as sk_kernels

from scalegp import gp
from scalegp._validation import as_compute_dtype, check_int, check_option
from scalegp.estimators._gpr_kernels import KernelSpec, check_alpha, check_size
from scalegp.estimators._precision import float_dtype
from scalegp.ops import SCHEMES, Engine, spatial_order

#: The ``solver`` settings of `ScalableGPRegressor`.
SOLVERS = ("auto", "exact", "bbmm")
#: Its ``optimizer`` settings ("fmin_l_bfgs_b" is scikit-learn's name for L-BFGS-B).
OPTIMIZERS = ("L-BFGS-B", "fmin_l_bfgs_b", "adam", None)
#: Its default ``alpha``, scikit-learn's, which the default model (learnt noise) ignores.
DEFAULT_ALPHA = 1e-10


def compute_dtype(estimator):
    """The estimator's compute dtype: ``dtype`` checked, None meaning JAX's default float.
    float64 is computed with JAX's x64 mode on: the estimator's public methods turn it on for
    their duration (`scalegp.estimators._precision.in_precision`)."""
    if estimator.dtype is None:
        return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    dtype = float_dtype(estimator.dtype)
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        # JAX would make float32 arrays of float64 requests: never compute so silently
        raise RuntimeError(
            'dtype="float64" computes inside the estimator\'s public methods (which turn '
            "JAX's x64 mode on for their duration); this was called outside them with x64 "
            "off: call it within scalegp.estimators._precision.precision_scope(dtype)"
        )
    return jnp.dtype(dtype)


def gp_engine(estimator):
    """The `scalegp.ops.Engine` of the estimator's settings (``impl``, ``mesh``,
    ``mesh_scheme``, ``prune``, ``prune_tol``), checked: the one a fit builds
    (`check_settings`) and hands to everything it runs, and the one of predictions. Its keys
    are the training inputs (or a sorted subset of them), which `fit` puts in spatial order
    wherever the engine may prune them (`training_order`)."""
    return Engine.create(estimator.impl, estimator.mesh, estimator.mesh_scheme,
                         prune=estimator.prune, prune_tol=estimator.prune_tol,
                         keys_in_order=np.ndim(estimator.alpha) == 0)


def bbmm_solver(estimator, seed, engine: Engine):
    """The BBMM solver of the estimator's settings on ``engine`` (`gp_engine`'s), its probes
    seeded by ``seed``."""
    return gp.BBMMSolver(
        num_probes=estimator.num_probes, preconditioner_rank=estimator.preconditioner_rank,
        cg_tol=float(estimator.cg_tol), max_cg_iter=estimator.max_cg_iter,
        love_rank=estimator.love_rank, seed=int(seed), engine=engine,
    )


def check_settings(estimator) -> Engine:
    """Checks every setting of ``estimator`` but the model's starting values; returns the
    engine its settings make (`gp_engine`), built once here for the whole fit."""
    check_option("optimizer", estimator.optimizer, OPTIMIZERS)
    if estimator.optimizer == "adam":
        check_positive("learning_rate", estimator.learning_rate)
    check_option("solver", estimator.solver, SOLVERS)
    if estimator.n_targets is not None:
        check_int("n_targets", estimator.n_targets, 1)
    if not isinstance(estimator.copy_X_train, (bool, np.bool_)):
        raise ValueError(
            f"copy_X_train must be True or False, got {estimator.copy_X_train!r}")
    if estimator.dtype is not None:
        float_dtype(estimator.dtype)
    check_option("mesh_scheme", estimator.mesh_scheme, SCHEMES)
    engine = gp_engine(estimator)
    for name, minimum in (("n_restarts_optimizer", 0), ("max_iter", 0), ("max_iter_full", 0),
                          ("exact_max_n", 1), ("subset_size", 2), ("num_probes", 1),
                          ("preconditioner_rank", 1), ("max_cg_iter", 1), ("love_rank", 1)):
        check_int(name, getattr(estimator, name), minimum)
    tol = estimator.full_data_tol
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (
            np.isfinite(tol) and tol >= 0):
        raise ValueError(f"full_data_tol must be a finite number >= 0 (nats per training "
                         f"point; 0 always takes the steps on all data), got {tol!r}")
    return engine


def check_n_targets(n_targets, y):
    """y's targets must be ``n_targets`` when that is set (scikit-learn's message)."""
    seen = 1 if y.ndim == 1 else y.shape[1]
    if n_targets is not None and seen != n_targets:
        raise ValueError(
            "The number of targets seen in `y` is different from the parameter "
            f"`n_targets`. Got {seen} != {n_targets}."
        )


def check_kernel(estimator, kernel):
    """The model's scikit-learn ``kernel`` (None: the default model), before X is read."""
    if kernel is None:
        return
    # before anything reads kernel.bounds: scikit-learn's Sum and Product read each
    # operand's bounds twice, 2**depth work for a deep kernel
    check_size(kernel)
    _check_restart_bounds(estimator, kernel)
    KernelSpec.from_sklearn(kernel)  # a kernel refused by design


def _check_restart_bounds(estimator, kernel):
    """Restarts are drawn within a kernel's bounds, so they must be finite (checked before
    anything else about the kernel, as scikit-learn does)."""
    if estimator.optimizer is None or not estimator.n_restarts_optimizer or kernel.n_dims == 0:
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        bounds = np.asarray(kernel.bounds, np.float64)
    if not np.all(np.isfinite(bounds)):
        raise ValueError(
            "n_restarts_optimizer > 0 requires that all bounds are finite: restarts start "
            "from points drawn uniformly within the kernel's bounds, so every free "
            "hyperparameter needs finite bounds; set them (e.g. "
            "RBF(length_scale_bounds=(1e-2, 1e3))) or use n_restarts_optimizer=0"
        )


def checked_alpha(alpha, n, default_model):
    """``alpha`` for ``n`` training points (`check_alpha`): what the kernel model adds to
    their diagonal; None for the default model, which has no use for it (and warns if it was
    set)."""
    alpha = check_alpha(alpha, n)
    if not default_model:
        return alpha
    if np.ndim(alpha) or alpha != DEFAULT_ALPHA:
        warnings.warn(
            "alpha is not used by the default model (kernel=None), whose noise is learnt "
            "(noise, noise_lower_bound); pass a kernel, e.g. ConstantKernel() * RBF() + "
            "WhiteKernel(), for alpha to be added to the diagonal",
            UserWarning, stacklevel=4)  # fit <- in_precision <- the caller
    return None


def default_model_start(estimator, d):
    """The default model's checked start: ``(lengthscale (d,), outputscale, noise)``."""
    lengthscale = np.broadcast_to(check_positive("lengthscale", estimator.lengthscale, (d,)),
                                  (d,))
    outputscale = float(check_positive("outputscale", estimator.outputscale))
    noise = float(check_positive("noise", estimator.noise))
    floor = estimator.noise_lower_bound
    if not (isinstance(floor, numbers.Real) and 0 <= floor < noise):
        raise ValueError(
            f"noise_lower_bound must be a number in [0, noise={noise}), got {floor!r}"
        )
    return lengthscale.copy(), outputscale, noise


def fixed_mean(mean, o):
    """A fixed ``mean`` as ``(o,)`` floats."""
    m = np.broadcast_to(np.asarray(mean, np.float64), (o,)) if np.ndim(mean) < 2 else None
    if m is None or not np.all(np.isfinite(m)):
        raise ValueError(f"mean must be None, a finite float or {o} floats, got {mean!r}")
    return m


def check_positive(name, value, shape=None):
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


def check_not_constant(y2):
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


def check_distances_fit(x, lengthscale):
    """Squared scaled distances of the centred training inputs ``x`` must be finite in their
    dtype: otherwise every kernel value is 0 and the fit fails for a reason no message names."""
    x = np.asarray(x)
    worst = float(np.max(np.sum((x.astype(np.float64) / lengthscale) ** 2, axis=1)))
    limit = float(np.finfo(x.dtype).max) / 4  # |a|^2 + |b|^2 - 2ab must not overflow
    if worst > limit:
        raise ValueError(
            f"X spans up to {np.sqrt(worst):.3g} lengthscales from its centre, and squared "
            f"distances that large overflow {x.dtype.name} (largest finite "
            f"{float(np.finfo(x.dtype).max):.3g}): rescale the features (e.g. "
            "sklearn.preprocessing.StandardScaler in a Pipeline, or set lengthscale to the "
            'features\' scale), or compute in float64 (dtype="float64")'
        )


def check_target(y2, noise_lower_bound, normalize_y, default_model, dtype):
    """y after numeric conversion (an object array holding None becomes NaN): finite and,
    unless ``normalize_y`` (which scales it in float64), on a scale that the compute ``dtype``
    holds (`_check_target_scale`) and, for the default model, that the absolute
    ``noise_lower_bound`` suits."""
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
    variances = np.var(y2, axis=0)
    _check_target_scale(variances, float(np.max(y2**2)), np.dtype(dtype))
    variance = float(np.min(variances))
    if default_model and 0 < variance < 100 * noise_lower_bound:
        warnings.warn(
            f"y has variance {variance:.3g}, below 100 x noise_lower_bound={noise_lower_bound:g}"
            " (an absolute bound on the noise variance): the noise cannot go below the signal, "
            "and predictions shrink to the mean. Use normalize_y=True, or lower "
            "noise_lower_bound, noise and outputscale to y's scale",
            UserWarning,
            stacklevel=5,  # the caller of fit (through in_precision)
        )


def _check_target_scale(variances, largest_square, dtype):
    """Without normalize_y the GP's variances (kernel, noise) are on the scale of y's, in the
    compute ``dtype``: a noise ``eps`` times the variance of y must be a normal number (below,
    the Cholesky's pivots and the noise lose their digits to subnormals and underflow: targets
    of 1e-30 in float32 predicted about 1e-6), and sums of up to ``1/eps`` squares of y must be
    finite (targets of 1e30 overflowed: the fit stayed at its start, a prediction 100x off).
    The default model is fitted in y over a power of two near its std, but its settings are in
    y's units (``noise_lower_bound`` 1e-6 over y's variance): within these limits they convert
    to normal numbers."""
    info = np.finfo(dtype)
    low, high = float(info.tiny / info.eps), float(info.max * info.eps)
    small = (variances > 0) & (variances < low)
    if not small.any() and largest_square <= high:
        return
    if small.any():
        j = int(np.flatnonzero(small)[0])
        where = "y" if variances.size == 1 else f"y[:, {j}]"
        found = f"{where} has standard deviation {np.sqrt(variances[j]):.3g}"
    else:
        found = f"y has values up to {np.sqrt(largest_square):.3g} in magnitude"
    raise ValueError(
        f"{found}, outside what {dtype.name} holds for a GP fitted in y's units (standard "
        f"deviations from {np.sqrt(low):.3g} to {np.sqrt(high):.3g}, values up to "
        f"{np.sqrt(high):.3g} in magnitude): its variances would underflow or overflow. Use "
        "normalize_y=True (y is scaled in float64), or rescale y"
        + (', or compute in float64 (dtype="float64")'
           if dtype == np.float32 else "")
    )


# ------------------------------------------------------------------------------------------
# The units of the fit

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
    """`host_centred` on the device (put there: JAX 0.10's ``jnp.asarray`` of a numpy array
    compiles a program for each shape)."""
    return jax.device_put(host_centred(X, centre, dtype, name, scale))


def training_order(X, alpha, engine, kernel, lengthscale, dtype):
    """The permutation `fit` applies to the training rows X (n, d) (None: keep them): their
    `scalegp.ops.spatial_order` where the ``engine`` may prune them in the compute ``dtype``,
    so that every kernel product with them as keys (training and prediction) need not sort
    them again; scaled by the default model's ``lengthscale`` (``kernel`` None). A per-point
    ``alpha`` keeps the rows as given (it is tied to their order)."""
    n, d = X.shape
    if np.ndim(alpha) or not engine.orders_keys(n, d, dtype):
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
