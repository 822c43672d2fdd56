"""The data's spread: effective sample size, weighted covariance, Scott's and Silverman's
rules, and the feature scalings (`Scaling`)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np


SCALES = (None, "standardize", "covariance")
BANDWIDTH_RULES = ("scott", "silverman")
# Rows farther than this many robust spreads (`robust_std`'s interquartile range over 1.349)
# from a feature's median are left out of the "standardize" and "covariance" scalings' moments:
# one such row sets the standard deviation alone, and in float32 rounds every other row's
# scaled value to one number (a row at 1e30 among normal points makes it 1.6e28). Ordinary
# data come nowhere near: normal data reach ~6 spreads at a billion points, lognormal ~100 at
# a million.
FAR_SPREADS = 1e6


def effective_sample_size(weights, n_samples: int | None = None) -> float:
    """Kish's effective sample size ``(sum w)^2 / sum w^2``; ``n_samples`` when weights is None."""
    if weights is None:
        if n_samples is None:
            raise ValueError("give weights or n_samples")
        return float(n_samples)
    w = np.asarray(weights, dtype=np.float64)
    return float(np.sum(w) ** 2 / np.sum(w**2))


def scott_factor(n_eff: float, d: int) -> float:
    """Scott's rule ``n_eff^(-1/(d+4))``: the bandwidth in units of the data's standard deviation
    (scipy.stats.gaussian_kde's ``scotts_factor``)."""
    return float(n_eff ** (-1.0 / (d + 4)))


def silverman_factor(n_eff: float, d: int) -> float:
    """Silverman's rule ``(n_eff (d + 2) / 4)^(-1/(d+4))`` (scipy's ``silverman_factor``)."""
    return float((n_eff * (d + 2) / 4.0) ** (-1.0 / (d + 4)))


def _check_spread_samples(n_positive: int, weighted: bool, what: str) -> None:
    """A ValueError when fewer than 2 samples carry positive weight (``what`` names the setting
    that needed the spread)."""
    if n_positive < 2:
        raise ValueError(
            f"{what} needs the spread of the data, which takes at least 2 samples with positive "
            f"weight; got n_samples={n_positive}"
            + ("" if not weighted else " (weights are relative: one below about 1e-323 times "
               "the largest is 0)")
            + ". Use a float bandwidth and scale=None for a single sample"
        )


def _n_positive(X, weights) -> int:
    return X.shape[0] if weights is None else int(np.sum(np.asarray(weights) > 0))


def weighted_covariance(X, weights=None, *, what: str = "this") -> np.ndarray:
    """(d, d) covariance of the rows of X, as ``np.cov(X.T, aweights=weights)`` (unbiased for
    reliability weights: divided by ``W - sum w^2 / W``), in float64.

    Raises ValueError when fewer than 2 samples carry positive weight (``what`` names the setting
    that needed the spread).
    """
    X = np.asarray(X, dtype=np.float64)
    _check_spread_samples(_n_positive(X, weights), weights is not None, what)
    cov = np.cov(X, rowvar=False, aweights=weights)
    return np.atleast_2d(cov)


def weighted_std(X, weights=None, *, what: str = "this") -> np.ndarray:
    """(d,) standard deviations of the features: the square root of `weighted_covariance`'s
    diagonal, computed feature by feature in O(n d) memory (the (d, d) covariance of 10,000
    features is 800 MB)."""
    X = np.asarray(X, dtype=np.float64)
    _check_spread_samples(_n_positive(X, weights), weights is not None, what)
    if weights is None:
        return np.std(X, axis=0, ddof=1)
    w = np.asarray(weights, np.float64)
    total = w.sum()
    mean = (w @ X) / total
    # np.cov's divisor for aweights with ddof=1
    return np.sqrt((w @ (X - mean) ** 2) / (total - np.sum(w**2) / total))


def constant_features(std: np.ndarray, location: np.ndarray) -> np.ndarray:
    """Indices of features whose spread is zero up to rounding of their mean."""
    tiny = 16 * np.finfo(np.float64).eps * np.maximum(np.abs(location), np.finfo(np.float64).tiny)
    return np.flatnonzero(~(std > tiny))


def raise_constant(features, what: str):
    raise ValueError(
        f"feature(s) {features.tolist()} of the data are constant (zero spread), so {what} cannot "
        "be computed from the spread; drop constant features, or use a float bandwidth with "
        "scale=None"
    )


def rule_bandwidth(X, rule: str = "scott", weights=None) -> np.ndarray:
    """Per-feature rule-of-thumb bandwidth ``factor(n_eff, d) * std_k`` as a float64 (d,) array.

    ``rule`` is "scott" (`scott_factor`) or "silverman" (`silverman_factor`); std_k is the
    weighted standard deviation of feature k (`weighted_std`) and n_eff the effective
    sample size. The bandwidth scales with the data (multiplying a feature by c multiplies its
    bandwidth by c), unlike scikit-learn's KernelDensity rules, which ignore the spread. X (n, d)
    and ``weights`` come checked (`check_points`, `check_weights`) from the caller.
    """
    assert rule in BANDWIDTH_RULES
    w = weights
    n, d = X.shape
    std = weighted_std(X, w, what=f"bandwidth={rule!r}")
    constant = constant_features(std, np.average(X, axis=0, weights=w))
    if constant.size:
        raise_constant(constant, f"bandwidth={rule!r}")
    factor = scott_factor if rule == "scott" else silverman_factor
    return factor(effective_sample_size(w, n), d) * std


