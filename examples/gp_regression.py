"""GP regression on scikit-learn's diabetes data with ScalableGPRegressor in a Pipeline.

Prints held-out RMSE and negative log predictive density (NLL per point) next to scikit-learn's
GaussianProcessRegressor with the equivalent kernel (ConstantKernel * RBF + WhiteKernel).

    python examples/gp_regression.py
"""

import time

import numpy as np
from sklearn.datasets import load_diabetes
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from scalegp import ScalableGPRegressor


def nll(mean, std, y):
    return float(np.mean(0.5 * np.log(2 * np.pi * std**2) + 0.5 * ((y - mean) / std) ** 2))


def main():
    x, y = load_diabetes(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    d = x.shape[1]
    models = {
        "scalegp ScalableGPRegressor": make_pipeline(
            StandardScaler(), ScalableGPRegressor(normalize_y=True, random_state=0)),
        "sklearn GaussianProcessRegressor": make_pipeline(
            StandardScaler(),
            GaussianProcessRegressor(ConstantKernel() * RBF(np.ones(d)) + WhiteKernel(0.1),
                                     normalize_y=True, random_state=0)),
    }
    for name, model in models.items():
        start = time.perf_counter()
        model.fit(x_train, y_train)
        mean, std = model.predict(x_test, return_std=True)
        elapsed = time.perf_counter() - start
        rmse = float(np.sqrt(np.mean((mean - y_test) ** 2)))
        print(f"{name:34s} RMSE {rmse:8.3f}  NLL/pt {nll(mean, std, y_test):7.4f}  "
              f"({elapsed:.1f} s, n_train={len(y_train)}, d={d})")


if __name__ == "__main__":
    main()
