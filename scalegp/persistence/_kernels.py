"""scikit-learn kernels in a model file: a JSON tree of allow-listed kernel classes, never
pickled.

A node is ``{"class": NAME, <the class's constructor keywords>}``: the hyperparameter values
(positive numbers in `HYPERPARAMETER_RANGE`; RBF's and Matern's ``length_scale`` may be a list,
one per feature),
their bounds (``[low, high]``, positive finite with low <= high, or ``"fixed"``; an ARD
``length_scale`` may have one pair per feature), Matern's ``nu`` (0.5, 1.5 or 2.5) and, for
Sum and Product, the operands ``k1`` and ``k2`` (nodes). Decoding constructs only the classes
below, with every keyword of the class and no other, each value checked first. For example
``ConstantKernel(2.0) * RBF([1.0, 3.0]) + WhiteKernel(0.1, "fixed")`` is::

    {"class": "Sum",
     "k1": {"class": "Product",
            "k1": {"class": "ConstantKernel", "constant_value": 2.0,
                   "constant_value_bounds": [1e-05, 100000.0]},
            "k2": {"class": "RBF", "length_scale": [1.0, 3.0],
                   "length_scale_bounds": [1e-05, 100000.0]}},
     "k2": {"class": "WhiteKernel", "noise_level": 0.1, "noise_level_bounds": "fixed"}}
"""

from __future__ import annotations

import math

import numpy as np

from scalegp.ops import MATERN_NUS
from scalegp.persistence._values import fail

#: A kernel tree deeper than this, or with more nodes, is refused (a sum of n terms built with
#: ``+`` is n - 1 levels deep).
MAX_DEPTH = 64
MAX_NODES = 256
#: A hyperparameter value must lie here: it and its reciprocal are then normal float32 numbers.
#: float32 is the default compute dtype; beyond this range a lengthscale or its reciprocal is 0
#: or inf there and predictions fail. A fit's optimiser, in log space within the kernel's bounds
#: (1e-5 to 1e5 by default), stays far inside.
HYPERPARAMETER_RANGE = (float(np.finfo(np.float32).tiny), 1 / float(np.finfo(np.float32).tiny))

# value kinds: "scalar" (a positive number), "ard" (a positive number or a non-empty list of
# them), "bounds" (of the hyperparameter named), "nu", "kernel" (a node)
_CLASSES = {
    "ConstantKernel": {"constant_value": "scalar", "constant_value_bounds": "bounds"},
    "RBF": {"length_scale": "ard", "length_scale_bounds": "bounds"},
    "Matern": {"length_scale": "ard", "length_scale_bounds": "bounds", "nu": "nu"},
    "RationalQuadratic": {"length_scale": "scalar", "alpha": "scalar",
                          "length_scale_bounds": "bounds", "alpha_bounds": "bounds"},
    "ExpSineSquared": {"length_scale": "scalar", "periodicity": "scalar",
                       "length_scale_bounds": "bounds", "periodicity_bounds": "bounds"},
    "WhiteKernel": {"noise_level": "scalar", "noise_level_bounds": "bounds"},
    "Sum": {"k1": "kernel", "k2": "kernel"},
    "Product": {"k1": "kernel", "k2": "kernel"},
}


def _sklearn_classes() -> dict:
    from sklearn.gaussian_process import kernels as sk

    return {name: getattr(sk, name) for name in _CLASSES}


# ---------------------------------------------------------------------------------------------
# encoding


def is_kernel(value) -> bool:
    from sklearn.gaussian_process.kernels import Kernel

    return isinstance(value, Kernel)


def encode_kernel(kernel, where: str, _depth: int = 0) -> dict:
    """``kernel`` as a JSON tree; a TypeError for a class or keyword outside the allow-list
    (the loader's checks then run on the result, so what is written can be read)."""
    if _depth > MAX_DEPTH:
        raise TypeError(f"cannot save {where}: kernels nested deeper than {MAX_DEPTH} levels")
    name = next((n for n, cls in _sklearn_classes().items() if type(kernel) is cls), None)
    if name is None:
        raise TypeError(f"cannot save {where}: {type(kernel).__name__} is not one of the kernels "
                        f"model files hold ({', '.join(_CLASSES)})")
    params = kernel.get_params(deep=False)
    if set(params) != set(_CLASSES[name]):
        raise TypeError(f"cannot save {where}: save_model does not know the parameters "
                        f"{sorted(set(params) ^ set(_CLASSES[name]))} of {name}; update "
                        "scalegp.persistence")
    node = {"class": name}
    for key, kind in _CLASSES[name].items():
        value = params[key]
        if kind == "kernel":
            node[key] = encode_kernel(value, where, _depth + 1)
        elif kind == "bounds" and isinstance(value, str):
            node[key] = value
        elif kind == "bounds":
            pairs = np.asarray(value, np.float64)
            node[key] = (pairs.reshape(2).tolist() if pairs.size == 2
                         else pairs.tolist())
        elif np.ndim(value) == 0:
            node[key] = _number(value)
        else:
            node[key] = np.asarray(value, np.float64).tolist()
    return node


def _number(value):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return value  # refused by the check


# ---------------------------------------------------------------------------------------------
# decoding


