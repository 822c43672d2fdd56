"""What every backend's tile code shares, written once: the online log-sum-exp step, the custom-VJP
wiring of a tiled product with a written-out backward pass, the Gaussian kernel's
log-normaliser, and the dense squared distances by coordinate differences. Plain JAX (it runs
inside Pallas kernels too)."""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalegp.ops._tiling import MASK_VALUE


def lse_step(run_max, run_sum, e, w, lw, keep=None):
    """One key tile folded into each row's running log-sum-exp, as FlashAttention's online
    softmax: with the row maximum ``M`` and the scaled sum ``S`` (``log Σ = M + log S``)::

        M' = max(M, max_j (e_ij + log w_j)),   S' = S e^{M - M'} + Σ_j w_j e^{e_ij - M'}

    over the pairs with ``w_j > 0`` (and ``keep``, where given: a pair left out, as a held-out
    row's own key). The terms are ``w_j e^{e - M'}``, not ``e^{e + log w_j - M'}``: rounding
    ``e + log w`` costs ~1e-4 absolute for far queries, and backward passes rebuild the terms
    from the same exponents.

    Args:
      run_max, run_sum: (p,) the running state (-inf and 0 before the first tile), or (p, 1)
        (a Mosaic kernel's VMEM scratch: the results keep that shape).
      e: (p, q) the tile's exponents; w, lw: (1, q) the keys' weights and their logs
        (`scalegp.ops._tiling.log_weights`: a finite stand-in for log 0); keep: optional (p, q).
    Returns:
      ``(M', S', rescale, terms)``: the new state, ``e^{M - M'}`` (p,) and the terms (p, q)
      (what a pass that carries moments of the terms needs too).
    """
    columns = run_max.ndim == 2
    as_column = (lambda t: t) if columns else (lambda t: t[:, None])
    if keep is None:
        new_max = jnp.maximum(run_max, jnp.max(e + lw, axis=1, keepdims=columns))
        terms = jnp.where(w > 0, jnp.exp(e - as_column(new_max)) * w, 0.0)
    else:
        keep = keep & (w > 0)
        new_max = jnp.maximum(run_max, jnp.max(jnp.where(keep, e + lw, MASK_VALUE), axis=1,
                                               keepdims=columns))
        terms = jnp.where(keep, jnp.exp(e - as_column(new_max)) * w, 0.0)
    rescale = jnp.exp(run_max - new_max)
    return new_max, run_sum * rescale + jnp.sum(terms, axis=1, keepdims=columns), rescale, terms


def tile_product(forward, backward, inputs: int, settings: int = 0):
    """A differentiable product from its forward pass and its written-out backward pass: the
    one custom-VJP wiring of the tiled backends.

    ``product(*inputs, *settings)``, called as ``forward`` is (keywords and defaults too): the
    first ``inputs`` arguments are differentiated (arrays, or pytrees of them such as a kernel
    expression), the next ``settings`` are static (tile sizes, tolerances, flags: hashable).

    Args:
      forward: ``forward(*inputs, *settings) -> (out, saved)``: the product and what the
        backward pass needs besides the inputs (a tuple, possibly empty: tiled backward passes
        recompute the tiles instead of storing them). Its signature and docstring are the
        product's.
      backward: ``backward(inputs, saved, g, *settings) -> cotangents``, one per input.
    """
    static = tuple(range(inputs, inputs + settings))
    signature = inspect.signature(forward)

    @functools.partial(jax.custom_vjp, nondiff_argnums=static)
    def product(*args):
        return forward(*args)[0]

    def product_fwd(*args):
        out, saved = forward(*args)
        return out, (args[:inputs], saved)

    def product_bwd(*args):
        static_args, (primal, saved), g = args[:settings], args[settings], args[settings + 1]
        return tuple(backward(primal, saved, g, *static_args))

    product.defvjp(product_fwd, product_bwd)

    @functools.wraps(forward)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return product(*bound.args)

    return call


