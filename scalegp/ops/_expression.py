"""Public entry points for kernel expressions (`scalegp.ops._kernels`): ``K v`` and the dense
``K``, for any sum and product of RBF, Matérn, rational-quadratic, periodic and constant kernels.

Inputs are centred on the keys' centre, as in `scalegp.ops._prepare` (row independence), but not
scaled: each term scales the tile's shared squared distances by its own lengthscales. A kernel
of the form ``c · RBF(l)`` takes the hand-written RBF path (`rbf_kernel_mv`), which is faster, and
on the xla implementation one of the form ``c · Matern(l, ν)``, ν = 3/2 or 5/2, the
hand-written Matérn path (`backends.xla._matern.matern_mv`: points scaled by ``√(2ν) / l``,
distances by the expansion, like the RBF's) where the points' scaled norms keep the
expansion's rounding within the accuracy target
(`scalegp.ops._matmul.MATERN_EXPANSION_MEAN_LIMIT`), the generic one otherwise.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from scalegp.ops._checks import (
    batch_shape,
    check_point_sets,
    float_dtype,
    product_arguments,
)
from scalegp.ops._kernels import (
    Kernel,
    check_kernel,
    kernel_tile,
    matern_form,
    rbf_form,
    scaled_matern,
)
from scalegp.ops._plan import (
    expansion_or_differences,
    keys_mean_sq,
    plan,
    pruning_mode,
)
from scalegp.ops._prepare import (
    batched_product,
    centred,
    centred_product,
    masked_rows,
    through_one_scalar,
)
from scalegp.ops._rbf import rbf_kernel_matrix, rbf_kernel_mv, static_tol
from scalegp.ops.pruning import auto_keys, check_prune, pruned_product


def kernel_mv(kernel: Kernel, x1, x2, v, *, impl="auto", block_q=None, block_k=None,
              prune="auto", prune_tol=None, keys_in_order=False):
    """Kernel matrix times vectors for a kernel expression, without forming the matrix.

    ``out = K(x1, x2) @ v`` with ``K_ij = k(x1_i, x2_j)``, ``k`` any `scalegp.ops` kernel
    (``RBF``, ``Matern``, ``RationalQuadratic``, ``ExpSineSquared``, ``Constant`` and sums and
    products of them).

    Args:
      kernel: the kernel; its hyperparameters are arrays (differentiable).
      x1: (..., n, d) query points; x2: (..., m, d) key points.
      v: (..., m, o) or (..., m) values; leading batch dimensions broadcast.
      impl: "dense", "xla", "triton", "pallas" or "auto", as in `rbf_kernel_mv`.
      block_q, block_k: tile sizes overriding the implementation's defaults.
      prune, prune_tol, keys_in_order: as in `rbf_kernel_mv`, for every expression whose
        values fall to 0 with distance (`backends.xla._pruned_expression`: RBF, Matérn and
        rational-quadratic terms, products with such a factor, sums of such terms); the
        error bound is relative to the kernel's largest value (``|c|`` for ``c · RBF(l)``).
        Other expressions are not pruned (``prune=True`` is then an error, "auto" does
        nothing). The pruned Pallas kernels are the RBF's: ``prune=True`` for another kernel
        on the pallas implementation is an error.
    Returns:
      (..., n, o), or (..., n) for vector ``v``. Differentiable in x1, x2, v and every
      hyperparameter; the xla and pallas paths use O((n + m)(d + o)) memory forward and
      backward. Rows whose squared distance from the keys' centre overflows the dtype give 0.

    ``c · Matern(l, ν)``, ν = 3/2 or 5/2, on xla takes the distance expansion or the coordinate
    differences per call, by ``lax.cond`` on the keys (`_matern_expansion_ok`); pass a batch as
    leading dimensions rather than ``jax.vmap`` around this function, under which the
    predicate is batched and both paths run.
    """
    fast = rbf_form(kernel)
    if fast is not None:
        scale, lengthscale = fast
        out = rbf_kernel_mv(x1, x2, v, lengthscale, impl=impl, block_q=block_q, block_k=block_k,
                            prune=prune, prune_tol=prune_tol, keys_in_order=keys_in_order)
        return out if scale is None else scale * out
    check_prune(prune, prune_tol)
    self_product = x1 is x2
    x1, x2, v, vector, dtype = product_arguments(x1, x2, v)
    n, m, d, o = x1.shape[-2], x2.shape[-2], x1.shape[-1], v.shape[-1]
    kernel = check_kernel(kernel, d, dtype)
    if prune is True and not kernel.decays:
        raise ValueError(
            "prune=True needs a kernel whose values fall to 0 with distance (RBF, Matern or "
            "RationalQuadratic terms, each sum term decaying, each product with a decaying "
            "factor); this one has a periodic or constant part that does not: pass "
            "prune=False or 'auto'")
    batch = batch_shape((x1.shape[:-2], "x1"), (x2.shape[:-2], "x2"), (v.shape[:-2], "v"))
    if n == 0 or m == 0:
        out = jnp.zeros(batch + (n, o), dtype)
        return out[..., 0] if vector else out
    return _kernel_mv(kernel, x1.astype(dtype), x2.astype(dtype), v.astype(dtype), impl=impl,
                      block_q=block_q, block_k=block_k, prune=prune,
                      prune_tol=static_tol(prune_tol), keys_in_order=bool(keys_in_order),
                      self_product=self_product, vector=vector)


def auto_prunes(kernel: Kernel, x2, *, impl="auto", prune_tol=None,
                keys_in_order=False) -> bool:
    """The choice ``kernel_mv(kernel, x1, x2, v, prune="auto")`` makes for the keys x2 (m, d),
    taken once on the host: it depends on the keys and the hyperparameters alone (row
    independence), so a caller with fixed keys (a fitted model predicting) can pass
    ``prune=True`` or ``False`` instead and skip the test in every call; each runs the branch
    ``"auto"`` would. False where "auto" never prunes (shapes, implementation, a kernel that
    does not decay)."""
    x2 = jnp.asarray(x2)
    dtype = float_dtype(x2.dtype)
    m, d = x2.shape
    kernel = check_kernel(kernel, d, dtype)
    check_prune("auto", prune_tol)
    mode = pruning_mode("auto", prune_tol, impl, m, d, dtype, False) if kernel.decays else None
    if mode is None or not _prunable_here(kernel, mode[2]):
        return False
    return bool(_auto_prunes(kernel, x2.astype(dtype), impl=impl,
                             prune_tol=static_tol(prune_tol), keys_in_order=bool(keys_in_order)))


@functools.partial(jax.jit, static_argnames=("impl", "prune_tol", "keys_in_order"))
def _auto_prunes(kernel, x2, *, impl, prune_tol, keys_in_order):
    """`auto_prunes`'s test, the one each path of `kernel_mv` runs under ``prune="auto"``."""
    m, d = x2.shape
    _, tol, core = pruning_mode("auto", prune_tol, impl, m, d, x2.dtype, False)
    fast, prunable = rbf_form(kernel), scaled_matern(kernel)
    if fast is not None:  # `rbf_kernel_mv`
        return auto_keys(x2, fast[1], tol, keys_in_order)[0]
    if prunable is not None:  # c · Matern: `pruned_product` with its profile
        matern = prunable[1]
        return auto_keys(x2, matern.lengthscale, tol, keys_in_order, matern.profile)[0]
    _, b, _, _ = centred(x2[:1], x2)  # the generic path prunes centred points
    return core.expression_auto_keys(kernel, b, tol, keys_in_order, core.block)[0]


