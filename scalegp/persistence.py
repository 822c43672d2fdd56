"""Model files that cannot run code: fitted estimators as plain arrays plus a JSON header.

``pickle`` (and joblib) files execute code on load, so a model from an untrusted source is a risk.
:func:`save_model` writes a ``.npz`` archive instead: every fitted numeric array under its own key,
and one JSON header with the format version, the estimator's class (from a fixed allow-list), its
parameters, its scalar fitted attributes, user metadata (e.g. feature names) and a SHA-256 checksum
over header and arrays. :func:`load_model` reads it with ``allow_pickle=False``, rebuilds only
allow-listed classes from JSON values and arrays, checks the checksum and the shapes, and raises
:class:`ModelFileError` naming the problem for anything else, so a corrupt, truncated, edited or
foreign file is rejected instead of half-loaded.

Supported: :class:`scalegp.ScalableGPRegressor`, scikit-learn's ``StandardScaler``, and a
``Pipeline`` of these (e.g. scaling then the GP).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "scalegp-model"
FORMAT_VERSION = 1
_HEADER_KEY = "__scalegp_header__"
#: Parameters that may hold live objects; saved as None unless they are an int or a string.
_RUNTIME_PARAMS = ("random_state", "mesh")
_ATTRIBUTE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*_?$|^_[A-Za-z][A-Za-z0-9_]*$")


class ModelFileError(ValueError):
    """A model file that cannot be loaded: not a scalegp model, corrupt, edited or inconsistent."""


def _allowed_classes() -> dict[str, type]:
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    from scalegp._gp_regressor import ScalableGPRegressor

    return {
        "scalegp.ScalableGPRegressor": ScalableGPRegressor,
        "sklearn.preprocessing.StandardScaler": StandardScaler,
        "sklearn.pipeline.Pipeline": Pipeline,
    }


def _class_name(estimator) -> str:
    for name, cls in _allowed_classes().items():
        if type(estimator) is cls:
            return name
    raise TypeError(
        f"save_model supports {', '.join(_allowed_classes())}; got {type(estimator).__name__}. "
        "Use pickle/joblib for other objects, and load those only from trusted sources."
    )


# ---------------------------------------------------------------------------------------------
# encoding: estimator <-> (JSON description, arrays)


def _json_value(value, where: str):
    """Parameters and scalar attributes as JSON values; numpy scalars become Python numbers."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if np.isfinite(value) else {"float": repr(value)}
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v, where) for v in value]
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":  # e.g. ARD lengthscale
        return {"ndarray": value.tolist(), "dtype": value.dtype.str}
    raise TypeError(f"cannot save {where} of type {type(value).__name__}: model files hold only "
                    "numbers, strings, None and numeric arrays")


def _from_json(value):
    if isinstance(value, dict):
        if "float" in value:
            return float(value["float"])
        if "ndarray" in value:
            return np.asarray(value["ndarray"], dtype=np.dtype(value["dtype"]))
        raise ModelFileError(f"unknown value encoding {sorted(value)}")
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _encode(estimator, prefix: str, arrays: dict[str, np.ndarray]) -> dict:
    from sklearn.pipeline import Pipeline

    name = _class_name(estimator)
    if isinstance(estimator, Pipeline):
        steps = [
            {"name": step_name, "estimator": _encode(step, f"{prefix}{i}.", arrays)}
            for i, (step_name, step) in enumerate(estimator.steps)
        ]
        params = {k: _json_value(v, f"parameter {k}")
                  for k, v in estimator.get_params(deep=False).items() if k != "steps"}
        return {"class": name, "params": params, "steps": steps}

    params = {}
    for key, value in estimator.get_params(deep=False).items():
        if key in _RUNTIME_PARAMS and not (value is None or isinstance(value, (int, str))):
            value = None  # e.g. a RandomState or a Mesh: they steer refits or placement only
        params[key] = _json_value(value, f"parameter {key}")
    attributes, array_keys = {}, {}
    for key, value in vars(estimator).items():
        if key in params:
            continue
        if isinstance(value, np.ndarray):
            if value.dtype.kind == "O":  # e.g. feature_names_in_: strings only
                if not all(isinstance(v, str) for v in value.ravel()):
                    raise TypeError(f"cannot save attribute {key}: an object array that is not "
                                    "all strings")
                value = value.astype(str)
            if value.dtype.kind not in "biufU":
                raise TypeError(f"cannot save attribute {key} of dtype {value.dtype}")
            array_keys[key] = f"{prefix}{key}"
            arrays[array_keys[key]] = value
        else:
            attributes[key] = _json_value(value, f"attribute {key}")
    return {"class": name, "params": params, "attributes": attributes, "arrays": array_keys}


