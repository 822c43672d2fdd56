"""The data and float64 references the KDE tests share: a seeded Gaussian mixture, and the
KDE's log-densities and leave-one-out log-densities by the definition."""

import numpy as np
from scipy.special import logsumexp

# log-density tolerance (atol) against the references, per compute dtype
TOL = {np.float32: 1e-4, np.float64: 1e-9}


def mixture(n, d=2, seed=0, draw=None):
    """n draws (seeded by ``draw``, default ``seed``) from a correlated, unequally spread
    three-component Gaussian mixture in d dimensions (fixed by ``seed``)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(3, d))
    mixing = np.eye(d) + 0.4 * rng.normal(size=(d, d))
    scales = np.array([0.3, 1.0, 0.6])
    rng = rng if draw is None else np.random.default_rng([seed, draw])
    labels = rng.choice(3, size=n, p=[0.5, 0.3, 0.2])
    return (centres[labels] + scales[labels, None] * rng.normal(size=(n, d))) @ mixing


def brute_log_density(Q, X, h, w=None):
    """The Gaussian KDE's log-density by the definition, in float64."""
    Q, X = np.asarray(Q, np.float64), np.asarray(X, np.float64)
    d = X.shape[1]
    w = np.ones(X.shape[0]) if w is None else np.asarray(w, np.float64)
    h = np.broadcast_to(np.asarray(h, np.float64), (d,))
    e = -0.5 * np.sum(((Q[:, None, :] - X[None, :, :]) / h) ** 2, axis=-1)
    return (
        logsumexp(e, b=w[None, :], axis=1) - np.log(w.sum()) - 0.5 * d * np.log(2 * np.pi)
        - np.log(h).sum()
    )


def brute_loo(X, h, w=None):
    """Leave-one-out log-densities by the definition, with every exact copy of x_i left out."""
    X = np.asarray(X, np.float64)
    n, d = X.shape
    w = np.ones(n) if w is None else np.asarray(w, np.float64)
    h = np.broadcast_to(np.asarray(h, np.float64), (d,))
    diff = (X[:, None, :] - X[None, :, :]) / h
    e = -0.5 * np.sum(diff**2, axis=-1)
    copy = np.all(X[:, None, :] == X[None, :, :], axis=-1)
    terms = np.where(copy | (w[None, :] == 0), -np.inf, e + np.log(np.where(w > 0, w, 1))[None, :])
    left = w.sum() - (copy * w[None, :]).sum(axis=1)
    return logsumexp(terms, axis=1) - np.log(left) - 0.5 * d * np.log(2 * np.pi) - np.log(h).sum()

