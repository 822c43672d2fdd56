"""The dense oracle: the whole kernel matrix at once, by the distance expansion, differentiated
by autodiff (no tiles, no coordinate differences, no pruning). The reference every other backend
is tested against, and the fastest path below about 1,024 × 1,024. ``impl="auto"`` never takes
it: its ``(n, m)`` products round differently for different n (row independence).

Its written-out backward passes (the mesh schemes' pieces) are autodiff of its forward: for the
log-sum-exp's share of a total ``f = M + L`` over several blocks, the block's own gradient scaled
by ``exp(f_block - f)``.

Library-internal (no ``__all__``): users reach it through `scalegp.ops`.
"""

import jax
import jax.numpy as jnp

from scalegp.ops._interface import Backend, ExpressionCore, RbfCore
from scalegp.ops.backends.dense._reference import (
    PRECISION,
    expression_mv,
    kernel_logsumexp,
    kernel_mv,
)


def _mv_bwd(a, b, v, g):
    return jax.vjp(kernel_mv, a, b, v)[1](g)


def _lse_pair(a, b, w):
    f = kernel_logsumexp(a, b, w)
    return f, jnp.zeros_like(f)  # f = M + L with M = f


def _lse_bwd(a, b, w, f_max, f_log_sum, g):
    f, pullback = jax.vjp(kernel_logsumexp, a, b, w)
    # the block's share of d(total)/d(inputs): its own gradient times exp(f_block - total)
    share = jnp.where(jnp.isfinite(f), jnp.exp(f - (f_max + f_log_sum)), 0.0)
    return pullback(g * share)


def rbf_cores(plan, direct: bool) -> RbfCore:
    del plan, direct  # untiled; no coordinate differences
    return RbfCore(mv=kernel_mv, lse=kernel_logsumexp, mv_bwd=_mv_bwd, lse_pair=_lse_pair,
                   lse_bwd=_lse_bwd)


def _expression_bwd(kernel, x, y, v, g):
    return jax.vjp(expression_mv, kernel, x, y, v)[1](g)


def expression_cores(plan, direct_weights: bool) -> ExpressionCore:
    del plan, direct_weights
    return ExpressionCore(mv=expression_mv, mv_bwd=_expression_bwd)


BACKEND = Backend(
    name="dense",
    compiles_on=frozenset({"cpu", "gpu", "tpu"}),
    capabilities=frozenset({"expression", "backward", "mesh", "float64"}),
    precision=PRECISION,
    tiles=lambda family, n, m, d: None,
    rbf=rbf_cores,
    expression=expression_cores,
)