@dataclasses.dataclass(frozen=True, eq=False)
class Scaling:
    """An affine map of the features, ``z = (x - location) @ A``, and its inverse.

    Attributes:
      kind: None, "standardize" or "covariance" (see `fit_scaling`).
      location: (d,) weighted mean; for kind None (a shift only) the per-feature median.
      scale: (d,) the per-feature standard deviations for "standardize" (``A = diag(1/scale)``),
        ones for None; None for "covariance". A diagonal map is kept as this vector, so that
        scaling wide data takes O(d) memory, not O(d^2).
      whitening: for "covariance", the (d, d) A: the inverse transposed Cholesky factor
        ``L^-T`` of the covariance ``Sigma = L L^T`` (so z has identity covariance); else None.
      colouring: for "covariance", A^-1 = ``L^T``; else None.
      log_abs_det: ``log|det A|``, added to log-densities computed in z.
      far_rows: the rows left out of the mean and spread (more than 1e6 interquartile ranges
        over 1.349 from a feature's median; they stay in the data), with a warning; or None.
    """

    kind: str | None
    location: np.ndarray
    scale: np.ndarray | None
    whitening: np.ndarray | None
    colouring: np.ndarray | None
    log_abs_det: float
    far_rows: np.ndarray | None = None

    @property
    def matrix(self) -> np.ndarray:
        """(d, d) A in ``z = (x - location) A`` (built on request for a diagonal map)."""
        return self.whitening if self.scale is None else np.diag(1.0 / self.scale)

    @property
    def inverse(self) -> np.ndarray:
        """(d, d) A^-1, for ``x = z A^-1 + location`` (built on request for a diagonal map)."""
        return self.colouring if self.scale is None else np.diag(self.scale)

    def transform(self, X) -> np.ndarray:
        """(n, d) -> (n, d) z, in float64."""
        shifted = np.asarray(X, dtype=np.float64) - self.location
        if self.kind is None:
            return shifted
        if self.scale is not None:
            return shifted * (1.0 / self.scale)  # elementwise: each row on its own
        return _rowwise_affine(shifted, self.whitening)

    def inverse_transform(self, Z) -> np.ndarray:
        """(n, d) z -> (n, d) x in float64."""
        Z = np.asarray(Z, dtype=np.float64)
        if self.kind is not None:
            Z = Z * self.scale if self.scale is not None else _rowwise_affine(Z, self.colouring)
        return Z + self.location


def _rowwise_affine(X, matrix) -> np.ndarray:
    """``X @ matrix`` for X (n, d), summed over features in a fixed order with elementwise
    operations. A BLAS product picks its kernels (and rounding) by n, so a row's z would depend
    on which rows it is transformed with; here it depends on the row alone, and equal rows give
    bit-identical z."""
    out = X[:, :1] * matrix[0]
    for k in range(1, X.shape[1]):
        out += X[:, k : k + 1] * matrix[k]
    return out


def weighted_lower_median(X, weights=None) -> np.ndarray:
    """Per feature, the first of X's sorted values (n, d) -> (d,) float64 whose cumulative
    weight reaches half the total: one of the data's own values, so that integer weights give
    exactly what the rows repeated give, and constant weights what none give."""
    return weighted_lower_quantiles(X, weights, (0.5,))[0]


def weighted_lower_quantiles(X, weights=None, levels=(0.5,)) -> np.ndarray:
    """(len(levels), d) float64: per feature and level q, the first of X's sorted values whose
    cumulative weight reaches q times the total (one of the data's own values)."""
    X = np.asarray(X, np.float64)
    order = np.argsort(X, axis=0, kind="stable")
    w = np.ones(X.shape[0]) if weights is None else np.asarray(weights, np.float64)
    cumulative = np.cumsum(w[order], axis=0)
    ordered = np.take_along_axis(X, order, axis=0)
    columns = np.arange(X.shape[1])
    return np.stack([ordered[np.argmax(cumulative >= q * cumulative[-1], axis=0), columns]
                     for q in levels])


# Rows from which `robust_std` takes its quartiles (a fixed stride through the data above it).
_QUARTILE_ROWS = 1 << 17


