"""The float64 reference, and the peers' numbers against it (in-process, tiny sizes).

tests/conftest.py enables jax_enable_x64 for the session, which the reference needs.
"""

import importlib.util
import math

import numpy as np
import pytest

from benchmarks.kmv import problems
from benchmarks.kmv.peers import make_peer

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)


def dense_kmv64(inputs):
    x1, x2, v = (np.asarray(inputs[k], np.float64) for k in ("x1", "x2", "v"))
    l = float(inputs["lengthscale"])
    r = ((x1[:, None, :] - x2[None, :, :]) ** 2).sum(-1) / l**2
    return np.exp(-0.5 * r) @ v


def test_inputs_are_deterministic_float32():
    a = problems.make_inputs("kernel_mv", 10, 7, 3, 2, seed=1)
    b = problems.make_inputs("kernel_mv", 10, 7, 3, 2, seed=1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["x1"].dtype == np.float32 and a["v"].shape == (7, 2)


def test_kde_data_is_whitened():
    x = problems.make_inputs("kde_density", 5, 200, 3, 1)["data"].astype(np.float64)
    np.testing.assert_allclose(np.cov(x.T), np.eye(3), atol=1e-6)


def test_reference_matches_a_direct_dense_computation():
    inputs = problems.make_inputs("kernel_mv", 33, 21, 3, 2)
    ref = problems.reference("kernel_mv", "fwd", inputs, entries=64)  # several chunks
    np.testing.assert_allclose(ref["out"], dense_kmv64(inputs), rtol=1e-12, atol=1e-12)


def test_reference_gradient_matches_finite_differences():
    inputs = problems.make_inputs("kernel_mv", 9, 8, 2, 2)
    grads = problems.reference("kernel_mv", "fwd_bwd", inputs, entries=16)

    def loss(l):
        return float(np.sum(dense_kmv64({**inputs, "lengthscale": l}) * inputs["G"]))

    l, eps = float(inputs["lengthscale"]), 1e-6
    fd = (loss(l + eps) - loss(l - eps)) / (2 * eps)
    assert math.isclose(float(grads["dlengthscale"]), fd, rel_tol=1e-6)


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")


@pytest.mark.parametrize("impl", [
    "numpy_dense", "numpy_chunked",
    pytest.param("torch_dense", marks=needs_torch),
    pytest.param("torch_chunked", marks=needs_torch),
])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_kernel_mv_peers_agree_with_the_reference(impl, mode):
    inputs = problems.make_inputs("kernel_mv", 70, 50, 3, 4)
    ref = problems.reference("kernel_mv", mode, inputs)
    peer = make_peer(impl, "kernel_mv", mode, inputs, "cpu", 2)
    try:
        err = problems.rel_err(peer.result(peer.sync(peer.call())), ref)
    finally:
        peer.close()
    errs = list(err.values()) if isinstance(err, dict) else [err]
    assert len(errs) == (4 if mode == "fwd_bwd" else 1)
    assert max(errs) < 1e-5


@pytest.mark.parametrize("impl", ["scipy_kde", "sklearn_kde"])
def test_kde_peers_use_the_same_bandwidth(impl):
    inputs = problems.make_inputs("kde_density", 40, 300, 2, 1)
    ref = problems.reference("kde_density", "fwd", inputs)
    peer = make_peer(impl, "kde_density", "fwd", inputs, "cpu", 1)
    assert problems.rel_err(peer.result(peer.call()), ref) < 1e-5
