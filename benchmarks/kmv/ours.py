"""scalegp.ops under JAX: the functions that are timed, jit-compiled ahead of time.

kernel_mv: ``rbf_kernel_mv(x1, x2, v, l, impl=...)``; kde_density: ``rbf_kde_density(q, x, h,
impl=...)`` (density, log=False); kernel_mv_matern32 and kernel_mv_composite: ``kernel_mv(kernel,
x1, x2, v, impl=...)`` with the kernel built inside the traced function from its hyperparameters
(`expression`; problems.py defines them). fwd_bwd is ``jax.value_and_grad`` of ``sum(out * G)``
with respect to every input and the lengthscale, bandwidth or every kernel hyperparameter; G is
passed as an argument, so xla_arg_mb of fwd_bwd counts it.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.kmv.problems import (
    COMPOSITE_FAMILY,
    KDE_GRADS,
    KERNEL_GRADS,
    KMV_GRADS,
    MATERN32_FAMILY,
    hyper_vector,
    is_expression,
    is_kde,
)

MB = 2.0**20


def expression(family, h):
    """The scalegp.ops kernel of a kernel-expression family from its hyperparameters ``h``
    (name -> array, `problems.hyperparameters`)."""
    from scalegp.ops import RBF, Constant, ExpSineSquared, Matern, RationalQuadratic

    if family == MATERN32_FAMILY:
        return Matern(h["lengthscale"], nu=1.5)
    if family == COMPOSITE_FAMILY:
        return (Constant(h["rbf_scale"]) * RBF(h["rbf_lengthscale"])
                + Constant(h["per_scale"]) * RBF(h["per_decay"])
                * ExpSineSquared(h["per_lengthscale"], h["per_period"])
                + Constant(h["rq_scale"]) * RationalQuadratic(h["rq_lengthscale"], h["rq_alpha"])
                + Constant(h["m12_scale"]) * Matern(h["m12_lengthscale"], nu=0.5))
    raise ValueError(f"{family!r} is not a kernel-expression family")


class JaxBench:
    """``setup()`` lowers and compiles (compile_s, xla_*_mb); ``call()`` runs the executable."""

    def __init__(self, impl, family, mode, inputs, block_q=None, block_k=None, block_o=None):
        import jax
        import jax.numpy as jnp

        from scalegp.ops import kernel_mv, rbf_kde_density, rbf_kernel_mv

        self.jax = jax
        self.mode = mode
        self.kde = is_kde(family)
        self.family = family
        self.hyper_order = None
        tiles = {"block_q": block_q, "block_k": block_k}
        if not self.kde and not is_expression(family):  # kernel_mv has no block_o
            tiles["block_o"] = block_o
        kw = {"impl": impl, **{k: int(v) for k, v in tiles.items() if v is not None}}
        if self.kde:
            names = ("queries", "data", "bandwidth")

            def f(q, x, h):
                return rbf_kde_density(q, x, h, **kw)

        elif is_expression(family):
            names = ("x1", "x2", "v", "hyper")
            self.hyper_order = tuple(inputs["hyper"])

            def f(x1, x2, v, h):
                return kernel_mv(expression(family, h), x1, x2, v, **kw)

        else:
            names = ("x1", "x2", "v", "lengthscale")

            def f(x1, x2, v, l):
                return rbf_kernel_mv(x1, x2, v, l, **kw)

        def as_f32(value):
            if isinstance(value, dict):
                return {k: np.asarray(x, np.float32) for k, x in value.items()}
            return np.asarray(value, np.float32)

        args = [as_f32(inputs[k]) for k in names]
        if mode == "fwd_bwd":
            argnums = tuple(range(len(args)))

            def g(*a):
                *xs, G = a
                return jax.value_and_grad(lambda *b: jnp.sum(f(*b) * G), argnums=argnums)(*xs)

            fn = g
            args.append(np.asarray(inputs["G"], np.float32))
        else:
            fn = f
        self.args = [jax.device_put(a) for a in args]
        self.jitted = jax.jit(fn)
        self.compiled = None
        self.needed_bytes = None  # from XLA's memory analysis, once compiled

    def setup(self) -> dict:
        t0 = time.perf_counter()
        self.compiled = self.jitted.lower(*self.args).compile()
        fields = {}
        try:
            mem = self.compiled.memory_analysis()
        except Exception:  # not every backend implements it
            mem = None
        if mem is not None:
            self.needed_bytes = (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                 + mem.output_size_in_bytes)
            fields = {
                "xla_temp_mb": mem.temp_size_in_bytes / MB,
                "xla_arg_mb": mem.argument_size_in_bytes / MB,
                "xla_out_mb": mem.output_size_in_bytes / MB,
            }
        fields["compile_s"] = time.perf_counter() - t0
        return fields

    def call(self):
        return self.compiled(*self.args)

    def sync(self, out):
        return self.jax.block_until_ready(out)

    def result(self, out):
        if self.mode == "fwd":
            return {"out": np.asarray(out)}
        if self.hyper_order is not None:
            dq, dk, dv, dh = out[1]
            grads = (dq, dk, dv, hyper_vector(self.jax.device_get(dh), self.hyper_order))
            return {k: np.asarray(g) for k, g in zip(KERNEL_GRADS, grads)}
        names = KDE_GRADS if self.kde else KMV_GRADS
        return {k: np.asarray(g) for k, g in zip(names, out[1])}

    def close(self):
        pass