def decode_kernel(value, where: str):
    """The scikit-learn kernel a checked JSON tree describes; a ModelFileError naming the
    problem for anything else."""
    count = [0]
    return _decode(value, where, where, 0, count)


def _decode(node, where: str, root: str, depth: int, count: list):
    if depth > MAX_DEPTH:
        fail(root, f"kernels nested deeper than {MAX_DEPTH} levels")
    count[0] += 1
    if count[0] > MAX_NODES:
        fail(root, f"more than {MAX_NODES} kernel nodes")
    if not isinstance(node, dict):
        fail(where, f"expected a kernel (an object with a 'class'), got {_show(node)}")
    name = node.get("class")
    if not (isinstance(name, str) and name in _CLASSES):
        fail(f"{where}.class", f"kernel class {_show(name)} is not one of "
                               f"{', '.join(_CLASSES)}")
    keys = _CLASSES[name]
    missing = [k for k in keys if k not in node]
    unknown = sorted(set(node) - set(keys) - {"class"})
    if unknown:
        fail(where, f"unknown key(s) {', '.join(_show(k) for k in unknown)} for {name}; "
                    f"allowed: {', '.join(keys)}")
    if missing:
        fail(where, f"missing key(s) {', '.join(missing)} of {name}")
    kwargs = {}
    for key, kind in keys.items():
        at = f"{where}.{key}"
        if kind == "kernel":
            kwargs[key] = _decode(node[key], at, root, depth + 1, count)
        elif kind == "scalar":
            kwargs[key] = _hyperparameter(node[key], at)
        elif kind == "ard":
            kwargs[key] = _positives(node[key], at)
        elif kind == "nu":
            nu = _positive(node[key], at)
            if float(nu) not in MATERN_NUS:
                fail(at, f"Matern nu must be one of {', '.join(map(str, MATERN_NUS))}, got {nu!r}")
            kwargs[key] = nu
    for key, kind in keys.items():
        if kind == "bounds":
            kwargs[key] = _bounds(node[key], kwargs[key[: -len("_bounds")]],
                                  f"{where}.{key}")
    return _sklearn_classes()[name](**kwargs)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive(value, where: str):
    """A positive finite JSON number (an int stays an int, as the caller gave it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(where, f"expected a positive finite number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        fail(where, f"expected a positive finite number, got {_show(value)}")
    return value


def _hyperparameter(value, where: str):
    """A positive number in `HYPERPARAMETER_RANGE`."""
    low, high = HYPERPARAMETER_RANGE
    if not low <= float(_positive(value, where)) <= high:
        fail(where, f"expected a value from {low:.3g} to {high:.3g} (so that it and its "
                    f"reciprocal are normal float32 numbers, the default compute dtype), got "
                    f"{_show(value)}")
    return value


def _positives(value, where: str):
    if isinstance(value, list):
        if not value:
            fail(where, "expected a positive number or a non-empty list of them, got []")
        return np.asarray([_hyperparameter(v, f"{where}[{i}]") for i, v in enumerate(value)],
                          np.float64)
    return _hyperparameter(value, where)


def _bounds(value, hyperparameter, where: str):
    """``"fixed"``, a pair ``(low, high)``, or for a list-valued hyperparameter one pair per
    element (an array of shape (k, 2))."""
    if isinstance(value, str) and value == "fixed":
        return value
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value) \
            and isinstance(hyperparameter, np.ndarray):
        if len(value) != hyperparameter.size:
            fail(where, f"expected one pair per value ({hyperparameter.size}), got "
                        f"{len(value)} pairs")
        return np.asarray([_pair(v, f"{where}[{i}]") for i, v in enumerate(value)], np.float64)
    return _pair(value, where)


def _pair(value, where: str) -> tuple:
    if not (isinstance(value, list) and len(value) == 2):
        fail(where, f'expected bounds [low, high] or "fixed", got {_show(value)}')
    low, high = (_positive(v, f"{where}[{i}]") for i, v in enumerate(value))
    if not float(low) <= float(high):
        fail(where, f"expected low <= high, got {_show(value)}")
    return (low, high)


# ---------------------------------------------------------------------------------------------
# comparing a fitted kernel with the kernel it was fitted from


def same_structure(fitted: dict, initial: dict, where: str) -> None:
    """``fitted`` (JSON of ``kernel_``) must be ``initial`` (JSON of ``kernel``) with only its
    free hyperparameter values changed (same classes, bounds, ν, fixed values and sizes)."""
    if fitted.get("class") != initial.get("class"):
        fail(where, f"is a {fitted.get('class')} where the kernel has a "
                    f"{initial.get('class')}")
    for key, kind in _CLASSES[fitted["class"]].items():
        a, b = fitted[key], initial[key]
        if kind == "kernel":
            same_structure(a, b, f"{where}.{key}")
        elif kind in ("scalar", "ard") and fitted[f"{key}_bounds"] != "fixed":
            if np.shape(a) != np.shape(b):
                fail(f"{where}.{key}", f"has shape {np.shape(a)} where the kernel has "
                                       f"{np.shape(b)}")
        elif not _equal(a, b):
            fail(f"{where}.{key}", f"is {_show(a)} where the kernel has {_show(b)}")


def _equal(a, b) -> bool:
    return np.shape(a) == np.shape(b) and bool(np.all(np.asarray(a) == np.asarray(b)))
