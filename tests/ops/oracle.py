"""Float64 oracles written independently of the engine (direct differences, no centring trick)."""

import jax
import jax.numpy as jnp
import numpy as np


def kernel_mv_f64(x1, x2, v, lengthscale):
    x1, x2, v, lengthscale = (jnp.asarray(t, jnp.float64) for t in (x1, x2, v, lengthscale))
    diff = (x1[..., :, None, :] - x2[..., None, :, :]) / lengthscale
    return jnp.exp(-0.5 * jnp.sum(diff**2, axis=-1)) @ v


def kde_log_density_f64(queries, data, bandwidth, weights=None):
    q, x, h = (jnp.asarray(t, jnp.float64) for t in (queries, data, bandwidth))
    d = x.shape[-1]
    w = jnp.ones(x.shape[:-1]) if weights is None else jnp.asarray(weights, jnp.float64)
    h_vec = jnp.broadcast_to(h, (d,))
    diff = (q[..., :, None, :] - x[..., None, :, :]) / h_vec
    log_k = -0.5 * jnp.sum(diff**2, axis=-1) - 0.5 * d * jnp.log(2 * jnp.pi) - jnp.sum(jnp.log(h_vec))
    w = (w / jnp.sum(w, axis=-1, keepdims=True))[..., None, :]
    # Not jax.scipy's logsumexp(b=w): its gradient is zero where w == 0, which is wrong.
    shift = jax.lax.stop_gradient(jnp.max(jnp.where(w > 0, log_k, -jnp.inf), axis=-1, keepdims=True))
    capped = jnp.minimum(log_k - shift, 700.0)  # zero weights on much closer points: 0 * finite
    return jnp.log(jnp.sum(w * jnp.exp(capped), axis=-1)) + shift[..., 0]


def value_and_grads(f):
    """``(*args, cot) -> (out, gradients)``: ``out = f(*args)`` and the gradients of
    ``sum(out * cot)`` in every argument, jitted: one compilation serves every value of one
    shape (a test's several lengthscales, say)."""

    def loss(*args_and_cot):
        *args, cot = args_and_cot
        out = f(*args)
        return jnp.sum(out * cot.astype(out.dtype)), out

    @jax.jit
    def run(*args_and_cot):
        argnums = tuple(range(len(args_and_cot) - 1))
        (_, out), gradients = jax.value_and_grad(loss, argnums, has_aux=True)(*args_and_cot)
        return out, gradients

    return run


def cotangent(shape, seed=0):
    """The fixed random cotangent G that `grads` uses for an output of this shape."""
    return np.random.default_rng(seed).standard_normal(shape)


def grads(f, args, cotangent_seed=0):
    """Gradients of sum(f(*args) * G) for a fixed random G, w.r.t. every argument."""
    out = f(*args)
    g = cotangent(out.shape, cotangent_seed)

    def loss(*a):
        return jnp.sum(f(*a) * jnp.asarray(g, out.dtype))

    return jax.grad(loss, argnums=tuple(range(len(args))))(*args)
