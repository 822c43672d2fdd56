"""scalegp.ops under JAX: the functions that are timed, jit-compiled ahead of time.

kernel_mv: ``rbf_kernel_mv(x1, x2, v, l, impl=...)``; kde_density: ``rbf_kde_density(q, x, h,
impl=...)`` (density, log=False). fwd_bwd is ``jax.value_and_grad`` of ``sum(out * G)`` with respect
to every input and the lengthscale or bandwidth; G is passed as an argument, so xla_arg_mb of
fwd_bwd counts it.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.kmv.problems import KDE_GRADS, KMV_GRADS, is_kde

MB = 2.0**20


class JaxBench:
    """``setup()`` lowers and compiles (compile_s, xla_*_mb); ``call()`` runs the executable."""

    def __init__(self, impl, family, mode, inputs, block_q=None, block_k=None, block_o=None):
        import jax
        import jax.numpy as jnp

        from scalegp.ops import rbf_kde_density, rbf_kernel_mv

        self.jax = jax
        self.mode = mode
        self.kde = is_kde(family)
        tiles = {"block_q": block_q, "block_k": block_k}
        if not self.kde:
            tiles["block_o"] = block_o
        kw = {"impl": impl, **{k: int(v) for k, v in tiles.items() if v is not None}}
        if self.kde:
            names = ("queries", "data", "bandwidth")

            def f(q, x, h):
                return rbf_kde_density(q, x, h, **kw)

        else:
            names = ("x1", "x2", "v", "lengthscale")

            def f(x1, x2, v, l):
                return rbf_kernel_mv(x1, x2, v, l, **kw)

        args = [np.asarray(inputs[k], np.float32) for k in names]
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
        names = KDE_GRADS if self.kde else KMV_GRADS
        return {k: np.asarray(g) for k, g in zip(names, out[1])}

    def close(self):
        pass
