"""scalegp.persistence._files: save_model and load_model on disk (round trips, the variance
cache), the checksum and the signature, atomic writes, and members read only after their .npy
headers are checked."""

import io
import json
import os

import numpy as np
import pytest

from scalegp import ScalableGPRegressor, ScalableKernelDensity
from scalegp import persistence
from scalegp.persistence import _files as persistence_files
from scalegp.persistence import ModelFileError, load_model, save_model
from tests.persistence.helpers import HEADER, crafted, data, resign, rewrite


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


def test_an_nlml_the_fit_did_not_evaluate_is_evaluated_after_loading(tmp_path):
    """A BBMM fit without steps on all data leaves its NLML unevaluated; the file holds none
    and the loaded model evaluates the same value when it is read."""
    x, y = data(80)
    gp = ScalableGPRegressor(solver="bbmm", optimizer=None, preconditioner_rank=10,
                             love_rank=20, random_state=0).fit(x, y)
    assert "log_marginal_likelihood_value_" not in vars(gp)
    path = save_model(gp, tmp_path / "bbmm.npz")
    assert "log_marginal_likelihood_value_" not in vars(gp)  # saving did not evaluate it
    loaded = load_model(path)
    assert loaded.log_marginal_likelihood_value_ == pytest.approx(
        gp.log_marginal_likelihood_value_, rel=1e-6)
    again = load_model(save_model(loaded, tmp_path / "again.npz"))  # now the file holds it
    assert vars(again)["log_marginal_likelihood_value_"] == loaded.log_marginal_likelihood_value_


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


def test_tampered_arrays_fail_the_checksum(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")

    def edit(header, arrays):
        arrays["1.alpha_"] = arrays["1.alpha_"] * 1.001

    rewrite(path, edit)
    with pytest.raises(ModelFileError, match="checksum mismatch"):
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


def test_deeply_nested_json_is_refused(pipeline, tmp_path):
    path = save_model(pipeline, tmp_path / "m.npz")
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    text = str(arrays.pop(HEADER)[()]).replace('"metadata": {}',
                                               '"metadata": ' + "[" * 100_000 + "]" * 100_000)
    np.savez(path, **{HEADER: np.array(text)}, **arrays)
    with pytest.raises(ModelFileError, match="nested too deeply"):
        load_model(path)


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


def test_an_interrupt_right_after_the_temporary_file_is_created_leaves_nothing(
        pipeline, tmp_path, monkeypatch):
    # Ctrl-C between creating the temporary file and noting it for removal once left it behind
    real_open = os.open

    def open_then_interrupt(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if str(path).endswith(".tmp"):
            os.close(fd)
            raise KeyboardInterrupt
        return fd

    monkeypatch.setattr(os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_model(pipeline, tmp_path / "m.npz")
    assert list(tmp_path.iterdir()) == []


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


def test_a_str_key_without_utf8_bytes_is_refused_by_name(pipeline, tmp_path):
    # as os.environ gives SCALEGP_MODEL_KEY=$'\xff': once a bare codec error
    with pytest.raises(ValueError, match=r"key must be .*\(a lone surrogate at position 1\)"):
        save_model(pipeline, tmp_path / "m.npz", key="k\udcff")
    assert not any(tmp_path.iterdir())


def test_a_header_too_long_to_load_is_not_saved(pipeline, tmp_path):
    """A file written is a file that loads: a header beyond the loader's cap (a per-point alpha
    of a million values, or metadata, as here) is refused at save."""
    with pytest.raises(ValueError, match="header would take .* characters, more than"):
        save_model(pipeline, tmp_path / "m.npz", metadata={"blob": "x" * (4 * 2**20)})
    assert not any(tmp_path.iterdir())
