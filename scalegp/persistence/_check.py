"""Checking a header against the schema before any array data is read, then the values, then
building the estimator."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from scalegp.estimators import check_alpha, check_settings, default_model_start, kernel_spec
from scalegp.persistence._kernels import decode_kernel, encode_kernel, same_structure
from scalegp.persistence._schema import (
    ARRAY_KEY,
    FORMAT_VERSION,
    HEADER_KEY,
    READ_VERSIONS,
    STEP_NAME,
    Attr,
    class_specs,
)
from scalegp.persistence._values import choice, fail, flag, integer


# ---------------------------------------------------------------------------------------------
# checking a description (before reading any array data), then the values


@dataclasses.dataclass
class _Plan:
    """One checked estimator of a description: what to build, once the arrays are read."""

    cls: type
    params: dict
    attributes: dict
    arrays: dict  # attribute -> (archive key, shape, dtype, Attr)
    steps: list | None = None  # Pipeline: [(name, _Plan)]
    #: attribute -> function(estimator) -> value: state rebuilt after the others are set
    derived: dict = dataclasses.field(default_factory=dict)
    #: function(arrays by attribute) -> None: rules that need the array data
    after: list = dataclasses.field(default_factory=list)


def _object(value, where: str, required: tuple, optional: tuple = ()) -> dict:
    if not isinstance(value, dict):
        fail(where, f"expected an object with keys {', '.join(required)}, got "
                    f"{type(value).__name__}")
    missing = [k for k in required if k not in value]
    unknown = sorted(set(value) - set(required) - set(optional))
    if missing:
        fail(where, f"missing key(s) {', '.join(missing)}")
    if unknown:
        fail(where, f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                    f"{', '.join(required + optional)}")
    return value


def _bind(dims: dict, name: str, size: int, where: str) -> None:
    if dims.setdefault(name, size) != size:
        fail(where, f"size {name}={size} disagrees with {name}={dims[name]} elsewhere in the "
                    "model")


def _check_description(description, where: str, dims: dict, top: bool = True,
                       version: int = FORMAT_VERSION) -> _Plan:
    """The `_Plan` of one estimator's description in format ``version``; ``dims`` collects
    sizes shared by the whole model (d) so that every array must agree with them."""
    specs = class_specs(version)
    name = description.get("class") if isinstance(description, dict) else None
    if name not in specs:
        fail(where, f"model class {name!r} is not one of {', '.join(specs)}")
    cls, param_checks, attr_specs = specs[name]
    if name == "sklearn.pipeline.Pipeline":
        _object(description, where, ("class", "params", "steps"))
    else:
        _object(description, where, ("class", "params", "attributes", "arrays"))
    params = _object(description["params"], f"{where}.params", (), tuple(param_checks))
    params = {k: param_checks[k](v, f"{where}.params.{k}") for k, v in params.items()}
    if name == "sklearn.pipeline.Pipeline":
        return _Plan(cls, params, {}, {}, _check_steps(description["steps"], where, dims, top,
                                                        version))
    attr_specs = {k: spec for k, spec in attr_specs.items() if spec.kind != "derived"}
    attributes = _object(description["attributes"], f"{where}.attributes", (), tuple(attr_specs))
    entries = _object(description["arrays"], f"{where}.arrays", (), tuple(attr_specs))
    for key in set(attributes) & set(entries):
        fail(where, f"attribute {key!r} is both a value and an array")
    present = set(attributes) | set(entries)
    missing = [k for k, spec in attr_specs.items() if spec.required and k not in present]
    if missing:
        fail(where, f"fitted state is incomplete (missing {', '.join(missing)})")
    values = {key: _check_value(value, attr_specs[key], f"{where}.attributes.{key}")
              for key, value in attributes.items()}
    local = {"o": 1} if values.get("_y_1d") else {}
    if "n_features_in_" in values:
        _bind(dims, "d", values["n_features_in_"], f"{where}.attributes.n_features_in_")
    arrays = {key: _check_entry(entry, attr_specs[key], values, f"{where}.arrays.{key}", dims,
                                local)
              for key, entry in entries.items()}
    plan = _Plan(cls, params, values, arrays)
    _check_consistency(name, plan, where, dims, local)
    return plan


def _check_steps(steps, where: str, dims: dict, top: bool, version: int) -> list:
    """A Pipeline's steps: ``[(name, _Plan)]``, StandardScalers then one final estimator."""
    if not top or not isinstance(steps, list) or not steps:
        fail(f"{where}.steps", "expected a non-empty list of steps at the top level")
    scaler = class_specs()["sklearn.preprocessing.StandardScaler"][0]
    plans, names = [], set()
    for i, step in enumerate(steps):
        at = f"{where}.steps[{i}]"
        step = _object(step, at, ("name", "estimator"))
        if not (isinstance(step["name"], str) and STEP_NAME.match(step["name"])
                and "__" not in step["name"]) or step["name"] in names:
            fail(f"{at}.name", f"expected a unique name of letters, digits, '.', '-' and "
                               f"single '_', got {step['name']!r}")
        names.add(step["name"])
        plan = _check_description(step["estimator"], f"{at}.estimator", dims, top=False,
                                  version=version)
        if plan.steps is not None or (i < len(steps) - 1 and plan.cls is not scaler):
            fail(at, "every step but the last must be a StandardScaler")
        plans.append((step["name"], plan))
    return plans


