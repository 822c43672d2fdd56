"""scalegp: Gaussian processes and kernel density estimation on a memory-linear RBF kernel engine.

The estimators are imported lazily, so that ``import scalegp`` (and ``scalegp --version``) does not
pay for JAX and scikit-learn until they are used.
"""

__version__ = "0.1.0"
__all__ = ["ScalableGPRegressor", "ScalableKernelDensity"]


def __getattr__(name):
    if name in __all__:
        from scalegp import estimators

        return getattr(estimators, name)
    raise AttributeError(f"module 'scalegp' has no attribute {name!r}")
