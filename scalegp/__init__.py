"""scalegp: Gaussian processes and kernel density estimation on a memory-linear RBF kernel engine.

The estimators are imported lazily, so that ``import scalegp`` (and ``scalegp --version``) does not
pay for JAX and scikit-learn until they are used. ``enable_compilation_cache()`` turns on JAX's
persistent compilation cache for the library (the command line has it on always; see
``scalegp._runtime``).
"""

__version__ = "0.1.0"
__all__ = ["ScalableGPClassifier", "ScalableGPRegressor", "ScalableKernelDensity",
           "enable_compilation_cache"]


def __getattr__(name):
    if name == "enable_compilation_cache":
        from scalegp._runtime import enable_compilation_cache

        return enable_compilation_cache
    if name in __all__:
        from scalegp import estimators

        return getattr(estimators, name)
    raise AttributeError(f"module 'scalegp' has no attribute {name!r}")
