"""scalegp.persistence._schema: what a model file may hold (the allow-listed classes, their
parameters and attributes) and the format versions it reads."""

from pathlib import Path

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, WhiteKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C

from scalegp.persistence import ModelFileError, load_model
from tests.persistence.helpers import crafted, gp_description, resign, rewrite, wave

V2_FILE = Path(__file__).parent.parent / "data" / "gp_pipeline_format_v2.npz"


def test_a_pipeline_memory_folder_is_refused(pipeline, tmp_path):
    # clone(model).fit(...) would write to and unpickle from this folder
    path = crafted(pipeline, tmp_path,
                   lambda header, _: header["model"]["params"].update(memory=str(tmp_path)))
    with pytest.raises(ModelFileError, match=r"model.params.memory: expected one of None"):
        load_model(path)


def test_format_version_3_files_load_with_the_new_parameters_at_their_defaults(
        kernel_pipeline, tmp_path):
    def as_version_3(header, arrays):
        header["version"] = 3
        for key in ("n_targets", "copy_X_train", "prune", "prune_tol", "full_data_tol"):
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
        for key in ("prune", "prune_tol", "full_data_tol"):
            del gp_description(header)["params"][key]

    loaded = load_model(crafted(kernel_pipeline, tmp_path, as_version_4))
    assert loaded[-1].prune == "auto" and loaded[-1].prune_tol is None
    xq = wave(9, d=2, seed=1)[0]
    np.testing.assert_array_equal(loaded.predict(xq), kernel_pipeline.predict(xq))


def test_format_version_6_files_load_with_the_default_full_data_tol(kernel_pipeline, tmp_path):
    def as_version_6(header, arrays):
        header["version"] = 6
        del gp_description(header)["params"]["full_data_tol"]

    loaded = load_model(crafted(kernel_pipeline, tmp_path, as_version_6))
    assert loaded[-1].full_data_tol == 1e-3
    xq = wave(9, d=2, seed=1)[0]
    np.testing.assert_array_equal(loaded.predict(xq), kernel_pipeline.predict(xq))


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


