"""scalegp.persistence._check: a header is checked against the schema before any array is read,
then the values and the rules across attributes (the estimator's own settings checks, the
model's kernel and theta_), each failure a ModelFileError naming where."""

import json
import re

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import RBF, WhiteKernel

from scalegp import ScalableGPRegressor
from scalegp.persistence import ModelFileError, load_model, save_model
from tests.persistence.helpers import crafted, gp_description, nest, resign, rewrite, wave


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


def test_a_kernel_set_by_log_marginal_likelihood_is_not_saved(tmp_path):
    gp = ScalableGPRegressor(RBF(1.0) + WhiteKernel(0.1), optimizer=None).fit(*wave())
    gp.log_marginal_likelihood(gp.kernel_.theta + 0.5, clone_kernel=False)
    with pytest.raises(ValueError, match="kernel_: does not hold the hyperparameters theta_"):
        save_model(gp, tmp_path / "m.npz")


def test_kernel_size_limits_apply_to_model_files(kernel_pipeline, tmp_path):
    # the estimator's limits (scikit-learn's Sum and Product cost 2^depth), not only the decoder's
    path = crafted(kernel_pipeline, tmp_path,
                   lambda h, _: gp_description(h)["params"].update(kernel=nest(11)))
    with pytest.raises(ModelFileError, match=r"params.kernel: the kernel is nested 11 levels deep"):
        load_model(path)
