import io
import json

import numpy as np
import pytest
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from scalegp import ScalableGPRegressor, ScalableKernelDensity
from scalegp import persistence
from scalegp.persistence import _files as persistence_files
from scalegp.persistence._files import _digest
from scalegp.persistence._schema import _HEADER_KEY
from scalegp.persistence import ModelFileError, load_model, save_model

HEADER = _HEADER_KEY


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


@pytest.mark.parametrize("store", [False, True])
def test_iterative_model_with_love_cache_and_multi_output(tmp_path, store):
    x, y = data(80)
    y2 = np.column_stack([y, np.cos(x[:, 1])])
    gp = ScalableGPRegressor(solver="bbmm", optimizer=None, lengthscale=np.array([1.0, 2.0]),
                             preconditioner_rank=10, love_rank=20, random_state=0).fit(x, y2)
    want = gp.predict(x[:5], return_std=True)  # builds the LOVE cache
    loaded = load_model(save_model(gp, tmp_path / "bbmm.npz", store_variance_cache=store))
    assert (loaded._love_factor is not None) == store and loaded.solver_ == "bbmm"
    mean, std = loaded.predict(x[:5], return_std=True)  # rebuilds the cache when not stored
    np.testing.assert_array_equal(mean, want[0])
    np.testing.assert_allclose(std, want[1], rtol=1e-6)


def test_files_hold_what_prediction_needs_unless_asked(tmp_path):
    x, y = data(300, d=1)
    gp = ScalableGPRegressor(optimizer=None, dtype="float32").fit(x, y)
    want = gp.predict(x[:9], return_std=True)
    small = save_model(gp, tmp_path / "small.npz")
    large = save_model(gp, tmp_path / "large.npz", store_variance_cache=True)
    # O(n d): inputs, targets and alpha, not the 300 x 300 float32 Cholesky factor
    assert small.stat().st_size < 20_000 < 300**2 * 4 < large.stat().st_size
    loaded = load_model(small)
    assert loaded._cholesky is None
    mean, std = loaded.predict(x[:9], return_std=True)
    np.testing.assert_array_equal(mean, want[0])
    np.testing.assert_allclose(std, want[1], rtol=1e-6)


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
    header["checksum"] = _digest(header, arrays).hex()


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
        header["model"]["steps"][1]["estimator"]["arrays"]["alpha_"]["shape"] = [59]
        resign(header, arrays)

    rewrite(path, edit)
    with pytest.raises(ModelFileError, match="size n=59 disagrees with n=60"):
        load_model(path)


