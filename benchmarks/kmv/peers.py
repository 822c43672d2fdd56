"""Peer baselines, each written in its fastest reasonable form.

Every peer computes exactly what scalegp.ops computes for the same inputs (see problems.py): the
RBF product ``K(x1, x2) @ v`` with lengthscale l, or the Gaussian KDE with bandwidth h, and for
fwd_bwd the value and the gradients of ``sum(out * G)`` with respect to every input, lengthscale or
bandwidth included. All work in float32 except scipy and scikit-learn, which compute in float64
whatever they are given.

Interface (shared with ours.py): ``setup()`` (not timed) returns extra record fields, ``call()``
runs once and returns the output, ``sync(out)`` waits for it, ``result(out)`` converts it to
numpy (``{"out": ...}`` or the gradients by name), ``close()`` releases thread pools.

numpy: the exponent is ``a.b - |a|^2/2 - |b|^2/2`` (one BLAS product, as in scalegp) on inputs
centred by their common mean, clamped at 0 and exponentiated in place. numpy has no autodiff, so
the backward is written by hand from the same tiles: with ``P = K * (G v^T)``,
``dv = K^T G``, ``da = P b - rowsum(P) a``, ``db = P^T a - colsum(P) b``, ``dl = sum(P r) / l``.
numpy_dense does it in one block (BLAS multi-threaded, exp single-threaded, as numpy is);
numpy_chunked cuts the rows into cache-sized blocks and gives each core a contiguous range of them
on a thread pool (numpy releases the GIL), with BLAS limited to one thread to avoid
oversubscription.

torch: the exponent via ``torch.addmm`` (not cdist), in place under no_grad for fwd; fwd_bwd by
autograd (torch.autograd.grad). torch_chunked runs row blocks; for fwd_bwd it calls backward on each
block's share of the loss right away, so no block's graph outlives it (memory stays one block)
while nothing is recomputed. torch uses one intra-op thread per core.

torch also runs the Matérn-3/2 family (kernel_mv_matern32: ARD lengthscale l, a (d,) leaf of
autograd): the squared distance ``s = |a|² + |b|² - 2 a.b`` of the scaled inputs by the same
addmm, clamped at 0, then ``t = √(3s)`` and ``(1 + t) e^{-t}``, in place for fwd. For fwd_bwd
autograd differentiates through ``√(3 max(s, 1e-30))``: the floor keeps the derivative of the
square root finite where s rounds to 0 (it changes k by 1.5e-30), and the clamp passes no
gradient there, the zero gradient scalegp.ops uses at r = 0. The other peers have no Matérn or
composite rows (numpy would need a hand-written backward per profile; pykeops could express
Matérn but is not written here).

pykeops: LazyTensor ``(-sqdist(a_i, b_j) / 2).exp() @ v`` (and ``.sum(1)`` for KDE), gradients by
KeOps' own autodiff through the torch binding. Its first call compiles the formula (cached on
disk across runs), which lands in compile_s.

scipy.stats.gaussian_kde and sklearn.neighbors.KernelDensity: the KDE family's forward only (they
have no gradients). gaussian_kde(data, bw_method=h) on data whitened to unit sample covariance has
kernel covariance exactly h^2 I; KernelDensity(bandwidth=h, kernel="gaussian", rtol=1e-6) uses a
KD/ball tree with a relative tolerance at float32 accuracy (its default rtol=0 is exact and slower).
Constructing the estimator (covariance and Cholesky factor; the tree) is inside the timed call:
scalegp has no fitting step, so the comparison is the cost of answering the query from raw data.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.kmv.problems import (
    KDE_GRADS,
    KERNEL_GRADS,
    KMV_GRADS,
    MATERN32_FAMILY,
    is_expression,
    is_kde,
)

SKLEARN_RTOL = 1e-6
# Row blocks of 2^20 kernel entries (4 MiB of float32): the best of 2^16 ... 2^22 for both at
# n = m = 4096, d = 8, o = 16 on the 2-core development machine (smaller blocks pay per-block
# overhead, larger ones fall out of cache).
# On a GPU torch gets blocks of 2^26 entries (256 MiB): launch overhead, not cache, decides there.
NUMPY_BLOCK_ENTRIES = 1 << 20
TORCH_BLOCK_ENTRIES = {"cpu": 1 << 20, "gpu": 1 << 26}


def _row_blocks(n: int, m: int, entries: int) -> list[slice]:
    rows = max(1, min(n, entries // max(m, 1)))
    return [slice(i, min(n, i + rows)) for i in range(0, n, rows)]


def _centre(x1, x2):
    return (x1.sum(0, dtype=np.float64) + x2.sum(0, dtype=np.float64)) / (len(x1) + len(x2))


class _Peer:
    def setup(self) -> dict:
        return {}

    def sync(self, out):
        return out

    def close(self):
        pass


# ----------------------------------------------------------------------------------------------
# numpy


class NumpyKmv(_Peer):
    def __init__(self, inputs, mode, chunked, threads):
        self.x1, self.x2, self.v, self.G = (inputs[k] for k in ("x1", "x2", "v", "G"))
        self.l = np.float32(inputs["lengthscale"])
        self.mode = mode
        n, m = len(self.x1), len(self.x2)
        self.threads = threads if chunked else 1
        blocks = _row_blocks(n, m, NUMPY_BLOCK_ENTRIES) if chunked else [slice(0, n)]
        # one contiguous range of row blocks per worker
        per = -(-len(blocks) // self.threads)
        self.ranges = [blocks[i : i + per] for i in range(0, len(blocks), per)]
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self.limiter = None
        if self.pool is not None:
            from threadpoolctl import threadpool_limits

            self.limiter = threadpool_limits(1, user_api="blas")

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()
        if self.limiter is not None:
            self.limiter.restore_original_limits()

    def _map(self, fn):
        if self.pool is None:
            return [fn(r) for r in self.ranges]
        return list(self.pool.map(fn, self.ranges))

    @staticmethod
    def _exponent(a_blk, b, b_hn):
        e = a_blk @ b.T
        e -= 0.5 * np.einsum("ij,ij->i", a_blk, a_blk)[:, None]
        e -= b_hn
        return np.minimum(e, 0.0, out=e)

    def call(self):
        c = _centre(self.x1, self.x2)
        a = ((self.x1 - c) / self.l).astype(np.float32)
        b = ((self.x2 - c) / self.l).astype(np.float32)
        b_hn = (0.5 * np.einsum("ij,ij->i", b, b))[None, :]
        v, G = self.v, self.G
        out = np.empty((len(a), v.shape[1]), np.float32)
        if self.mode == "fwd":

            def fwd(blocks):
                for s in blocks:
                    k = self._exponent(a[s], b, b_hn)
                    np.matmul(np.exp(k, out=k), v, out=out[s])

            self._map(fwd)
            return out

        da = np.empty_like(a)

        def fwd_bwd(blocks):
            value, dl = 0.0, 0.0
            dv, db = np.zeros_like(v), np.zeros_like(b)
            for s in blocks:
                e = self._exponent(a[s], b, b_hn)
                k = np.exp(e)
                np.matmul(k, v, out=out[s])
                value += float(np.einsum("ij,ij->", out[s], G[s], dtype=np.float64))
                p = G[s] @ v.T
                p *= k
                dv += k.T @ G[s]
                da[s] = p @ b - p.sum(1)[:, None] * a[s]
                db += p.T @ a[s] - p.sum(0)[:, None] * b
                dl += float(np.einsum("ij,ij->", p, e, dtype=np.float64))
            return value, dl, dv, db

        parts = self._map(fwd_bwd)
        value = sum(p[0] for p in parts)
        dl = -2.0 * sum(p[1] for p in parts) / self.l
        dv = sum(p[2] for p in parts)
        db = sum(p[3] for p in parts)
        return value, {"dq": da / self.l, "dk": db / self.l, "dv": dv, "dlengthscale": dl}

    def result(self, out):
        return {"out": out} if self.mode == "fwd" else out[1]


# ----------------------------------------------------------------------------------------------
# torch


class TorchKmv(_Peer):
    def __init__(self, inputs, mode, chunked, device, threads):
        import torch

        self.torch = torch
        if device == "cpu":
            torch.set_num_threads(threads)
        self.dev = torch.device("cuda" if device == "gpu" else "cpu")
        t = {k: torch.from_numpy(np.asarray(inputs[k])).to(self.dev)
             for k in ("x1", "x2", "v", "G")}
        self.x1, self.x2, self.v, self.G = t["x1"], t["x2"], t["v"], t["G"]
        self.l = torch.tensor(float(inputs["lengthscale"]), dtype=torch.float32, device=self.dev)
        n, m = self.x1.shape[0], self.x2.shape[0]
        self.mode = mode
        self.chunked = chunked
        entries = TORCH_BLOCK_ENTRIES[device]
        self.blocks = _row_blocks(n, m, entries) if chunked else [slice(0, n)]

    def sync(self, out):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()
        return out

    @staticmethod
    def _k(a_blk, b, b_hn):
        # -|a|^2/2 - |b|^2/2 + a.b, as one addmm plus a broadcast subtraction
        e = b_hn.neg().unsqueeze(0).addmm(a_blk, b.T)
        return (e - 0.5 * (a_blk * a_blk).sum(1, keepdim=True)).clamp(max=0.0).exp()

    @staticmethod
    def _profile_(e):
        """The kernel's values from a block of ``-|a - b|²/2``, in place (fwd)."""
        return e.clamp_(max=0.0).exp_()

    def _forward(self, c):
        torch = self.torch
        with torch.no_grad():
            a, b = (self.x1 - c) / self.l, (self.x2 - c) / self.l
            b_hn = 0.5 * (b * b).sum(1)
            out = torch.empty(a.shape[0], self.v.shape[1], device=self.dev)
            for s in self.blocks:
                e = b_hn.neg().unsqueeze(0).addmm(a[s], b.T)
                e.sub_(0.5 * (a[s] * a[s]).sum(1, keepdim=True))  # -|a - b|²/2
                torch.mm(self._profile_(e), self.v, out=out[s])
            return out

    def call(self):
        torch = self.torch
        c = ((self.x1.sum(0) + self.x2.sum(0)) / (self.x1.shape[0] + self.x2.shape[0])).detach()
        if self.mode == "fwd":
            return self._forward(c)
        leaves = [t.detach().requires_grad_() for t in (self.x1, self.x2, self.v, self.l)]
        x1, x2, v, l = leaves
        if not self.chunked:
            a, b = (x1 - c) / l, (x2 - c) / l
            out = self._k(a, b, 0.5 * (b * b).sum(1)) @ v
            value = (out * self.G).sum()
            return value.detach(), torch.autograd.grad(value, leaves)
        value = torch.zeros((), device=self.dev)
        for s in self.blocks:
            b = (x2 - c) / l  # O(m d), recomputed so each block's graph is self-contained
            out = self._k((x1[s] - c) / l, b, 0.5 * (b * b).sum(1)) @ v
            part = (out * self.G[s]).sum()
            part.backward()
            value += part.detach()
        return value, [t.grad for t in leaves]

    def result(self, out):
        if self.mode == "fwd":
            return {"out": out.cpu().numpy()}
        return {k: g.detach().cpu().numpy() for k, g in zip(KMV_GRADS, out[1])}


