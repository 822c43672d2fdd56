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

MODES = ("fwd", "fwd_bwd")


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    kinds: tuple[str, ...]  # "kmv" (K @ v), "kde" (density)
    modes: tuple[str, ...]
    devices: tuple[str, ...]
    modules: tuple[str, ...]  # importable modules it needs
    ours: bool = False
    description: str = ""


IMPLS = {
    i.name: i
    for i in (
        Impl("dense", ("kmv", "kde"), MODES, ("cpu", "gpu"), ("jax",), True,
             "scalegp.ops impl='dense': builds the n x m kernel matrix"),
        Impl("xla", ("kmv", "kde"), MODES, ("cpu", "gpu"), ("jax",), True,
             "scalegp.ops impl='xla': blocked lax.map/scan, memory-linear"),
        Impl("pallas", ("kmv", "kde"), MODES, ("cpu", "gpu"), ("jax",), True,
             "scalegp.ops impl='pallas': fused kernels (Triton on GPU, interpret mode on CPU)"),
        Impl("auto", ("kmv", "kde"), MODES, ("cpu", "gpu"), ("jax",), True,
             "scalegp.ops impl='auto': the library default"),
        Impl("numpy_dense", ("kmv",), MODES, ("cpu",), ("numpy",), False,
             "numpy float32, whole kernel matrix; hand-written backward"),
        Impl("numpy_chunked", ("kmv",), MODES, ("cpu",), ("numpy", "threadpoolctl"), False,
             "numpy float32, row chunks on a thread pool (one per core, BLAS single-threaded)"),
        Impl("torch_dense", ("kmv",), MODES, ("cpu", "gpu"), ("torch",), False,
             "torch float32, addmm exponent, whole kernel matrix; autograd backward"),
        Impl("torch_chunked", ("kmv",), MODES, ("cpu", "gpu"), ("torch",), False,
             "torch float32, row chunks; autograd backward chunk by chunk"),
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
    return "kde" if family == KDE else "kmv"


def applies(impl: str, family: str, mode: str, device: str) -> bool:
    """Whether ``impl`` has a row for this family, mode and device at all."""
    i = IMPLS.get(impl)
    return i is not None and (
        kind_of(family) in i.kinds and mode in i.modes and device in i.devices
    )


def missing_modules(impl: str) -> list[str]:
    """Modules ``impl`` needs that cannot be imported here (checked without importing them)."""
    return [m for m in IMPLS[impl].modules if importlib.util.find_spec(m) is None]

