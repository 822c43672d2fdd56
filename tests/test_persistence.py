import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, ExpSineSquared, Matern, RationalQuadratic, \
    WhiteKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C
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
     r"params.kernel: expected a kernel \(an object with a 'class'\), got 'os.system'"),
    (lambda h: gp_description(h)["params"].update(colour="red"),
     r"params: unknown key\(s\) 'colour'"),
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

def test_integer_targets_round_trip(tmp_path):
    x, y = data()
    gp = ScalableGPRegressor(optimizer=None).fit(x, (y > 0).astype(np.uint8))
    loaded = load_model(save_model(gp, tmp_path / "m.npz"))
    np.testing.assert_array_equal(loaded.predict(x[:3]), gp.predict(x[:3]))


# ---------------------------------------------------------------------------------------------
# scikit-learn kernels (ScalableGPRegressor(kernel=...)): JSON trees of allow-listed classes

V2_FILE = Path(__file__).parent / "data" / "gp_pipeline_format_v2.npz"


def wave(n=40, d=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 5, size=(n, d))
    y = np.sin(2 * x[:, 0]) + 0.3 * x[:, -1] + 0.1 * rng.normal(size=n)
    return x, y


def assert_same_gp(loaded, gp, xq):
    """Predictions (bitwise), the likelihood at and off the optimum, kernel_ and the settings."""
    for want, got in zip(gp.predict(xq, return_std=True), loaded.predict(xq, return_std=True)):
        np.testing.assert_array_equal(got, want)
    assert loaded.kernel_ == gp.kernel_ and repr(loaded.kernel_) == repr(gp.kernel_)
    assert loaded.get_params(deep=False) == gp.get_params(deep=False)
    assert loaded._spec == gp._spec and loaded._spec is not None
    np.testing.assert_array_equal(loaded.theta_, gp.theta_)
    theta = gp.kernel_.theta
    for t in (theta, theta + 0.1):
        assert loaded.log_marginal_likelihood(t) == gp.log_marginal_likelihood(t)
    _, grad = loaded.log_marginal_likelihood(theta, eval_gradient=True)
    np.testing.assert_array_equal(grad, gp.log_marginal_likelihood(theta, eval_gradient=True)[1])
    assert not hasattr(loaded, "lengthscale_") and not hasattr(loaded, "outputscale_")


def test_composite_kernel_round_trip(tmp_path):
    x, y = wave()
    kernel = (C(1.0) * RBF(1.0) + C(0.5) * RBF(2.0) * ExpSineSquared(1.0, 3.0,
                                                                      periodicity_bounds="fixed")
              + C(0.3) * RationalQuadratic(alpha=2.0) + WhiteKernel(0.1))
    gp = ScalableGPRegressor(kernel, max_iter=15, random_state=0).fit(x, y)
    loaded = load_model(save_model(gp, tmp_path / "k.npz"))
    assert_same_gp(loaded, gp, wave(9, seed=1)[0])
    assert loaded.kernel_.k1.k1.k2.k2.periodicity == 3.0  # fixed: kept as given


def test_matern_ard_with_fixed_and_per_feature_bounds_round_trip(tmp_path):
    x, y = wave(d=2)
    kernel = C(2.0, "fixed") * Matern([1.0, 3.0], [(1e-2, 1e2), (0.5, 50.0)], nu=1.5) \
        + WhiteKernel(0.1, (1e-4, 1.0))
    gp = ScalableGPRegressor(kernel, alpha=1e-6, mean=0.0, normalize_y=True, max_iter=15,
                             random_state=0)
    model = make_pipeline(StandardScaler(), gp).fit(x, y)
    loaded = load_model(save_model(model, tmp_path / "m.npz"))
    xq = wave(9, d=2, seed=1)[0]
    np.testing.assert_array_equal(loaded.predict(xq), model.predict(xq))
    assert_same_gp(loaded[-1], model[-1], StandardScaler().fit(x).transform(xq))
    assert loaded[-1].alpha == 1e-6 and loaded[-1].kernel_.k1.k1.constant_value == 2.0
    assert loaded[-1].theta_.shape == (3,)  # the fixed mean and constant are not optimised


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


