"""Model files that cannot run code: fitted estimators as plain arrays plus a JSON header.

``pickle`` (and joblib) files execute code on load, so a model from an untrusted source is a risk.
:func:`save_model` writes a ``.npz`` archive instead: every fitted numeric array under its own key,
uncompressed, and one JSON header with the format version, the estimator's class (from a fixed
allow-list), its parameters, its scalar fitted attributes, the shape and dtype of every array,
user metadata (e.g. feature names) and a SHA-256 checksum over header and arrays.

:func:`load_model` trusts nothing in the file. It reads the header first and checks it against a
schema: only allow-listed classes, each with only its own parameters (of their types; a
Pipeline's ``memory`` is None) and attributes, and array shapes that agree with each other and
with the model's sizes. Only then does it read each array, after checking its ``.npy`` header
against the declared shape and dtype, so no file can make it allocate more than the file holds.
Then come the checksum, the optional signature, and the values (finite, positive where they must
be). Anything else raises :class:`ModelFileError` naming the problem.

The checksum detects corruption, not tampering: anyone can edit a file and recompute it. Loading
an edited file still cannot run code, but it can load a different model. For tamper-evidence,
sign with a secret key (``save_model(..., key=...)``, an HMAC-SHA256) and load with the same key.

By default a file holds what prediction needs (training inputs, the solve ``alpha``,
hyperparameters, scaler): O(n d) numbers. The variance caches (the exact solver's n × n Cholesky
factor, the iterative solver's n × ``love_rank`` factor) are rebuilt on the first variance
request unless saved with ``store_variance_cache=True``.

Supported: :class:`scalegp.ScalableGPRegressor`, scikit-learn's ``StandardScaler``, and a
``Pipeline`` of StandardScalers ending in either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import json
import os
import re
import tempfile
import zipfile
from pathlib import Path

import numpy as np

FORMAT = "scalegp-model"
FORMAT_VERSION = 2
_HEADER_KEY = "__scalegp_header__"
#: The JSON header is read whole before anything is checked: cap it (a model's header is a few
#: kB plus the feature names).
_MAX_HEADER_CHARS = 4 * 2**20
_ARRAY_KEY = re.compile(r"^[A-Za-z0-9_.]{1,200}$")
_STEP_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class ModelFileError(ValueError):
    """A model file that cannot be loaded: not a scalegp model, corrupt, edited or inconsistent."""


def _fail(where: str, problem: str):
    raise ModelFileError(f"{where}: {problem}")


# ---------------------------------------------------------------------------------------------
# the schema: classes, their parameters (JSON values) and fitted attributes


def _real(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not np.isfinite(value):
        _fail(where, f"expected a finite number, got {value!r}")
    return value


def _integer(minimum, maximum=2**63 - 1):
    def check(value, where):
        if isinstance(value, bool) or not isinstance(value, int) \
                or not minimum <= value <= maximum:
            _fail(where, f"expected an integer in [{minimum}, {maximum}], got {value!r}")
        return value
    return check


def _flag(value, where):
    if not isinstance(value, bool):
        _fail(where, f"expected true or false, got {value!r}")
    return value


def _choice(*options):
    def check(value, where):
        if not any(value is o or (isinstance(value, str) and value == o) for o in options):
            _fail(where, f"expected one of {', '.join(map(repr, options))}, got {value!r}")
        return value
    return check


def _reals(value, where):
    """A number, or a non-empty list of numbers (saved from an array)."""
    if isinstance(value, list):
        if not value:
            _fail(where, "expected a number or a non-empty list of numbers, got []")
        return np.asarray([_real(v, f"{where}[{i}]") for i, v in enumerate(value)], np.float64)
    return _real(value, where)


def _optional(check):
    return lambda value, where: None if value is None else check(value, where)


def _mesh(value, where):
    # A Mesh object is saved as None: it names this machine's devices.
    return value if value == "all" else _optional(_integer(1))(value, where)


@dataclasses.dataclass(frozen=True)
class _Attr:
    """A fitted attribute: a JSON value (``kind`` int, real, bool or str) or an array
    (``kind`` array) of one of ``dtypes`` with ``shape`` in named sizes (n training points,
    d features, o targets, k LOVE rank, t parameters; "y" is (n,) or (n, o) as ``_y_1d``)."""

    kind: str
    shape: tuple | str = ()
    dtypes: tuple = ("<f8", "<f4")
    minimum: float | None = None  # values >= minimum (> with strict)
    maximum: int = 2**63 - 1     # int attributes
    strict: bool = False
    choices: tuple = ()
    none: bool = False      # None is allowed
    scalar: bool = False    # an array attribute that may also be a JSON number
    required: bool = True
    finite: bool = True
    cache: bool = False     # stored only with store_variance_cache


_INTS = ("<i8", "<i4")
_POSITIVE = dict(minimum=0.0, strict=True)


def _specs() -> dict[str, tuple[type, dict, dict]]:
    """Per allow-listed class: the class, its parameters' checks, its attributes."""
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    from scalegp.estimators._gpr import _SOLVERS, ScalableGPRegressor
    from scalegp.estimators._kde import IMPLS
    from scalegp.ops import SCHEMES

    features = dict(n_features_in_=_Attr("int", minimum=1),
                    feature_names_in_=_Attr("array", ("d",), ("U",), required=False))
    return {
        "scalegp.ScalableGPRegressor": (ScalableGPRegressor, dict(
            lengthscale=_reals, outputscale=_real, noise=_real, noise_lower_bound=_real,
            mean=_optional(_reals), normalize_y=_flag,
            optimizer=_choice("L-BFGS-B", "adam", None), learning_rate=_real,
            n_restarts_optimizer=_integer(0), max_iter=_integer(0), solver=_choice(*_SOLVERS),
            exact_max_n=_integer(1), subset_size=_integer(2), max_iter_full=_integer(0),
            num_probes=_integer(1), preconditioner_rank=_integer(1), cg_tol=_real,
            max_cg_iter=_integer(1), love_rank=_integer(1),
            dtype=_choice(None, "float32", "float64"), impl=_choice(*IMPLS), mesh=_mesh,
            mesh_scheme=_choice(*SCHEMES), verbose=lambda v, w: _flag(v, w) if isinstance(
                v, bool) else _integer(0)(v, w),
            random_state=_optional(_integer(0)),
        ), dict(
            features,
            X_train_=_Attr("array", ("n", "d")),
            y_train_=_Attr("array", "y", ("<f8", "<f4", "|b1", "|i1", "|u1", "<i2", "<u2",
                                          "<u4", "<u8") + _INTS),
            alpha_=_Attr("array", "y"),
            theta_=_Attr("array", ("t",), ("<f8",)),
            _y_train_mean=_Attr("array", ("o",), ("<f8",)),
            _y_train_std=_Attr("array", ("o",), ("<f8",), **_POSITIVE),
            _fixed_mean=_Attr("array", ("o",), ("<f8",), none=True),
            _y_1d=_Attr("bool"),
            solver_=_Attr("str", choices=("exact", "bbmm")),
            _probe_seed=_Attr("int", minimum=0, maximum=2**31 - 2),
            lengthscale_=_Attr("array", ("d",), ("<f8",), **_POSITIVE),
            outputscale_=_Attr("real", **_POSITIVE),
            noise_=_Attr("real", **_POSITIVE),
            mean_=_Attr("array", ("o",), ("<f8",)),
            n_iter_=_Attr("int", minimum=0),
            log_marginal_likelihood_value_=_Attr("real", finite=False),
            _cholesky=_Attr("array", ("n", "n"), none=True, cache=True),
            _love_factor=_Attr("array", ("n", "k"), none=True, cache=True),
        )),
        "sklearn.preprocessing.StandardScaler": (StandardScaler, dict(
            copy=_flag, with_mean=_flag, with_std=_flag,
        ), dict(
            features,
            n_samples_seen_=_Attr("array", ("d",), ("<f8",) + _INTS, minimum=0, scalar=True),
            mean_=_Attr("array", ("d",), ("<f8",), none=True),
            var_=_Attr("array", ("d",), ("<f8",), minimum=0, none=True),
            scale_=_Attr("array", ("d",), ("<f8",), **_POSITIVE, none=True),
        )),
        # memory=None: a file must not pick a folder that a later fit writes and unpickles.
        "sklearn.pipeline.Pipeline": (Pipeline, dict(
            memory=_choice(None), transform_input=_choice(None), verbose=_flag,
        ), {}),
    }


