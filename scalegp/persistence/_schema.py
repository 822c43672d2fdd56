"""What a model file may hold: the allow-listed classes, their parameters and attributes with
their types and shapes, and how an estimator is encoded into a header and arrays."""

from __future__ import annotations

import dataclasses
import re

import numpy as np


FORMAT = "scalegp-model"
#: The version written. It changes when a file could hold something an older scalegp cannot
#: read; a newer scalegp keeps reading the older versions in `READ_VERSIONS` where it can.
#: 3: ScalableGPRegressor's ``kernel`` and ``alpha`` parameters and ``kernel_`` attribute
#: (scikit-learn kernels as JSON trees, `scalegp.persistence._kernels`). Version 2 files (the
#: default model only) load as models with ``kernel=None``, ``kernel_`` rebuilt.
#: 4: ScalableGPRegressor's ``n_targets`` and ``copy_X_train`` parameters, ``alpha`` one value
#: per training point, optimizer "fmin_l_bfgs_b". Version 3 files load with the defaults.
#: 5: its ``prune`` and ``prune_tol`` parameters; older files load with the defaults.
FORMAT_VERSION = 5
READ_VERSIONS = (2, 3, 4, 5)
#: What each older version lacks: {first version with them: {class: (parameters,
#: attributes)}}.
_ABSENT_BEFORE = {
    3: {"scalegp.ScalableGPRegressor": (("kernel", "alpha"), ("kernel_",))},
    4: {"scalegp.ScalableGPRegressor": (("n_targets", "copy_X_train"), ())},
    5: {"scalegp.ScalableGPRegressor": (("prune", "prune_tol"), ())},
}
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


def _finite_number(value) -> bool:
    """A JSON number (not a bool) that is finite as a float (a huge integer is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return bool(np.isfinite(float(value)))
    except OverflowError:
        return False


def _real(value, where):
    if not _finite_number(value):
        _fail(where, f"expected a finite number, got {value!r:.80}")
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


def _kernel(value, where):
    from scalegp.persistence._kernels import decode_kernel

    return decode_kernel(value, where)


def _mesh(value, where):
    # A Mesh object is saved as None: it names this machine's devices.
    return value if value == "all" else _optional(_integer(1))(value, where)


@dataclasses.dataclass(frozen=True)
class _Attr:
    """A fitted attribute: a JSON value (``kind`` int, real, bool, str or kernel, a
    scikit-learn kernel as `scalegp.persistence._kernels` encodes it) or an array (``kind``
    array) of one of ``dtypes`` with ``shape`` in named sizes (n training points, d features,
    o targets, k LOVE rank, t parameters; "y" is (n,) or (n, o) as ``_y_1d``). ``kind``
    derived: state rebuilt at load from the rest, never stored."""

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


def _specs(version: int = FORMAT_VERSION) -> dict[str, tuple[type, dict, dict]]:
    """Per allow-listed class: the class, its parameters' checks, its attributes, as format
    ``version`` has them."""
    specs = _all_specs()
    for first, absent in _ABSENT_BEFORE.items():
        if version >= first:
            continue
        for name, (params, attributes) in absent.items():
            cls, param_checks, attr_specs = specs[name]
            specs[name] = (cls, {k: v for k, v in param_checks.items() if k not in params},
                           {k: v for k, v in attr_specs.items() if k not in attributes})
    return specs


def _all_specs() -> dict[str, tuple[type, dict, dict]]:
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    from scalegp.estimators._gpr import _SOLVERS, ScalableGPRegressor
    from scalegp.estimators._kde import IMPLS
    from scalegp.ops import SCHEMES

    features = dict(n_features_in_=_Attr("int", minimum=1),
                    feature_names_in_=_Attr("array", ("d",), ("U",), required=False))
    return {
        "scalegp.ScalableGPRegressor": (ScalableGPRegressor, dict(
            kernel=_optional(_kernel), alpha=_reals, lengthscale=_reals, outputscale=_real, noise=_real, noise_lower_bound=_real,
            mean=_optional(_reals), normalize_y=_flag, copy_X_train=_flag,
            n_targets=_optional(_integer(1)),
            optimizer=_choice("L-BFGS-B", "fmin_l_bfgs_b", "adam", None), learning_rate=_real,
            n_restarts_optimizer=_integer(0), max_iter=_integer(0), solver=_choice(*_SOLVERS),
            exact_max_n=_integer(1), subset_size=_integer(2), max_iter_full=_integer(0),
            num_probes=_integer(1), preconditioner_rank=_integer(1), cg_tol=_real,
            max_cg_iter=_integer(1), love_rank=_integer(1),
            dtype=_choice(None, "float32", "float64"), impl=_choice(*IMPLS), mesh=_mesh,
            mesh_scheme=_choice(*SCHEMES), prune=_choice(True, False, "auto"),
            prune_tol=_optional(_real), verbose=lambda v, w: _flag(v, w) if isinstance(
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
            # the default model's (kernel=None) only: required there (_check_consistency)
            lengthscale_=_Attr("array", ("d",), ("<f8",), **_POSITIVE, required=False),
            outputscale_=_Attr("real", **_POSITIVE, required=False),
            kernel_=_Attr("kernel"),
            _spec=_Attr("derived"),
            _fixed_noise=_Attr("derived"),  # alpha for the training points, from the params
            # with a kernel: its WhiteKernel terms (0 without any; version 3 files: plus alpha)
            noise_=_Attr("real", minimum=0.0),
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


def _check_spec_current(gp) -> None:
    """A GP's compiled kernel (``_spec``) and the alpha of its training points are rebuilt at
    load from its ``kernel`` and ``alpha``: they must still be those it was fitted with (not
    changed by ``set_params`` since)."""
    from scalegp.estimators._gpr_kernels import check_alpha, kernel_spec

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
    from scalegp.persistence._kernels import encode_kernel, is_kernel

    if is_kernel(value):
        return encode_kernel(value, where)
    raise TypeError(f"cannot save {where} of type {type(value).__name__}: model files hold only "
                    "numbers, strings, None, numeric arrays and scikit-learn kernels")


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
    if params.get("dtype") is not None:
        try:  # np.float64 and the like, as their name
            params["dtype"] = np.dtype(params["dtype"]).name
        except TypeError:
            pass  # refused by the check
    if name == "scalegp.ScalableGPRegressor":
        _check_spec_current(estimator)
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
