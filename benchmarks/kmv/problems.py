"""Inputs of one benchmark configuration, its float64 reference, and relative errors.

Inputs are generated in numpy from the configuration alone (seeded by it), so the parent, the
reference child and every implementation's child see bit-identical float32 arrays.

kernel_mv: x1 (n, d), x2 (m, d), v (m, o) and the upstream weights G (n, o) are standard normal;
the lengthscale is the scalar sqrt(d), so that a typical kernel entry is about exp(-1) in every
dimension (with l = 1 and d = 32 almost all entries would underflow and the benchmark would time
zeros). fwd_bwd is the value and gradient of ``sum(out * G)`` with respect to x1, x2, v and l.

kde_density: data (m, d) standard normal, then whitened so that its sample covariance (with the
m - 1 divisor) is exactly the identity: scipy's gaussian_kde, whose kernel covariance is
``bw_method**2 * cov(data)``, then uses exactly the isotropic bandwidth h that every other
implementation gets. h is Scott's rule for unit covariance, ``m ** (-1 / (d + 4))``. Queries (n, d)
are standard normal; fwd_bwd is the value and gradient of ``sum(density * G)`` with respect to the
queries, the data and h.

The reference is computed in float64 with JAX (x64 must be enabled in that process), in chunks of
query rows under ``jax.checkpoint`` so that neither it nor its autodiff gradient holds more than one
chunk x m block: it fits in memory at any size, but its cost grows like n * m, which is why the
runner skips it above ``--ref-max-n``. It shares no code with scalegp.ops.

Kernel expressions (the kernels section; same x1, x2, v, G as kernel_mv at the same shape, the
generator being seeded identically, so the three families differ only in the kernel):

kernel_mv_matern32: ARD Matérn-3/2 ``(1 + √3 r) exp(-√3 r)``, ``r² = Σ_d ((x_d - x'_d) / l_d)²``,
with the (d,) lengthscale ``sqrt(d) · ones`` (the RBF rows' scale, per feature).

kernel_mv_composite: a fixed sum of the four kinds of term a GP model combines, all lengthscales
scalar and relative to sqrt(d) (``L = sqrt(d)``; ``ρ = |x - x'|`` Euclidean, unscaled)::

    1.0  · RBF(L)                                   exp(-ρ² / (2 L²))
  + 0.5  · RBF(2 L) · ExpSineSquared(1.0, L)        exp(-ρ² / (8 L²)) exp(-2 sin²(π ρ / L))
  + 0.5  · RationalQuadratic(L, α = 1.5)            (1 + ρ² / (2 α L²))^(-α)
  + 0.25 · Matern(L, ν = 1/2)                       exp(-ρ / L)

Its 11 hyperparameters (``COMPOSITE``: the four outputscales, five lengthscales, the period and
α) are all differentiated. For these families fwd_bwd is the gradient of ``sum(out * G)`` with
respect to x1, x2, v and every hyperparameter, the last as one vector ``dhyper`` in the order of
`hyperparameters` (for Matérn-3/2: the d lengthscales). Their reference forms distances from the
coordinate differences (no ``|a|² + |b|² - 2a·b`` cancellation near r = 0, where the square root
of Matérn-1/2 and -3/2 would magnify it), in chunks of ``entries / d`` pairs.
"""

from __future__ import annotations

import math

import numpy as np

KDE_FAMILY = "kde_density"
MATERN32_FAMILY = "kernel_mv_matern32"  # = catalog.MATERN32
COMPOSITE_FAMILY = "kernel_mv_composite"  # = catalog.COMPOSITE
KMV_GRADS = ("dq", "dk", "dv", "dlengthscale")
KDE_GRADS = ("dq", "dk", "dbandwidth")
KERNEL_GRADS = ("dq", "dk", "dv", "dhyper")

