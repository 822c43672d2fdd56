"""scalegp.persistence._schema: what a model file may hold (the allow-listed classes, their
parameters and attributes), how an estimator is encoded, and the format versions it reads."""

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, WhiteKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C

from scalegp import ScalableGPRegressor
from scalegp import persistence
from scalegp.persistence import ModelFileError, load_model, save_model
from tests.persistence.helpers import HEADER, crafted, data, gp_description, resign, rewrite, \
    wave

V2_FILE = Path(__file__).parent.parent / "data" / "gp_pipeline_format_v2.npz"


def test_a_pipeline_memory_folder_is_refused(pipeline, tmp_path):
    # clone(model).fit(...) would write to and unpickle from this folder
    path = crafted(pipeline, tmp_path,
                   lambda header, _: header["model"]["params"].update(memory=str(tmp_path)))
    with pytest.raises(ModelFileError, match=r"model.params.memory: expected one of None"):
        load_model(path)


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


def test_format_version_3_files_load_with_the_new_parameters_at_their_defaults(
        kernel_pipeline, tmp_path):
    def as_version_3(header, arrays):
        header["version"] = 3
        for key in ("n_targets", "copy_X_train", "prune", "prune_tol"):
            del gp_description(header)["params"][key]

    loaded = load_model(crafted(kernel_pipeline, tmp_path, as_version_3))
    assert loaded[-1].n_targets is None and loaded[-1].copy_X_train is True
    assert loaded[-1].prune == "auto" and loaded[-1].prune_tol is None
    xq = wave(9, d=2, seed=1)[0]
    for want, got in zip(kernel_pipeline.predict(xq, return_std=True),
                         loaded.predict(xq, return_std=True)):
        np.testing.assert_array_equal(got, want)


def test_format_version_4_files_load_with_the_pruning_defaults(kernel_pipeline, tmp_path):
    def as_version_4(header, arrays):
        header["version"] = 4
        for key in ("prune", "prune_tol"):
            del gp_description(header)["params"][key]

    loaded = load_model(crafted(kernel_pipeline, tmp_path, as_version_4))
    assert loaded[-1].prune == "auto" and loaded[-1].prune_tol is None
    xq = wave(9, d=2, seed=1)[0]
    np.testing.assert_array_equal(loaded.predict(xq), kernel_pipeline.predict(xq))


def test_default_model_stores_its_kernel_and_no_spec(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")
    with np.load(path, allow_pickle=False) as archive:
        header = json.loads(str(archive[HEADER][()]))
    assert header["version"] == persistence.FORMAT_VERSION == 5
    described = gp_description(header)
    assert described["params"]["kernel"] is None and described["params"]["alpha"] == 1e-10
    assert described["attributes"]["kernel_"]["class"] == "Sum"
    assert "_spec" not in described["attributes"] and "_spec" not in described["arrays"]
    loaded = load_model(path)[-1]
    assert loaded._spec is None and loaded.kernel_ == pipeline[-1].kernel_


def test_format_version_2_files_still_load():
    """A file written by scalegp before kernel= (commit 0a71086, format version 2; see
    tests/data/README.md) loads as a kernel=None model and predicts as it did then, to float32
    rounding: bitwise until 1bfa205, which centres the inputs on their median instead of their
    mean (4e-6 apart then, on means up to 0.85)."""
    model, metadata = load_model(V2_FILE, return_metadata=True)
    gp = model[-1]
    assert gp.kernel is None and gp._spec is None and gp.alpha == 1e-10
    assert gp.kernel_ == C(gp.outputscale_) * RBF(gp.lengthscale_) + WhiteKernel(gp.noise_)
    mean, std = model.predict(np.array(metadata["query"]), return_std=True)
    np.testing.assert_allclose(mean, metadata["mean"], rtol=0, atol=3e-5)
    np.testing.assert_allclose(std, metadata["std"], rtol=3e-5)
    # The LML is recomputed by today's objective (rᵀα from one Cholesky solve since the exact
    # path's analytic gradient; ‖L⁻¹r‖² then) on inputs centred on their median: equal to
    # float32 rounding (3e-5 relative since 1bfa205: a sum of terms of ~20 that cancel to -3.2).
    np.testing.assert_allclose(gp.log_marginal_likelihood(gp.theta_), metadata["lml"],
                               rtol=1e-4)


def test_format_version_2_files_cannot_hold_kernels(tmp_path):
    path = tmp_path / "v2.npz"
    path.write_bytes(V2_FILE.read_bytes())

    def edit(header, arrays):
        gp_description(header)["params"]["kernel"] = {"class": "WhiteKernel", "noise_level": 1.0,
                                                     "noise_level_bounds": "fixed"}
        resign(header, arrays)

    rewrite(path, edit)
    with pytest.raises(ModelFileError, match=r"params: unknown key\(s\) 'kernel'"):
        load_model(path)


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