def _decode(description: dict, arrays) -> Any:
    allowed = _allowed_classes()
    name = description.get("class")
    if name not in allowed:
        raise ModelFileError(f"model class {name!r} is not one of {', '.join(allowed)}")
    cls = allowed[name]
    params = {k: _from_json(v) for k, v in description.get("params", {}).items()}
    if "steps" in description:
        steps = [(s["name"], _decode(s["estimator"], arrays)) for s in description["steps"]]
        return cls(steps=steps, **params)
    try:
        estimator = cls(**params)
    except TypeError as error:
        raise ModelFileError(f"parameters of {name} do not match this version: {error}") from None
    restored = {k: _from_json(v) for k, v in description.get("attributes", {}).items()}
    for key, array_key in description.get("arrays", {}).items():
        if array_key not in arrays:
            raise ModelFileError(f"array {array_key!r} is missing")
        value = arrays[array_key]
        restored[key] = value.astype(object) if value.dtype.kind == "U" else value
    for key, value in restored.items():
        if not _ATTRIBUTE_NAME.match(key) or key.startswith("__"):
            raise ModelFileError(f"attribute name {key!r} is not allowed")
        setattr(estimator, key, value)
    _check_consistent(estimator)
    return estimator


def _check_consistent(estimator) -> None:
    """Shape checks for the fitted state that prediction relies on."""
    from scalegp._gp_regressor import ScalableGPRegressor

    if not isinstance(estimator, ScalableGPRegressor):
        return
    required = ("theta_", "alpha_", "X_train_", "y_train_", "n_features_in_", "_y_train_mean",
                "_y_train_std", "_fixed_mean", "_y_1d", "solver_", "_cholesky", "_love_factor")
    missing = [k for k in required if not hasattr(estimator, k)]
    if missing:
        raise ModelFileError(f"fitted state is incomplete (missing {', '.join(missing)})")
    x = np.asarray(estimator.X_train_)
    alpha = np.asarray(estimator.alpha_)
    problems = []
    if x.ndim != 2 or x.shape[1] != estimator.n_features_in_:
        problems.append(f"X_train_ has shape {x.shape}, expected (n, {estimator.n_features_in_})")
    elif alpha.shape[0] != x.shape[0]:
        problems.append(f"alpha_ has {alpha.shape[0]} rows, X_train_ {x.shape[0]}")
    if estimator._cholesky is not None and np.shape(estimator._cholesky) != (x.shape[0],) * 2:
        problems.append(f"the Cholesky factor has shape {np.shape(estimator._cholesky)}")
    for key in ("theta_", "alpha_", "X_train_"):
        if not np.all(np.isfinite(np.asarray(getattr(estimator, key), np.float64))):
            problems.append(f"{key} has non-finite values")
    if problems:
        raise ModelFileError("inconsistent fitted state: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# checksum and file access


def _checksum(header: dict, arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for key in sorted(arrays):
        value = np.ascontiguousarray(arrays[key])
        digest.update(f"{key}|{value.dtype.str}|{value.shape}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def save_model(model, path, *, metadata: dict | None = None) -> Path:
    """Writes a fitted model to ``path`` (``.npz``), atomically (temporary file, then rename).

    Parameters
    ----------
    model : ScalableGPRegressor, StandardScaler or a Pipeline of these, fitted.
    path : str or Path
    metadata : dict, optional
        JSON-serialisable extras stored in the header, e.g. ``{"features": [...]}``;
        :func:`load_model` returns them with ``return_metadata=True``.

    Returns
    -------
    Path written.
    """
    from sklearn.utils.validation import check_is_fitted

    check_is_fitted(model)
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "scalegp_version": _version(),
        "model": _encode(model, "", arrays),
        "metadata": json.loads(json.dumps(metadata or {})),
    }
    header["checksum"] = _checksum(header, arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **{_HEADER_KEY: np.array(json.dumps(header))}, **arrays)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def load_model(path, *, return_metadata: bool = False):
    """Reads a model written by :func:`save_model`; never unpickles.

    Raises
    ------
    ModelFileError
        Not a scalegp model file, an unsupported format version, a checksum mismatch (edited or
        corrupt), an unknown class or an inconsistent fitted state.
    """
    path = Path(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            raise ModelFileError(f"{path} holds a single array, not a scalegp model file")
        with loaded as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (FileNotFoundError, IsADirectoryError, PermissionError, ModelFileError):
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as error:
        raise ModelFileError(f"{path} is not a readable model file ({error})") from None
    if _HEADER_KEY not in arrays:
        raise ModelFileError(f"{path} is not a scalegp model file (no header)")
    try:
        header = json.loads(str(arrays.pop(_HEADER_KEY)[()]))
    except (json.JSONDecodeError, TypeError) as error:
        raise ModelFileError(f"{path}: the header is not valid JSON ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not a scalegp model file")
    if header.get("version") != FORMAT_VERSION:
        raise ModelFileError(f"{path} has model format version {header.get('version')!r}; this "
                             f"scalegp reads version {FORMAT_VERSION}: refit, or use the scalegp "
                             f"version that wrote it ({header.get('scalegp_version')})")
    stored = header.pop("checksum", None)
    if stored != _checksum(header, arrays):
        raise ModelFileError(f"{path}: checksum mismatch, the file was modified or is corrupt; "
                             "refit the model or restore the original file")
    model = _decode(header["model"], arrays)
    return (model, header.get("metadata", {})) if return_metadata else model


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes via a temporary file in the same folder and a rename, so a reader never sees a
    half-written file and a failure leaves any previous file untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _version() -> str:
    import scalegp

    return scalegp.__version__
