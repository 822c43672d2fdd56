"""Drawing from a KDE, as scikit-learn's KernelDensity draws."""

from __future__ import annotations

import numpy as np

from scalegp._validation import check_int, check_memory, check_points, check_weights
from scalegp.kde._density import check_bandwidth_value


def rng_from(random_state):
    """A numpy Generator or RandomState (both have choice and standard_normal)."""
    if isinstance(random_state, (np.random.Generator, np.random.RandomState)):
        return random_state
    return np.random.default_rng(random_state)


def check_sample_memory(n_samples: int, n_features: int, extra: int = 0) -> None:
    """A MemoryError, before anything is allocated, where `sample` of ``n_samples`` draws of
    ``n_features`` needs more memory than this process can hold: three float64 arrays of the
    draws' size (the rows picked, the noise, a caller's unscaling) and two of ``n_samples``
    values at once; ``extra`` adds the caller's bytes (the command line's file)."""
    check_memory(8 * n_samples * (3 * n_features + 2) + extra,
                 f"{n_samples:,} draws of {n_features} features",
                 "draw fewer at a time (draws with other seeds are independent)")


def sample(data, bandwidth, n_samples: int = 1, weights=None, random_state=None) -> np.ndarray:
    """Draws from the KDE: pick row j with probability ``w_j / W``, add ``h * N(0, I)``.

    Drawn as scikit-learn's KernelDensity does (one uniform u per draw; the row is
    ``floor(u n)`` without weights, else the first whose cumulative weight reaches ``u W``; then
    the normals), so that for a given seed constant weights draw exactly as no weights, and
    integer weights exactly as the rows repeated.

    Args:
      data: (n, d) points; bandwidth: float or (d,); weights: optional (n,) >= 0.
      n_samples: number of draws (>= 0).
      random_state: None, an int seed, or a numpy Generator/RandomState (reproducible with a seed).
    Returns:
      (n_samples, d) float64 array.
    """
    X = check_points(data, "data").astype(np.float64)
    n, d = X.shape
    w = check_weights(weights, n, "weights")
    h = check_bandwidth_value(bandwidth, d)
    n_samples = check_int("n_samples", n_samples, 0)
    check_sample_memory(n_samples, d)
    rng = rng_from(random_state)
    u = rng.uniform(0.0, 1.0, size=n_samples)
    if w is None:
        rows = (u * n).astype(np.int64)
    else:
        cumulative = np.cumsum(w)
        # a zero-weight tail makes several rows end at the total: the first of them is drawn
        rows = np.minimum(np.searchsorted(cumulative, u * cumulative[-1]), n - 1)
    return rng.normal(X[rows], np.asarray(h, dtype=np.float64))
