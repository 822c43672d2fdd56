"""scikit-learn estimators on scalegp's GP and KDE layers, one private module each.

They follow scikit-learn's conventions: ``__init__`` only stores its arguments, everything is
validated in ``fit`` with scikit-learn's own helpers, fitted attributes end in ``_``, and the
estimators work with clone, pickle, Pipeline and GridSearchCV.
"""

from scalegp.estimators._gpr import ScalableGPRegressor
from scalegp.estimators._kde import ScalableKernelDensity

__all__ = ["ScalableGPRegressor", "ScalableKernelDensity"]