def test_a_kernel_set_by_log_marginal_likelihood_is_not_saved(tmp_path):
    gp = ScalableGPRegressor(RBF(1.0) + WhiteKernel(0.1), optimizer=None).fit(*wave())
    gp.log_marginal_likelihood(gp.kernel_.theta + 0.5, clone_kernel=False)
    with pytest.raises(ValueError, match="kernel_: does not hold the hyperparameters theta_"):
        save_model(gp, tmp_path / "m.npz")


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


def test_a_header_too_long_to_load_is_not_saved(pipeline, tmp_path):
    """A file written is a file that loads: a header beyond the loader's cap (a per-point alpha
    of a million values, or metadata, as here) is refused at save."""
    with pytest.raises(ValueError, match="header would take .* characters, more than"):
        save_model(pipeline, tmp_path / "m.npz", metadata={"blob": "x" * (4 * 2**20)})
    assert not any(tmp_path.iterdir())


def test_iterative_solver_kernel_model_round_trip(tmp_path):
    x, y = wave(d=2)
    gp = ScalableGPRegressor(C(1.0) * Matern([1.0, 2.0], nu=0.5) + WhiteKernel(0.1),
                             solver="bbmm", optimizer=None, preconditioner_rank=10, love_rank=20,
                             random_state=0).fit(x, y)
    want = gp.predict(x[:5], return_std=True)
    loaded = load_model(save_model(gp, tmp_path / "bbmm.npz"))
    mean, std = loaded.predict(x[:5], return_std=True)
    np.testing.assert_array_equal(mean, want[0])
    np.testing.assert_allclose(std, want[1], rtol=1e-6)
    assert loaded.kernel_ == gp.kernel_ and loaded._spec == gp._spec


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


@pytest.fixture(scope="module")
def kernel_pipeline():
    x, y = wave(d=2)
    kernel = C(1.0) * RBF([1.0, 2.0]) + C(0.5) * Matern(1.0, nu=2.5) + WhiteKernel(0.1)
    return make_pipeline(StandardScaler(), ScalableGPRegressor(kernel, optimizer=None)).fit(x, y)


def nest(depth):
    node = {"class": "RBF", "length_scale": 1.0, "length_scale_bounds": "fixed"}
    for _ in range(depth):
        node = {"class": "Product", "k1": node, "k2": {"class": "ConstantKernel",
                                                       "constant_value": 1.0,
                                                       "constant_value_bounds": "fixed"}}
    return node


def tree(depth):
    if depth == 0:
        return {"class": "WhiteKernel", "noise_level": 1.0, "noise_level_bounds": "fixed"}
    return {"class": "Sum", "k1": tree(depth - 1), "k2": tree(depth - 1)}


def kernel_json(header, key="kernel"):
    described = gp_description(header)
    return described["params"][key] if key == "kernel" else described["attributes"][key]


def rbf_node(header, key="kernel"):
    return kernel_json(header, key)["k1"]["k1"]["k2"]  # RBF([1, 2])


def matern_node(header, key="kernel"):
    return kernel_json(header, key)["k1"]["k2"]["k2"]


def both(edit):
    """The same edit to ``kernel`` and ``kernel_`` (so only the rule under test fails)."""
    return lambda h: (edit(h, "kernel"), edit(h, "kernel_"))