class TorchMatern32(TorchKmv):
    """ARD Matérn-3/2 ``(1 + t) e^{-t}``, ``t = √(3 Σ_d ((x_d - x'_d) / l_d)²)``, row blocks as
    TorchKmv (one block for torch_dense)."""

    #: floor of s under the square root in the autograd path (see the module docstring)
    S_FLOOR = 1e-30

    def __init__(self, inputs, mode, chunked, device, threads):
        super().__init__({**inputs, "lengthscale": 1.0}, mode, chunked, device, threads)
        self.l = self.torch.from_numpy(
            np.asarray(inputs["hyper"]["lengthscale"], np.float32)).to(self.dev)

    @classmethod
    def _k(cls, a_blk, b, b_hn):
        s = b_hn.neg().unsqueeze(0).addmm(a_blk, b.T)  # a.b - |b|^2/2
        s = (s - 0.5 * (a_blk * a_blk).sum(1, keepdim=True)) * -2.0
        t = (3.0 * s.clamp(min=cls.S_FLOOR)).sqrt()
        return (1.0 + t) * (-t).exp()

    def _profile_(self, t):
        """``(1 + t) e^{-t}`` from a block of ``-s/2``, in place (fwd; fwd_bwd autograds `_k`)."""
        t.mul_(-6.0).clamp_(min=0.0).sqrt_()  # t = sqrt(3 s)
        e = self.torch.neg(t).exp_()
        return t.add_(1.0).mul_(e)

    def result(self, out):
        if self.mode == "fwd":
            return {"out": out.cpu().numpy()}
        return {k: g.detach().cpu().numpy().reshape(-1) if k == "dhyper"
                else g.detach().cpu().numpy() for k, g in zip(KERNEL_GRADS, out[1])}


