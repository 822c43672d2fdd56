"""ScalableGPClassifier: scikit-learn's estimator checks (float32), its model against
scikit-learn's at fixed hyperparameters (float64), the fitted model's accuracy against
scikit-learn's, one-vs-rest probabilities, the matrix-free path against the dense one, and its
errors."""

import warnings

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.datasets import make_classification, make_moons
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF, CompoundKernel
from sklearn.gaussian_process.kernels import ConstantKernel as C
from sklearn.metrics import log_loss
from sklearn.utils.estimator_checks import parametrize_with_checks

from scalegp import ScalableGPClassifier


@parametrize_with_checks([ScalableGPClassifier()])
def test_sklearn_compatible(estimator, check):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        check(estimator)


def _moons(n=200, seed=0):
    X, y = make_moons(2 * n, noise=0.3, random_state=seed)
    return X[:n], y[:n], X[n:], y[n:]


@pytest.mark.x64
def test_fixed_hyperparameters_match_scikit_learn():
    # optimizer=None: scikit-learn's model exactly (mode, log marginal likelihood and its
    # gradient, latent moments and probabilities), float64 without the global switch.
    X, y, X_test, _ = _moons()
    kernel = C(2.0) * RBF([0.8, 1.5])
    ours = ScalableGPClassifier(kernel, optimizer=None, dtype="float64").fit(X, y)
    ref = GaussianProcessClassifier(kernel, optimizer=None).fit(X, y)
    assert ours.log_marginal_likelihood_value_ == pytest.approx(
        ref.log_marginal_likelihood_value_, rel=1e-6)
    value, grad = ours.log_marginal_likelihood(kernel.theta, eval_gradient=True)
    ref_value, ref_grad = ref.log_marginal_likelihood(kernel.theta, eval_gradient=True)
    assert value == pytest.approx(ref_value, rel=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6)
    for a, b in zip(ours.latent_mean_and_variance(X_test), ref.latent_mean_and_variance(X_test)):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(ours.predict_proba(X_test), ref.predict_proba(X_test),
                               atol=1e-10)


def test_default_model_accuracy_against_scikit_learn():
    # float32 default, learnt ARD kernel: as accurate as scikit-learn's learnt C * RBF.
    X, y, X_test, y_test = _moons(300)
    ours = ScalableGPClassifier(random_state=0).fit(X, y)
    ref = GaussianProcessClassifier(C(1.0) * RBF(1.0), random_state=0).fit(X, y)
    assert ours.score(X_test, y_test) >= ref.score(X_test, y_test) - 0.01
    assert log_loss(y_test, ours.predict_proba(X_test)) <= 1.05 * log_loss(
        y_test, ref.predict_proba(X_test))
    assert ours.log_marginal_likelihood_value_ >= ref.log_marginal_likelihood_value_ - 0.5
    np.testing.assert_array_equal(ours.predict(X_test),
                                  ours.predict_proba(X_test)[:, 1] >= 0.5)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # a bound reached
def test_one_vs_rest():
    X, y = make_classification(240, n_features=4, n_informative=3, n_redundant=0,
                               n_classes=3, n_clusters_per_class=1, random_state=0)
    labels = np.array(["a", "b", "c"])[y]
    model = ScalableGPClassifier(random_state=0).fit(X[:160], labels[:160])
    assert isinstance(model.kernel_, CompoundKernel) and len(model.kernel_.kernels) == 3
    proba = model.predict_proba(X[160:])
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(model.predict(X[160:]),
                                  model.classes_[np.argmax(proba, axis=1)])
    assert model.score(X[160:], labels[160:]) > 0.8
    # one theta for all classes, or their concatenation; the mean over classes
    per_class = [k.theta for k in model.kernel_.kernels]
    assert model.log_marginal_likelihood(np.concatenate(per_class)) == pytest.approx(
        model.log_marginal_likelihood(), rel=1e-5)
    with pytest.raises(ValueError, match="not implemented for multi-class"):
        model.log_marginal_likelihood(per_class[0], eval_gradient=True)
    with pytest.raises(ValueError, match="only supported for binary"):
        model.latent_mean_and_variance(X[:2])


def test_matrix_free_path_matches_dense():
    # solver="cg" at fixed hyperparameters (float32): the dense path's predictions.
    X, y, X_test, _ = _moons(300, seed=1)
    kernel = C(9.0) * RBF([0.9, 2.0])
    dense = ScalableGPClassifier(kernel, optimizer=None).fit(X, y)
    cg = ScalableGPClassifier(kernel, optimizer=None, solver="cg", preconditioner_rank=64,
                              random_state=0).fit(X, y)
    assert cg.solver_ == "cg" and dense.solver_ == "exact"
    np.testing.assert_allclose(cg.predict_proba(X_test), dense.predict_proba(X_test),
                               atol=2e-3)
    assert cg.log_marginal_likelihood_value_ == pytest.approx(
        dense.log_marginal_likelihood_value_, rel=2e-3)


