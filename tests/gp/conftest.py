"""Fixtures the GP tests share."""

import pytest

from tests.gp.problems import regression_data, sklearn_gp


@pytest.fixture(scope="module")
def data2000():
    x, y, x_test = regression_data(2000)
    return x, y, x_test, sklearn_gp(x, y)