# ----------------------------------------------------------------------------------------------
# pykeops


class KeopsPeer(_Peer):
    def __init__(self, inputs, mode, kde, device):
        import torch
        from pykeops.torch import LazyTensor

        self.torch, self.LazyTensor = torch, LazyTensor
        self.dev = torch.device("cuda" if device == "gpu" else "cpu")
        self.kde, self.mode = kde, mode
        names = ("queries", "data", "bandwidth") if kde else ("x1", "x2", "lengthscale", "v")
        self.args = [
            torch.tensor(np.asarray(inputs[k]), dtype=torch.float32, device=self.dev)
            for k in names
        ]
        self.G = torch.from_numpy(np.asarray(inputs["G"])).to(self.dev)

    def sync(self, out):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()
        return out

    def _forward(self, x1, x2, scale, v=None):
        LazyTensor = self.LazyTensor
        a_i = LazyTensor((x1 / scale)[:, None, :])
        b_j = LazyTensor((x2 / scale)[None, :, :])
        k = (-0.5 * a_i.sqdist(b_j)).exp()
        if v is not None:
            return k @ v
        n, d = x1.shape
        m = x2.shape[0]
        log_norm = -0.5 * d * math.log(2 * math.pi) - d * self.torch.log(scale) - math.log(m)
        return k.sum(dim=1).view(-1) * self.torch.exp(log_norm)

    def call(self):
        if self.mode == "fwd":
            with self.torch.no_grad():
                return self._forward(*self.args)
        leaves = [t.detach().requires_grad_() for t in self.args]
        value = (self._forward(*leaves) * self.G).sum()
        grads = self.torch.autograd.grad(value, leaves)
        return value.detach(), grads

    def result(self, out):
        if self.mode == "fwd":
            return {"out": out.detach().cpu().numpy()}
        grads = [g.cpu().numpy() for g in out[1]]
        if self.kde:
            return dict(zip(KDE_GRADS, grads))
        dq, dk, dl, dv = grads
        return {"dq": dq, "dk": dk, "dv": dv, "dlengthscale": dl}