def robust_std(X, weights, std: np.ndarray) -> np.ndarray:
    """(d,) per feature the smaller of ``std`` (`weighted_std`) and the weighted interquartile
    range over 1.349 (the ratio of a normal distribution's), Silverman's robust spread: a few
    far rows inflate the standard deviation without limit (one row at 1e30 made it 1.6e28 among
    normal points) but move the quartiles by at most a rank. A feature whose quartiles are equal
    (over half its weight on one value) keeps its standard deviation. Above `_QUARTILE_ROWS`
    rows the quartiles come from every k-th row (quartiles do not need every point)."""
    X = np.asarray(X)
    stride = -(-X.shape[0] // _QUARTILE_ROWS)
    w = None if weights is None else np.asarray(weights)[::stride]
    lower, upper = weighted_lower_quantiles(X[::stride], w, (0.25, 0.75))
    iqr = (upper - lower) / 1.349
    return np.where(iqr > 0, np.minimum(std, iqr), std)


def fit_scaling(X, weights=None, scale: str | None = None) -> Scaling:
    """The `Scaling` for ``scale``: None (a shift to the per-feature median), "standardize" (per
    feature: subtract the weighted mean, divide by the weighted standard deviation) or
    "covariance" (full whitening by the weighted covariance, as scipy.stats.gaussian_kde does).

    Raises ValueError for constant features ("standardize") and for a singular covariance
    ("covariance": linearly dependent features or fewer samples than features). X (n, d),
    ``weights`` and ``scale`` come checked (`check_points`, `check_weights`, one of `SCALES`)
    from the caller.
    """
    assert scale in SCALES
    n, d = X.shape
    w = weights
    if scale is None:
        # Units unchanged, but centred in float64 before the compute dtype rounds them: data
        # at 1e6 with unit spread kept a float32 spacing of 0.06 uncentred (log-densities off
        # by 0.06 at bandwidth 0.5). A median, which one far outlier does not move.
        return Scaling(None, weighted_lower_median(X, w), np.ones(d), None, None, 0.0)
    far = _far_from_the_bulk(X, w, scale)
    if far is not None:
        keep = np.ones(n, bool)
        keep[far] = False
        X, w = X[keep], None if w is None else w[keep]
    scaling = _moment_scaling(X, w, scale)
    return scaling if far is None else dataclasses.replace(scaling, far_rows=far)


def _far_from_the_bulk(X, w, scale: str) -> np.ndarray | None:
    """The rows more than `FAR_SPREADS` robust spreads from a feature's median, with a warning,
    or None (none, or too many to leave out: fewer than 2 weighted rows would remain)."""
    stride = -(-X.shape[0] // _QUARTILE_ROWS)
    lower, median, upper = weighted_lower_quantiles(
        X[::stride], None if w is None else w[::stride], (0.25, 0.5, 0.75))
    spread = (upper - lower) / 1.349
    usable = spread > 0  # over half the weight on one value: no robust spread to judge by
    distance = np.abs(X[:, usable] - median[usable]) / spread[usable]
    far = np.flatnonzero(np.any(distance > FAR_SPREADS, axis=1))
    remaining = X.shape[0] - far.size if w is None else np.sum(np.delete(w, far) > 0)
    if not far.size or remaining < 2:
        return None
    shown = ", ".join(str(r) for r in far[:10]) + (f", ... ({far.size:,} in all)"
                                                   if far.size > 10 else "")
    warnings.warn(
        f"row(s) {shown} of the {X.shape[0]:,} lie over {FAR_SPREADS:.0e} interquartile spreads "
        f"from the median of a feature: scale={scale!r} leaves them out of its mean and spread, "
        "which they alone would set (they stay in the density). Check them for data errors; "
        "scaling_.far_rows lists them", UserWarning, stacklevel=4)
    return far


def _moment_scaling(X, w, scale: str) -> Scaling:
    """`fit_scaling` for "standardize" and "covariance", from the moments of these rows."""
    n, d = X.shape
    location = np.average(X.astype(np.float64), axis=0, weights=w)
    std = weighted_std(X, w, what=f"scale={scale!r}")
    constant = constant_features(std, location)
    if constant.size:
        raise_constant(constant, f"scale={scale!r}")
    if scale == "standardize":
        return Scaling("standardize", location, std, None, None, float(-np.sum(np.log(std))))
    cov = weighted_covariance(X, w, what=f"scale={scale!r}")
    # Judge singularity on the correlation matrix, so that features of very different units do
    # not make a well-posed problem look singular.
    eigenvalues = np.linalg.eigvalsh(cov / np.outer(std, std))
    if eigenvalues[0] <= 100 * d * np.finfo(np.float64).eps * eigenvalues[-1]:
        rank = int(np.sum(eigenvalues > 100 * d * np.finfo(np.float64).eps * eigenvalues[-1]))
        raise ValueError(
            f"scale='covariance' needs an invertible covariance, but the covariance of the data "
            f"is singular (numerical rank {rank} of {d} features, n_samples={n}): features are "
            "linearly dependent or there are too few samples. Use scale='standardize', or drop "
            "dependent features"
        )
    import scipy.linalg  # here: the other scalings and rules run without it

    chol = np.linalg.cholesky(cov)
    matrix = scipy.linalg.solve_triangular(chol, np.eye(d), lower=True).T
    return Scaling("covariance", location, None, matrix, chol.T.copy(),
                   float(-np.sum(np.log(np.diag(chol)))))
