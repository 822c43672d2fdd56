"""Data and entry-point wrappers shared by the tests of the pruned products (tests/ops/
pruning/test_*.py, backends/*/test_pruned*.py): clustered, uniform and offset point sets, a relative
error, the xla pruned ``K v`` and KDE log-density on unordered points, a float64 Matérn oracle."""

import jax.numpy as jnp
import numpy as np

from scalegp.ops import RBF
from scalegp.ops._plan import BACKENDS
from scalegp.ops.pruning import _rules as rules

BLOCK = 32  # small tiles, so that small problems have many tiles to skip


def clustered(rng, n, d, clusters=12, spread=0.01, offset=0.0):
    centres = rng.uniform(size=(clusters, d))
    x = centres[rng.integers(clusters, size=n)] + spread * rng.standard_normal((n, d))
    return (x + offset).astype(np.float32)


def datasets(rng, n, d):
    return {
        "clustered": clustered(rng, n, d),
        "uniform": rng.uniform(size=(n, d)).astype(np.float32),
        "offset": clustered(rng, n, d, offset=1e3),
    }

#: The xla backend's pruned products (its core takes no tile size: the keys' tiles carry it).
XLA_CORE = BACKENDS["xla"].pruned(None)


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def pruned_mv(x1, x2, v, lengthscale, tol, block=BLOCK, profile=RBF.profile):
    keys = rules.ordered_keys(jnp.asarray(x2), jnp.asarray(lengthscale), block)
    return rules.kernel_mv(jnp.asarray(x1), keys, jnp.asarray(v), jnp.asarray(lengthscale), tol,
                           XLA_CORE, profile=profile)


def pruned_log_density(q, x, h, w, tol, block=BLOCK):
    keys = rules.ordered_keys(jnp.asarray(x), jnp.asarray(h), block)
    w = jnp.asarray(w, x.dtype)
    w = w / jnp.sum(w)
    d = x.shape[1]
    log_norm = -0.5 * d * np.log(2 * np.pi) - jnp.sum(jnp.log(jnp.broadcast_to(h, (d,))))
    return rules.kernel_logsumexp(jnp.asarray(q), keys, w, jnp.asarray(h), tol, XLA_CORE) + log_norm


def matern_mv_f64(x1, x2, v, lengthscale, nu):
    x1, x2, v, lengthscale = (jnp.asarray(t, jnp.float64) for t in (x1, x2, v, lengthscale))
    diff = (x1[:, None, :] - x2[None, :, :]) / lengthscale
    # sqrt of a clamped sum: the oracle's own gradient at r = 0 is not exercised here
    t = jnp.sqrt(2 * nu * jnp.maximum(jnp.sum(diff**2, axis=-1), 1e-300))
    poly = {0.5: 1.0, 1.5: 1.0 + t, 2.5: 1.0 + t + t**2 / 3}[nu]
    return (poly * jnp.exp(-t)) @ v