def test_dunder_attributes_are_refused(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")

    def edit(header, arrays):
        header["model"]["steps"][1]["estimator"]["attributes"]["__class__"] = "x"
        resign(header, arrays)

    rewrite(path, edit)
    with pytest.raises(ModelFileError, match="unknown key.*'__class__'"):
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


# ---------------------------------------------------------------------------------------------
# hostile files: a valid checksum proves nothing, every one must be a ModelFileError


def crafted(pipeline, tmp_path, edit):
    path = save_model(pipeline, tmp_path / "m.npz", store_variance_cache=True)

    def edit_and_resign(header, arrays):
        edit(header, arrays)
        resign(header, arrays)

    rewrite(path, edit_and_resign)
    return path


def gp_description(header):
    return header["model"]["steps"][1]["estimator"]


def test_a_pipeline_memory_folder_is_refused(pipeline, tmp_path):
    # clone(model).fit(...) would write to and unpickle from this folder
    path = crafted(pipeline, tmp_path,
                   lambda header, _: header["model"]["params"].update(memory=str(tmp_path)))
    with pytest.raises(ModelFileError, match=r"model.params.memory: expected one of None"):
        load_model(path)


@pytest.mark.parametrize("edit, message", [
    (lambda h: gp_description(h)["params"].update(love_rank="1024"),
     r"params.love_rank: expected an integer in \[1, \d+\], got '1024'"),
    (lambda h: gp_description(h)["attributes"].update(_probe_seed=2**40),
     r"_probe_seed: expected an integer in \[0, 2147483646\]"),
    (lambda h: h.update(signature="é" * 64), r"header.signature: expected 64 hexadecimal digits"),
    (lambda h: h.update(signature=None), r"header.signature: expected 64 hexadecimal"),
    (lambda h: gp_description(h)["params"].update(impl=["dense"]), r"params.impl: expected one"),
    (lambda h: gp_description(h)["params"].update(kernel="os.system"),
     r"params: unknown key\(s\) 'kernel'"),
    (lambda h: h["model"]["steps"].__setitem__(0, "scale"), r"steps\[0\]: expected an object"),
    (lambda h: h["model"]["steps"][0].pop("name"), r"steps\[0\]: missing key\(s\) name"),
    (lambda h: h["model"]["steps"][0].update(name="a__b"), r"steps\[0\].name: expected a uniq"),
    (lambda h: h.pop("model"), r"header: missing key\(s\) model"),
    (lambda h: gp_description(h).update(attributes=[]), r"attributes: expected an object"),
    (lambda h: gp_description(h)["attributes"].update(predict="x"),
     r"attributes: unknown key\(s\) 'predict'; allowed: "),
    (lambda h: gp_description(h)["attributes"].update(_y_1d=1), r"_y_1d: expected true or false"),
    (lambda h: gp_description(h)["attributes"].pop("solver_"), r"missing solver_"),
    (lambda h: h["model"]["steps"].reverse(), r"every step but the last must be a StandardScaler"),
    (lambda h: h["model"]["steps"][0].update(estimator=json.loads(json.dumps(h["model"]))),
     r"at the top level"),
    (lambda h: h.update(metadata=[1]), r"metadata: expected an object"),
    (lambda h: h.update(metadata={"a": json.loads("[" * 40 + "]" * 40)}),
     r"nested deeper than 32 levels"),
])
def test_malformed_headers_are_refused_with_a_reason(pipeline, tmp_path, edit, message):
    path = crafted(pipeline, tmp_path, lambda header, _: edit(header))
    with pytest.raises(ModelFileError, match=message):
        load_model(path)


def test_deeply_nested_json_is_refused(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    text = str(arrays.pop(HEADER)[()]).replace('"metadata": {}',
                                               '"metadata": ' + "[" * 100_000 + "]" * 100_000)
    np.savez(path, **{HEADER: np.array(text)}, **arrays)
    with pytest.raises(ModelFileError, match="nested too deeply"):
        load_model(path)


@pytest.mark.parametrize("key, value, message", [
    ("1._y_train_mean", np.array([np.nan]), r"_y_train_mean: has non-finite values"),
    ("1._cholesky", np.nan, r"_cholesky: has non-finite values"),
    ("1._y_train_std", np.array([0.0]), r"_y_train_std: has values <= 0"),
    ("0.scale_", np.ones(3), r"size d=3 disagrees with d=2"),
    ("1.X_train_", np.ones((60, 2), np.float16), r"X_train_.dtype: expected one of <f8, <f4"),
    ("1.alpha_", np.ones((60, 1)), r"alpha_.shape: expected 1 sizes \(n\)"),
])
def test_arrays_are_checked_against_the_header(pipeline, tmp_path, key, value, message):
    def edit(header, arrays):
        arrays[key] = np.broadcast_to(value, np.shape(value) or arrays[key].shape).copy()
        step, attribute = key.split(".", 1)
        entry = header["model"]["steps"][int(step)]["estimator"]["arrays"][attribute]
        entry.update(shape=list(arrays[key].shape), dtype=arrays[key].dtype.str)

    with pytest.raises(ModelFileError, match=message):
        load_model(crafted(pipeline, tmp_path, edit))


def npy_member(shape, dtype="<f8", data=b""):
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": dtype, "shape": shape, "fortran_order": False})
    return buffer.getvalue() + data


def scaler_file(path, declared_d, member_shape):
    """A StandardScaler file whose header declares d features and whose scale_ member claims
    ``member_shape`` but holds no data."""
    import zipfile

    entry = {"key": "scale_", "shape": [declared_d], "dtype": "<f8"}
    header = {"format": persistence.FORMAT, "version": persistence.FORMAT_VERSION,
              "scalegp_version": "0", "metadata": {}, "checksum": "0" * 64,
              "model": {"class": "sklearn.preprocessing.StandardScaler",
                        "params": {"with_mean": False},
                        "attributes": {"n_features_in_": declared_d, "n_samples_seen_": 5,
                                       "mean_": None, "var_": None},
                        "arrays": {"scale_": entry}}}
    with zipfile.ZipFile(path, "w") as archive:
        text = json.dumps(header)
        archive.writestr(f"{HEADER}.npy", npy_member((), f"<U{len(text)}",
                                                     text.encode("utf-32-le")))
        archive.writestr("scale_.npy", npy_member(member_shape))
    return path


@pytest.mark.parametrize("declared_d, member_shape, message", [
    (2, (10**12,), r"holds <f8 \(1000000000000,\); the header declares <f8 \(2,\)"),
    (10**12, (10**12,), r"has 0 bytes of data, <f8 \(1000000000000,\) needs 8000000000000"),
])
def test_declared_sizes_are_checked_before_reading(tmp_path, declared_d, member_shape, message):
    path = scaler_file(tmp_path / "big.npz", declared_d, member_shape)
    assert path.stat().st_size < 4000
    with pytest.raises(ModelFileError, match=message):
        load_model(path)


def test_compressed_members_and_memory_errors(pipeline, tmp_path, monkeypatch):
    path = save_model(pipeline, tmp_path / "m.npz")
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    np.savez_compressed(path, **arrays)  # a zip bomb needs compression
    with pytest.raises(ModelFileError, match="is compressed"):
        load_model(path)

    def no_memory(*args):
        raise MemoryError

    save_model(pipeline, path)
    monkeypatch.setattr(persistence_files, "_read_member", no_memory)
    with pytest.raises(ModelFileError, match="not enough memory"):
        load_model(path)


def test_members_the_header_does_not_declare_are_refused(pipeline, tmp_path):
    path = crafted(pipeline, tmp_path, lambda _, arrays: arrays.update(extra=np.ones(3)))
    with pytest.raises(ModelFileError, match="members the header does not declare: extra.npy"):
        load_model(path)


def test_save_refuses_what_load_would_refuse(pipeline, tmp_path):
    from sklearn.base import clone

    model = clone(pipeline).set_params(memory=str(tmp_path))
    model.fit(*data())
    with pytest.raises(ValueError, match="cannot save this model: .*memory: expected one of None"):
        save_model(model, tmp_path / "m.npz")


def test_signed_files_need_the_key_and_unsigned_ones_are_refused_with_one(pipeline, tmp_path):
    signed = save_model(pipeline, tmp_path / "s.npz", key="s3cret")
    assert isinstance(load_model(signed, key=b"s3cret"), type(pipeline))
    with pytest.raises(ModelFileError, match="is signed; load it with its key"):
        load_model(signed)
    with pytest.raises(ModelFileError, match="signature does not match this key"):
        load_model(signed, key="guess")
    # an edit with a recomputed checksum is what the key catches
    rewrite(signed, lambda header, arrays: (arrays["1.alpha_"].__imul__(2),
                                            resign(header, arrays)))
    with pytest.raises(ModelFileError, match="signature does not match this key"):
        load_model(signed, key="s3cret")
    unsigned = save_model(pipeline, tmp_path / "u.npz")
    with pytest.raises(ModelFileError, match="is not signed, but a key was given"):
        load_model(unsigned, key="s3cret")
    with pytest.raises(ValueError, match="key must be a non-empty"):
        save_model(pipeline, tmp_path / "e.npz", key="")


def test_integer_targets_round_trip(tmp_path):
    x, y = data()
    gp = ScalableGPRegressor(optimizer=None).fit(x, (y > 0).astype(np.uint8))
    loaded = load_model(save_model(gp, tmp_path / "m.npz"))
    np.testing.assert_array_equal(loaded.predict(x[:3]), gp.predict(x[:3]))