#: The composite kernel's hyperparameters: name -> value as a multiple of sqrt(d) (lengthscales
#: and the period) or as is, in the order of ``dhyper``. See the module docstring for the kernel.
COMPOSITE = {
    "rbf_scale": (1.0, False), "rbf_lengthscale": (1.0, True),
    "per_scale": (0.5, False), "per_decay": (2.0, True), "per_lengthscale": (1.0, False),
    "per_period": (1.0, True),
    "rq_scale": (0.5, False), "rq_lengthscale": (1.0, True), "rq_alpha": (1.5, False),
    "m12_scale": (0.25, False), "m12_lengthscale": (1.0, True),
}


def is_kde(family: str) -> bool:
    return family == KDE_FAMILY


def is_expression(family: str) -> bool:
    """A kernel-expression family (Matérn-3/2, composite): inputs carry ``hyper``."""
    return family in (MATERN32_FAMILY, COMPOSITE_FAMILY)


def hyperparameters(family: str, d: int) -> dict:
    """The kernel's hyperparameters by name, float32, in the order of ``dhyper``."""
    root = math.sqrt(d)
    if family == MATERN32_FAMILY:
        return {"lengthscale": np.full(d, root, np.float32)}
    if family == COMPOSITE_FAMILY:
        return {k: np.float32(v * root if relative else v)
                for k, (v, relative) in COMPOSITE.items()}
    raise ValueError(f"{family!r} is not a kernel-expression family")


def hyper_vector(values: dict, order) -> np.ndarray:
    """``values`` (name -> scalar or array) flattened into one vector, names in ``order``."""
    return np.concatenate([np.ravel(np.asarray(values[k])) for k in order])


def scott_bandwidth(m: int, d: int) -> float:
    """Scott's rule for data of unit covariance, rounded to a float32 value."""
    return float(np.float32(m ** (-1.0 / (d + 4))))


def make_inputs(family: str, n: int, m: int, d: int, o: int, seed: int = 0) -> dict:
    """float32 inputs of one configuration (o is ignored for KDE: its output is (n,))."""
    kde = is_kde(family)
    rng = np.random.default_rng([seed, n, m, d, 1 if kde else o, int(kde)])
    f32 = np.float32
    if not kde:
        inputs = {
            "x1": rng.standard_normal((n, d)).astype(f32),
            "x2": rng.standard_normal((m, d)).astype(f32),
            "v": rng.standard_normal((m, o)).astype(f32),
            "G": rng.standard_normal((n, o)).astype(f32),
            "lengthscale": f32(math.sqrt(d)),
        }
        if is_expression(family):
            del inputs["lengthscale"]
            inputs["hyper"] = hyperparameters(family, d)
        return inputs
    z = rng.standard_normal((m, d))
    z -= z.mean(axis=0)
    if m > d:
        chol = np.linalg.cholesky(z.T @ z / (m - 1))
        z = np.linalg.solve(chol, z.T).T
    return {
        "queries": rng.standard_normal((n, d)).astype(f32),
        "data": z.astype(f32),
        "bandwidth": f32(scott_bandwidth(m, d)),
        "G": rng.standard_normal(n).astype(f32),
    }


# ----------------------------------------------------------------------------------------------
# float64 reference (JAX with x64 enabled)