@pytest.mark.parametrize("edit, message", [
    (lambda h: rbf_node(h).update({"class": "DotProduct"}),
     r"params.kernel.k1.k1.k2.class: kernel class 'DotProduct' is not one of ConstantKernel, RBF"),
    (lambda h: rbf_node(h).update({"class": "__import__"}),
     r"kernel.k1.k1.k2.class: kernel class '__import__' is not one of"),
    (lambda h: gp_description(h)["params"].update(kernel={"class": "os.system", "k1": "ls"}),
     r"params.kernel.class: kernel class 'os.system' is not one of"),
    (lambda h: rbf_node(h).pop("class"), r"k1.k1.k2.class: kernel class None is not one of"),
    (lambda h: rbf_node(h).update(sigma_0=1.0),
     r"k1.k1.k2: unknown key\(s\) 'sigma_0' for RBF; allowed: length_scale, length_scale_bou"),
    (lambda h: rbf_node(h).update(__class__="x"), r"unknown key\(s\) '__class__' for RBF"),
    (lambda h: rbf_node(h).pop("length_scale_bounds"),
     r"k1.k1.k2: missing key\(s\) length_scale_bounds of RBF"),
    (lambda h: rbf_node(h).update(length_scale=[1.0, -2.0]),
     r"k2.length_scale\[1\]: expected a positive finite number, got -2.0"),
    (lambda h: matern_node(h).update(length_scale=float("nan")),
     r"k2.length_scale: expected a positive finite number, got nan"),
    (lambda h: matern_node(h).update(length_scale=float("inf")),
     r"k2.length_scale: expected a positive finite number, got inf"),
    (lambda h: matern_node(h).update(length_scale=10**400), r"expected a positive finite number"),
    (lambda h: matern_node(h).update(length_scale=0), r"expected a positive finite number, got 0"),
    (lambda h: matern_node(h).update(length_scale="1.0"), r"positive finite number, got '1.0'"),
    (lambda h: matern_node(h).update(length_scale=True), r"positive finite number, got True"),
    (lambda h: rbf_node(h).update(length_scale=[]), r"non-empty list of them, got \[\]"),
    (lambda h: gp_description(h)["params"].update(kernel=nest(500)),
     r"params.kernel: kernels nested deeper than 64 levels"),
    (lambda h: gp_description(h)["params"].update(kernel=tree(9)),
     r"params.kernel: more than 256 kernel nodes"),
    (lambda h: matern_node(h).update(nu=2.0),
     r"k2.nu: Matern nu must be one of 0.5, 1.5, 2.5, got 2.0"),
    (lambda h: matern_node(h).update(nu="inf"), r"k2.nu: expected a positive finite number"),
    (lambda h: matern_node(h).update(length_scale_bounds=[1.0]),
     r"k2.length_scale_bounds: expected bounds \[low, high\] or \"fixed\", got \[1.0\]"),
    (lambda h: matern_node(h).update(length_scale_bounds=[1.0, 2.0, 3.0]),
     r"length_scale_bounds: expected bounds \[low, high\]"),
    (lambda h: matern_node(h).update(length_scale_bounds="free"),
     r"length_scale_bounds: expected bounds \[low, high\] or \"fixed\", got 'free'"),
    (lambda h: matern_node(h).update(length_scale_bounds={"low": 1}), r"expected bounds"),
    (lambda h: matern_node(h).update(length_scale_bounds=[2.0, 1.0]),
     r"length_scale_bounds: expected low <= high, got \[2.0, 1.0\]"),
    (lambda h: matern_node(h).update(length_scale_bounds=[-1.0, 1.0]),
     r"length_scale_bounds\[0\]: expected a positive finite number, got -1.0"),
    (lambda h: matern_node(h).update(length_scale_bounds=[[1.0, 2.0]]),
     r"length_scale_bounds: expected bounds \[low, high\]"),  # per-element: ARD values only
    (lambda h: rbf_node(h).update(length_scale_bounds=[[1.0, 2.0]] * 3),
     r"k2.length_scale_bounds: expected one pair per value \(2\), got 3 pairs"),
    (lambda h: gp_description(h)["params"].update(kernel=[1, 2]),
     r"params.kernel: expected a kernel \(an object with a 'class'\), got \[1, 2\]"),
    # well-formed trees that break the estimator's rules or disagree with the fitted state
    (both(lambda h, k: rbf_node(h, k).update(length_scale=[1.0, 2.0, 3.0])),
     r"params.kernel: RBF has 3 lengthscales but X has 2 features"),
    (both(lambda h, k: kernel_json(h, k)["k1"]["k1"].update(
        k1={"class": "WhiteKernel", "noise_level": 1.0, "noise_level_bounds": "fixed"})),
     r"params.kernel: kernel WhiteKernel.* is not supported: WhiteKernel times a kernel other"),
    (lambda h: gp_description(h)["params"].update(alpha=-1.0),
     r"params.kernel: alpha must be a non-negative number"),
    (lambda h: gp_description(h)["params"].update(alpha="1e-10"),
     r"params.alpha: expected a finite number, got '1e-10'"),
    (lambda h: matern_node(h, "kernel_").update(nu=0.5),
     r"attributes.kernel_.k1.k2.k2.nu: is 0.5 where the kernel has 2.5"),
    (lambda h: kernel_json(h, "kernel_").update(k2=kernel_json(h, "kernel_")["k1"]),
     r"attributes.kernel_.k2: is a Sum where the kernel has a WhiteKernel"),
    (lambda h: matern_node(h, "kernel_").update(length_scale=2.0),
     r"attributes.kernel_: does not hold the hyperparameters theta_ gives"),
    (both(lambda h, k: matern_node(h, k).update(length_scale_bounds="fixed")),
     r"arrays.theta_: expected 6 parameters for these sizes, got 7"),
    (lambda h: gp_description(h)["attributes"].update(outputscale_=1.0),
     r"attributes: outputscale_ belong to the default model \(kernel=None\)"),
    (lambda h: gp_description(h)["attributes"].update(kernel_=None),
     r"attributes.kernel_: expected a value, got null"),
    (lambda h: gp_description(h)["attributes"].pop("kernel_"), r"missing kernel_"),
    (lambda h: gp_description(h)["attributes"].update(_spec=None),
     r"unknown key\(s\) '_spec'"),
    (lambda h: h.update(version=2),
     r"params: unknown key\(s\) 'alpha', 'copy_X_train', 'kernel', 'n_targets'"),
    (lambda h: h.update(version=3), r"params: unknown key\(s\) 'copy_X_train', 'n_targets'"),
    (lambda h: h.update(version=True), r"format version True"),
    (lambda h: h.update(version=3.0), r"format version 3.0"),
])
def test_hostile_kernels_are_refused_with_a_reason(kernel_pipeline, tmp_path, edit, message):
    path = crafted(kernel_pipeline, tmp_path, lambda header, _: edit(header))
    with pytest.raises(ModelFileError, match=message):
        load_model(path)


