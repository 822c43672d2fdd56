"""scikit-learn estimators on scalegp's GP and KDE layers, in private modules.

They follow scikit-learn's conventions: ``__init__`` only stores its arguments, everything is
validated in ``fit`` with scikit-learn's own helpers, fitted attributes end in ``_``, and the
estimators work with clone, pickle, Pipeline and GridSearchCV.

Besides the three estimators (``__all__``), the package exports, for `scalegp.persistence` and not
as user API, what a model file's checks ask of them: the GP's settings checks
(`check_settings`, `default_model_start`, `SOLVERS`) and its kernel translation
(`kernel_spec`, `check_alpha`); for the command line's KDE, which fits through `scalegp.kde`,
the estimators' float64 scope (`precision_scope`). All are imported on first use.
"""

import importlib

__all__ = ["ScalableGPClassifier", "ScalableGPRegressor", "ScalableKernelDensity"]

# Imported on first use: a private module of the package (the command line's KDE takes
# `_precision` alone) then costs neither scikit-learn's import nor the GP's.
_EXPORTS = {
    "ScalableGPClassifier": "_gpc",
    "ScalableGPRegressor": "_gpr",
    "ScalableKernelDensity": "_kde",
    "SOLVERS": "_gpr_inputs",
    "check_settings": "_gpr_inputs",
    "default_model_start": "_gpr_inputs",
    "check_alpha": "_gpr_kernels",
    "kernel_spec": "_gpr_kernels",
    "precision_scope": "_precision",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scalegp.estimators' has no attribute {name!r}")
    return getattr(importlib.import_module(f"scalegp.estimators.{module}"), name)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
