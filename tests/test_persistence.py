import io
import json

import numpy as np
import pytest
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from scalegp import ScalableGPRegressor, ScalableKernelDensity
from scalegp import persistence
from scalegp.persistence import ModelFileError, load_model, save_model

HEADER = persistence._HEADER_KEY


def data(n=60, d=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * np.arange(1, d + 1) + 5.0
    y = np.sin(x[:, 0]) + 0.1 * rng.normal(size=n)
    return x, y


@pytest.fixture(scope="module")
def pipeline():
    x, y = data()
    return make_pipeline(StandardScaler(), ScalableGPRegressor(max_iter=5, random_state=0)).fit(x, y)


def test_pipeline_round_trip_reproduces_predictions(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz", metadata={"features": ["a", "b"]})
    loaded, metadata = load_model(path, return_metadata=True)
    assert metadata == {"features": ["a", "b"]}
    assert [name for name, _ in loaded.steps] == [name for name, _ in pipeline.steps]
    xq = data(10, seed=1)[0]
    for want, got in zip(pipeline.predict(xq, return_std=True), loaded.predict(xq, return_std=True)):
        np.testing.assert_array_equal(got, want)
    gp = loaded[-1]
    assert gp.get_params() == pipeline[-1].get_params()
    np.testing.assert_array_equal(gp.lengthscale_, pipeline[-1].lengthscale_)
    # nothing in the file needs pickle
    with np.load(path, allow_pickle=False) as archive:
        assert all(archive[k].dtype.kind != "O" for k in archive.files)


def test_iterative_model_with_love_cache_and_multi_output(tmp_path):
    x, y = data(80)
    y2 = np.column_stack([y, np.cos(x[:, 1])])
    gp = ScalableGPRegressor(solver="bbmm", optimizer=None, lengthscale=np.array([1.0, 2.0]),
                             preconditioner_rank=10, love_rank=20, random_state=0).fit(x, y2)
    want = gp.predict(x[:5], return_std=True)  # builds the LOVE cache
    loaded = load_model(save_model(gp, tmp_path / "bbmm.npz"))
    assert loaded._love_factor is not None and loaded.solver_ == "bbmm"
    for a, b in zip(want, loaded.predict(x[:5], return_std=True)):
        np.testing.assert_array_equal(b, a)


def rewrite(path, edit):
    """Rewrites a model file after ``edit(header, arrays)``, like a hand edit would."""
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    header = json.loads(str(arrays.pop(HEADER)[()]))
    edit(header, arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **{HEADER: np.array(json.dumps(header))}, **arrays)
    path.write_bytes(buffer.getvalue())


def resign(header, arrays):
    header.pop("checksum")
    header["checksum"] = persistence._checksum(header, arrays)


def test_tampered_arrays_fail_the_checksum(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")

    def edit(header, arrays):
        arrays["1.alpha_"] = arrays["1.alpha_"] * 1.001

    rewrite(path, edit)
    with pytest.raises(ModelFileError, match="checksum mismatch"):
        load_model(path)


def test_classes_outside_the_allow_list_are_refused_even_with_a_valid_checksum(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")

    def edit(header, arrays):
        header["model"]["steps"][0]["estimator"]["class"] = "os.system"
        resign(header, arrays)

    rewrite(path, edit)
    with pytest.raises(ModelFileError, match="'os.system' is not one of"):
        load_model(path)


def test_inconsistent_state_is_refused(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")

    def edit(header, arrays):
        arrays["1.alpha_"] = arrays["1.alpha_"][:-1]
        resign(header, arrays)

    rewrite(path, edit)
    with pytest.raises(ModelFileError, match="alpha_ has 59 rows, X_train_ 60"):
        load_model(path)


def test_dunder_attributes_are_refused(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")

    def edit(header, arrays):
        header["model"]["steps"][1]["estimator"]["attributes"]["__class__"] = "x"
        resign(header, arrays)

    rewrite(path, edit)
    with pytest.raises(ModelFileError, match="'__class__' is not allowed"):
        load_model(path)


def test_other_files_are_not_models(pipeline, tmp_path):
    np.save(tmp_path / "a.npy", np.ones(3))
    with pytest.raises(ModelFileError, match="single array"):
        load_model(tmp_path / "a.npy")
    np.savez(tmp_path / "b.npz", x=np.ones(3))
    with pytest.raises(ModelFileError, match="not a scalegp model file"):
        load_model(tmp_path / "b.npz")
    (tmp_path / "c.npz").write_bytes(b"not a zip at all")
    with pytest.raises(ModelFileError, match="not a readable model file"):
        load_model(tmp_path / "c.npz")
    good = save_model(pipeline, tmp_path / "good.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelFileError):
        load_model(tmp_path / "cut.npz")
    rewrite(tmp_path / "good.npz", lambda header, arrays: header.update(version=99))
    with pytest.raises(ModelFileError, match="format version 99"):
        load_model(tmp_path / "good.npz")
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing.npz")


def test_unsupported_or_unfitted_models_are_not_saved(tmp_path):
    x, _ = data()
    with pytest.raises(TypeError, match="save_model supports"):
        save_model(ScalableKernelDensity().fit(x), tmp_path / "k.npz")
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        save_model(ScalableGPRegressor(), tmp_path / "g.npz")
    assert not any(tmp_path.iterdir())


def test_a_missing_variance_cache_is_rebuilt_on_first_use():
    x, y = data()
    gp = ScalableGPRegressor(max_iter=5, random_state=0).fit(x, y)
    want = gp.predict(x[:7], return_std=True)
    cholesky = gp._cholesky
    gp._cholesky = None  # as a model file without caches leaves it
    got = gp.predict(x[:7], return_std=True)
    assert gp._love_factor is None  # the exact model rebuilt its own factor, not a LOVE one
    np.testing.assert_array_equal(gp._cholesky, cholesky)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b, a)
