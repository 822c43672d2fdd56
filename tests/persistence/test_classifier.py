"""Model files of ScalableGPClassifier: round trips that predict exactly as before (two and three
classes, the default model and a scikit-learn kernel, float32 by default), files of the other
kind refused where one kind is expected, and hostile or corrupt classifier files refused with
one ModelFileError naming what is wrong."""

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, WhiteKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from scalegp import ScalableGPClassifier
from scalegp.persistence import ModelFileError, load_model, save_model
from tests.persistence.helpers import crafted, rewrite


def blobs(n=60, classes=2, seed=0):
    """Two features, ``classes`` labels (text for three) that depend on them, noisily."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2)) * [1.0, 3.0] + 2.0
    score = x[:, 0] - 2.0 + 0.3 * rng.normal(size=n)
    if classes == 2:
        return x, (score > 0).astype(int)
    return x, np.array(["low", "mid", "high"])[np.digitize(score, [-0.5, 0.5])]


@pytest.fixture(scope="module")
def binary():
    return ScalableGPClassifier(max_iter=10, random_state=0).fit(*blobs())


@pytest.fixture(scope="module")
def three_classes():
    return ScalableGPClassifier(max_iter=10, random_state=0).fit(*blobs(classes=3))


def assert_same_predictions(model, loaded, x):
    np.testing.assert_array_equal(loaded.predict_proba(x), model.predict_proba(x))
    np.testing.assert_array_equal(loaded.predict(x), model.predict(x))


@pytest.mark.parametrize("classes", [2, 3])
@pytest.mark.parametrize("kernel", [None, C(1.0) * RBF(1.0) + WhiteKernel(0.01)])
def test_round_trip_predicts_exactly_as_before(tmp_path, classes, kernel):
    x, y = blobs(classes=classes)
    model = ScalableGPClassifier(kernel, max_iter=10, random_state=0).fit(x, y)
    loaded = load_model(save_model(model, tmp_path / "gpc.npz"), expect="classifier")
    assert type(loaded) is ScalableGPClassifier and loaded.get_params()["dtype"] is None
    assert loaded._alphas[0].dtype == np.float32  # the default compute dtype, as fitted
    assert_same_predictions(model, loaded, blobs(25, seed=1)[0])
    np.testing.assert_array_equal(loaded.classes_, model.classes_)
    assert loaded.classes_.dtype == model.classes_.dtype
    assert str(loaded.kernel_) == str(model.kernel_)
    assert loaded.log_marginal_likelihood_value_ == model.log_marginal_likelihood_value_
    assert loaded.log_marginal_likelihood() == model.log_marginal_likelihood()
    with np.load(tmp_path / "gpc.npz", allow_pickle=False) as archive:
        assert all(archive[k].dtype.kind != "O" for k in archive.files)


def test_pipeline_and_object_labels_round_trip(tmp_path):
    x, y = blobs(classes=3)
    model = make_pipeline(StandardScaler(), ScalableGPClassifier(max_iter=5, random_state=0))
    model.fit(x, y.astype(object))  # as pandas gives text
    assert model.classes_.dtype == object
    loaded = load_model(save_model(model, tmp_path / "p.npz"), expect="classifier")
    assert_same_predictions(model, loaded, x[:9])
    assert loaded.classes_.tolist() == ["high", "low", "mid"]


def test_float64_matrix_free_classifier_round_trip(tmp_path):
    x, y = blobs(80)
    model = ScalableGPClassifier(solver="cg", dtype="float64", optimizer=None,
                                 preconditioner_rank=10, random_state=0).fit(x, y)
    loaded = load_model(save_model(model, tmp_path / "cg.npz"))
    assert loaded.solver_ == "cg" and loaded._factors[0].dtype == np.float64
    assert_same_predictions(model, loaded, x[:9])


def test_inputs_at_a_large_scale_round_trip(tmp_path):
    # fitted in units of X's spread (_scale, a power of two), kernel_ in X's: both as before;
    # X times 2^100 (1.3e30, whose float32 squares overflow) is fitted as X is, bit for bit
    x, y = blobs(classes=3)
    scale = 2.0**100
    model = ScalableGPClassifier(max_iter=10, random_state=0).fit(scale * x, y)
    ref = ScalableGPClassifier(max_iter=10, random_state=0).fit(x, y)
    queries = blobs(25, seed=1)[0]
    np.testing.assert_array_equal(model.predict_proba(scale * queries),
                                  ref.predict_proba(queries))
    loaded = load_model(save_model(model, tmp_path / "gpc.npz"))
    assert loaded._scale == model._scale == scale * ref._scale == 2.0**101
    assert_same_predictions(model, loaded, scale * queries)
    assert str(loaded.kernel_) == str(model.kernel_)
    assert all(k.k2.length_scale_bounds[1] == 1e5 * 2.0**101 for k in loaded.kernel_.kernels)
    theta = np.concatenate([k.theta for k in loaded.kernel_.kernels])
    assert loaded.log_marginal_likelihood(theta) == pytest.approx(
        model.log_marginal_likelihood_value_, rel=1e-5)


def test_files_without_the_scale_load_in_the_inputs_units(tmp_path):
    # files before _scale were fitted in X's own units: they load with _scale 1
    x, y = blobs()
    model = ScalableGPClassifier(max_iter=10, random_state=0).fit(x / 2, y)
    assert model._scale == 1.0  # X's spread is about 1.1

    def as_version_7(header, arrays):
        header["version"] = 7
        del header["model"]["attributes"]["_scale"]

    loaded = load_model(crafted(model, tmp_path, as_version_7))
    assert loaded._scale == 1.0
    assert_same_predictions(model, loaded, blobs(25, seed=1)[0] / 2)
    assert str(loaded.kernel_) == str(model.kernel_)


def test_files_of_the_other_kind_are_refused_where_one_is_expected(binary, pipeline, tmp_path):
    gpc = save_model(binary, tmp_path / "gpc.npz")
    gpr = save_model(pipeline, tmp_path / "gpr.npz")
    with pytest.raises(ModelFileError, match=r"gpc.npz holds a ScalableGPClassifier, not a "
                                             r"regressor; give a file saved from a regressor"):
        load_model(gpc, expect="regressor")
    with pytest.raises(ModelFileError, match=r"holds a ScalableGPRegressor \(the last step of a "
                                             r"Pipeline\), not a classifier"):
        load_model(gpr, expect="classifier")
    assert type(load_model(gpr, expect="regressor")[-1]).__name__ == "ScalableGPRegressor"
    with pytest.raises(ValueError, match="expect must be one of 'classifier', 'regressor'"):
        load_model(gpc, expect="classifer")


def test_what_a_file_cannot_hold_is_not_saved(binary, tmp_path):
    from sklearn.base import clone

    x, y = blobs()
    mixed = clone(binary).set_params(optimizer=None).fit(x, y)
    mixed.classes_ = np.array([1, "a"], dtype=object)  # fit refuses such labels
    with pytest.raises(TypeError, match="labels that are all text or all numbers"):
        save_model(mixed, tmp_path / "m.npz")
    changed = clone(binary).fit(x, y).set_params(kernel=RBF(2.0))
    with pytest.raises(ValueError, match="its kernel was changed after fit"):
        save_model(changed, tmp_path / "m.npz")

    def optimizer(obj_func, theta, bounds):
        return theta, obj_func(theta, eval_gradient=False)

    custom = ScalableGPClassifier(optimizer=optimizer).fit(x, y)
    with pytest.raises(TypeError, match="cannot save parameter optimizer"):
        save_model(custom, tmp_path / "m.npz")
    assert not any(tmp_path.iterdir())


def _set_array(key, value):
    def edit(header, arrays):
        arrays[key] = value
        header["model"]["arrays"][key.split(".")[-1]].update(
            shape=list(value.shape), dtype=value.dtype.str)
    return edit


def _with(edit_arrays):
    return lambda header, arrays: edit_arrays(arrays)


@pytest.mark.parametrize("edit, message", [
    (_set_array("_alphas", np.zeros((1, 59), np.float32)), r"size n=59 disagrees with n=60"),
    (_set_array("_thetas", np.zeros((2, 3))), r"size b=1 disagrees with b=2"),
    (lambda h, a: [_set_array(k, np.concatenate([a[k], a[k]]))(h, a) for k in
                   ("_thetas", "_alphas", "_factors", "_modes", "_values")],
     r"expected 1 binary problem\(s\) for 2 classes, got 2"),
    (_set_array("_thetas", np.zeros((1, 2))), r"expected 3 hyperparameters per problem"),
    (_with(lambda a: a["_thetas"].__setitem__((0, 1), np.nan)),
     r"model.arrays._thetas: has non-finite values \(NaN or inf\)"),
    (_with(lambda a: a["_thetas"].__setitem__((0, 1), 500.0)),
     r"log-hyperparameters beyond"),
    (_set_array("classes_", np.array([b"a", b"b"])), r"classes_.dtype: expected one of"),
    (_set_array("classes_", np.array([0.0, 1j])), r"classes_.dtype: expected one of"),
    (_set_array("classes_", np.array([1, 0])), r"distinct labels in increasing order"),
    (_set_array("classes_", np.array([0.0, np.nan])), r"classes_: has non-finite values"),
    (_set_array("classes_", np.array([0, 1, 2])), r"3 labels, but n_classes_ is 2"),
    (_with(lambda a: a["_codes"].__setitem__(0, 2)), r"_codes: has class numbers >= 2"),
    (_with(lambda a: a["_codes"].__setitem__(0, -1)), r"_codes: has values < 0"),
    (lambda h, a: h["model"]["params"].update(
        kernel={"class": "DotProduct", "sigma_0": 1.0, "sigma_0_bounds": "fixed"}),
     r"params.kernel.*'DotProduct'"),
    (lambda h, a: h["model"]["params"].update(cg_tol=2.0), r"cg_tol must be a number in \(0, 1\)"),
    (lambda h, a: h["model"]["params"].update(multi_class="one_vs_one"),
     r"params.multi_class: expected one of 'one_vs_rest'"),
    (lambda h, a: h["model"]["attributes"].update(kernel_="RBF"), r"unknown key.*'kernel_'"),
    (lambda h, a: h.update(version=5), r"model class 'scalegp.ScalableGPClassifier' is not one of"),
    (lambda h, a: h["model"]["attributes"].update(_scale=3.0),
     r"attributes._scale: expected a power of two, got 3.0"),
    (lambda h, a: h["model"]["attributes"].update(_scale=-2.0), r"_scale: has values <= 0"),
    (lambda h, a: h["model"]["attributes"].pop("_scale"), r"_scale"),  # required from version 8
])
def test_hostile_classifier_files_are_refused(binary, tmp_path, edit, message):
    with pytest.raises(ModelFileError, match=message):
        load_model(crafted(binary, tmp_path, edit))


def test_a_corrupt_classifier_file_fails_the_checksum(three_classes, tmp_path):
    path = save_model(three_classes, tmp_path / "m.npz")
    rewrite(path, lambda header, arrays: arrays["_alphas"].__imul__(1.001))
    with pytest.raises(ModelFileError, match="checksum mismatch"):
        load_model(path)