def _prunable_here(kernel, core) -> bool:
    """Whether the backend's pruned core takes this kernel: the RBF's form everywhere, other
    decaying expressions where it declares "pruned_profiles" (`PrunedCore.expression`)."""
    return rbf_form(kernel) is not None or core.expression is not None


# compiled once per shapes and settings (the kernel's structure is static, its
# hyperparameters traced), as `scalegp.ops._rbf._rbf_kernel_mv`
@functools.partial(jax.jit, static_argnames=(
    "impl", "block_q", "block_k", "prune", "prune_tol", "keys_in_order", "self_product",
    "vector"))
def _kernel_mv(kernel, x1, x2, v, *, impl, block_q, block_k, prune, prune_tol, keys_in_order,
               self_product, vector):
    """`kernel_mv` on a checked kernel and arguments in the compute dtype (n, m >= 1), for a
    kernel not of the RBF's form."""
    n, m, d, o = x1.shape[-2], x2.shape[-2], x1.shape[-1], v.shape[-1]
    dtype = x1.dtype
    batch = batch_shape((x1.shape[:-2], "x1"), (x2.shape[:-2], "x2"), (v.shape[:-2], "v"))
    # short query tiles for a small unbatched call (`scalegp.ops._interface.Backend.shorten`)
    chosen = plan(impl, m, d, dtype, family="expression", queries=None if batch else n,
                  columns=o, block_q=block_q, block_k=block_k)
    cores = chosen.expression()
    product = functools.partial(cores.mv, kernel)
    single = centred_product(product)

    matern = matern_form(kernel)
    if matern is not None and cores.matern is not None:
        differences = centred_product(functools.partial(
            chosen.expression(direct_weights=True).mv, kernel))
        # above DIRECT_MAX_D the generic path's distances come from the expansion as well
        expansion_ok = (_matern_expansion_ok(cores.matern, x2, *matern[1:], batch, dtype)
                        if chosen.differences else True)
        single = _scaled_matern(cores.matern, *matern, d, dtype, differences, expansion_ok)
    pruning = (None if not kernel.decays else
               pruning_mode(prune, prune_tol, impl, m, d, dtype, bool(batch)))
    if pruning is not None:
        always, tol, core = pruning
        if not _prunable_here(kernel, core):
            raise ValueError(
                f"the {chosen.impl} backend prunes the RBF only; prune other kernels with "
                "impl='xla' (or pass prune=False)")
        prunable = scaled_matern(kernel)
        if prunable is not None:  # c · Matern: the profile's pruned path
            scale, matern = prunable
            single = pruned_product(single, matern.lengthscale, always, tol, keys_in_order,
                                    self_product, core, profile=matern.profile, scale=scale)
        else:
            single = centred_product(core.expression(
                kernel, product, always, tol, keys_in_order, self_product, core.block))
    return batched_product(single, x1, x2, v, batch, vector, dtype)


