"""Input and parameter checks shared by the library functions and the scikit-learn estimators.

Every error says what was expected, what was received and how to fix it. The array checks use
numpy only, so that `scalegp.kde` works without going through scikit-learn's helpers; the
estimators call scikit-learn's own `validate_data` first (feature names, ``n_features_in_``,
messages scikit-learn users know) and these checks after it.
"""

from __future__ import annotations

import numbers
import os
import warnings

import numpy as np

try:
    import resource  # POSIX only
except ImportError:
    resource = None


def check_points(X, name: str = "X", *, min_samples: int = 1) -> np.ndarray:
    """X as a 2-D, finite, real floating-point numpy array of shape (n_samples, n_features).

    Integer and boolean input is converted to float64; float32 stays float32.
    """
    X = np.asarray(X)
    if X.dtype == object or not (
        np.issubdtype(X.dtype, np.number) or np.issubdtype(X.dtype, np.bool_)
    ):
        raise ValueError(f"{name} must hold real numbers, got dtype {X.dtype}")
    if np.iscomplexobj(X):
        raise ValueError(f"{name} must hold real numbers, got complex dtype {X.dtype}")
    if X.ndim != 2:
        hint = f"; for n points in one dimension pass {name}.reshape(-1, 1)" if X.ndim == 1 else ""
        raise ValueError(
            f"{name} must be a 2-D array of shape (n_samples, n_features), got shape "
            f"{X.shape}{hint}"
        )
    if X.shape[0] < min_samples:
        raise ValueError(
            f"{name} must have at least {min_samples} sample(s), got shape {X.shape}"
        )
    if X.shape[1] < 1:
        raise ValueError(f"{name} must have at least one feature, got shape {X.shape}")
    if not np.issubdtype(X.dtype, np.floating):
        X = X.astype(np.float64)
    bad = ~np.isfinite(X)
    if bad.any():
        rows = np.unique(np.nonzero(bad)[0])
        what = "NaN" if np.isnan(X).any() else "infinity"
        raise ValueError(
            f"{name} contains {what} in {rows.size} row(s) (first: row {rows[0]}); remove or "
            "impute non-finite values first: nothing is dropped silently"
        )
    return X


def as_compute_dtype(X, dtype, name: str = "X") -> np.ndarray:
    """Finite X (n, ...) converted to the compute dtype, where every value must stay finite.

    float64 values beyond float32's range (about 3.4e38) become infinity when JAX computes in
    float32: a ValueError naming the first such row, not NaN or a silent wrong answer.
    """
    with np.errstate(over="ignore"):  # reported below, by row
        out = np.asarray(X).astype(dtype, copy=False)
    bad = ~np.isfinite(out)
    if bad.any():
        rows = np.unique(np.nonzero(bad)[0])
        raise ValueError(
            f"{name} has values beyond the range of {np.dtype(dtype).name} (largest finite "
            f"{float(np.finfo(dtype).max):.3g}) in {rows.size} row(s) (first: row {rows[0]}): "
            "rescale the features (e.g. sklearn.preprocessing.StandardScaler in a Pipeline), or "
            'compute in float64 (jax.config.update("jax_enable_x64", True))'
        )
    return out


def check_weights(weights, n_samples: int, name: str = "sample_weight") -> np.ndarray | None:
    """Sample weights as a float64 (n_samples,) array: finite, non-negative, not all zero, and
    scaled by a power of two so that the largest lies in [0.5, 1).

    Weights are relative (only their ratios matter). The scaling keeps sums, squares and the
    float32 cast from overflowing or underflowing at any scale (1e308 each, or 5e-324 each), and
    is exact: ratios are kept, and integer weights stay the counts of repeated rows. A weight
    below about 1e-323 times the largest becomes 0, with a RuntimeWarning. None stays None
    (equal weights).
    """
    if weights is None:
        return None
    w = np.asarray(weights)
    if w.dtype == object or not (np.issubdtype(w.dtype, np.number) or w.dtype == np.bool_):
        raise ValueError(f"{name} must hold real numbers, got dtype {w.dtype}")
    if np.iscomplexobj(w):
        raise ValueError(f"{name} must hold real numbers, got complex dtype {w.dtype}")
    w = w.astype(np.promote_types(w.dtype, np.float64))  # a long double stays one
    if w.ndim == 0:
        # scikit-learn accepts a scalar weight: the same weight for every sample
        w = np.full(n_samples, w)
    if w.shape != (n_samples,):
        raise ValueError(
            f"{name} must have shape ({n_samples},), one weight per sample, got shape {w.shape}"
        )
    if not np.all(np.isfinite(w)):
        raise ValueError(
            f"{name} must be finite, got {np.sum(~np.isfinite(w))} non-finite value(s)"
        )
    if np.any(w < 0):
        raise ValueError(
            f"{name} must be non-negative, got {np.sum(w < 0)} negative value(s) "
            f"(smallest {w.min():g}); a weight of 0 removes a sample"
        )
    if not np.any(w > 0):
        raise ValueError(f"{name} must not be all zero: at least one sample needs positive weight")
    # scaled before the float64 cast, so that long doubles beyond its range keep their ratios
    scaled = np.ldexp(w, -np.frexp(w.max())[1]).astype(np.float64)
    lost = int(np.sum((w > 0) & (scaled == 0)))
    if lost:
        warnings.warn(
            f"{name}: {lost} positive weight(s) are below about 1e-323 times the largest weight "
            f"({w.max():g}), beyond float64's range of ratios, and count as zero",
            RuntimeWarning,
            stacklevel=3,
        )
    return scaled


