"""scalegp: Gaussian processes and kernel density estimation on a memory-linear RBF kernel engine."""

__version__ = "0.1.0"
