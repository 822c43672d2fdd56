"""What each implementation name means, which families and modes it runs, and what it needs.

Light on purpose: the parent process imports this (and nothing heavy) to plan a run.
"""

from __future__ import annotations

import dataclasses
import importlib.util

KMV = "kernel_mv"
KDE = "kde_density"
PEAK = "kernel_mv_peak"
MAX_N = "kernel_mv_max_n"
TILES = "kernel_mv_tiles"
CROSSOVER = "kernel_mv_crossover"
#: The kernels section: kernel expressions other than the RBF (problems.py defines them).
MATERN32 = "kernel_mv_matern32"
COMPOSITE = "kernel_mv_composite"
#: The kernels section's families, RBF first: its ``kernel_mv`` rows are the grid's RBF product at
#: the section's shapes, the baseline of the report's ratios.
KERNEL_FAMILIES = (KMV, MATERN32, COMPOSITE)

MODES = ("fwd", "fwd_bwd")


ALL_KINDS = ("kmv", "kde", "matern32", "composite")
#: Where scalegp.ops runs; the peers have no TPU row (torch and pykeops are CUDA or CPU only).
JAX_DEVICES = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    # "kmv" (RBF K @ v), "kde" (density), "matern32" and "composite" (kernel expressions)
    kinds: tuple[str, ...]
    modes: tuple[str, ...]
    devices: tuple[str, ...]
    modules: tuple[str, ...]  # importable modules it needs
    ours: bool = False
    description: str = ""


IMPLS = {
    i.name: i
    for i in (
        Impl("dense", ALL_KINDS, MODES, JAX_DEVICES, ("jax",), True,
             "scalegp.ops impl='dense': builds the n x m kernel matrix"),
        Impl("xla", ALL_KINDS, MODES, JAX_DEVICES, ("jax",), True,
             "scalegp.ops impl='xla': blocked lax.map/scan, memory-linear"),
        Impl("pallas", ALL_KINDS, MODES, JAX_DEVICES, ("jax",), True,
             "scalegp.ops impl='pallas': fused kernels (Triton on GPU, Mosaic on TPU, interpret "
             "mode on CPU)"),
        Impl("auto", ALL_KINDS, MODES, JAX_DEVICES, ("jax",), True,
             "scalegp.ops impl='auto': the library default"),
        Impl("numpy_dense", ("kmv",), MODES, ("cpu",), ("numpy",), False,
             "numpy float32, whole kernel matrix; hand-written backward"),
        Impl("numpy_chunked", ("kmv",), MODES, ("cpu",), ("numpy", "threadpoolctl"), False,
             "numpy float32, row chunks on a thread pool (one per core, BLAS single-threaded)"),
        Impl("torch_dense", ("kmv", "matern32"), MODES, ("cpu", "gpu"), ("torch",), False,
             "torch float32, addmm exponent (squared distance for Matern-3/2), whole kernel "
             "matrix; autograd backward"),
        Impl("torch_chunked", ("kmv", "matern32"), MODES, ("cpu", "gpu"), ("torch",), False,
             "torch float32, row chunks (RBF and Matern-3/2); autograd backward chunk by chunk"),
        Impl("pykeops", ("kmv", "kde"), MODES, ("cpu", "gpu"), ("pykeops", "torch"), False,
             "pykeops LazyTensor reduction (torch binding); KeOps autodiff backward"),
        Impl("scipy_kde", ("kde",), ("fwd",), ("cpu",), ("scipy",), False,
             "scipy.stats.gaussian_kde(bw_method=h) on whitened data: kernel covariance h^2 I"),
        Impl("sklearn_kde", ("kde",), ("fwd",), ("cpu",), ("sklearn",), False,
             "sklearn KernelDensity(kernel='gaussian', bandwidth=h, rtol=1e-6), fit included"),
    )
}

OURS = tuple(name for name, i in IMPLS.items() if i.ours)
PEERS = tuple(name for name, i in IMPLS.items() if not i.ours)


def kind_of(family: str) -> str:
    return {KDE: "kde", MATERN32: "matern32", COMPOSITE: "composite"}.get(family, "kmv")


def applies(impl: str, family: str, mode: str, device: str) -> bool:
    """Whether ``impl`` has a row for this family, mode and device at all."""
    i = IMPLS.get(impl)
    return i is not None and (
        kind_of(family) in i.kinds and mode in i.modes and device in i.devices
    )


def missing_modules(impl: str) -> list[str]:
    """Modules ``impl`` needs that cannot be imported here (checked without importing them)."""
    return [m for m in IMPLS[impl].modules if importlib.util.find_spec(m) is None]

