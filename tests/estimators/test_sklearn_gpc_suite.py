"""scikit-learn's own GaussianProcessClassifier tests, run on ScalableGPClassifier.

`SklearnGPC` has scikit-learn's constructor and maps it onto ScalableGPClassifier:
``kernel=None`` as scikit-learn's default, ``ConstantKernel(1.0, "fixed") * RBF(1.0, "fixed")``
(ScalableGPClassifier's own ``kernel=None`` learns an ARD kernel), everything else passed
through. Every ``test_*`` function of the installed
``sklearn/gaussian_process/tests/test_gpc.py`` is re-exposed here with its own
parametrisation, in float64 (x64 on), with the module's ``GaussianProcessClassifier`` replaced
by `SklearnGPC`: every test passes or is skipped for a reason listed in `NOT_APPLICABLE` (a
kernel on strings, refused by design and checked by the error it raises) or
`EXPECTED_FAILURES`. Callable optimizers are supported, so scikit-learn's custom-optimizer
test runs.
"""

import functools

import pytest
from sklearn.gaussian_process.kernels import RBF, ConstantKernel
from sklearn.gaussian_process.tests import test_gpc as sk_tests

from scalegp import ScalableGPClassifier
from scalegp.estimators._gpc import in_units
from tests.estimators.sklearn_suite import run_substituted


class SklearnGPC(ScalableGPClassifier):
    """scikit-learn's GaussianProcessClassifier constructor on ScalableGPClassifier."""

    def __init__(self, kernel=None, *, optimizer="fmin_l_bfgs_b", n_restarts_optimizer=0,
                 max_iter_predict=100, warm_start=False, copy_X_train=True, random_state=None,
                 multi_class="one_vs_rest", n_jobs=None):
        super().__init__(kernel=kernel, optimizer=optimizer,
                         n_restarts_optimizer=n_restarts_optimizer,
                         max_iter_predict=max_iter_predict, warm_start=warm_start,
                         copy_X_train=copy_X_train, random_state=random_state,
                         multi_class=multi_class, n_jobs=n_jobs)

    def _model_kernel(self, n_features, scale=1.0):
        if self.kernel is None:  # scikit-learn's default is in X's units
            return in_units(ConstantKernel(1.0, "fixed") * RBF(1.0, "fixed"), 1.0 / scale)
        return super()._model_kernel(n_features, scale)


_STRUCTURED = ("MiniSeqKernel, a kernel on strings: X must be numeric and 2-D (a ValueError "
               "by design, raised here)")

#: Test name -> (pattern, reason): the test stops at a ValueError matching the pattern, by
#: design; it is skipped with the reason (and runs, should that error go away).
NOT_APPLICABLE = {
    "test_predict_consistent_structured": (r"MiniSeqKernel|could not convert|numeric",
                                           _STRUCTURED),
    "test_latent_mean_and_variance_works_on_structured_kernels": (
        r"MiniSeqKernel|could not convert|numeric", _STRUCTURED),
}

#: Test name -> reason: scikit-learn marks it xfail(raises=AssertionError); a case that fails
#: its assertion is skipped with this reason, one that passes passes.
EXPECTED_FAILURES = {
    "test_lml_gradient": "scikit-learn marks this test xfail (its issue 31366): finite "
                         "differences with epsilon 1e-9 are rounding noise at many of its "
                         "points; tests/gp/test_laplace.py checks the gradient against "
                         "scikit-learn's analytic one and against finite differences",
}


@pytest.fixture
def global_random_seed():
    """scikit-learn's fixture (its conftest, not installed): its default seed."""
    return 42


def _adapted(name, test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        run_substituted(sk_tests, "GaussianProcessClassifier", SklearnGPC, test, args, kwargs,
                        name, EXPECTED_FAILURES, NOT_APPLICABLE)

    marks = [m for m in getattr(test, "pytestmark", []) if m.name != "xfail"]
    marks.append(pytest.mark.x64)
    if name == "test_lml_gradient":  # 52 cases of an xfail-marked test: CI time
        marks.append(pytest.mark.slow)
    run.pytestmark = marks
    run.__name__ = run.__qualname__ = f"test_float64_{name[len('test_'):]}"
    return run


for _name, _test in {name: test for name, test in vars(sk_tests).items()
                     if name.startswith("test_") and callable(test)}.items():
    _run = _adapted(_name, _test)
    globals()[_run.__name__] = _run
del _name, _test, _run