# ----------------------------------------------------------------------------------------------
# scipy / scikit-learn KDE


class _KdePeer(_Peer):
    """A float64 KDE peer: queries, data and the bandwidth h; forward only."""

    def __init__(self, inputs):
        self.q = np.asarray(inputs["queries"], np.float64)
        self.x = np.asarray(inputs["data"], np.float64)
        self.h = float(inputs["bandwidth"])

    def result(self, out):
        return {"out": out}


class ScipyKde(_KdePeer):
    def call(self):
        from scipy.stats import gaussian_kde

        return gaussian_kde(self.x.T, bw_method=self.h).evaluate(self.q.T)


class SklearnKde(_KdePeer):
    def call(self):
        from sklearn.neighbors import KernelDensity

        kde = KernelDensity(kernel="gaussian", bandwidth=self.h, rtol=SKLEARN_RTOL).fit(self.x)
        return np.exp(kde.score_samples(self.q))


def make_peer(impl: str, family: str, mode: str, inputs: dict, device: str, threads: int):
    kde = is_kde(family)
    if is_expression(family):
        if family == MATERN32_FAMILY and impl in ("torch_dense", "torch_chunked"):
            return TorchMatern32(inputs, mode, impl == "torch_chunked", device, threads)
        raise ValueError(f"peer {impl!r} has no {family} rows")
    if impl in ("numpy_dense", "numpy_chunked"):
        return NumpyKmv(inputs, mode, impl == "numpy_chunked", threads)
    if impl in ("torch_dense", "torch_chunked"):
        return TorchKmv(inputs, mode, impl == "torch_chunked", device, threads)
    if impl == "pykeops":
        return KeopsPeer(inputs, mode, kde, device)
    if impl == "scipy_kde":
        return ScipyKde(inputs)
    if impl == "sklearn_kde":
        return SklearnKde(inputs)
    raise ValueError(f"unknown peer {impl!r}")
