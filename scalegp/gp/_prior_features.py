"""Random-feature draws of functions from a GP prior, for any `scalegp.ops` kernel expression.

A stationary kernel is the Fourier transform of a positive measure of total mass ``k(0)``
(Bochner): ``k(x - x') = k(0) E_ω[cos(ωᵀ(x - x'))]`` with ``ω ~ p = measure / k(0)``. One draw
with ``F`` frequencies ``ω_j ~ p`` and weights ``a_j, b_j ~ N(0, 1)`` is::

    f(x) = √(k(0)/F) Σ_j (a_j cos(ω_jᵀx) + b_j sin(ω_jᵀx))                       (Rahimi–Recht)

Given its frequencies, f is Gaussian with covariance ``k̂(τ) = (k(0)/F) Σ_j cos(ω_jᵀτ)``. Every
draw takes fresh frequencies, so:

- at any one point f is exactly ``N(0, k(0))`` (``cos² + sin² = 1``);
- the covariance of the draws, averaged over them, is exactly ``k`` (``E_ω k̂ = k``): sample
  means and covariances of many draws converge to the kernel's, whatever ``F``;
- a single draw's covariance errs by ``k̂ - k``, of standard deviation at most ``k(0)/√F`` per
  entry (``Var cos ≤ 1``; about ``k(0)/√(2F)`` where ``k(τ) ≈ 0``); that, the non-Gaussian joint
  law of a few features, is the error ``F`` (`PRIOR_FEATURES` by default) controls. Tested in
  tests/gp/test_prior_features.py.

Spectral measures (``l`` the lengthscales, ARD for RBF and Matérn, ``z ~ N(0, I_d)``):

    RBF                ω = z / l                                         (Gaussian)
    Matern ν           ω = z / l · √(2ν / g),   g ~ χ²(2ν)               (Student-t, 2ν dof)
    RationalQuadratic  ω = z / l · √τ,          τ ~ Gamma(α, rate α)     (a scale mixture of RBFs)
    ExpSineSquared     ω = 2πk / p,  P(k) = e^{-1/l²} I_k(1/l²) (×2 for k ≥ 1)   (one feature)
    Constant c         ω = 0, mass c

The periodic kernel is ``exp(-(1 - cos(2πτ/p))/l²)``, whose Fourier series has the modified
Bessel coefficients above (they sum to 1); it is a profile of the Euclidean distance, which for
more than one feature is not a positive-definite function and has no spectral measure, so it
is refused there. A product's measure is the convolution of its factors' (``ω = Σ_i ω_i``,
independent, mass the product); a sum inside a product is the mixture of its terms' (a term
chosen with probability its mass over the total). The terms of the top-level sum are drawn
independently, each with its own ``F`` frequencies, and added (a constant term with one).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from scipy import special

from scalegp import ops

#: Frequencies per term of the kernel's top-level sum, per draw (each gives a cosine and a sine
#: feature): a single draw's covariance errs by at most ``k(0)/√F`` (sd) per entry, 3 % of
#: ``k(0)`` here; the draws' covariance averaged over draws is exact whatever ``F``.
PRIOR_FEATURES = 1024

#: The ExpSineSquared harmonics kept: ``k ≤ 8√(1/l²) + 20``, whose left-out weight is far
#: below float64 rounding (``I_k(z) e^{-z} ≈ e^{-k²/2z}/√(2πz)`` for large ``z``, factorial
#: decay for small), at most this many.
MAX_HARMONICS = 100_000

#: Rows of the test or training inputs per compiled evaluation block (padded to it).
ROW_BLOCK = 1024

#: The most ``rows × draws × frequencies`` phases one evaluation block holds.
_BLOCK_PHASES = 1 << 22


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PriorDraws:
    """``S`` random functions of ``o`` outputs each,
    ``f_s,o(x) = Σ_j c_j (a_sjo cos(ω_sjᵀx) + b_sjo sin(ω_sjᵀx))``.

    Attributes:
      frequencies: ``(S, F, d)``, ``ω`` (each draw its own).
      amplitudes: ``(F,)``, ``c_j = √(mass/F_t)`` of the term ``t`` the frequency belongs to.
      weights: ``(S, 2F, o)``, ``[a; b]``, independent ``N(0, 1)``.
    """

    frequencies: jax.Array
    amplitudes: jax.Array
    weights: jax.Array

    @property
    def n_draws(self) -> int:
        return self.frequencies.shape[0]

    def __call__(self, x) -> jax.Array:
        """The draws at ``x (m, d)``: ``(m, o, S)``. Memory linear in ``m`` and ``S``: rows
        in blocks of `ROW_BLOCK` (padded), draws in chunks that keep a block's phases under
        ``2**22``."""
        x = jnp.asarray(x, self.frequencies.dtype)
        m, (s, f) = x.shape[0], self.frequencies.shape[:2]
        o = self.weights.shape[-1]
        rows = min(ROW_BLOCK, 1 << max(m - 1, 0).bit_length())  # small m: the next power of 2
        chunk = max(1, min(s, _BLOCK_PHASES // (rows * f)))
        pad = -s % chunk
        freq = jnp.pad(self.frequencies, ((0, pad), (0, 0), (0, 0)))
        weights = jnp.pad(self.weights, ((0, pad), (0, 0), (0, 0)))
        blocks = []
        for start in range(0, m, rows):
            block = x[start: start + rows]
            padded = jnp.pad(block, ((0, rows - block.shape[0]), (0, 0)))
            values = _evaluate(freq, self.amplitudes, weights, padded, chunk)
            blocks.append(values[: block.shape[0], :, :s])
        if not blocks:
            return jnp.zeros((0, o, s), self.frequencies.dtype)
        return jnp.concatenate(blocks, axis=0)

    def covariance(self, x1, x2) -> jax.Array:
        """Each draw's own covariance ``k̂_s(x1, x2)``: ``(S, m1, m2)``, given its frequencies
        (for tests and error estimates; dense, keep it small)."""
        diff = x1[:, None, :] - x2[None, :, :]
        phase = jnp.einsum("abd,sfd->sabf", diff, self.frequencies,
                           precision=lax.Precision.HIGHEST)
        return jnp.sum(self.amplitudes**2 * jnp.cos(phase), axis=-1)


@functools.partial(jax.jit, static_argnums=4)
def _evaluate(freq, amplitudes, weights, x, chunk):
    """``(b, o, S')`` for one padded block of rows, the draws ``chunk`` at a time."""
    s, f, _ = freq.shape

    def one_chunk(args):
        fr, w = args  # (chunk, F, d), (chunk, 2F, o)
        phase = jnp.einsum("bd,cfd->cbf", x, fr, precision=lax.Precision.HIGHEST)
        cos = amplitudes * jnp.cos(phase)
        sin = amplitudes * jnp.sin(phase)
        return (jnp.einsum("cbf,cfo->boc", cos, w[:, :f], precision=lax.Precision.HIGHEST)
                + jnp.einsum("cbf,cfo->boc", sin, w[:, f:], precision=lax.Precision.HIGHEST))

    fr = freq.reshape(s // chunk, chunk, f, -1)
    w = weights.reshape(s // chunk, chunk, 2 * f, -1)
    out = lax.map(one_chunk, (fr, w))  # (s/chunk, b, o, chunk)
    return jnp.moveaxis(out, 0, 2).reshape(x.shape[0], weights.shape[-1], s)


def draw_prior(kernel: ops.Kernel, d: int, n_draws: int, n_outputs: int, rng,
               n_features: int = PRIOR_FEATURES, dtype=None) -> PriorDraws:
    """``n_draws`` functions of ``n_outputs`` outputs from ``GP(0, kernel)`` on ``d`` features,
    as random features (module docstring): ``n_features`` frequencies per term of the
    top-level sum (one for a constant term), each draw its own.

    ``rng``: a ``numpy.random.RandomState`` (the same state gives the same draws); the
    frequencies and weights are drawn on the host in float64 and stored in ``dtype`` (default
    that of the kernel's hyperparameters). ``kernel``'s hyperparameters must be concrete.
    A ValueError for an ExpSineSquared term with ``d > 1`` (no spectral measure) or a negative
    constant (not a covariance).
    """
    n_features = int(n_features)
    if n_features < 1:
        raise ValueError(f"n_features must be a positive integer, got {n_features}")
    if n_draws < 1 or n_outputs < 1:
        raise ValueError(f"need at least one draw and one output, got {n_draws}, {n_outputs}")
    if dtype is None:
        dtype = jnp.result_type(*jax.tree_util.tree_leaves(kernel))
    frequencies, amplitudes = [], []
    for term in _summands(kernel):
        size = 1 if _is_constant(term) else n_features
        omega, mass = _frequencies(term, rng, (n_draws, size), d)
        frequencies.append(omega)
        amplitudes.append(np.full(size, math.sqrt(mass / size)))
    frequencies = np.concatenate(frequencies, axis=1)
    weights = rng.standard_normal((n_draws, 2 * frequencies.shape[1], n_outputs))
    return PriorDraws(frequencies=jnp.asarray(frequencies, dtype),
                      amplitudes=jnp.asarray(np.concatenate(amplitudes), dtype),
                      weights=jnp.asarray(weights, dtype))


def _summands(kernel):
    if isinstance(kernel, ops.Sum):
        return [leaf for term in kernel.terms for leaf in _summands(term)]
    return [kernel]


def _is_constant(kernel) -> bool:
    if isinstance(kernel, ops.Product):
        return all(_is_constant(t) for t in kernel.terms)
    return isinstance(kernel, ops.Constant)


def _scalar(value, what) -> float:
    value = np.asarray(value, np.float64)
    if value.size != 1:
        raise ValueError(f"{what} must be a single number, got shape {value.shape}")
    return float(value.reshape(()))


def _lengthscales(node, d) -> np.ndarray:
    """The node's lengthscales as (d,) (a scalar broadcast)."""
    value = np.asarray(node.lengthscale, np.float64).reshape(-1)
    if value.size not in (1, d):
        raise ValueError(f"{type(node).__name__} has {value.size} lengthscales for {d} features")
    return np.broadcast_to(value, (d,))


def _frequencies(node, rng, size, d):
    """``(ω size + (d,), mass)``: frequencies from the node's normalised spectral measure and
    its total mass ``k(0)``."""
    if isinstance(node, ops.Constant):
        value = _scalar(node.value, "Constant value")
        if value < 0:
            raise ValueError(f"a negative constant ({value}) is not a covariance: no prior draw")
        return np.zeros(size + (d,)), value
    if isinstance(node, ops.RBF):
        return rng.standard_normal(size + (d,)) / _lengthscales(node, d), 1.0
    if isinstance(node, ops.Matern):
        nu = float(node.nu)
        chi2 = rng.gamma(nu, 2.0, size)  # χ²(2ν)
        z = rng.standard_normal(size + (d,)) / _lengthscales(node, d)
        return z * np.sqrt(2.0 * nu / chi2)[..., None], 1.0
    if isinstance(node, ops.RationalQuadratic):
        alpha = _scalar(node.alpha, "RationalQuadratic alpha")
        tau = rng.gamma(alpha, 1.0 / alpha, size)
        z = rng.standard_normal(size + (d,)) / _scalar(node.lengthscale, "RQ lengthscale")
        return z * np.sqrt(tau)[..., None], 1.0
    if isinstance(node, ops.ExpSineSquared):
        if d != 1:
            raise ValueError(
                f"ExpSineSquared on {d} features has no random-feature prior: a periodic profile "
                "of the Euclidean distance is not positive definite beyond one feature, so it has "
                "no spectral measure; draw with method='exact' (few query rows) or give the "
                "periodic term one feature")
        harmonics, p = _harmonic_weights(_scalar(node.lengthscale, "ExpSineSquared "
                                                 "lengthscale"))
        k = rng.choice(harmonics.size, size=size, p=p)
        period = _scalar(node.period, "ExpSineSquared period")
        return (2.0 * math.pi / period * harmonics[k])[..., None], 1.0
    if isinstance(node, ops.Product):
        omega, mass = np.zeros(size + (d,)), 1.0
        for factor in node.terms:
            w, m = _frequencies(factor, rng, size, d)
            omega, mass = omega + w, mass * m
        return omega, mass
    if isinstance(node, ops.Sum):
        parts = [_frequencies(term, rng, size, d) for term in node.terms]
        masses = np.array([m for _, m in parts])
        total = float(masses.sum())
        if total <= 0:
            return np.zeros(size + (d,)), 0.0
        choice = rng.choice(len(parts), size=size, p=masses / total)
        omega = np.choose(choice[..., None], [w for w, _ in parts])
        return omega, total
    raise ValueError(f"no random-feature prior for a {type(node).__name__} kernel")


@functools.lru_cache(maxsize=64)
def _harmonic_weights(lengthscale: float):
    """``(k, P(k))`` of the ExpSineSquared Fourier series: ``P(0) = e^{-z} I_0(z)``,
    ``P(k) = 2 e^{-z} I_k(z)``, ``z = 1/l²``, truncated (`MAX_HARMONICS`) and renormalised."""
    z = 1.0 / lengthscale**2
    top = int(min(MAX_HARMONICS, math.ceil(8.0 * math.sqrt(z) + 20.0)))
    k = np.arange(top + 1)
    weights = special.ive(k, z)
    weights[1:] *= 2.0
    return k.astype(np.float64), weights / weights.sum()
