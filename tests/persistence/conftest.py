"""The fitted models the model-file tests save: the default GP and a kernel GP, each in a
Pipeline with a StandardScaler."""

import pytest
from sklearn.gaussian_process.kernels import RBF, Matern, WhiteKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from scalegp import ScalableGPRegressor
from tests.persistence.helpers import data, wave


@pytest.fixture(scope="module")
def pipeline():
    x, y = data()
    return make_pipeline(StandardScaler(), ScalableGPRegressor(max_iter=5, random_state=0)).fit(x, y)


@pytest.fixture(scope="module")
def kernel_pipeline():
    x, y = wave(d=2)
    kernel = C(1.0) * RBF([1.0, 2.0]) + C(0.5) * Matern(1.0, nu=2.5) + WhiteKernel(0.1)
    return make_pipeline(StandardScaler(), ScalableGPRegressor(kernel, optimizer=None)).fit(x, y)
