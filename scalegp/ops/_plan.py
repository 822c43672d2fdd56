"""The one list of backends (`BACKENDS`) and `plan`, the one function that decides, for a call,
which backend runs, whether it runs interpreted, its tiles and whether keys spread over many
lengthscales may take the coordinate differences; with the run-time choice between the distance
expansion and those differences. The products on one device (`_rbf`, `_expression`, the pruned
paths) and on a mesh (`sharding`) ask it, never a backend by name. This is the only module that
compares backend or platform names (`tools/check_structure.py` enforces it).

What each backend declares (`scalegp.ops._interface.Backend`), and what ``impl="auto"`` picks:

=========  =======================  ===========================================================
backend    platforms                families (capabilities)
=========  =======================  ===========================================================
dense      cpu, gpu, tpu            rbf, expression, backward (autodiff), mesh; builds K (not
                                    memory-linear, rows not independent of their batch)
xla        cpu, gpu, tpu            rbf, expression, backward, differences, matern_expansion,
                                    pruned (any decaying profile or expression), prunes under
                                    auto, planned KDE (with its leave-one-out form), mesh, row
                                    independent, memory-linear; short tiles for small batches
triton     gpu (interpreted: cpu)   rbf, expression, backward, differences, pruned (the RBF),
                                    mesh, row independent, memory-linear
mosaic     tpu (interpreted: cpu)   rbf (the differences or the expansion chosen inside),
                                    expression, backward, matern_expansion, pruned (the
                                    RBF; not under auto), planned KDE (scoring), dense
                                    products (compiled only), mesh, row independent,
                                    memory-linear
=========  =======================  ===========================================================

- ``impl="auto"``: among the backends that declare the platform in ``auto_on`` and the keys'
  dtype in ``auto_dtypes``, a fused one that compiles there, else the first in `BACKENDS`:
  triton on a GPU and mosaic on a TPU in float32, xla otherwise (CPU, float64 on a GPU or
  TPU). Decided by the platform and the keys, never the number of queries (row independence).
- ``impl="pallas"``: the platform's fused kernels: the fused backend that compiles on it
  (triton on a GPU, mosaic on a TPU), else one that runs interpreted there (triton in
  interpret mode on a CPU, for tests).
- a backend's name: that backend, where it compiles or interprets; an error elsewhere.
- dense products (`dense_backend`, for `scalegp.ops.dense_products`): the fused backend that
  compiles on the platform, where it declares them (mosaic on a TPU); else XLA's dot.

A new backend is one sub-package of `scalegp.ops.backends` exporting ``BACKEND`` and one line in
`BACKENDS` (`register` at run time: tests/ops/test_conformance.py's toy backend).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from scalegp._runtime import usable_cores
from scalegp.ops import pruning
from scalegp.ops._interface import Backend, Plan, PrunedCore
from scalegp.ops._kernels import DIRECT_MAX_D
from scalegp.ops._matmul import RBF_EXPANSION_MEAN_LIMIT
from scalegp.ops._prepare import prepare
from scalegp.ops._tiling import BlockSizes
from scalegp.ops.backends import dense, mosaic, triton, xla

#: Every backend, by name. A new backend is one more entry.
BACKENDS: dict[str, Backend] = {b.name: b for b in (dense.BACKEND, xla.BACKEND, triton.BACKEND,
                                                    mosaic.BACKEND)}
#: The name that means "the platform's fused kernels" (model files store it).
FUSED = "pallas"
#: The tile families a plan is made for: the RBF products, the kernel-expression products, and
#: the pruned products.
FAMILIES = ("rbf", "expression", "pruned")


def register(backend: Backend) -> None:
    """Adds ``backend`` to `BACKENDS` (a new one: its name must be free)."""
    if backend.name in BACKENDS or backend.name in ("auto", FUSED):
        raise ValueError(f"a backend named {backend.name!r} exists already")
    BACKENDS[backend.name] = backend


def unregister(name: str) -> None:
    """Removes a backend `register` added."""
    BACKENDS.pop(name)


def implementations() -> tuple[str, ...]:
    """The ``impl`` values besides "auto": every backend's name and "pallas"."""
    return tuple(BACKENDS) + (FUSED,)