def _matern_expansion_ok(expansion, x2, lengthscale, nu, batch_shape, dtype):
    """Whether the backend's hand-written Matérn ``expansion`` (`MaternExpansion`) is accurate
    enough for these keys: their mean squared norm prepared as `_scaled_matern` does
    (`keys_mean_sq`) against its ``mean_limit``, from the keys alone (row independence)."""
    limit = expansion.coordinate_limit(x2.shape[-1], dtype)

    def scaled(x2):
        return _matern_prepared(x2[:1], x2, lengthscale, nu, limit)[1]

    return keys_mean_sq(x2, scaled, batch_shape, dtype) <= expansion.mean_limit[nu]


def _matern_prepared(x1, x2, lengthscale, nu, limit):
    """Points centred as `centred` does, divided by ``l / √(2ν)`` and clipped to ``limit``."""
    a, b, far_a, far_b = centred(x1, x2, lengthscale * (1 / math.sqrt(2 * nu)))
    return jnp.clip(a, -limit, limit), jnp.clip(b, -limit, limit), far_a, far_b


def _scaled_matern(matern, scale, lengthscale, nu, d, dtype, differences, expansion_ok):
    """``single(x1, x2, v)`` for ``scale · Matern(lengthscale, nu)`` on a backend with a
    hand-written Matérn expansion (``matern``, `MaternExpansion`): that path where
    ``expansion_ok`` (`_matern_expansion_ok`; True: always), else ``differences`` (the
    expression product with its lengthscale gradients from the differences, accurate there
    too), chosen by `expansion_or_differences`: only the branch taken runs. The hand-written
    path: points centred as `centred` does, divided by ``l / √(2ν)`` (so the profile's
    argument is their distance), and clipped to its ``coordinate_limit``. Rows whose scaled
    squared distance from the keys' centre overflows give 0, as in `rbf_kernel_mv`."""
    limit = matern.coordinate_limit(d, dtype)

    def expansion(x1, x2, v):
        # ARD lengthscales keep the chain rule through the points
        fixed, through = (through_one_scalar(lengthscale) if jnp.ndim(lengthscale) == 0
                          else (lengthscale, jnp.ones((), dtype)))
        a, b, far_a, far_b = _matern_prepared(x1, x2, fixed, nu, limit)
        out = masked_rows(matern.mv(a, b, masked_rows(v, far_b), nu, through), far_a)
        return out if scale is None else scale * out

    def single(x1, x2, v):
        return expansion_or_differences(expansion_ok, expansion, differences, x1, x2, v)

    return single


def kernel_matrix(kernel: Kernel, x1, x2):
    """The dense kernel matrix ``K(x1, x2)`` (n, m) of a kernel expression: for small problems
    (Cholesky, cross covariances). Centred as `kernel_mv` is; differentiable in the points and
    every hyperparameter.

    Args:
      kernel: a `scalegp.ops` kernel; x1: (n, d); x2: (m, d).
    """
    fast = rbf_form(kernel)
    if fast is not None:
        scale, lengthscale = fast
        out = rbf_kernel_matrix(x1, x2, lengthscale)
        return out if scale is None else scale * out
    x1, x2 = jnp.asarray(x1), jnp.asarray(x2)
    check_point_sets(x1, x2, ("x1", "x2"))
    dtype = float_dtype(x1, x2)
    kernel = check_kernel(kernel, x1.shape[-1], dtype)
    a, b, far_a, far_b = centred(x1.astype(dtype), x2.astype(dtype))
    return jnp.where(far_a[:, None] | far_b[None, :], 0.0, kernel_tile(kernel, a, b.T))
