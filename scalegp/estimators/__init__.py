"""scikit-learn estimators on scalegp's GP and KDE layers, in private modules.

They follow scikit-learn's conventions: ``__init__`` only stores its arguments, everything is
validated in ``fit`` with scikit-learn's own helpers, fitted attributes end in ``_``, and the
estimators work with clone, pickle, Pipeline and GridSearchCV.

Besides the three estimators (``__all__``), the package exports, for `scalegp.persistence` and not
as user API, what a model file's checks ask of them: the GP's settings checks
(`check_settings`, `default_model_start`, `SOLVERS`) and its kernel translation
(`kernel_spec`, `check_alpha`).
"""

from scalegp.estimators._gpc import ScalableGPClassifier
from scalegp.estimators._gpr import ScalableGPRegressor
from scalegp.estimators._gpr_checks import SOLVERS, check_settings, default_model_start
from scalegp.estimators._gpr_kernels import check_alpha, kernel_spec
from scalegp.estimators._kde import ScalableKernelDensity

__all__ = ["ScalableGPClassifier", "ScalableGPRegressor", "ScalableKernelDensity"]