#: The ``impl`` values of the built-in backends besides "auto" (what model files may hold).
IMPLEMENTATIONS = implementations()


def _platform(backend: str | None) -> str:
    """The platform products are planned for: ``backend`` where given, else that of the device
    `jax.default_device` made the default, if any (an estimator's `host_scope` makes it the
    host CPU on a TPU machine, and the products must then be planned for the CPU: the TPU's
    compiled Mosaic kernels do not run there), else JAX's default backend."""
    if backend:
        return backend
    device = jax.config.jax_default_device
    if device is not None:
        return getattr(device, "platform", str(device))
    return jax.default_backend()


def lapack_on_host(platform: str | None = None) -> bool:
    """Whether dense linear algebra on host arrays (scipy's LAPACK) runs on the device itself:
    the platform is the host CPU. The exact GP takes LAPACK's ``potri`` there and XLA's
    triangular solves elsewhere."""
    return _platform(platform) == "cpu"


def dense_work_on_host(platform: str | None = None) -> bool:
    """Whether float64 arithmetic and small dense factorisations (the exact GP) belong on the
    host CPU rather than on the platform's device: on a TPU, which has no float64 hardware and
    runs such work (short steps, small matrices) far slower than its host (docs/decisions.md
    #50)."""
    return _platform(platform) == "tpu"


#: Usable cores from which a host CPU compiles a fit's programs ahead (`compiles_ahead`).
COMPILE_AHEAD_MIN_CORES = 8


def compiles_ahead(platform: str | None = None) -> bool:
    """Whether a fit compiles its later programs in background threads while it works
    (`scalegp._ahead`): on a TPU, whose GP programs compile for seconds each (their Mosaic
    kernels) while the host's other cores idle (docs/decisions.md #62); on a host CPU of at
    least `COMPILE_AHEAD_MIN_CORES` usable cores (a TPU machine's host, where the exact GP
    runs), whose compilations would otherwise queue on the fit's thread while most cores wait
    (#63). Not on a smaller CPU, whose cores run the fit itself; not on a GPU, where it was
    not measured."""
    platform = _platform(platform)
    return platform == "tpu" or (platform == "cpu"
                                 and usable_cores() >= COMPILE_AHEAD_MIN_CORES)


def dense_backend(platform: str | None = None) -> Backend | None:
    """The backend whose `DenseProducts` run on ``platform`` (default: as `_platform`): the
    fused one that compiles there, where it declares "dense_products" (Mosaic on a TPU); else
    None (XLA's dot at ``HIGHEST``). Interpreted kernels are never taken: on a CPU they would
    be slower than its own dot for no gain (the tests call them directly)."""
    platform = _platform(platform)
    fused = _fused(platform)
    if fused is None or platform not in fused.compiles_on or not fused.can("dense_products"):
        return None
    return fused


def available_implementations(backend: str | None = None) -> dict[str, str]:
    """Which backends run on ``backend`` (a platform; default: JAX's default backend), and
    how; "pallas" names the one it means there."""
    platform = _platform(backend)
    out = {name: entry.describe(platform) for name, entry in BACKENDS.items()
           if entry.runs_on(platform)}
    fused = _fused(platform)
    if fused is not None:
        out[FUSED] = f"{fused.name}: {fused.describe(platform)}"
    return out


def _fused(platform: str) -> Backend | None:
    """The backend "pallas" means on ``platform``: fused and compiled there, else fused and
    interpreted there, else None."""
    fused = [b for b in BACKENDS.values() if b.fused]
    for entry in fused:
        if platform in entry.compiles_on:
            return entry
    for entry in fused:
        if platform in entry.interprets_on:
            return entry
    return None


def _auto(platform: str, dtype) -> Backend:
    name = jnp.dtype(dtype).name
    candidates = [b for b in BACKENDS.values() if platform in b.auto_on and name in b.auto_dtypes]
    candidates.sort(key=lambda b: not (b.fused and platform in b.compiles_on))
    if not candidates:
        raise ValueError(f"no backend runs {name} products on {platform} under impl='auto'")
    return candidates[0]