def _check_entry(entry, spec: Attr, values: dict, at: str, dims: dict, local: dict):
    """One array's declaration: ``(archive key, shape, dtype, spec)``; its sizes are bound to
    the model's (``dims``) or the estimator's (``local``)."""
    if spec.kind != "array":
        fail(at, f"expected a {spec.kind} value, not an array")
    entry = _object(entry, at, ("key", "shape", "dtype"))
    if not (isinstance(entry["key"], str) and ARRAY_KEY.match(entry["key"])):
        fail(f"{at}.key", f"expected a name of letters, digits, '_' and '.', got "
                          f"{entry['key']!r}")
    template = spec.shape if spec.shape != "y" else (
        ("n",) if values.get("_y_1d") else ("n", "o"))
    shape = entry["shape"]
    if not (isinstance(shape, list) and len(shape) == len(template) and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        fail(f"{at}.shape", f"expected {len(template)} sizes ({', '.join(template)}), got "
                            f"{shape!r}")
    for size_name, size in zip(template, shape):
        _bind(dims if size_name == "d" else local, size_name, size, f"{at}.shape")
    dtype = entry["dtype"]
    if not (isinstance(dtype, str) and (dtype in spec.dtypes or (
            "U" in spec.dtypes and re.fullmatch(r"<U[1-9][0-9]{0,3}", dtype)))):
        fail(f"{at}.dtype", f"expected one of {', '.join(spec.dtypes)}, got {dtype!r}")
    return entry["key"], tuple(shape), np.dtype(dtype), spec


def _check_consistency(name, plan: _Plan, where, dims, local) -> None:
    """Rules across attributes: the model (kernel) and its parameter count, the cache's rank and
    solver, a scaler's statistics."""
    params, values, arrays = plan.params, plan.attributes, plan.arrays
    n_kernel = None
    if name == "scalegp.ScalableGPRegressor":
        _check_gp_settings(plan, where, dims["d"])
        n_kernel = _check_gp_kernel(plan, where, dims["d"], local["n"])
    if name == "scalegp.ScalableGPClassifier":
        _check_classifier(plan, where, dims["d"], local)
    if "t" in local:
        learnt_mean = "_fixed_mean" not in arrays
        want = n_kernel + (local["o"] if learnt_mean else 0)
        if local["t"] != want:
            fail(f"{where}.arrays.theta_", f"expected {want} parameters for these sizes, got "
                                           f"{local['t']}")
    if "k" in local and local["k"] > local["n"]:
        fail(f"{where}.arrays._love_factor", f"rank {local['k']} exceeds n={local['n']}")
    if values.get("solver_") == "exact" and "_love_factor" in arrays or (
            values.get("solver_") == "bbmm" and "_cholesky" in arrays):
        fail(where, f"a variance cache that does not belong to solver {values['solver_']!r}")
    if name == "sklearn.preprocessing.StandardScaler":
        needed = [k for k, flag in (("mean_", params.get("with_mean", True)),
                                    ("scale_", params.get("with_std", True))) if flag]
        if any(k not in arrays for k in needed):
            fail(where, f"{' and '.join(needed)} must be arrays with with_mean/with_std set")


def _check_gp_settings(plan: _Plan, where: str, d: int) -> None:
    """A GP's parameters by the estimator's own checks at fit, for the ranges and combinations
    that the schema's types leave open (``prune_tol`` in [0, 1), a positive ``learning_rate``
    with adam, the default model's start); its ``mesh`` names devices, which only the machine
    that runs the model can check."""
    estimator = plan.cls(**dict(plan.params, mesh=None))
    try:
        check_settings(estimator)
        if plan.params.get("kernel") is None:
            default_model_start(estimator, d)
    except (TypeError, ValueError) as error:
        fail(f"{where}.params", str(error))


def _default_kernel(outputscale, lengthscale, noise):
    """``kernel_`` of a model fitted with ``kernel=None``, as ScalableGPRegressor sets it."""
    from sklearn.gaussian_process import kernels as sk

    return sk.ConstantKernel(outputscale) * sk.RBF(lengthscale) + sk.WhiteKernel(noise)


def _check_gp_kernel(plan: _Plan, where: str, d: int, n: int) -> int:
    """A GP's model: the default one (``kernel=None``: lengthscale_ and outputscale_, and
    kernel_ as they give it) or a scikit-learn kernel (``kernel_`` of its structure, agreeing
    with ``theta_``; ``_spec`` rebuilt, and alpha for the ``n`` training points); returns the
    kernel's count of optimised parameters."""
    params, values, arrays = plan.params, plan.attributes, plan.arrays
    kernel = params.get("kernel")
    default_only = [k for k in ("lengthscale_", "outputscale_") if k in values or k in arrays]
    if kernel is None:
        missing = [k for k in ("lengthscale_", "outputscale_") if k not in default_only]
        if missing:
            fail(where, f"fitted state is incomplete (missing {', '.join(missing)})")
        plan.derived["_spec"] = lambda estimator: None
        plan.derived["_fixed_noise"] = lambda estimator: None
        if "kernel_" not in values:  # format version 2
            plan.derived["kernel_"] = lambda e: _default_kernel(e.outputscale_, e.lengthscale_,
                                                                e.noise_)
        else:
            def check_default(attrs):
                want = _default_kernel(attrs["outputscale_"], attrs["lengthscale_"],
                                       attrs["noise_"])
                if attrs["kernel_"] != want:
                    fail(f"{where}.attributes.kernel_", f"expected {want} (the default model's "
                                                        f"kernel), got {attrs['kernel_']}")
            plan.after.append(check_default)
        return d + 2
    if default_only:
        fail(f"{where}.attributes", f"{' and '.join(default_only)} belong to the default model "
                                    "(kernel=None), not to a model with a kernel")
    alpha = params.get("alpha", plan.cls().alpha)
    try:
        spec = kernel_spec(kernel, alpha, d)
    except (TypeError, ValueError) as error:
        fail(f"{where}.params.kernel", str(error))
    try:
        fixed_noise = check_alpha(alpha, n)
    except ValueError as error:
        fail(f"{where}.params.alpha", str(error))
    plan.derived["_spec"] = lambda estimator: spec
    plan.derived["_fixed_noise"] = lambda estimator: fixed_noise
    same_structure(encode_kernel(values["kernel_"], "kernel_"),
                   encode_kernel(kernel, "kernel"), f"{where}.attributes.kernel_")

    def check_theta(attrs):
        theta = attrs["theta_"][attrs["theta_"].size - kernel.n_dims:]
        fitted = attrs["kernel_"].theta
        if not np.allclose(fitted, theta, rtol=0, atol=1e-9):
            fail(f"{where}.attributes.kernel_", f"does not hold the hyperparameters theta_ "
                                                f"gives: log values {np.round(fitted, 6)}, "
                                                f"theta_ has {np.round(theta, 6)}")
    plan.after.append(check_theta)
    return kernel.n_dims


def _check_classifier(plan: _Plan, where: str, d: int, local: dict) -> None:
    """A classifier's settings (its own checks at fit), its model (``kernel``, or the default
    one for ``d`` features) with one row of ``theta`` per binary problem (one for two classes,
    one per class for more), the labels (sorted, distinct) and each point's class among them;
    ``_spec`` and ``kernel_`` are rebuilt from the model in the units of ``_scale`` (1 where
    absent) and ``_thetas``."""
    values = plan.attributes
    scale = values.setdefault("_scale", 1.0)  # files before it were fitted in X's units
    if np.frexp(scale)[0] != 0.5:
        fail(f"{where}.attributes._scale", f"expected a power of two, got {scale!r}")
    estimator = plan.cls(**plan.params)
    try:
        estimator._settings()
        kernel_spec(estimator._model_kernel(d), 1e-10, d)  # (alpha: any valid one)
        kernel = estimator._model_kernel(d, scale)  # in the units it was fitted in
        spec = kernel_spec(kernel, 1e-10, d)
    except (TypeError, ValueError) as error:
        fail(f"{where}.params", str(error))
    classes = values["n_classes_"]
    if local["c"] != classes:
        fail(f"{where}.arrays.classes_", f"{local['c']} labels, but n_classes_ is {classes}")
    problems = 1 if classes == 2 else classes
    if local["b"] != problems:
        fail(f"{where}.arrays._thetas", f"expected {problems} binary problem(s) for {classes} "
                                        f"classes, got {local['b']}")
    if local["p"] != kernel.n_dims:
        fail(f"{where}.arrays._thetas", f"expected {kernel.n_dims} hyperparameters per problem "
                                        f"for kernel {kernel}, got {local['p']}")
    plan.derived["_spec"] = lambda e: spec
    plan.derived["kernel_"] = lambda e: e._fitted_kernel()
    largest = float(np.log(1 / np.finfo(np.float32).tiny))  # values as _kernels allows them

    def check_values(attrs):
        labels = attrs["classes_"]
        if not np.all(labels[1:] > labels[:-1]):
            fail(f"{where}.arrays.classes_", f"expected distinct labels in increasing order, "
                                             f"got {labels[:10].tolist()}")
        if np.any(attrs["_codes"] >= classes):
            fail(f"{where}.arrays._codes", f"has class numbers >= {classes} (the classes)")
        if np.any(np.abs(attrs["_thetas"]) > largest):
            fail(f"{where}.arrays._thetas", f"has log-hyperparameters beyond ±{largest:.4g} "
                                            "(values that float32 cannot hold)")
    plan.after.append(check_values)


def _check_value(value, spec: Attr, where: str):
    if value is None:
        if not spec.none:
            fail(where, "expected a value, got null")
        return None
    kind = "real" if spec.kind == "array" and spec.scalar else spec.kind
    if kind == "array":
        fail(where, "expected an array (under 'arrays'), got a value")
    if kind == "bool":
        return flag(value, where)
    if kind == "str":
        return choice(*spec.choices)(value, where)
    if kind == "int":
        return integer(int(spec.minimum or 0), spec.maximum)(value, where)
    if kind == "kernel":
        return decode_kernel(value, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(where, f"expected a number, got {value!r:.80}")
    try:
        number = float(value)
    except OverflowError:  # a huge JSON integer
        number = np.inf if value > 0 else -np.inf
    _check_numbers(np.asarray(number, np.float64), spec, where)
    return value


def _check_numbers(values: np.ndarray, spec: Attr, where: str) -> None:
    if spec.finite and not np.all(np.isfinite(values)):
        fail(where, "has non-finite values (NaN or inf)")
    if spec.minimum is not None:
        below = values <= spec.minimum if spec.strict else values < spec.minimum
        if np.any(below):
            fail(where, f"has values {'<=' if spec.strict else '<'} {spec.minimum:g}, e.g. "
                        f"{values[below].ravel()[0]:g}")


def check_arrays(plan: _Plan, arrays: dict, where: str) -> None:
    for i, (_, step) in enumerate(plan.steps or ()):
        check_arrays(step, arrays, f"{where}.steps[{i}].estimator")
    for key, (archive_key, _, _, spec) in plan.arrays.items():
        if arrays[archive_key].dtype.kind != "U":
            _check_numbers(arrays[archive_key], spec, f"{where}.arrays.{key}")
    if plan.after:
        attrs = dict(plan.attributes, **{key: arrays[archive_key] for key, (archive_key, _, _, _)
                                         in plan.arrays.items()})
        for check in plan.after:
            check(attrs)


def build(plan: _Plan, arrays: dict):
    if plan.steps is not None:
        return plan.cls(steps=[(name, build(step, arrays)) for name, step in plan.steps],
                        **plan.params)
    estimator = plan.cls(**plan.params)
    for key, value in plan.attributes.items():
        setattr(estimator, key, value)
    for key, (archive_key, _, _, spec) in plan.arrays.items():
        value = arrays[archive_key]
        if spec.stacked:  # a list again, of arrays or (one value each) Python numbers
            value = [float(v) for v in value] if value.ndim == 1 else list(value)
        setattr(estimator, key, value.astype(object) if spec.as_object else value)
    for key, make in plan.derived.items():
        setattr(estimator, key, make(estimator))
    return estimator


def _check_depth(value, where: str, limit: int = 32) -> None:
    """JSON nested deeper than ``limit`` (the checksum's json.dumps would recurse into it)."""
    level = [value]
    for _ in range(limit):
        level = [v for item in level if isinstance(item, (dict, list))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return
    fail(where, f"nested deeper than {limit} levels")


def check_header(header, where: str) -> tuple[_Plan, dict]:
    """The whole header against the schema; returns the plan and the declared arrays
    (archive key -> (shape, dtype))."""
    _object(header, where, ("format", "version", "scalegp_version", "model", "metadata",
                            "checksum"), ("signature",))
    if not isinstance(header["metadata"], dict):
        fail(f"{where}.metadata", f"expected an object, got {type(header['metadata']).__name__}")
    _check_depth(header["metadata"], f"{where}.metadata")
    if not isinstance(header["scalegp_version"], str):
        fail(f"{where}.scalegp_version", f"expected a string, got {header['scalegp_version']!r}")
    for key in ("checksum", "signature"):
        if key in header and not (isinstance(header[key], str)
                                  and re.fullmatch(r"[0-9a-f]{64}", header[key])):
            fail(f"{where}.{key}", f"expected 64 hexadecimal digits, got {header[key]!r:.80}")
    if type(header["version"]) is not int or header["version"] not in READ_VERSIONS:
        fail(f"{where}.version", f"expected one of {READ_VERSIONS}, got {header['version']!r}")
    plan = _check_description(header["model"], "model", {}, version=header["version"])
    declared: dict = {}

    def collect(p: _Plan):
        for _, step in p.steps or ():
            collect(step)
        for archive_key, shape, dtype, _ in p.arrays.values():
            if archive_key in declared or archive_key == HEADER_KEY:
                fail("model", f"array key {archive_key!r} is used twice")
            declared[archive_key] = (shape, dtype)

    collect(plan)
    return plan, declared
