"""scalegp.persistence._encode: what save_model writes for an estimator: its parameters and
attributes as JSON values (a numpy dtype by name, integer targets, a per-point alpha), its kernels,
no derived state, and a GP only with the kernel and alpha it was fitted with."""

import json

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, WhiteKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C

from scalegp import ScalableGPRegressor
from scalegp import persistence
from scalegp.persistence import load_model, save_model
from tests.persistence.helpers import HEADER, data, gp_description, wave


def test_integer_targets_round_trip(tmp_path):
    x, y = data()
    gp = ScalableGPRegressor(optimizer=None).fit(x, (y > 0).astype(np.uint8))
    loaded = load_model(save_model(gp, tmp_path / "m.npz"))
    np.testing.assert_array_equal(loaded.predict(x[:3]), gp.predict(x[:3]))


def test_per_point_alpha_n_targets_and_a_numpy_dtype_round_trip(tmp_path):
    x, y = wave(d=2)
    alpha = np.linspace(1e-3, 1e-1, len(y))
    gp = ScalableGPRegressor(C(1.0) * RBF([1.0, 2.0]) + WhiteKernel(0.01), alpha=alpha,
                             n_targets=1, copy_X_train=False, dtype=np.float32, max_iter=10,
                             random_state=0).fit(x, y)
    loaded = load_model(save_model(gp, tmp_path / "a.npz"))
    assert loaded.dtype == "float32" and loaded.n_targets == 1 and loaded.copy_X_train is False
    np.testing.assert_array_equal(loaded.alpha, alpha)
    np.testing.assert_array_equal(loaded._fixed_noise, gp._fixed_noise)
    xq = wave(9, d=2, seed=1)[0]
    for want, got in zip(gp.predict(xq, return_std=True), loaded.predict(xq, return_std=True)):
        np.testing.assert_array_equal(got, want)
    assert loaded.log_marginal_likelihood(gp.kernel_.theta) == gp.log_marginal_likelihood(
        gp.kernel_.theta)
    gp.set_params(alpha=alpha * 2)
    with pytest.raises(ValueError, match="its kernel or alpha was changed after fit"):
        save_model(gp, tmp_path / "changed.npz")


def test_default_model_stores_its_kernel_and_no_spec(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")
    with np.load(path, allow_pickle=False) as archive:
        header = json.loads(str(archive[HEADER][()]))
    assert header["version"] == persistence.FORMAT_VERSION == 8
    described = gp_description(header)
    assert described["params"]["kernel"] is None and described["params"]["alpha"] == 1e-10
    assert described["attributes"]["kernel_"]["class"] == "Sum"
    assert "_spec" not in described["attributes"] and "_spec" not in described["arrays"]
    loaded = load_model(path)[-1]
    assert loaded._spec is None and loaded.kernel_ == pipeline[-1].kernel_


@pytest.mark.filterwarnings("ignore:K \\+ noise:RuntimeWarning")  # noise 0: jitter added
def test_kernel_settings_changed_after_fit_are_not_saved(tmp_path):
    x, y = wave()
    gp = ScalableGPRegressor(C(1.0) * RBF(1.0), alpha=0.0, optimizer=None).fit(x, y)
    assert gp.noise_ == 0.0  # no WhiteKernel and alpha=0: still a model that can be saved
    loaded = load_model(save_model(gp, tmp_path / "m.npz"))
    np.testing.assert_array_equal(loaded.predict(x[:4]), gp.predict(x[:4]))
    # the compiled kernel is rebuilt at load from kernel and alpha: they must be the fitted ones
    for change in ({"alpha": 1e-3}, {"kernel": C(1.0) * RBF(2.0)}, {"kernel": None}):
        changed = ScalableGPRegressor(C(1.0) * RBF(1.0), alpha=0.0, optimizer=None).fit(x, y)
        changed.set_params(**change)
        with pytest.raises(ValueError, match="its kernel or alpha was changed after fit"):
            save_model(changed, tmp_path / "changed.npz")
    assert not (tmp_path / "changed.npz").exists()