def check_impl(impl) -> None:
    if impl != "auto" and impl not in implementations():
        raise ValueError(f"impl must be one of {('auto',) + implementations()}, got {impl!r}")


def backend_of(impl, dtype=jnp.float32, platform: str | None = None) -> Backend:
    """The `Backend` that ``impl`` ("auto", "pallas" or a backend's name) means for keys of
    ``dtype`` on ``platform`` (default: JAX's default backend); a ValueError naming what runs
    there where it does not run."""
    check_impl(impl)
    platform = _platform(platform)
    if impl == "auto":
        return _auto(platform, dtype)
    if impl == FUSED:
        entry = _fused(platform)
        if entry is None:
            raise ValueError(
                f"impl='pallas' means the platform's fused kernels, and there are none for "
                f"{platform} yet; pass impl='auto' or 'xla' (runs here: "
                f"{', '.join(available_implementations(platform))})")
    else:
        entry = BACKENDS[impl]
        if not entry.runs_on(platform):
            raise ValueError(f"impl={impl!r} does not run on {platform}; pass impl='auto' or "
                             f"one of {', '.join(available_implementations(platform))}")
    if jnp.dtype(dtype) == jnp.float64 and not entry.can("float64"):
        raise ValueError(f"impl={impl!r} runs the {entry.name} backend, which computes in "
                         "float32 only; pass float32 inputs, or impl='auto' or 'xla' for "
                         "float64")
    return entry


def auto_config(m: int, d: int, *, dtype=jnp.float32, backend: str | None = None
                ) -> tuple[str, BlockSizes]:
    """The backend and tile sizes that ``impl="auto"`` picks for ``m`` keys of ``d`` features
    on ``backend`` (a platform; default: JAX's default backend).

    The choice depends on the keys only, never on the number of queries, so that each query
    row's result is bitwise the same in any batch. Hence no dense path under auto: its
    ``(n, m)`` products round differently for different n. Returns ``(impl, block_sizes)``.
    """
    entry = backend_of("auto", dtype, backend)
    return entry.name, entry.tiles("rbf", None, m, d)


def overridden(default: BlockSizes, block_q=None, block_k=None, block_o=None) -> BlockSizes:
    """``default`` with the tile sizes the caller gave (None: keep)."""
    overrides = {k: int(v) for k, v in (("block_q", block_q), ("block_k", block_k),
                                        ("block_o", block_o)) if v is not None}
    return dataclasses.replace(default, **overrides)


def _pruned_overrides(core_is_fused: bool, block_q, block_k):
    """A fused backend's pruned kernels take one tile height for queries and keys:
    ``block_k`` (or ``block_q`` alone) sets both unless ``block_q`` is given too (then they
    must agree, checked by the backend)."""
    if not core_is_fused:
        return block_q, block_k
    block = block_k if block_k is not None else block_q
    if block is None:
        return None, None
    return (block_q if block_q is not None else block), block


def plan(impl, m: int, d: int, dtype, *, family: str = "rbf", n: int | None = None,
         queries: int | None = None, columns: int | None = None, block_q=None, block_k=None,
         block_o=None, backend: str | None = None) -> Plan:
    """The `Plan` of one call: the backend ``impl`` means (`backend_of`) for ``m`` keys of
    ``d`` features in ``dtype``, its tiles for ``family`` with the caller's overrides (none for
    an untiled backend), interpret mode, and whether the coordinate differences may run.
    ``n``: the queries of one shard on a mesh (None on one device). ``queries`` and
    ``columns``: on one device and unbatched, the call's query rows and value columns (None
    for a log-sum-exp), from which the backend may take short query tiles
    (`scalegp.ops._interface.Backend.shorten`); None: the full tile."""
    entry = backend_of(impl, dtype, backend)
    if family == "pruned":
        block_q, block_k = _pruned_overrides(entry.fused, block_q, block_k)
    blocks = full = entry.tiles(family, n, m, d)
    if blocks is not None:
        full = overridden(blocks, block_q, block_k, block_o)
        blocks = overridden(blocks, None, block_k, block_o)
        if entry.shorten is not None and family != "pruned":
            blocks = entry.shorten(blocks, queries, columns)
        blocks = overridden(blocks, block_q)
    platform = _platform(backend)
    interpret = platform not in entry.compiles_on
    return Plan(entry, family, blocks, interpret,
                entry.can("differences") and d <= DIRECT_MAX_D, full)


