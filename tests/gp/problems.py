"""The regression problem and references the GP tests share: data, fixed RBF hyperparameters,
scikit-learn's GP with the same kernel (optimizer=None, alpha=0), and a pytree flattener."""

import jax
import numpy as np
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

from scalegp import gp

LENGTHSCALE = np.array([1.0, 1.5, 2.0, 0.8])
OUTPUTSCALE = 1.3
NOISE = 0.05


def regression_data(n, d=4, seed=0, num_test=200):
    """(x (n, d), y (n,), x_test (num_test, d)): standard normal inputs, y a noisy sine of a
    projection of x."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = np.sin(x @ np.linspace(0.5, 1.0, d)) + 0.2 * rng.normal(size=n)
    x_test = rng.normal(size=(num_test, d))
    return x, y, x_test


def sklearn_gp(x, y, lengthscale=LENGTHSCALE):
    """scikit-learn's GP on (x, y) at the fixed hyperparameters (no optimisation)."""
    kernel = ConstantKernel(OUTPUTSCALE) * RBF(lengthscale) + WhiteKernel(NOISE)
    return GaussianProcessRegressor(kernel, optimizer=None, alpha=0.0).fit(x, y)


def rbf_params(dtype, lengthscale=LENGTHSCALE, mean=0.0):
    """`scalegp.gp.GPParams` at the same fixed hyperparameters."""
    return gp.GPParams.from_constrained(mean, OUTPUTSCALE, lengthscale, NOISE, dtype=dtype)


def flatten(tree):
    """A pytree's leaves as one float64 vector."""
    return np.concatenate([np.asarray(leaf, np.float64).ravel() for leaf in jax.tree.leaves(tree)])

