"""scalegp.estimators._gpr_units: the units ScalableGPRegressor is fitted in."""

import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.estimators._gpr_units import centred, input_centre
from scalegp.ops._prepare import centre_of


@pytest.mark.parametrize("m", [1, 2, 7, 1024, 1025, 3001])
def test_inputs_are_centred_on_the_engines_centre(m):
    """The inputs are centred on the host (float64, before the cast) on the centre the engine
    takes of them (`centre_of`: a lower median of an even-stride sample, one of their own
    numbers), so the engine then finds them centred on an exact 0."""
    X = np.random.default_rng(m).normal(size=(m, 3)) * 1e3 + 1e6
    centre = input_centre(X)
    assert all(np.any(X[:, j] == centre[j]) for j in range(X.shape[1]))
    x = centred(X, centre, jnp.float32)
    np.testing.assert_array_equal(np.asarray(centre_of(x)), np.zeros(3, np.float32))
