"""The input and settings checks of `ScalableGPRegressor`, and the settings they convert: the
compute dtype, the engine, the default model's start, a fixed mean. Each raises ValueError (or
warns) with the advice the user needs; none reads more of X or y than its checks need."""

from __future__ import annotations

import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from scalegp import gp
from scalegp._validation import check_int, check_option
from scalegp.estimators._gpr_kernels import KernelSpec, check_alpha, check_size
from scalegp.estimators._precision import float_dtype
from scalegp.ops import SCHEMES, Engine

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
    """The engine of the BBMM solver and of predictions. Its keys are the training inputs
    (or a sorted subset of them), which `fit` puts in spatial order wherever the engine may
    prune them (`scalegp.estimators._gpr_units.training_order`)."""
    return Engine.create(estimator.impl, estimator.mesh, estimator.mesh_scheme,
                         prune=estimator.prune, prune_tol=estimator.prune_tol,
                         keys_in_order=np.ndim(estimator.alpha) == 0)


def bbmm_solver(estimator, seed):
    """The BBMM solver of the estimator's settings, its probes seeded by ``seed``."""
    return gp.BBMMSolver(
        num_probes=estimator.num_probes, preconditioner_rank=estimator.preconditioner_rank,
        cg_tol=float(estimator.cg_tol), max_cg_iter=estimator.max_cg_iter,
        love_rank=estimator.love_rank, seed=int(seed), engine=gp_engine(estimator),
    )


def check_settings(estimator):
    """Checks every setting of ``estimator`` but the model's starting values."""
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
    gp_engine(estimator)
    for name, minimum in (("n_restarts_optimizer", 0), ("max_iter", 0), ("max_iter_full", 0),
                          ("exact_max_n", 1), ("subset_size", 2), ("num_probes", 1),
                          ("preconditioner_rank", 1), ("max_cg_iter", 1), ("love_rank", 1)):
        check_int(name, getattr(estimator, name), minimum)
    tol = estimator.full_data_tol
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (
            np.isfinite(tol) and tol >= 0):
        raise ValueError(f"full_data_tol must be a finite number >= 0 (nats per training "
                         f"point; 0 always takes the steps on all data), got {tol!r}")


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