@pytest.mark.parametrize("edit, message", [
    (lambda h: gp_description(h)["attributes"].pop("outputscale_"),
     r"fitted state is incomplete \(missing outputscale_\)"),
    (lambda h: gp_description(h)["attributes"]["kernel_"]["k2"].update(noise_level=0.5),
     r"attributes.kernel_: expected .* \(the default model's kernel\), got "),
    (lambda h: gp_description(h)["params"].update(cg_tol=10**400),
     r"params.cg_tol: expected a finite number, got 1000000"),
    (lambda h: gp_description(h)["attributes"].update(log_marginal_likelihood_value_=-10**400),
     None),  # -inf is allowed there (a divergent fit), as a float overflow
])
def test_default_model_kernel_rules(pipeline, tmp_path, edit, message):
    path = crafted(pipeline, tmp_path, lambda header, _: edit(header))
    if message is None:
        assert load_model(path)[-1].log_marginal_likelihood_value_ == -10**400
        return
    with pytest.raises(ModelFileError, match=message):
        load_model(path)


@pytest.mark.parametrize("edit, message", [
    (lambda h: gp_description(h)["params"].update(prune_tol=5),
     r"params: prune_tol must be in \[0, 1\) \(None for the default\), got 5"),
    (lambda h: gp_description(h)["params"].update(prune_tol=-1),
     r"params: prune_tol must be .* got -1"),
    (lambda h: gp_description(h)["params"].update(prune_tol=1e300),
     r"params: prune_tol must be .* got 1e\+300"),
    (lambda h: gp_description(h)["params"].update(optimizer="adam", learning_rate=-0.1),
     r"params: learning_rate must be positive and finite, got -0.1"),
    (lambda h: gp_description(h)["params"].update(noise_lower_bound=1.0),
     r"params: noise_lower_bound must be a number in \[0, noise=0.1\), got 1.0"),
    (lambda h: gp_description(h)["params"].update(lengthscale=[1.0, 2.0, 3.0]),
     r"params: lengthscale must be a scalar or have 2 entries \(one per feature\)"),
])
def test_parameters_are_checked_by_the_estimators_own_rules(pipeline, tmp_path, edit, message):
    # they passed the schema's types and failed at predict without naming the file
    path = crafted(pipeline, tmp_path, lambda header, _: edit(header))
    with pytest.raises(ModelFileError, match=rf"^{re.escape(str(path))}: "
                                             rf"model.steps\[1\].estimator.{message}"):
        load_model(path)