def _class_name(estimator) -> str:
    for name, (cls, _, _) in _specs().items():
        if type(estimator) is cls:
            return name
    raise TypeError(
        f"save_model supports {', '.join(_specs())}; got {type(estimator).__name__}. "
        "Use pickle/joblib for other objects, and load those only from trusted sources."
    )


# ---------------------------------------------------------------------------------------------
# encoding: estimator -> (JSON description, arrays)


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
    raise TypeError(f"cannot save {where} of type {type(value).__name__}: model files hold only "
                    "numbers, strings, None and numeric arrays")


def _encode(estimator, prefix: str, arrays: dict, store_cache: bool) -> dict:
    from sklearn.pipeline import Pipeline

    name = _class_name(estimator)
    _, param_checks, attr_specs = _specs()[name]
    params = estimator.get_params(deep=False)
    if isinstance(estimator, Pipeline):
        steps = [{"name": step_name, "estimator": _encode(step, f"{prefix}{i}.", arrays,
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
    attributes, array_entries = {}, {}
    for key, value in vars(estimator).items():
        if key in params:
            continue
        spec = attr_specs.get(key)
        if spec is None:
            raise TypeError(f"save_model does not know the attribute {key} of {name}; update "
                            "scalegp.persistence")
        if spec.cache and not store_cache:
            value = None
        if isinstance(value, np.ndarray):
            if value.dtype.kind == "O":  # feature_names_in_: strings only
                value = value.astype(str)
            value = np.ascontiguousarray(value)
            array_entries[key] = {"key": f"{prefix}{key}", "shape": list(value.shape),
                                  "dtype": value.dtype.str}
            arrays[f"{prefix}{key}"] = value
        else:
            attributes[key] = _json_value(value, f"attribute {key}")
    return {"class": name, "params": {k: _json_value(v, f"parameter {k}")
                                      for k, v in params.items()},
            "attributes": attributes, "arrays": array_entries}


# ---------------------------------------------------------------------------------------------
# checking a description (before reading any array data), then the values


@dataclasses.dataclass
class _Plan:
    """One checked estimator of a description: what to build, once the arrays are read."""

    cls: type
    params: dict
    attributes: dict
    arrays: dict  # attribute -> (archive key, shape, dtype, _Attr)
    steps: list | None = None  # Pipeline: [(name, _Plan)]


def _object(value, where: str, required: tuple, optional: tuple = ()) -> dict:
    if not isinstance(value, dict):
        _fail(where, f"expected an object with keys {', '.join(required)}, got "
                     f"{type(value).__name__}")
    missing = [k for k in required if k not in value]
    unknown = sorted(set(value) - set(required) - set(optional))
    if missing:
        _fail(where, f"missing key(s) {', '.join(missing)}")
    if unknown:
        _fail(where, f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                     f"{', '.join(required + optional)}")
    return value


def _bind(dims: dict, name: str, size: int, where: str) -> None:
    if dims.setdefault(name, size) != size:
        _fail(where, f"size {name}={size} disagrees with {name}={dims[name]} elsewhere in the "
                     "model")


def _check_description(description, where: str, dims: dict, top: bool = True) -> _Plan:
    specs = _specs()
    name = description.get("class") if isinstance(description, dict) else None
    if name not in specs:
        _fail(where, f"model class {name!r} is not one of {', '.join(specs)}")
    cls, param_checks, attr_specs = specs[name]
    if name == "sklearn.pipeline.Pipeline":
        _object(description, where, ("class", "params", "steps"))
    else:
        _object(description, where, ("class", "params", "attributes", "arrays"))
    params = _object(description["params"], f"{where}.params", (), tuple(param_checks))
    params = {k: param_checks[k](v, f"{where}.params.{k}") for k, v in params.items()}
    if name == "sklearn.pipeline.Pipeline":
        steps = description["steps"]
        if not top or not isinstance(steps, list) or not steps:
            _fail(f"{where}.steps", "expected a non-empty list of steps at the top level")
        plans, names = [], set()
        for i, step in enumerate(steps):
            at = f"{where}.steps[{i}]"
            step = _object(step, at, ("name", "estimator"))
            if not (isinstance(step["name"], str) and _STEP_NAME.match(step["name"])
                    and "__" not in step["name"]) or step["name"] in names:
                _fail(f"{at}.name", f"expected a unique name of letters, digits, '.', '-' and "
                                    f"single '_', got {step['name']!r}")
            names.add(step["name"])
            plan = _check_description(step["estimator"], f"{at}.estimator", dims, top=False)
            if plan.steps is not None or (i < len(steps) - 1 and plan.cls is not specs[
                    "sklearn.preprocessing.StandardScaler"][0]):
                _fail(at, "every step but the last must be a StandardScaler")
            plans.append((step["name"], plan))
        return _Plan(cls, params, {}, {}, plans)

    attributes = _object(description["attributes"], f"{where}.attributes", (), tuple(attr_specs))
    entries = _object(description["arrays"], f"{where}.arrays", (), tuple(attr_specs))
    for key in set(attributes) & set(entries):
        _fail(where, f"attribute {key!r} is both a value and an array")
    present = set(attributes) | set(entries)
    missing = [k for k, spec in attr_specs.items() if spec.required and k not in present]
    if missing:
        _fail(where, f"fitted state is incomplete (missing {', '.join(missing)})")
    values = {}
    for key, value in attributes.items():
        values[key] = _check_value(value, attr_specs[key], f"{where}.attributes.{key}")
    local = {"o": 1} if values.get("_y_1d") else {}
    if "n_features_in_" in values:
        _bind(dims, "d", values["n_features_in_"], f"{where}.attributes.n_features_in_")
    arrays = {}
    for key, entry in entries.items():
        spec, at = attr_specs[key], f"{where}.arrays.{key}"
        if spec.kind != "array":
            _fail(at, f"expected a {spec.kind} value, not an array")
        entry = _object(entry, at, ("key", "shape", "dtype"))
        if not (isinstance(entry["key"], str) and _ARRAY_KEY.match(entry["key"])):
            _fail(f"{at}.key", f"expected a name of letters, digits, '_' and '.', got "
                               f"{entry['key']!r}")
        template = spec.shape if spec.shape != "y" else (
            ("n",) if values.get("_y_1d") else ("n", "o"))
        shape = entry["shape"]
        if not (isinstance(shape, list) and len(shape) == len(template) and all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            _fail(f"{at}.shape", f"expected {len(template)} sizes ({', '.join(template)}), got "
                                 f"{shape!r}")
        for size_name, size in zip(template, shape):
            _bind(dims if size_name == "d" else local, size_name, size, f"{at}.shape")
        dtype = entry["dtype"]
        if not (isinstance(dtype, str) and (dtype in spec.dtypes or (
                spec.dtypes == ("U",) and re.fullmatch(r"<U[1-9][0-9]{0,3}", dtype)))):
            _fail(f"{at}.dtype", f"expected one of {', '.join(spec.dtypes)}, got {dtype!r}")
        arrays[key] = (entry["key"], tuple(shape), np.dtype(dtype), spec)
    if "t" in local:
        learnt_mean = "_fixed_mean" not in arrays
        want = dims["d"] + 2 + (local["o"] if learnt_mean else 0)
        if local["t"] != want:
            _fail(f"{where}.arrays.theta_", f"expected {want} parameters for these sizes, got "
                                            f"{local['t']}")
    if "k" in local and local["k"] > local["n"]:
        _fail(f"{where}.arrays._love_factor", f"rank {local['k']} exceeds n={local['n']}")
    if values.get("solver_") == "exact" and "_love_factor" in arrays or (
            values.get("solver_") == "bbmm" and "_cholesky" in arrays):
        _fail(where, f"a variance cache that does not belong to solver {values['solver_']!r}")
    if name == "sklearn.preprocessing.StandardScaler":
        needed = [k for k, flag in (("mean_", params.get("with_mean", True)),
                                    ("scale_", params.get("with_std", True))) if flag]
        if any(k not in arrays for k in needed):
            _fail(where, f"{' and '.join(needed)} must be arrays with with_mean/with_std set")
    return _Plan(cls, params, values, arrays)


def _check_value(value, spec: _Attr, where: str):
    if value is None:
        if not spec.none:
            _fail(where, "expected a value, got null")
        return None
    kind = "real" if spec.kind == "array" and spec.scalar else spec.kind
    if kind == "array":
        _fail(where, "expected an array (under 'arrays'), got a value")
    if kind == "bool":
        return _flag(value, where)
    if kind == "str":
        return _choice(*spec.choices)(value, where)
    if kind == "int":
        return _integer(int(spec.minimum or 0), spec.maximum)(value, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(where, f"expected a number, got {value!r}")
    _check_numbers(np.asarray(value, np.float64), spec, where)
    return value


def _check_numbers(values: np.ndarray, spec: _Attr, where: str) -> None:
    if spec.finite and not np.all(np.isfinite(values)):
        _fail(where, "has non-finite values (NaN or inf)")
    if spec.minimum is not None:
        below = values <= spec.minimum if spec.strict else values < spec.minimum
        if np.any(below):
            _fail(where, f"has values {'<=' if spec.strict else '<'} {spec.minimum:g}, e.g. "
                         f"{values[below].ravel()[0]:g}")


def _check_arrays(plan: _Plan, arrays: dict, where: str) -> None:
    for i, (_, step) in enumerate(plan.steps or ()):
        _check_arrays(step, arrays, f"{where}.steps[{i}].estimator")
    for key, (archive_key, _, _, spec) in plan.arrays.items():
        if spec.dtypes != ("U",):
            _check_numbers(arrays[archive_key], spec, f"{where}.arrays.{key}")


def _build(plan: _Plan, arrays: dict):
    if plan.steps is not None:
        return plan.cls(steps=[(name, _build(step, arrays)) for name, step in plan.steps],
                        **plan.params)
    estimator = plan.cls(**plan.params)
    for key, value in plan.attributes.items():
        setattr(estimator, key, value)
    for key, (archive_key, _, _, _) in plan.arrays.items():
        value = arrays[archive_key]
        setattr(estimator, key, value.astype(object) if value.dtype.kind == "U" else value)
    return estimator


def _check_depth(value, where: str, limit: int = 32) -> None:
    """JSON nested deeper than ``limit`` (the checksum's json.dumps would recurse into it)."""
    level = [value]
    for _ in range(limit):
        level = [v for item in level if isinstance(item, (dict, list))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return
    _fail(where, f"nested deeper than {limit} levels")


def _check_header(header, where: str) -> tuple[_Plan, dict]:
    """The whole header against the schema; returns the plan and the declared arrays
    (archive key -> (shape, dtype))."""
    _object(header, where, ("format", "version", "scalegp_version", "model", "metadata",
                            "checksum"), ("signature",))
    if not isinstance(header["metadata"], dict):
        _fail(f"{where}.metadata", f"expected an object, got {type(header['metadata']).__name__}")
    _check_depth(header["metadata"], f"{where}.metadata")
    if not isinstance(header["scalegp_version"], str):
        _fail(f"{where}.scalegp_version", f"expected a string, got {header['scalegp_version']!r}")
    for key in ("checksum", "signature"):
        if key in header and not (isinstance(header[key], str)
                                  and re.fullmatch(r"[0-9a-f]{64}", header[key])):
            _fail(f"{where}.{key}", f"expected 64 hexadecimal digits, got {header[key]!r:.80}")
    plan = _check_description(header["model"], "model", {})
    declared: dict = {}

    def collect(p: _Plan):
        for _, step in p.steps or ():
            collect(step)
        for archive_key, shape, dtype, _ in p.arrays.values():
            if archive_key in declared or archive_key == _HEADER_KEY:
                _fail("model", f"array key {archive_key!r} is used twice")
            declared[archive_key] = (shape, dtype)

    collect(plan)
    return plan, declared


# ---------------------------------------------------------------------------------------------
# checksum, signature and file access


def _digest(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    content = {k: v for k, v in header.items() if k not in ("checksum", "signature")}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode())
    for key in sorted(arrays):
        value = np.ascontiguousarray(arrays[key])
        digest.update(f"{key}|{value.dtype.str}|{value.shape}|".encode())
        digest.update(value.tobytes())
    return digest.digest()


def _signature(key, digest: bytes) -> str:
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, bytes) or not key:
        raise ValueError(f"key must be a non-empty str or bytes, got {key!r}")
    return hmac.new(key, digest, hashlib.sha256).hexdigest()


def save_model(model, path, *, metadata: dict | None = None, key: str | bytes | None = None,
               store_variance_cache: bool = False) -> Path:
    """Writes a fitted model to ``path`` (``.npz``), atomically (temporary file, then rename).

    Parameters
    ----------
    model : ScalableGPRegressor, StandardScaler or a Pipeline of StandardScalers ending in one
        of them, fitted.
    path : str or Path
    metadata : dict, optional
        JSON-serialisable extras stored in the header, e.g. ``{"features": [...]}``;
        :func:`load_model` returns them with ``return_metadata=True``.
    key : str or bytes, optional
        Signs the file (HMAC-SHA256) so that :func:`load_model` with the same key detects any
        edit; keep the key secret. Without it the file has a checksum only, which detects
        corruption but not tampering.
    store_variance_cache : bool, default=False
        Also store the GP's variance factor (the exact solver's n × n Cholesky factor, the
        iterative solver's n × ``love_rank`` factor, if built). Off, the file holds O(n d)
        numbers and the factor is rebuilt on the first ``return_std``/``return_cov``.

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
        "model": _encode(model, "", arrays, store_variance_cache),
        "metadata": json.loads(json.dumps(metadata or {})),
        "checksum": "0" * 64,  # left out of the digest
    }
    # The loader's checks, here too: a file written is a file that loads.
    try:
        plan, _ = _check_header(header, "header")
        _check_arrays(plan, arrays, "model")
    except ModelFileError as error:
        raise ValueError(f"cannot save this model: {error}") from None
    digest = _digest(header, arrays)
    header["checksum"] = digest.hex()
    if key is not None:
        header["signature"] = _signature(key, digest)
    buffer = io.BytesIO()
    np.savez(buffer, **{_HEADER_KEY: np.array(json.dumps(header))}, **arrays)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def load_model(path, *, return_metadata: bool = False, key: str | bytes | None = None):
    """Reads a model written by :func:`save_model`; never unpickles.

    Parameters
    ----------
    path : str or Path
    return_metadata : bool, default=False
        Also return the metadata dict given to :func:`save_model`.
    key : str or bytes, optional
        The key the file was signed with. With a key, an unsigned file or one signed with
        another key is refused; without one, a signed file is refused.

    Raises
    ------
    ModelFileError
        Not a scalegp model file, an unsupported format version, a header or array that breaks
        the schema, a checksum mismatch (corrupt), a missing or wrong signature.
    """
    path = Path(path)
    if key is not None:
        _signature(key, b"")  # a bad key is the caller's error, before reading anything
    try:
        with open(path, "rb") as f:
            if f.read(6) == np.lib.format.MAGIC_PREFIX:
                raise ModelFileError(f"{path} holds a single array, not a scalegp model file")
        with zipfile.ZipFile(path) as archive:
            members = {info.filename: info for info in archive.infolist()}
            if len(members) != len(archive.infolist()):
                raise ModelFileError(f"{path} has duplicated members")
            if f"{_HEADER_KEY}.npy" not in members:
                raise ModelFileError(f"{path} is not a scalegp model file (no header)")
            raw = _read_member(archive, members[f"{_HEADER_KEY}.npy"], None, path)
            header = _parse_header(raw[()], path)
            plan, declared = _with_path(path, _check_header, header, "header")
            extra = sorted(set(members) - {f"{k}.npy" for k in declared}
                           - {f"{_HEADER_KEY}.npy"})
            if extra:
                raise ModelFileError(f"{path} has members the header does not declare: "
                                     f"{', '.join(extra[:5])}")
            arrays = {}
            for archive_key, (shape, dtype) in declared.items():
                if f"{archive_key}.npy" not in members:
                    raise ModelFileError(f"{path}: array {archive_key!r} is missing")
                arrays[archive_key] = _read_member(archive, members[f"{archive_key}.npy"],
                                                   (shape, dtype), path)
    except (FileNotFoundError, IsADirectoryError, PermissionError, ModelFileError):
        raise
    except MemoryError:
        raise ModelFileError(f"{path}: not enough memory to load this model") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as error:
        raise ModelFileError(f"{path} is not a readable model file ({error})") from None
    digest = _digest(header, arrays)
    if not hmac.compare_digest(header["checksum"], digest.hex()):
        raise ModelFileError(f"{path}: checksum mismatch, the file is corrupt or was modified; "
                             "refit the model or restore the original file")
    _check_signature(header, digest, key, path)
    _with_path(path, _check_arrays, plan, arrays, "model")
    model = _build(plan, arrays)
    return (model, header["metadata"]) if return_metadata else model


def _with_path(path, check, *args):
    try:
        return check(*args)
    except ModelFileError as error:
        raise ModelFileError(f"{path}: {error}") from None


def _check_signature(header: dict, digest: bytes, key, path) -> None:
    signature = header.get("signature")
    if key is None and signature is not None:
        raise ModelFileError(f"{path} is signed; load it with its key (key=..., or the "
                             "SCALEGP_MODEL_KEY environment variable for the command line)")
    if key is not None and signature is None:
        raise ModelFileError(f"{path} is not signed, but a key was given: it may have been "
                             "edited; sign it (save_model(..., key=...)) or load it without a key")
    if key is not None and not hmac.compare_digest(signature, _signature(key, digest)):
        raise ModelFileError(f"{path}: the signature does not match this key: the file was "
                             "modified or signed with another key")


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, declared, path) -> np.ndarray:
    """One ``.npy`` member; its header is checked against ``declared`` (shape, dtype), or for
    the JSON header against the size cap, before its data are read, and its data must fill it
    exactly: memory never exceeds what the file holds."""
    where = f"{path}: member {info.filename!r}"
    if info.compress_type != zipfile.ZIP_STORED:
        raise ModelFileError(f"{where} is compressed; scalegp model files store arrays as is")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ModelFileError(f"{where} has .npy format version {version}, expected 1.0 "
                                 "or 2.0")
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran_order, dtype = read_header(f)
        if declared is None:  # the JSON header: one string
            if shape != () or dtype.kind != "U" or dtype.itemsize > 4 * _MAX_HEADER_CHARS:
                raise ModelFileError(f"{where}: expected one string of at most "
                                     f"{_MAX_HEADER_CHARS} characters, got {dtype} {shape}")
        elif (shape, dtype) != declared or fortran_order:
            raise ModelFileError(f"{where} holds {dtype.str} {shape}"
                                 f"{' (Fortran order)' if fortran_order else ''}; the header "
                                 f"declares {declared[1].str} {declared[0]}")
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=object))  # no overflow
        if info.file_size != f.tell() + nbytes:
            raise ModelFileError(f"{where} has {info.file_size - f.tell()} bytes of data, "
                                 f"{dtype.str} {shape} needs {nbytes}")
        array = np.empty(shape, dtype)
        view, filled = memoryview(array.reshape(-1).view(np.uint8)), 0
        while filled < nbytes:
            count = f.readinto(view[filled:])
            if not count:
                raise ModelFileError(f"{where} is truncated")
            filled += count
    return array


def _parse_header(text, path) -> dict:
    try:
        header = json.loads(str(text))
    except RecursionError:
        raise ModelFileError(f"{path}: the header is nested too deeply") from None
    except json.JSONDecodeError as error:
        raise ModelFileError(f"{path}: the header is not valid JSON ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not a scalegp model file")
    if header.get("version") != FORMAT_VERSION:
        raise ModelFileError(f"{path} has model format version {header.get('version')!r}; this "
                             f"scalegp reads version {FORMAT_VERSION}: refit, or use the scalegp "
                             f"version that wrote it ({header.get('scalegp_version')})")
    return header


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