def test_matrix_free_fit_from_subset():
    # n above exact_max_n: the exact fit on a subset, then L-BFGS-B steps on all points by
    # the matrix-free objective; as accurate as the dense fit.
    X, y, X_test, y_test = _moons(400, seed=2)
    dense = ScalableGPClassifier(random_state=0).fit(X, y)
    cg = ScalableGPClassifier(exact_max_n=200, subset_size=150, preconditioner_rank=64,
                              max_iter_full=2, random_state=0).fit(X, y)
    assert cg.solver_ == "cg"
    assert cg.score(X_test, y_test) >= dense.score(X_test, y_test) - 0.02
    assert log_loss(y_test, cg.predict_proba(X_test)) <= 1.05 * log_loss(
        y_test, dense.predict_proba(X_test))


def test_errors():
    X, y, _, _ = _moons(20)
    with pytest.raises(ValueError, match="cannot be a CompoundKernel"):
        ScalableGPClassifier(CompoundKernel([RBF()])).fit(X, y)
    with pytest.raises(ValueError, match="2 or more distinct classes; got 1 class"):
        ScalableGPClassifier().fit(X, np.zeros(20))
    with pytest.raises(ValueError, match="multi_class"):
        ScalableGPClassifier(multi_class="one_vs_one").fit(X, y)
    model = ScalableGPClassifier(optimizer=None).fit(X, y)
    with pytest.raises(ValueError, match="Shape of theta"):
        model.log_marginal_likelihood(np.zeros(5))
    assert clone(model).get_params() == model.get_params()


def test_objective_slopes_back_from_a_non_finite_value():
    # L-BFGS-B's first step goes to a corner of the bounds, where a float32 Cholesky of B can
    # fail: an infinite value there ended the fit at its start. The objective returns a value
    # above the best finite one, with a gradient pointing back to it.
    import jax.numpy as jnp

    from scalegp.estimators._gpc_binary import LaplaceObjective
    from scalegp.gp._laplace import LaplaceMode

    class Solver:
        def mode(self, params, x, t, f0=None, gradient=False):
            theta = np.asarray(params.theta, np.float64)
            value = -np.sum(theta**2) if np.all(theta < 5) else np.nan
            return LaplaceMode(f=t, a=t, value=jnp.asarray(value),
                               grad=params.__class__(params.mean, -2 * params.theta,
                                                     params.spec))

    objective = LaplaceObjective(Solver(), None, jnp.zeros((3, 1)), jnp.zeros(3))
    start = np.array([1.0, 2.0])
    value, grad = objective(start)
    assert value == pytest.approx(5.0) and np.allclose(grad, 2 * start)
    corner = np.array([10.0, -10.0])
    bad_value, bad_grad = objective(corner)
    assert np.isfinite(bad_value) and bad_value > value
    assert bad_grad @ (corner - start) > 0


def test_objective_answers_a_point_met_again_from_memory():
    # A failed line search near the optimum shrinks its steps below float32's resolution and
    # L-BFGS-B evaluates its iterate again: with warm starts each such value differs (noise
    # to the optimiser) and costs a Newton run on all points. Points equal in the compute dtype
    # are answered from memory and not counted as evaluations.
    import jax.numpy as jnp

    from scalegp.estimators._gpc_binary import LaplaceObjective
    from scalegp.gp._laplace import LaplaceMode

    class Solver:
        calls = 0

        def mode(self, params, x, t, f0=None, gradient=False):
            Solver.calls += 1  # a different value at every call, as warm starts give
            theta = np.asarray(params.theta, np.float64)
            value = -np.sum(theta**2) + 1e-3 * Solver.calls
            return LaplaceMode(f=t, a=t, value=jnp.asarray(value),
                               grad=params.__class__(params.mean, -2 * params.theta,
                                                     params.spec))

    objective = LaplaceObjective(Solver(), None, jnp.zeros((3, 1), jnp.float32), jnp.zeros(3))
    start = np.array([1.0, 2.0])
    first = objective(start)
    again = objective(start + 1e-12)  # the same float32 theta
    assert again[0] == first[0] and np.array_equal(again[1], first[1])
    assert objective.evaluations == Solver.calls == 1
    objective(start + 1e-3)
    assert objective.evaluations == 2