def with_theta(edit, rbf=(1.0, 2.0), matern=1.0, noise=0.1):
    """``edit(header)`` to ``kernel_``, and ``theta_`` made that of kernel_pipeline's kernel
    with these values, as the edit leaves ``kernel_``."""
    kernel = C(1.0) * RBF(list(rbf)) + C(0.5) * Matern(matern, nu=2.5) + WhiteKernel(noise)

    def edit_both(header, arrays):
        edit(header)
        arrays["1.theta_"][-kernel.n_dims:] = kernel.theta

    return edit_both


@pytest.mark.parametrize("edit, message", [
    (with_theta(lambda h: rbf_node(h, "kernel_").update(length_scale=[1e300, 2.0]),
                rbf=(1e300, 2.0)),
     r"attributes.kernel_.k1.k1.k2.length_scale\[0\]: expected a value from 1.18e-38 to "
     r"8.51e\+37 .*, got 1e\+300"),
    (with_theta(lambda h: matern_node(h, "kernel_").update(length_scale=1e-300), matern=1e-300),
     r"attributes.kernel_.k1.k2.k2.length_scale: expected a value from .*, got 1e-300"),
    (with_theta(lambda h: kernel_json(h, "kernel_")["k2"].update(noise_level=1e39), noise=1e39),
     r"attributes.kernel_.k2.noise_level: expected a value from .*, got 1e\+39"),
    (lambda h, _: rbf_node(h).update(length_scale=[1.0, 1e-40]),
     r"params.kernel.k1.k1.k2.length_scale\[1\]: expected a value from .*, got 1e-40"),
])
def test_hyperparameters_beyond_float32_are_refused(kernel_pipeline, tmp_path, edit, message):
    # a lengthscale of 1e300 or 1e-300 agreeing with theta_ loaded and failed at return_std
    path = crafted(kernel_pipeline, tmp_path, edit)
    with pytest.raises(ModelFileError, match=rf"^{re.escape(str(path))}: .*{message}"):
        load_model(path)

def test_kernels_outside_the_allow_list_are_not_saved(tmp_path):
    from sklearn.gaussian_process.kernels import DotProduct

    gp = ScalableGPRegressor(RBF(1.0) + WhiteKernel(0.1), optimizer=None).fit(*wave())
    gp.kernel_ = gp.kernel_ + DotProduct()  # as a scikit-learn GP's kernel_ could be
    with pytest.raises(TypeError, match="DotProduct is not one of the kernels model files hold"):
        save_model(gp, tmp_path / "m.npz")
    gp = ScalableGPRegressor(RBF(1.0, (0.0, 1e5)) + WhiteKernel(0.1), optimizer=None)
    gp.fit(*wave())
    with pytest.raises(ValueError, match=r"cannot save this model: .*length_scale_bounds\[0\]: "
                                         "expected a positive finite number, got 0.0"):
        save_model(gp, tmp_path / "m.npz")
    assert not any(tmp_path.iterdir())


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


def test_kernel_size_limits_apply_to_model_files(kernel_pipeline, tmp_path):
    # the estimator's limits (scikit-learn's Sum and Product cost 2^depth), not only the decoder's
    path = crafted(kernel_pipeline, tmp_path,
                   lambda h, _: gp_description(h)["params"].update(kernel=nest(11)))
    with pytest.raises(ModelFileError, match=r"params.kernel: the kernel is nested 11 levels deep"):
        load_model(path)