def check_option(name: str, value, options) -> None:
    """value must be one of options (compared with ==; None allowed when listed)."""
    if value is None:
        ok = None in options
    else:
        ok = isinstance(value, str) and value in [o for o in options if o is not None]
    if not ok:
        shown = ", ".join(repr(o) for o in options)
        raise ValueError(f"{name} must be one of {shown}, got {value!r}")


def check_int(name: str, value, minimum: int, *, allow_none: bool = False) -> int | None:
    """An integer >= minimum (None too when allow_none)."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        expected = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_bandwidth(bandwidth, choices, n_features: int | None = None):
    """A bandwidth parameter: a positive finite number, one of the string ``choices``, or
    (when ``n_features`` is given) an array of ``n_features`` positive finite numbers.

    Returns the string, a Python float, or a float64 (n_features,) array.
    """
    options = ["a positive float"] + [repr(c) for c in choices]
    if n_features is not None:
        options.append("an array of n_features positive floats")
    expected = ", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0]
    if isinstance(bandwidth, str):
        if bandwidth not in choices:
            raise ValueError(f"bandwidth must be {expected}; got the string {bandwidth!r}")
        return bandwidth
    if isinstance(bandwidth, (bool, np.bool_)) or bandwidth is None:
        raise ValueError(f"bandwidth must be {expected}; got {bandwidth!r}")
    if isinstance(bandwidth, numbers.Real):
        value = float(bandwidth)
        if not (np.isfinite(value) and value > 0):
            raise ValueError(
                f"bandwidth must be {expected}; got {bandwidth!r}. The bandwidth is the standard "
                "deviation of the Gaussian kernel, so it must be > 0 and finite"
            )
        return value
    try:
        array = np.asarray(bandwidth, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"bandwidth must be {expected}; got {bandwidth!r}") from None
    if array.ndim == 0:
        return check_bandwidth(float(array), choices, n_features)
    if n_features is None or array.shape != (n_features,):
        raise ValueError(
            f"bandwidth must be {expected}; got an array of shape {array.shape}"
            + (f" for data with {n_features} features" if n_features is not None else "")
        )
    if not np.all(np.isfinite(array) & (array > 0)):
        raise ValueError(f"bandwidth must be positive and finite in every feature, got {array}")
    return array


def validate_data(estimator, X, **kwargs):
    """scikit-learn's `validate_data` (public since 1.6), or the estimator method before it."""
    try:
        from sklearn.utils.validation import validate_data as _validate_data
    except ImportError:  # scikit-learn < 1.6
        return estimator._validate_data(X, **kwargs)
    return _validate_data(estimator, X, **kwargs)


def memory_limit() -> int | None:
    """Bytes this process can still hold at most: the physical memory, or what its
    address-space limit (``RLIMIT_AS``) leaves beside the address space it holds, when lower;
    None when neither is known."""
    limits = []
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        limits.append(os.sysconf("SC_PHYS_PAGES") * page)
    except (AttributeError, ValueError, OSError):  # not POSIX, or not reported
        page = 0
    if resource is not None:
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            try:
                with open("/proc/self/statm") as f:  # Linux: the address space held, in pages
                    held = int(f.read().split()[0]) * page
            except (OSError, ValueError, IndexError):
                held = 0
            limits.append(max(soft - held, 0))
    return min(limits) if limits else None


class MemoryLimitError(MemoryError):
    """A request refused before any work by `check_memory`: too large for this process, however
    much memory is free (the command line reports it as bad input, exit code 2)."""


def check_memory(needed: int, what: str, fix: str,
                 device: tuple[str, int] | None = None) -> None:
    """A `MemoryLimitError` (a MemoryError), before anything is allocated, where ``what``
    needs more than `memory_limit` (``needed`` bytes): an allocation that large aborts the
    process or fails part-way. ``device``: ``(platform, bytes)`` of the accelerator whose
    memory the request is for instead (XLA would fail with RESOURCE_EXHAUSTED part-way through
    the work), which adds the host CPU to the fixes. The message reads "{what} need about N
    bytes, more than the L bytes ...: {fix}"."""
    if device is not None:
        platform, limit = device
        held = f"of the {platform.upper()} device's memory"
        fix += "; or run it on the host CPU (JAX_PLATFORMS=cpu)"
    else:
        limit = memory_limit()
        held = "this process can hold (physical memory, or its address-space limit)"
    if limit is not None and needed > limit:
        raise MemoryLimitError(
            f"{what} need about {needed:,} bytes, more than the {limit:,} bytes {held}: {fix}")