# ----------------------------------------------------------------------------------------------
# pruning


def pruning_mode(prune, prune_tol, impl, m, d, dtype, batched, block_q=None, block_k=None
                 ) -> tuple[bool, float, PrunedCore] | None:
    """None (no pruning), or ``(always, tol, core)``: prune unconditionally, or as
    ``prune="auto"`` decides at run time (`scalegp.ops.pruning.pruning_pays`); ``core`` the
    backend's `PrunedCore`."""
    pruning.check_prune(prune, prune_tol)
    if prune is False:
        return None
    tol = pruning.default_tolerance(dtype) if prune_tol is None else float(prune_tol)
    entry = backend_of(impl, dtype)
    if prune is True and not entry.can("pruned"):
        raise ValueError(
            f"prune=True needs a backend with pruned products, and impl={impl!r} selects "
            f"{entry.name!r}, which has none; pass impl='xla' or 'pallas', or prune=False")
    if prune is not True and not (entry.can("prunes_under_auto")
                                  and pruning.considered_by_auto(m, d, batched)):
        return None
    chosen = plan(impl, m, d, dtype, family="pruned", block_q=block_q, block_k=block_k)
    return prune is True, tol, chosen.pruned()


# ----------------------------------------------------------------------------------------------
# the expansion or the differences, at run time


def mean_sq(b):
    """``mean_j |b_j|²`` of prepared keys b (m, d), as one sum over all entries: the per-row
    norms first (`feature_sum`) made XLA's CPU backend reduce d columns of (m, 1) in one YNN
    fusion that cost most of a one-query product (docs/decisions.md #41). It feeds a
    threshold only, so its rounding may differ from the rows' norms."""
    return jnp.sum(b * b) / b.shape[0]


def keys_mean_sq(x2, scaled, batch_shape, dtype):
    """The keys' mean squared norm ``mean_j |b_j|²`` with ``b = scaled(x2)`` (prepared keys),
    the largest over a batch, without gradient: what decides between a product's distance
    expansion and its coordinate differences (`RBF_EXPANSION_MEAN_LIMIT`). It depends on the
    keys alone (row independence) and is one unbatched number, so that a ``lax.cond`` on it
    stays a branch under the engine's ``vmap`` (a batched predicate would make it a select,
    which runs both paths); across a batch the largest chooses for all."""
    keys = x2.astype(dtype)
    if batch_shape:
        keys = jnp.reshape(keys, (-1,) + keys.shape[-2:])
        return lax.stop_gradient(jnp.max(jax.vmap(lambda x2: mean_sq(scaled(x2)))(keys)))
    return lax.stop_gradient(mean_sq(scaled(keys)))


def expansion_ok(b):
    """Whether the RBF's distance expansion is accurate enough for prepared keys b (m, d): their
    mean squared norm (`mean_sq`, no gradient) against `RBF_EXPANSION_MEAN_LIMIT`."""
    return lax.stop_gradient(mean_sq(b)) <= RBF_EXPANSION_MEAN_LIMIT


def rbf_expansion_ok(x2, lengthscale, batch_shape, dtype):
    """Whether the RBF products' distance expansion is accurate enough for these keys
    (`keys_mean_sq` of the keys prepared as `prepare` does, against
    `RBF_EXPANSION_MEAN_LIMIT`)."""
    def scaled(x2):
        return prepare(x2[:1], x2, lengthscale)[1]

    return keys_mean_sq(x2, scaled, batch_shape, dtype) <= RBF_EXPANSION_MEAN_LIMIT


def expansion_or_differences(ok, expansion, differences, *operands):
    """``expansion(*operands)`` where ``ok`` (a traced boolean, or True: always), else
    ``differences(*operands)``, by ``lax.cond``: only the branch taken runs. The one place the
    products choose between the distance expansion and the coordinate differences."""
    if ok is True:
        return expansion(*operands)
    return lax.cond(ok, expansion, differences, *operands)
