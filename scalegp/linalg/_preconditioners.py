"""Preconditioners for kernel systems ``A = K + D`` (``D`` the noise diagonal).

- :func:`pivoted_cholesky`: a rank-k factor ``K ≈ L Lᵀ`` from the diagonal of ``K`` and one
  column of ``K`` per step, never forming ``K`` (Harbrecht, Peters & Schneider, 2012; used as a
  GP preconditioner by Gardner et al., 2018).
- :class:`LowRankPreconditioner`: ``P = L Lᵀ + D`` with ``solve``, ``logdet`` and ``sample`` in
  ``O(n k²)`` setup and ``O(n k t)`` per use.
- :class:`DiagonalPreconditioner`: ``P = D``; ``DiagonalPreconditioner.identity(n)`` stands for
  "no preconditioner" where a probe distribution and ``log|P|`` are still needed.

All three are pytrees, so they can be built inside ``jit`` and passed through ``jit``/``vmap``.

Rows over several devices: inside ``jax.shard_map`` with the rows of ``K`` split over a mesh axis,
pass ``axis_name`` to :func:`pivoted_cholesky` and :meth:`LowRankPreconditioner.from_factor`; each
device then holds and computes only its rows of the factor and basis, and the devices exchange
O(p) numbers per pivot and O(p k²) once (the QR), never a whole column or factor. ``solve``,
``logdet`` and ``sample`` need no changes: applied to row-sharded arrays in the global view (under
``jit``), their only cross-row operations are the ``(k, t)`` products ``Qᵀ W`` and sums over
rows, which XLA's partitioner finishes with all-reduces.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp.linalg._host import eigh_numpy, host_call
from scalegp.ops import DenseProducts, dense_products, dense_work_on_host

# Full float32 products on GPUs too: TF32 would cost the preconditioner three digits.
_HIGHEST = lax.Precision.HIGHEST


class Preconditioner(Protocol):
    """A symmetric positive-definite ``P (n, n)`` used by :func:`scalegp.linalg.cg` and the
    stochastic estimators :func:`scalegp.linalg.solve_and_logdet` and
    :func:`scalegp.linalg.hutchinson_trace`."""

    def solve(self, v: jax.Array) -> jax.Array:
        """``P⁻¹ V`` for ``V (..., n, t)``."""
        ...

    def logdet(self) -> jax.Array:
        """``log|P|``, shape ``(...)``."""
        ...

    def sample(self, key: jax.Array, num_samples: int) -> jax.Array:
        """``num_samples`` independent draws from ``N(0, P)``, as columns ``(..., n, t)``."""
        ...


# --------------------------------------------------------------------------------------------
# Diagonal


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DiagonalPreconditioner:
    """``P = diag(d)``.

    Attributes:
      diag: ``(..., n)``, positive.
    """

    diag: jax.Array

    @classmethod
    def identity(cls, n: int, dtype=jnp.float32) -> "DiagonalPreconditioner":
        """``P = I`` of size ``n``: probes ``N(0, I)`` and ``log|P| = 0``."""
        return cls(jnp.ones((n,), dtype))

    def solve(self, v: jax.Array) -> jax.Array:
        return v / self.diag[..., None]

    def logdet(self) -> jax.Array:
        return jnp.sum(jnp.log(self.diag), axis=-1)

    def sample(self, key: jax.Array, num_samples: int) -> jax.Array:
        shape = self.diag.shape + (num_samples,)
        return jnp.sqrt(self.diag)[..., None] * jax.random.normal(key, shape, self.diag.dtype)


# --------------------------------------------------------------------------------------------
# Low rank plus diagonal


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRankPreconditioner:
    """``P = L Lᵀ + D``, ``L (n, k)``, ``D = diag(noise)`` positive.

    Stored in the scaled eigen-form ``P = D^{1/2} (I + Q S² Qᵀ) D^{1/2}`` with ``Q (n, k)``
    orthonormal and ``Q S² Qᵀ = U Uᵀ`` for ``U = D^{-1/2} L`` (``s`` the singular values of
    ``U``); then::

        P⁻¹ V = D^{-1/2} (W - Q diag(s²/(1+s²)) Qᵀ W),   W = D^{-1/2} V
        log|P| = Σ log Dᵢᵢ + Σ log(1 + s²)
        sample = D^{1/2} (Q S ε₁ + ε₂) = L ε₁' + D^{1/2} ε₂,   ε ~ N(0, I)

    which is Woodbury with the ``k×k`` system diagonalised.

    Departure from the textbook Woodbury form ``D⁻¹ - D⁻¹L (I + LᵀD⁻¹L)⁻¹ LᵀD⁻¹`` with a
    Cholesky factor of ``I + UᵀU``: a Householder QR ``U = Q₀ R`` and the SVD of the small ``R``
    give ``s`` and the rotated basis ``Q`` without forming ``UᵀU``, whose entries grow as
    ``1/σ²`` and whose rounding is ``eps · s_max²``; ``log|P|`` is then ``Σ log1p(s²)`` with no
    cancellation. The cost is the same ``O(n k²)``; on RBF kernels the accuracy gained is small
    (docs/decisions.md #15). Zero columns of ``L`` (rank below k) are
    harmless: they give ``s = 0``.

    On a TPU (``method="auto"``), where XLA compiles a dense QR and SVD for minutes, the same
    form comes from Gram matrices instead, with every ``k×k`` step on the host in float64
    (:meth:`from_factor`, ``method="gram"``).

    Build with :meth:`from_factor`. Attributes (all with the same leading batch dims):
      basis: ``(..., n, k)`` orthonormal ``Q``.
      scaled_eigenvalues: ``(..., k)`` ``s²``, the eigenvalues of ``D^{-1/2} L Lᵀ D^{-1/2}``.
      noise: ``(..., n)`` diagonal of ``D``.
      products: the float32-accurate products its setup, ``solve`` and ``sample`` use
        (static; None: `scalegp.ops.dense_products` of the platform in use).
    """

    basis: jax.Array
    scaled_eigenvalues: jax.Array
    noise: jax.Array
    products: DenseProducts | None = dataclasses.field(default=None,
                                                       metadata={"static": True})

    @classmethod
    def from_factor(
        cls, factor: jax.Array, noise: float | jax.Array, *, axis_name=None, method="auto",
        products: DenseProducts | None = None,
    ) -> "LowRankPreconditioner":
        """``P = factor factorᵀ + diag(noise)``.

        Args:
          factor: ``(..., n, k)``, e.g. :attr:`PivotedCholesky.factor`.
          noise: positive scalar or ``(..., n)`` (heteroscedastic noise).
          axis_name: inside ``shard_map`` with the rows of ``factor`` (and ``noise``) split over
            this mesh axis: ``basis`` and ``noise`` come back row-sharded like ``factor``, with
            the same ``Q`` and ``s`` up to rounding. By Householder, the QR is then a
            tall-skinny QR (each device factors its rows, the ``k×k`` triangles are
            all-gathered and factored again); by the Gram matrices, these are summed over the
            devices.
          method: how ``U = D^{-1/2} L`` is brought into the eigen-form.
            ``"householder"``: a Householder QR of ``U`` and the SVD of its ``k×k`` triangle,
            in the graph.
            ``"gram"``: ``O(n k²)`` products on the device and the ``k×k`` eigensolvers on
            the host in float64 (`_eigen_form_by_gram`): for a TPU, where XLA compiled the
            QR and the SVD for minutes (docs/decisions.md #52). Directions in which the
            columns of ``U``, each scaled to unit length, are dependent beyond float32's
            reach (`GRAM_CUTOFF_EPS`) are left out, as are singular values at the rounding
            level of the largest: ``P`` is then a little weaker there, never indefinite.
            ``"auto"`` (default): "gram" where dense work belongs on the host
            (`scalegp.ops.dense_work_on_host`: a TPU), else "householder".
          products: the float32-accurate products of the Gram route and of later ``solve``
            and ``sample`` calls (`scalegp.ops.dense_products`, which the default, None,
            takes at each use): over a mesh, XLA's, which it partitions.
        """
        if method == "auto":
            method = "gram" if dense_work_on_host() else "householder"
        if method not in ("householder", "gram"):
            raise ValueError(f"method must be 'auto', 'householder' or 'gram', got {method!r}")
        noise = jnp.broadcast_to(jnp.asarray(noise, factor.dtype), factor.shape[:-1])
        scaled = factor / jnp.sqrt(noise)[..., None]
        if method == "gram":
            basis, scaled_eigenvalues = _eigen_form_by_gram(
                scaled, products or dense_products(), axis_name)
            return cls(basis=basis, scaled_eigenvalues=scaled_eigenvalues, noise=noise,
                       products=products)
        q, r = jnp.linalg.qr(scaled, mode="reduced")
        if axis_name is not None:
            # TSQR (Demmel et al., 2012): U = blockdiag(Q_d) [R_1; ...; R_p] = blockdiag(Q_d) Q' R.
            stacked = lax.all_gather(r, axis_name, axis=r.ndim - 2, tiled=True)
            q_outer, r = jnp.linalg.qr(stacked, mode="reduced")
            # This device's k rows of Q' (its triangle's place in the stack).
            k = q.shape[-1]
            q_outer_rows = lax.dynamic_slice_in_dim(q_outer, lax.axis_index(axis_name) * k, k,
                                                    axis=q_outer.ndim - 2)
            q = _matmul(q, q_outer_rows)
        # QR is unique only up to the signs of R's rows; fixing diag(R) >= 0 makes Q, and so
        # the basis and the probes drawn by `sample`, the same whichever way R was reached (one
        # QR or TSQR), so sharded and single-device fits see the same random numbers.
        signs = jnp.where(jnp.diagonal(r, axis1=-2, axis2=-1) < 0, -1.0, 1.0).astype(r.dtype)
        q, r = q * signs[..., None, :], r * signs[..., :, None]
        # U Uᵀ = Q₀ R Rᵀ Q₀ᵀ = (Q₀ W) S² (Q₀ W)ᵀ for the SVD R = W S Yᵀ.
        rotation, singular_values, _ = jnp.linalg.svd(r, full_matrices=False)
        return cls(
            basis=_matmul(q, rotation),
            scaled_eigenvalues=singular_values**2,
            noise=noise,
            products=products,
        )

    def _products(self) -> DenseProducts:
        return self.products or dense_products()

    def solve(self, v: jax.Array) -> jax.Array:
        matmul, matmul_tn = self._products()
        inv_sqrt_noise = lax.rsqrt(self.noise)[..., None]
        w = v * inv_sqrt_noise
        coords = matmul_tn(self.basis, w)
        rest = w - matmul(self.basis, coords)
        # Projected out twice ("twice is enough", Parlett): one projection leaves eps·|W| of
        # W in span(Q), which the 1/σ² of P⁻¹ turns into rᵀP⁻¹r errors of eps·|r|²/σ², more
        # than the true ~|r|²/λ for residuals in the span of large eigenvalues λ: P⁻¹ was
        # then not positive definite in float32 and CG broke down (rᵀz < 0) at n = 10^5.
        more = matmul_tn(self.basis, rest)
        inverse = 1.0 / (1.0 + self.scaled_eigenvalues)[..., None]
        return (rest + matmul(self.basis, (coords + more) * inverse - more)) * inv_sqrt_noise

    def logdet(self) -> jax.Array:
        return jnp.sum(jnp.log(self.noise), axis=-1) + jnp.sum(
            jnp.log1p(self.scaled_eigenvalues), axis=-1
        )

    def sample(self, key: jax.Array, num_samples: int) -> jax.Array:
        low_rank_key, diag_key = jax.random.split(key)
        k = self.scaled_eigenvalues.shape[-1]
        dtype = self.noise.dtype
        batch = self.noise.shape[:-1]
        eps_low = jax.random.normal(low_rank_key, batch + (k, num_samples), dtype)
        eps_diag = jax.random.normal(diag_key, self.noise.shape + (num_samples,), dtype)
        low_rank = self._products().matmul(
            self.basis, jnp.sqrt(self.scaled_eigenvalues)[..., None] * eps_low)
        scaled = low_rank + eps_diag
        return jnp.sqrt(self.noise)[..., None] * scaled


#: `_eigen_form_by_gram`'s first pass keeps the directions whose eigenvalue of the column-scaled
#: Gram matrix ``H`` is above this many units of rounding (``eps``) of the largest. ``H`` is
#: known to about ``eps`` per entry, so the kept part's condition number stays under
#: ``1 / (100 eps)`` and the first pass's basis is orthonormal to about 1e-2, which the second
#: pass repairs; the directions left out are combinations of unit columns shorter than
#: ``10 √eps`` (0.3% in float32).
GRAM_CUTOFF_EPS = 100


def _eigen_form_by_gram(scaled: jax.Array, products: DenseProducts, axis_name=None
                        ) -> tuple[jax.Array, jax.Array]:
    """``(Q, s²)`` with ``Q (..., n, k)`` orthonormal (or zero) columns and ``Q diag(s²) Qᵀ =
    U Uᵀ`` for ``U = scaled (..., n, k)``, from Gram matrices: CholeskyQR2 with eigensolvers.

    1. ``G = UᵀU`` on the device; on the host ``H = C G C`` with ``C`` the columns' inverse
       norms (pivoted-Cholesky columns span many orders of magnitude, their unit-scaled
       Gram matrix few: condition numbers of 4 to 2e4 on the RBF factors tried,
       docs/decisions.md #52), ``H = V μ Vᵀ``, and
       ``X₁ = C V μ^{-1/2}`` on the directions with ``μ > GRAM_CUTOFF_EPS · eps · max μ``
       (zero columns elsewhere).
    2. ``Q₁ = U X₁`` on the device, nearly orthonormal; ``Q₁ᵀQ₁`` and ``Q₁ᵀU`` on the
       device; on the host ``X₂ = (Q₁ᵀQ₁)^{-1/2}`` (on its eigenvalues near 1; the zero
       columns stay zero), then the SVD ``X₂ᵀ (Q₁ᵀU) = W S Yᵀ``, so that
       ``U ≈ Q₁X₂ · W S Yᵀ``.
    3. ``Q = Q₁ (X₂ W)`` on the device, ``s = S``; singular values at or below
       ``√k · eps · S_max`` (the rounding of ``Q₁ᵀU``), and their columns, are set to zero.

    Departure from the textbook CholeskyQR2: eigensolvers instead of Cholesky factors, so that
    dependent or zero columns (a factor whose rank fell short of k) drop out instead of
    breaking the factorisation, and the column scaling, which keeps the singular values to
    float32's relative accuracy where one Gram matrix of ``U`` would lose those below
    ``√eps · S_max``. The singular values come from ``Q₁ᵀU``, not from ``G``, for the same
    reason. Five ``n k²`` float32-accurate products (``products``,
    `scalegp.ops.DenseProducts`); two ``k×k`` round trips to the host.
    """
    matmul, matmul_tn = products
    k = scaled.shape[-1]
    total = functools.partial(_all_reduce, lax.psum, axis_name)
    square = jax.ShapeDtypeStruct(scaled.shape[:-2] + (k, k), scaled.dtype)
    (first,) = host_call(_gram_first_pass, (square,), total(matmul_tn(scaled, scaled)))
    q1 = matmul(scaled, first)
    rotation, scaled_eigenvalues = host_call(
        _gram_second_pass, (square, jax.ShapeDtypeStruct(square.shape[:-1], square.dtype)),
        total(matmul_tn(q1, q1)), total(matmul_tn(q1, scaled)))
    return matmul(q1, rotation), scaled_eigenvalues


def _gram_first_pass(gram):
    """`_eigen_form_by_gram`'s ``X₁`` from ``G`` (..., k, k), on the host."""
    g = np.asarray(gram, np.float64)
    diagonal = np.diagonal(g, axis1=-2, axis2=-1)
    inverse_norms = _inverse_sqrt(diagonal, diagonal > 0)
    mu, vectors = eigh_numpy(g * inverse_norms[..., :, None] * inverse_norms[..., None, :])
    keep = mu > GRAM_CUTOFF_EPS * np.finfo(gram.dtype).eps * mu[..., -1:]
    return (inverse_norms[..., :, None] * vectors * _inverse_sqrt(mu, keep)[..., None, :],)


def _gram_second_pass(q1_gram, q1_t_u):
    """`_eigen_form_by_gram`'s ``(X₂ W, S²)`` from ``Q₁ᵀQ₁`` and ``Q₁ᵀU`` (..., k, k), on the
    host."""
    nu, vectors = eigh_numpy(q1_gram)
    # ≈ 1 on the directions the first pass kept, exactly 0 on those it left out
    x2 = vectors * _inverse_sqrt(nu, nu > 0.5)[..., None, :]
    projected = np.swapaxes(x2, -1, -2) @ np.asarray(q1_t_u, np.float64)
    if not np.isfinite(projected).all():
        return np.full_like(x2, np.nan), np.full(x2.shape[:-1], np.nan)
    try:
        w, s, _ = np.linalg.svd(projected)
    except np.linalg.LinAlgError:  # unconverged
        return np.full_like(x2, np.nan), np.full(x2.shape[:-1], np.nan)
    live = s > np.sqrt(s.shape[-1]) * np.finfo(q1_gram.dtype).eps * s[..., :1]
    return (x2 @ w) * live[..., None, :], np.where(live, s * s, 0.0)


def _inverse_sqrt(values, keep):
    """``1/√values`` where ``keep``, 0 elsewhere; NaN where ``values`` is (a failed host step
    must reach the caller as NaNs, not as a basis that left everything out)."""
    safe = np.where(keep, values, 1.0)
    return np.where(np.isnan(values), np.nan, np.where(keep, 1.0 / np.sqrt(safe), 0.0))


# --------------------------------------------------------------------------------------------
# Pivoted Cholesky


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PivotedCholesky:
    """Rank-k pivoted Cholesky factor ``K ≈ L Lᵀ`` with diagnostics.

    Attributes:
      factor: ``(n, max_rank)`` ``L``; columns beyond ``rank`` are zero.
      pivots: ``(max_rank,)`` int32 pivot index of each column, ``-1`` beyond ``rank``.
      rank: int32, number of columns computed.
      residual_trace: ``tr(K - L Lᵀ)`` as tracked by the factorisation.
      num_jittered: int32, pivots that were not positive (beyond rounding) and were replaced by
        the jitter; nonzero means ``K`` was numerically rank-deficient before ``max_rank`` and
        ``rel_tol`` was below what the arithmetic can resolve.
    """

    factor: jax.Array
    pivots: jax.Array
    rank: jax.Array
    residual_trace: jax.Array
    num_jittered: jax.Array


def pivoted_cholesky(
    diag: jax.Array,
    column: Callable[[jax.Array], jax.Array],
    *,
    max_rank: int,
    rel_tol: float | None = None,
    axis_name=None,
) -> PivotedCholesky:
    """Greedy pivoted Cholesky of a PSD kernel matrix ``K (n, n)`` known by diagonal and columns.

    Step ``m`` picks the largest remaining residual diagonal ``i``, computes
    ``l = (K[:, i] - L L[i]ᵀ) / √(residual_ii)``, appends it to ``L`` and subtracts ``l²`` from
    the residual diagonal. It stops after ``max_rank`` columns or once
    ``tr(K - L Lᵀ) <= rel_tol · tr(K)``. Cost: ``max_rank`` calls to ``column`` and
    ``O(n max_rank²)`` arithmetic; memory ``O(n max_rank)``.

    Use it for ``K`` alone (not ``K + σ²I``) and pass the noise to
    :meth:`LowRankPreconditioner.from_factor`.

    Args:
      diag: ``(n,)`` diagonal of ``K``.
      column: ``i -> K[:, i]`` of shape ``(n,)`` for a traced int32 scalar ``i`` (e.g. one kernel
        product against a single point).
      max_rank: static upper bound ``k`` on the rank.
      rel_tol: relative trace tolerance; default ``10 · max_rank · eps``, i.e. stop when the
        residual is at the rounding level of the factorisation.
      axis_name: inside ``shard_map`` with the rows of ``K`` split evenly over this mesh axis:
        ``diag`` and ``column(i)`` are then this device's rows, ``i`` is a global row index
        (:func:`sharded_row` fetches row ``i`` of a row-sharded array), and ``factor`` is this
        device's rows. Per pivot the devices exchange their best candidate (an all-gather of
        ``p`` numbers) and the pivot's row of ``L`` (a ``psum`` of ``k`` numbers).

    Returns:
      :class:`PivotedCholesky`. For a batch of kernels, ``jax.vmap`` this function.

    Departures from the textbook:
      - The residual diagonal is clamped at 0 and chosen pivots are excluded explicitly, so
        rounding can neither re-select a pivot nor make the trace estimate negative.
      - Rows of chosen pivots are set to zero in later columns, as in exact arithmetic, which keeps
        ``L[pivots]`` exactly lower triangular.
      - A pivot at or below the jitter ``max_rank · eps · max(diag)`` (a non-positive pivot up to
        rounding) is replaced by the jitter instead of dividing by ~0, and counted in
        ``num_jittered``; outside ``jit`` a warning is issued.
    """
    if diag.ndim != 1:
        raise ValueError(f"diag must be (n,); vmap pivoted_cholesky for batches (got {diag.shape})")
    n = diag.shape[0]
    dtype = diag.dtype
    eps = jnp.finfo(dtype).eps
    if rel_tol is None:
        rel_tol = 10.0 * max_rank * float(eps)
    total = functools.partial(_all_reduce, lax.psum, axis_name)
    stop_at = rel_tol * total(jnp.sum(diag))
    jitter = max_rank * eps * _all_reduce(lax.pmax, axis_name, jnp.max(diag))
    row_ids = jnp.arange(n, dtype=jnp.int32) + _row_offset(n, axis_name)

    state = _PivotState(
        step=jnp.zeros((), jnp.int32),
        factor=jnp.zeros((n, max_rank), dtype),
        residual=jnp.maximum(diag, 0.0),
        chosen=jnp.zeros((n,), bool),
        pivots=jnp.full((max_rank,), -1, jnp.int32),
        num_jittered=jnp.zeros((), jnp.int32),
    )

    def keep_going(s: _PivotState) -> jax.Array:
        return (s.step < max_rank) & (total(jnp.sum(s.residual)) > stop_at)

    def add_column(s: _PivotState) -> _PivotState:
        i, pivot = _argmax(jnp.where(s.chosen, -jnp.inf, s.residual), row_ids, axis_name)
        jittered = pivot <= jitter
        pivot = jnp.maximum(pivot, jitter)
        pivot_row = sharded_row(s.factor, i, axis_name)
        residual_column = column(i).astype(dtype) - _matmul(s.factor, pivot_row)
        is_pivot = row_ids == i
        chosen = s.chosen | is_pivot
        new = jnp.where(chosen, 0.0, residual_column * lax.rsqrt(pivot))
        new = jnp.where(is_pivot, jnp.sqrt(pivot), new)
        return _PivotState(
            step=s.step + 1,
            factor=s.factor.at[:, s.step].set(new),
            residual=jnp.where(chosen, 0.0, jnp.maximum(s.residual - new**2, 0.0)),
            chosen=chosen,
            pivots=s.pivots.at[s.step].set(i),
            num_jittered=s.num_jittered + jittered.astype(jnp.int32),
        )

    state = lax.while_loop(keep_going, add_column, state)
    result = PivotedCholesky(
        factor=state.factor,
        pivots=state.pivots,
        rank=state.step,
        residual_trace=total(jnp.sum(state.residual)),
        num_jittered=state.num_jittered,
    )
    _warn_if_jittered(result)
    return result


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _PivotState:
    step: jax.Array
    factor: jax.Array
    residual: jax.Array
    chosen: jax.Array
    pivots: jax.Array
    num_jittered: jax.Array


def sharded_row(rows: jax.Array, i: jax.Array, axis_name=None) -> jax.Array:
    """Row ``i`` (a global index) of an array whose rows are split evenly over ``axis_name``.

    Inside ``shard_map``: the device that holds row ``i`` contributes it and the others zeros,
    summed with ``psum`` (``rows.shape[1:]`` numbers move, not the array). ``rows[i]`` when
    ``axis_name`` is None.
    """
    if axis_name is None:
        return rows[i]
    local = i - _row_offset(rows.shape[0], axis_name)
    held = (local >= 0) & (local < rows.shape[0])
    row = lax.dynamic_index_in_dim(rows, jnp.clip(local, 0, rows.shape[0] - 1), keepdims=False)
    return lax.psum(jnp.where(held, row, jnp.zeros_like(row)), axis_name)


def _row_offset(n_local: int, axis_name) -> jax.Array:
    """Global index of this device's first row (rows split evenly, in device order)."""
    if axis_name is None:
        return jnp.zeros((), jnp.int32)
    return (lax.axis_index(axis_name) * n_local).astype(jnp.int32)


def _all_reduce(reduce, axis_name, x):
    return x if axis_name is None else reduce(x, axis_name)


def _argmax(values: jax.Array, global_rows: jax.Array, axis_name) -> tuple[jax.Array, jax.Array]:
    """(global index, value) of the largest entry of a row-split vector; ties go to the lowest
    index, as with ``jnp.argmax`` on the whole vector."""
    j = jnp.argmax(values)
    best, index = values[j], global_rows[j]
    if axis_name is None:
        return index, best
    bests = lax.all_gather(best, axis_name)
    winner = jnp.argmax(bests)  # devices hold consecutive row ranges, in order
    return lax.all_gather(index, axis_name)[winner], bests[winner]


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=_HIGHEST)


def _warn_if_jittered(result: PivotedCholesky) -> None:
    if isinstance(result.num_jittered, jax.core.Tracer):
        return
    count = int(result.num_jittered)
    if count:
        warnings.warn(
            f"pivoted_cholesky: {count} non-positive pivot(s) replaced by jitter; the kernel "
            f"matrix is numerically rank {int(result.rank) - count}. Lower max_rank or leave "
            "rel_tol at its default.",
            RuntimeWarning,
            stacklevel=3,
        )
