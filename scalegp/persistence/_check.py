"""Checking a header against the schema before any array data is read, then the values, then
building the estimator."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from scalegp.persistence._schema import (
    _ARRAY_KEY,
    _HEADER_KEY,
    _STEP_NAME,
    _Attr,
    _choice,
    _fail,
    _flag,
    _integer,
    _specs,
)


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
    """The `_Plan` of one estimator's description; ``dims`` collects sizes shared by the whole
    model (d) so that every array must agree with them."""
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
        return _Plan(cls, params, {}, {}, _check_steps(description["steps"], where, dims, top))
    attributes = _object(description["attributes"], f"{where}.attributes", (), tuple(attr_specs))
    entries = _object(description["arrays"], f"{where}.arrays", (), tuple(attr_specs))
    for key in set(attributes) & set(entries):
        _fail(where, f"attribute {key!r} is both a value and an array")
    present = set(attributes) | set(entries)
    missing = [k for k, spec in attr_specs.items() if spec.required and k not in present]
    if missing:
        _fail(where, f"fitted state is incomplete (missing {', '.join(missing)})")
    values = {key: _check_value(value, attr_specs[key], f"{where}.attributes.{key}")
              for key, value in attributes.items()}
    local = {"o": 1} if values.get("_y_1d") else {}
    if "n_features_in_" in values:
        _bind(dims, "d", values["n_features_in_"], f"{where}.attributes.n_features_in_")
    arrays = {key: _check_entry(entry, attr_specs[key], values, f"{where}.arrays.{key}", dims,
                                local)
              for key, entry in entries.items()}
    _check_consistency(name, params, values, arrays, where, dims, local)
    return _Plan(cls, params, values, arrays)


def _check_steps(steps, where: str, dims: dict, top: bool) -> list:
    """A Pipeline's steps: ``[(name, _Plan)]``, StandardScalers then one final estimator."""
    if not top or not isinstance(steps, list) or not steps:
        _fail(f"{where}.steps", "expected a non-empty list of steps at the top level")
    scaler = _specs()["sklearn.preprocessing.StandardScaler"][0]
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
        if plan.steps is not None or (i < len(steps) - 1 and plan.cls is not scaler):
            _fail(at, "every step but the last must be a StandardScaler")
        plans.append((step["name"], plan))
    return plans


def _check_entry(entry, spec: _Attr, values: dict, at: str, dims: dict, local: dict):
    """One array's declaration: ``(archive key, shape, dtype, spec)``; its sizes are bound to
    the model's (``dims``) or the estimator's (``local``)."""
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
    return entry["key"], tuple(shape), np.dtype(dtype), spec


def _check_consistency(name, params, values, arrays, where, dims, local) -> None:
    """Rules across attributes: the parameter count, the cache's rank and solver, a scaler's
    statistics."""
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
