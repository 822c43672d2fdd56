"""Gaussian kernel density estimation at scale, on the engine's memory-linear log-sum-exp.

Model
-----
For data ``x_1 .. x_n`` (rows of an (n, d) array) with weights ``w_j >= 0`` (``W = sum_j w_j``),
a scaling ``z(x) = (x - mu) A`` (``scale``: see `Scaling`; A is the identity for
``scale=None``) and a bandwidth ``h`` (a scalar or a (d,) vector, in the units of z), the
density is::

    p(x) = |det A| * (1 / W) * sum_j w_j N(z(x); z_j, diag(h^2))

so ``log p(x) = log p_z(z(x)) + log|det A|`` (the Jacobian of the scaling). ``scale="covariance"``
with a scalar h reproduces scipy.stats.gaussian_kde (kernel covariance ``h^2 Sigma``);
``scale=None`` reproduces scikit-learn's KernelDensity(kernel="gaussian", bandwidth=h).

Weights
-------
Weights are relative importances, normalised by W, at any scale: `check_weights` scales them by
a power of two (exactly) so that the largest lies in [0.5, 1), and they reach float32 relative
to the largest, so w and c w give the same model for c from 1e-300 to 1e300 (weights of 5e-324
each are equal weights). A weight below about 1e-38 times the largest (1e-323 in float64
numpy: spread, sampling) counts as zero. With a fixed or cross-validated bandwidth,
integer weights give exactly the density of the data with repeated rows. The spread-based pieces
(the ``scott``/``silverman`` rules and the ``standardize``/``covariance`` scalings) follow
scipy.stats.gaussian_kde: weighted covariance with ``aweights`` and Kish's effective sample size
``n_eff = W^2 / sum_j w_j^2``, so multiplying all weights by a constant changes nothing (repeating
rows, in contrast, raises n and so shrinks a rule-based bandwidth).

Bandwidth selection by cross-validation
---------------------------------------
`cross_validate_bandwidth` maximises the mean leave-one-out (LOO) log-likelihood::

    L(h) = sum_{i in H} w_i log p_{-i}(x_i) / sum_{i in H} w_i,
    p_{-i}(x_i) = sum_{j != i} w_j N(x_i; x_j, diag(h^2)) / (W - w_i)

over ``log h``: one per feature (the "diagonal" bandwidth) with L-BFGS-B, a scalar by a
safeguarded search along the line (below). Where
the engine may prune on one device (the xla implementation, ``prune`` True or "auto") and the
problem is past one dense block, the objective runs on the host-planned pruned path
(`scalegp.ops.backends.xla._planned.PlannedDensity`: the data's tile tree, built once): each
evaluation plans the held-out rows' tiles against the tree and makes one forward pass, whose
moments ``Σ_j w_j K_ij ((x_id - x_jd) / h_d)²`` give the gradient ``∂ log p_{-i} / ∂ log h_d``
without a backward pass, and whose fourth moment ``Σ_j w_j K_ij |(x_i - x_j) / h|⁴`` the
second derivative in a scalar ``log h``; a scalar bandwidth is then found by a safeguarded
Newton search instead of the scan (below). Otherwise the gradient comes from the engine's VJP.
The planned path's k-d order of the data is kept for scoring (`fit_kde`).
Details that matter:

- Exact duplicates are collapsed into one point carrying the summed weight before anything else,
  and a held-out point leaves out *every* copy of itself. Otherwise a point's twin, at distance 0,
  would reward ``h -> 0`` without limit; with the copies collapsed the LOO likelihood goes to
  -inf as h -> 0 and has an interior maximum. For integer weights this also makes weights and
  repeated rows give the identical objective.
- The self term is removed exactly, not subtracted: held-out points are processed in groups of at
  most 1024; for a group the engine sums over all points *outside* the group (the group's
  weights set to zero) and a small dense block adds the other members of the group with its
  diagonal masked (on the planned path, each held-out row skips its own key inside the tile
  sums). Subtracting the self term from the full sum instead would cancel
  catastrophically for isolated points, the ones that decide how small h may be, in float32.
- For large n the held-out set H is a random subset of ``cv_subsample`` distinct points (default
  8192), each scored against *all* the other data: an unbiased estimate of the full LOO mean at
  a cost of ``cv_subsample * n`` kernel evaluations per step instead of ``n^2``. The selected
  bandwidth then carries subsampling noise: a few percent for a scalar bandwidth; per-feature
  bandwidths can move further along directions in which the likelihood is nearly flat (at
  almost no cost in likelihood). Raise ``cv_subsample`` (None: every point) to reduce it.
- Start and safeguards: a coarse scan of the common log-scale below Scott's rule (five values,
  from exp(-4.5) to 1 times Scott's bandwidth, forward passes only; Scott's rule is derived for
  a single Gaussian and oversmooths anything else; here Scott's factor times a robust spread
  per feature, the smaller of the standard deviation and the interquartile range over 1.349,
  so that a few far rows do not move the scan and the bounds) picks the start, so a
  multimodal LOO curve is not climbed from the wrong side; L-BFGS-B (per-feature bandwidths)
  or, for a scalar one, a secant search on the gradient inside the bracket of the scan's best
  point and its neighbours then runs within bounds of exp(-10) to exp(5) times Scott's
  bandwidth, and the best point seen is returned. Reaching a bound raises a warning
  (typically a feature with few distinct values: ties in one coordinate make the LOO
  likelihood grow without limit as that coordinate's bandwidth shrinks).
- A scalar bandwidth on the planned path skips the scan (its evaluations near Scott's rule cost
  the most there: a pass visits every tile pair within the kernel's reach): Newton steps in
  ``s = h^-2`` (exact where each point's sum is one neighbour's term) start from the scan's
  smallest bandwidth, inside a bracket of evaluated points where the gradient has either sign
  and the same bounds. It returns the first maximum it reaches from below, which is the scan's
  choice where the LOO curve has one maximum in log h; where it has several, it may return a
  smaller one than the scan would have picked.

What cross-validation checks
----------------------------
Three layouts make the leave-one-out optimum a poor bandwidth; each gives a UserWarning that
names the cause and what to do, and a field of `CVResult` (docs/kde.md):

- Far rows (``far_rows``): at the optimum, each held-out row's pull on log h is estimated from
  its own slope and curvature (`_trust.far_candidates`); rows that may set it alone are
  searched without, and left out of the objective (not of the density) where that moves h by
  over `_trust.FAR_FACTOR` (10x), or where their term underflows (about 1e19 bandwidths away in
  float32: it is then lost at any bandwidth, and left out before the search). One row at 1e30
  among normal points had set h to 2.6e28.
- A layout flatter than the features (``flat_directions``): principal directions of the
  held-out points with a spread under half the bandwidth (points on a line in 8-D).
- Heavy stacks of exact duplicates (``stacked_share``): stacks of 16 copies or more holding 5%
  of the weight or more, among values that no other row shares feature by feature (so not
  integer or rounded data, whose ties are their resolution). Cross-validation leaves a stack
  out whole, so it treats it as one point.

The "standardize" and "covariance" scalings leave rows more than `_spread.FAR_SPREADS` (1e6)
interquartile spreads from a feature's median out of their moments, with a warning
(`Scaling.far_rows`): such a row would set the spread alone.

Scoring
-------
Exact duplicate rows are one key carrying their summed weight in scoring too
(`FittedKDE.distinct`): a stack of copies costs one kernel value per query, and the data
themselves are scored as their distinct rows (each row's value is the one it gets as a query).

Several devices
---------------
Every function that evaluates the engine takes ``mesh=None`` (one device) or a
`jax.sharding.Mesh` (or "all", a device count or a device list; see `scalegp.ops.as_mesh`)
and ``scheme`` ("allgather" or "ring"): queries are then sharded over the mesh and the data
gathered or passed around a ring (`scalegp.ops.sharded_kde_density`). Cross-validation with a
mesh always takes the grouped path, each group's held-out queries sharded over the devices, so the
objective is the same sum as on one device (equal up to float summation order). With "allgather"
the data are put on every device once for all groups (scheme "replicated" of
`sharded_kde_density`), and the backward pass sums only the bandwidth's gradient across devices.

Precision
---------
Arrays are computed in float64 when every input is float64 and JAX's x64 mode is enabled, in
float32 otherwise (see `compute_dtype`). Spread estimates, scalings and sampling use numpy
float64 throughout. Log-densities are finite for queries far from all data (the engine keeps a
running maximum per query).

Modules (private; what the estimator uses is exported here): ``_spread`` (effective sample
size, covariance, rules, scalings), ``_density`` (batched log-densities), ``_loo`` (the
leave-one-out objective), ``_cv`` (its maximisation), ``_trust`` (what cross-validation checks
of the data), ``_sample`` and ``_fitted`` (`FittedKDE`, `fit_kde`). Every engine call goes
through a `scalegp.ops.Engine`.

Straight walks: the public functions (`fit_kde`, `cross_validate_bandwidth`, `log_density`,
`FittedKDE.log_density`) check their arguments and build one `scalegp.ops.Engine` from the
settings ``impl``, ``mesh``, ``scheme``, ``prune`` and ``prune_tol``; what they call takes that
engine and trusts its inputs (the estimator checks with scikit-learn's helpers, builds its
engine and calls `fit_checked` and `FittedKDE.log_density_with`). A fit collapses the duplicate
rows once (in z, as computed), and cross-validation takes those rows; where its objective ran
on the host-planned path, scoring reuses its tile tree (the same points in the same order).
"""

from scalegp.kde._cv import CV_BANDWIDTHS, DEFAULT_CV_SUBSAMPLE, CVResult, cross_validate_bandwidth
from scalegp.kde._density import DEFAULT_BATCH_SIZE, log_density
from scalegp.kde._fitted import FittedKDE, fit_checked, fit_kde
from scalegp.kde._sample import check_sample_memory
from scalegp.kde._spread import BANDWIDTH_RULES, SCALES, Scaling, scott_factor

# Library-internal, not user API (hence not in __all__): `fit_checked`, `fit_kde` for a caller
# that checked its arguments and built the engine (`scalegp.ScalableKernelDensity`).
__all__ = [
    "BANDWIDTH_RULES",
    "CV_BANDWIDTHS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_CV_SUBSAMPLE",
    "SCALES",
    "CVResult",
    "FittedKDE",
    "Scaling",
    "check_sample_memory",
    "cross_validate_bandwidth",
    "fit_kde",
    "log_density",
    "scott_factor",
]
