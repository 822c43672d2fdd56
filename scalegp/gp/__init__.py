"""Exact Gaussian-process regression: the model, its marginal likelihood, and prediction.

Model (one kernel shared by ``o`` outputs)::

    y[:, j] = m_j + f_j(x) + ε,   f_j ~ GP(0, s · k_l),   ε ~ N(0, σ² I),
    k_l(x, x') = exp(-½ Σ_d ((x_d - x'_d) / l_d)²),

with constant means ``m (o,)``, outputscale ``s``, ARD lengthscales ``l (d,)`` and noise variance
``σ² >= noise_lower_bound``. Writing ``A = s K + σ² I`` (``K (n, n)`` the kernel matrix of the
training inputs) and ``r_j = y_j - m_j``, the objective is the negative log marginal likelihood
summed over outputs::

    NLML = ½ Σ_j r_jᵀ A⁻¹ r_j + (o/2) log|A| + (n o / 2) log 2π.

Layout (tinygp style: the model never factorises anything itself):

- :class:`GPParams`: the hyperparameters as an unconstrained pytree (``softplus`` maps them to
  ``s``, ``l`` and ``σ² - noise_lower_bound``); :meth:`GPParams.constrained` gives the
  :class:`Hyperparameters` and :meth:`GPParams.from_constrained` inverts it.
- Solvers, interchangeable objects with the same two methods ``value_and_grad`` (objective
  and its gradient with respect to the unconstrained parameters, as an :class:`ObjectiveResult`)
  and ``posterior`` (the prediction cache, a :class:`Posterior`):

  * :class:`CholeskySolver`: dense Cholesky of ``A``, ``O(n²)`` memory and ``O(n³)`` time;
    exact to rounding. Meant for up to :data:`EXACT_MAX_N` points.
  * :class:`BBMMSolver`: black-box matrix–matrix inference (Gardner et al., 2018): one
    preconditioned mBCG call on ``[r, z₁ … z_t]`` (``z_i ~ N(0, P)``, ``P`` a rank-k pivoted
    Cholesky preconditioner), stochastic Lanczos quadrature for ``log|A|`` and the gradient::

        ∂NLML/∂θ = -½ Σ_j α_jᵀ (∂A/∂θ) α_j + (o/2t) Σ_i (A⁻¹z_i)ᵀ (∂A/∂θ) (P⁻¹z_i),
        ∂NLML/∂m_j = -1ᵀ α_j,       α = A⁻¹ r,

    whose quadratic forms come from one vector–Jacobian product of
    :func:`scalegp.ops.rbf_kernel_mv` (no ``n × n`` array in the forward or the gradient).
    Probes come from a fixed key, so the objective is a deterministic function of the
    parameters (what L-BFGS needs).

- :func:`predict`: mean ``m + s K(X*, X) α`` and, optionally, variance
  ``s - s² k*ᵀ A⁻¹ k* (+ σ²)`` and covariance, from a :class:`Posterior`. The exact posterior
  uses the Cholesky factor; the iterative one a LOVE-style cache ``A⁻¹ ≈ R Rᵀ`` (Pleiss et al.,
  2018) on a pivoted-Cholesky subspace (:meth:`BBMMSolver.love`, or
  ``BBMMSolver.posterior(..., variance=True)`` with the solve that it preconditions). A
  covariance whose ``(m, m)`` matrices exceed the memory this process can hold is refused
  (:func:`check_covariance_memory`) before any work.
- :func:`sample_paths`: posterior function draws by Matheron's rule, a random-feature prior
  draw (``_prior_features``, any kernel expression) updated by one batched solve and one kernel
  product, memory linear in the test rows (``_sample``, ``_prior_features``).
- :func:`predict_moments`: the mean and latent variance of :func:`predict` as a traceable
  function of the test points (for gradients with respect to them).
- :func:`fisher_information`: the expected information of a subset, the curvature that
  `ScalableGPRegressor`'s full-data scoring steps start from (:func:`fisher_information_ahead`
  compiles its programs in background threads).
- Binary classification (``_laplace``): the Laplace approximation with a logistic likelihood,
  :class:`LaplaceCholesky` (dense, scikit-learn's algorithm) and :class:`LaplaceCG` (Newton
  steps by preconditioned CG with ``B = I + W^½KW^½``, SLQ and engine VJPs), each giving the
  mode (a ``LaplaceMode``) and a `Posterior` for :func:`predict`; :func:`averaged_sigmoid` turns
  latent moments into probabilities.
- :func:`constrained`: parameters' hyperparameters as one compiled program.

Modules (private; what the estimators use is exported here): ``_params`` (parameters,
results), ``_exact`` (Cholesky), ``_bbmm`` (iterative inference and its preconditioner),
``_predict``. The iterative solvers' kernel products, their preconditioners' kernel columns
included, and the predictions' run through the one `scalegp.ops.Engine` they are given
(implementation and devices); the dense matrices of the exact paths come from
`scalegp.ops.kernel_matrix`.
"""

from scalegp.gp._bbmm import BBMMSolver
from scalegp.gp._exact import (
    EXACT_MAX_N,
    CholeskySolver,
    NotPositiveDefiniteError,
    fisher_information,
    fisher_information_ahead,
)
from scalegp.gp._laplace import LaplaceCG, LaplaceCholesky, averaged_sigmoid
from scalegp.gp._params import (
    GPParams,
    KernelParams,
    Posterior,
    constrained,
    softplus_inverse,
)
from scalegp.gp._predict import (
    COVARIANCE_MATRICES,
    check_covariance_memory,
    predict,
    predict_moments,
)
from scalegp.gp._prior_features import PRIOR_FEATURES
from scalegp.gp._sample import SAMPLE_EXACT_MAX_ROWS, sample_paths, sample_prior

__all__ = [
    "COVARIANCE_MATRICES",
    "EXACT_MAX_N",
    "BBMMSolver",
    "CholeskySolver",
    "GPParams",
    "KernelParams",
    "LaplaceCG",
    "LaplaceCholesky",
    "NotPositiveDefiniteError",
    "PRIOR_FEATURES",
    "Posterior",
    "SAMPLE_EXACT_MAX_ROWS",
    "averaged_sigmoid",
    "check_covariance_memory",
    "constrained",
    "fisher_information",
    "fisher_information_ahead",
    "predict",
    "predict_moments",
    "sample_paths",
    "sample_prior",
    "softplus_inverse",
]