def _row_chunk(n: int, m: int, entries: int) -> int:
    return max(1, min(n, entries // max(m, 1)))


def _map_rows(fn, rows, chunk):
    """Applies ``fn(*row_chunks) -> (chunk, ...)`` over row chunks of ``rows`` (checkpointed)."""
    import jax
    import jax.numpy as jnp

    n = rows[0].shape[0]
    k = -(-n // chunk)
    padded = [
        jnp.pad(r, [(0, k * chunk - n)] + [(0, 0)] * (r.ndim - 1)).reshape(k, chunk, *r.shape[1:])
        for r in rows
    ]
    out = jax.lax.map(lambda args: jax.checkpoint(fn)(*args), tuple(padded))
    return out.reshape(k * chunk, *out.shape[2:])[:n]


def _neg_half_sqdist(a, b):
    import jax.numpy as jnp
    from jax import lax

    cross = jnp.dot(a, b.T, precision=lax.Precision.HIGHEST)
    r = jnp.sum(a * a, axis=1)[:, None] + jnp.sum(b * b, axis=1)[None, :] - 2.0 * cross
    return -0.5 * jnp.maximum(r, 0.0)


def _kmv64(x1, x2, v, l, chunk):
    import jax
    import jax.numpy as jnp

    c = jax.lax.stop_gradient(jnp.concatenate([x1, x2]).mean(axis=0))
    b = (x2 - c) / l
    return _map_rows(lambda xc: jnp.exp(_neg_half_sqdist((xc - c) / l, b)) @ v, [x1], chunk)


def _kde_log64(q, x, h, chunk, weights=None):
    """log of ``sum_j w_j N(q_i; x_j, h^2) / sum_j w_j`` (equal weights when None)."""
    import jax
    import jax.numpy as jnp
    from jax.scipy.special import logsumexp

    n, d = q.shape
    m = x.shape[0]
    c = jax.lax.stop_gradient(jnp.concatenate([q, x]).mean(axis=0))
    b = (x - c) / h
    if weights is None:
        lse = _map_rows(lambda qc: logsumexp(_neg_half_sqdist((qc - c) / h, b), axis=1), [q],
                        chunk)
        log_total = math.log(m)
    else:
        lse = _map_rows(
            lambda qc: logsumexp(_neg_half_sqdist((qc - c) / h, b), axis=1, b=weights[None, :]),
            [q], chunk)
        log_total = jnp.log(jnp.sum(weights))
    log_h = jnp.sum(jnp.log(h)) * (d if jnp.ndim(h) == 0 else 1)
    return lse - log_total - log_h - 0.5 * d * math.log(2 * math.pi)


def reference(family: str, mode: str, inputs: dict, entries: int = 1 << 22) -> dict:
    """float64 reference results: {"out": ...} for fwd, the gradients for fwd_bwd (numpy arrays).

    ``entries`` bounds the size of one chunk x m block. Requires ``jax_enable_x64``.
    """
    import jax
    import jax.numpy as jnp

    if not jax.config.jax_enable_x64:
        raise RuntimeError("the float64 reference needs jax_enable_x64")
    if is_expression(family):
        return _expression_reference(family, mode, inputs, entries)
    f64 = {k: jnp.asarray(np.asarray(val, np.float64)) for k, val in inputs.items()}
    if is_kde(family):
        q, x, h, G = f64["queries"], f64["data"], f64["bandwidth"], f64["G"]
        chunk = _row_chunk(q.shape[0], x.shape[0], entries)

        def fwd(q, x, h):
            return jnp.exp(_kde_log64(q, x, h, chunk))

        args, names = (q, x, h), KDE_GRADS
    else:
        x1, x2, v, l, G = f64["x1"], f64["x2"], f64["v"], f64["lengthscale"], f64["G"]
        chunk = _row_chunk(x1.shape[0], x2.shape[0], entries)

        def fwd(x1, x2, v, l):
            return _kmv64(x1, x2, v, l, chunk)

        args, names = (x1, x2, v, l), KMV_GRADS
    if mode == "fwd":
        return {"out": np.asarray(jax.jit(fwd)(*args))}
    loss = lambda *a: jnp.sum(fwd(*a) * G)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    return {name: np.asarray(g) for name, g in zip(names, grads)}


def _expression64(family, x1, x2, v, h, chunk):
    """``K(x1, x2) @ v`` in float64 for a kernel-expression family, from the formulas of the
    module docstring (nothing of scalegp.ops), over checkpointed chunks of query rows."""
    import jax.numpy as jnp

    tiny = jnp.finfo(jnp.float64).tiny

    def root(s):  # √s with a zero gradient at s = 0 (never reached by distinct random points)
        return jnp.sqrt(jnp.maximum(s, tiny))

    def tile(xc):
        diff = xc[:, None, :] - x2[None, :, :]  # (chunk, m, d)
        if family == MATERN32_FAMILY:
            t = root(3.0 * jnp.sum(jnp.square(diff / h["lengthscale"]), axis=-1))
            k = (1.0 + t) * jnp.exp(-t)
        else:
            rho2 = jnp.sum(jnp.square(diff), axis=-1)
            rho = root(rho2)
            rbf = jnp.exp(-0.5 * rho2 / jnp.square(h["rbf_lengthscale"]))
            periodic = (jnp.exp(-0.5 * rho2 / jnp.square(h["per_decay"]))
                        * jnp.exp(-2.0 * jnp.square(jnp.sin(math.pi * rho / h["per_period"]))
                                  / jnp.square(h["per_lengthscale"])))
            rq = jnp.power(1.0 + rho2 / (2.0 * h["rq_alpha"] * jnp.square(h["rq_lengthscale"])),
                           -h["rq_alpha"])
            m12 = jnp.exp(-rho / h["m12_lengthscale"])
            k = (h["rbf_scale"] * rbf + h["per_scale"] * periodic + h["rq_scale"] * rq
                 + h["m12_scale"] * m12)
        return k @ v

    return _map_rows(tile, [x1], chunk)


def _expression_reference(family, mode, inputs, entries):
    import jax
    import jax.numpy as jnp

    x1, x2, v, G = (jnp.asarray(np.asarray(inputs[k], np.float64)) for k in ("x1", "x2", "v", "G"))
    h = {k: jnp.asarray(np.asarray(val, np.float64)) for k, val in inputs["hyper"].items()}
    d = x1.shape[1]
    chunk = _row_chunk(x1.shape[0], x2.shape[0], max(1, entries // d))

    def fwd(x1, x2, v, h):
        return _expression64(family, x1, x2, v, h, chunk)

    if mode == "fwd":
        return {"out": np.asarray(jax.jit(fwd)(x1, x2, v, h))}

    def loss(*a):
        return jnp.sum(fwd(*a) * G)

    dq, dk, dv, dh = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x1, x2, v, h)
    return {"dq": np.asarray(dq), "dk": np.asarray(dk), "dv": np.asarray(dv),
            "dhyper": hyper_vector(jax.device_get(dh), inputs["hyper"])}


def save_reference(path, ref: dict) -> None:
    """Writes atomically, so a killed child never leaves half a reference behind."""
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, **ref)
    import os

    os.replace(tmp, path)


def load_reference(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


# ----------------------------------------------------------------------------------------------
# errors


def relative_error(x, ref) -> float:
    """Norm-wise relative error ``|x - ref| / |ref|`` in float64."""
    x = np.asarray(x, np.float64).reshape(np.shape(ref))
    ref = np.asarray(ref, np.float64)
    scale = np.linalg.norm(ref)
    diff = np.linalg.norm(x - ref)
    return float(diff / scale) if scale > 0 else float(diff)


def rel_err(result: dict, ref: dict):
    """A number for fwd (``{"out": ...}``), a dict per gradient for fwd_bwd. For the kernel
    expressions' hyperparameter vector ``dhyper`` also ``dhyper_max``, the largest relative
    error of a single hyperparameter (the norm-wise one is dominated by the largest)."""
    if "out" in ref:
        return relative_error(result["out"], ref["out"])
    out = {k: relative_error(result[k], ref[k]) for k in ref if k in result}
    if "dhyper" in out:
        x = np.asarray(result["dhyper"], np.float64).reshape(np.shape(ref["dhyper"]))
        r = np.asarray(ref["dhyper"], np.float64)
        out["dhyper_max"] = max(relative_error(a, b) for a, b in zip(x.ravel(), r.ravel()))
    return out
