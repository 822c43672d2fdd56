"""Encoding a fitted estimator for a model file: its JSON description (class, parameters, scalar
attributes, array declarations, a Pipeline's steps) and its arrays, as the schema's
`class_specs` allow them."""

from __future__ import annotations

import numpy as np

from scalegp.estimators import check_alpha, kernel_spec
from scalegp.persistence._kernels import encode_kernel, is_kernel
from scalegp.persistence._schema import class_specs


def _check_spec_current(gp) -> None:
    """A GP's compiled kernel (``_spec``) and the alpha of its training points are rebuilt at
    load from its ``kernel`` and ``alpha``: they must still be those it was fitted with (not
    changed by ``set_params`` since)."""
    try:
        current = kernel_spec(gp.kernel, gp.alpha, gp.n_features_in_)
        alpha = None if current is None else check_alpha(gp.alpha, gp.X_train_.shape[0])
        fitted = getattr(gp, "_fixed_noise", None)
        same = current == getattr(gp, "_spec", None) and (
            alpha is fitted if alpha is None or fitted is None
            else np.shape(alpha) == np.shape(fitted) and np.array_equal(alpha, fitted))
    except (TypeError, ValueError):
        same = False
    if not same:
        raise ValueError("cannot save this model: its kernel or alpha was changed after fit "
                         "(set_params); refit it, or restore the settings it was fitted with")


def _check_classifier_current(gpc) -> None:
    """A classifier's compiled kernel is rebuilt at load from its ``kernel``: it must still be
    the one it was fitted with."""
    try:
        current = kernel_spec(gpc._model_kernel(gpc.n_features_in_, gpc._scale), 1e-10,
                              gpc.n_features_in_)
    except (TypeError, ValueError):
        current = None
    if current != getattr(gpc, "_spec", None):
        raise ValueError("cannot save this model: its kernel was changed after fit "
                         "(set_params); refit it, or restore the kernel it was fitted with")


def _labels(value: np.ndarray, where: str) -> np.ndarray:
    """An object array of labels (scikit-learn keeps pandas' text so) as text or numbers."""
    items = value.tolist()
    if all(isinstance(v, str) for v in items):
        return value.astype(str)
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
           for v in items):
        return np.asarray(items)
    raise TypeError(f"cannot save {where}: model files hold labels that are all text or all "
                    f"numbers, got {sorted({type(v).__name__ for v in items})}")


def _json_value(value, where: str):
    """Parameters and scalar attributes as JSON values; numpy scalars and small parameter
    arrays (an ARD lengthscale) become Python numbers and lists."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iuf":
        return value.astype(np.float64).tolist()
    if is_kernel(value):
        return encode_kernel(value, where)
    raise TypeError(f"cannot save {where} of type {type(value).__name__}: model files hold only "
                    "numbers, strings, None, numeric arrays and scikit-learn kernels")


def encode(estimator, prefix: str, arrays: dict, store_cache: bool) -> dict:
    """``estimator``'s JSON description; its arrays go into ``arrays`` under ``prefix`` plus the
    attribute's name (a Pipeline's step i under ``prefix`` + "i."), the variance caches as None
    unless ``store_cache``. A TypeError for what the schema does not know."""
    from sklearn.pipeline import Pipeline

    name = _class_name(estimator)
    _, param_checks, attr_specs = class_specs()[name]
    params = estimator.get_params(deep=False)
    if isinstance(estimator, Pipeline):
        steps = [{"name": step_name, "estimator": encode(step, f"{prefix}{i}.", arrays,
                                                          store_cache)}
                 for i, (step_name, step) in enumerate(params.pop("steps"))]
        return {"class": name, "params": {k: _json_value(v, f"parameter {k}")
                                          for k, v in params.items()}, "steps": steps}
    if set(params) != set(param_checks):
        raise TypeError(f"save_model does not know the parameters "
                        f"{sorted(set(params) ^ set(param_checks))} of {name}; update "
                        "scalegp.persistence")
    if not (params.get("mesh") is None or isinstance(params["mesh"], (int, str))):
        params["mesh"] = None  # a Mesh or a device list: it names this machine's devices
    if not (params.get("random_state") is None or isinstance(params["random_state"], int)):
        params["random_state"] = None  # a RandomState steers refits only
    if params.get("dtype") is not None:
        try:  # np.float64 and the like, as their name
            params["dtype"] = np.dtype(params["dtype"]).name
        except TypeError:
            pass  # refused by the check
    if name == "scalegp.ScalableGPRegressor":
        _check_spec_current(estimator)
    if name == "scalegp.ScalableGPClassifier":
        _check_classifier_current(estimator)
    attributes, array_entries = {}, {}
    for key, value in vars(estimator).items():
        if key in params:
            continue
        spec = attr_specs.get(key)
        if spec is None:
            raise TypeError(f"save_model does not know the attribute {key} of {name}; update "
                            "scalegp.persistence")
        if spec.kind == "derived":
            continue
        if spec.cache and not store_cache:
            value = None
        if spec.stacked:  # a list of equal-shape arrays, or of numbers
            value = np.stack([np.asarray(v) for v in value])
        if isinstance(value, np.ndarray):
            if value.dtype.kind == "O":  # feature_names_in_ (text), classes_
                value = _labels(value, f"attribute {key}")
            value = np.ascontiguousarray(value)
            array_entries[key] = {"key": f"{prefix}{key}", "shape": list(value.shape),
                                  "dtype": value.dtype.str}
            arrays[f"{prefix}{key}"] = value
        else:
            attributes[key] = _json_value(value, f"attribute {key}")
    return {"class": name, "params": {k: _json_value(v, f"parameter {k}")
                                      for k, v in params.items()},
            "attributes": attributes, "arrays": array_entries}


def _class_name(estimator) -> str:
    for name, (cls, _, _) in class_specs().items():
        if type(estimator) is cls:
            return name
    raise TypeError(
        f"save_model supports {', '.join(class_specs())}; got {type(estimator).__name__}. "
        "Use pickle/joblib for other objects, and load those only from trusted sources."
    )