def gaussian_log_norm(bandwidth, d: int):
    """``log`` of the Gaussian kernel's normalisation ``(2π)^(-d/2) / prod_k h_k`` for a scalar
    or (d,) bandwidth h: what turns a KDE's log-sum into a log-density. numpy in, numpy out (a
    float64 bandwidth stays float64 whatever JAX's x64 mode); JAX in, JAX out."""
    xp = np if isinstance(bandwidth, (np.ndarray, np.generic)) else jnp
    log = np.log if xp is np else accurate_log
    return -0.5 * d * math.log(2 * math.pi) - xp.sum(log(bandwidth)) * (
        d if xp.ndim(bandwidth) == 0 else 1
    )


def accurate_log(x):
    """``log x`` to about the accuracy of the platform's ``exp``: one Newton step on its
    ``log``, ``y + x e^{-y} - 1``. A TPU's float32 log errs by up to 1e-4 absolute, its exp
    by 5e-6 relative (benchmarks/results/mosaic_check_tpu_v5e.json); on a CPU the step changes
    nothing but rounding. For x >= 0, a sum of non-negative terms (a kernel row's, a
    bandwidth): -inf where it is 0 (a row with no mass), not the step's ``0 · inf``; the guard
    keeps gradients finite where x > 0."""
    positive = x > 0
    safe = jnp.where(positive, x, 1.0)
    y = jnp.log(safe)
    return jnp.where(positive, y + (safe * jnp.exp(-y) - 1), -jnp.inf)


def sq_differences(x1, x2, inv_scale, *, reverse_only: bool = False):
    """``Σ_k ((x1_ik - x2_jk) s_k)²``, (n, m), for x1 (n, d), x2 (m, d), s (d,): the squared
    scaled distances by coordinate differences, never the expansion ``|a|² + |b|² - 2 a·b``
    (which rounds at the points' squared norms: at a lengthscale of 1e-3 of the data's spread,
    float32 put the diagonal of K at 0.6 instead of 1). The dense log-kernels of ops
    (`rbf_log_kernel_matrix`) and of the KDE's leave-one-out blocks are ``-1/2`` of it.

    One feature per step of a scan, so the program is the same at any d. Differentiable in
    both modes (the exact GP takes forward-mode derivatives of its kernel matrix), where
    reverse mode keeps an (n, m) residual per feature; with ``reverse_only`` a written-out
    backward pass recomputes the differences feature by feature instead, in O(n m) memory at
    any d (measured: docs/decisions.md #46), and forward mode is not available (a custom
    VJP)."""
    if reverse_only:
        return _sq_differences_reverse(x1, x2, inv_scale)
    return _sq_differences(x1, x2, inv_scale)


def _sq_differences(x1, x2, inv_scale):
    def step(total, feature):
        a, b, s = feature
        q = (a[:, None] - b[None, :]) * s
        return total + q * q, None

    total = jnp.zeros((x1.shape[0], x2.shape[0]), x1.dtype)
    return lax.scan(step, total, (x1.T, x2.T, inv_scale))[0]


def _sq_differences_bwd(inputs, saved, g):
    """With ``δ_ijk = x1_ik - x2_jk`` and ``t = g ∘ δ_k s_k``: ``dx1_ik = 2 s_k Σ_j t_ij``,
    ``dx2_jk = -2 s_k Σ_i t_ij``, ``ds_k = 2 Σ_ij t_ij δ_ijk``, a feature per step."""
    del saved
    x1, x2, inv_scale = inputs

    def step(_, feature):
        a, b, s = feature
        delta = a[:, None] - b[None, :]
        t = g * (delta * s)
        return None, (2 * s * jnp.sum(t, axis=1), -2 * s * jnp.sum(t, axis=0),
                      2 * jnp.sum(t * delta))

    _, (dx1, dx2, ds) = lax.scan(step, None, (x1.T, x2.T, inv_scale))
    return dx1.T, dx2.T, ds


_sq_differences_reverse = tile_product(
    lambda x1, x2, inv_scale: (_sq_differences(x1, x2, inv_scale), ()), _sq_differences_bwd,
    inputs=3)
