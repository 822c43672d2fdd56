"""Checks of the sharded engine that need several devices, run in a child process.

``python tests/ops/sharding/checks.py CHECK [ARGS]`` prints one JSON line of numbers, which
`tests/ops/sharding/test_products.py` asserts on. The parent sets ``XLA_FLAGS`` (the host device count)
before this process imports JAX; the device count cannot change once JAX has started.

Checks:
  agreement     WHICH [SCHEMES]: sharded vs single-device forward and gradients (relative
                errors); WHICH "xla" (per-device xla, both schemes or the comma-separated
                SCHEMES; "replicated" runs the KDE only) or "impls" (ring with per-device auto
                and pallas).
  expression    WHICH [SCHEMES]: the same for a composite kernel expression
                (sharded_expression_mv and Engine.kernel_mv), per-device WHICH "xla" or
                "pallas"; the kernel's gradient as its worst hyperparameter.
  memory        compiled temporary bytes per device for p = 1, 2, 4, both schemes.
  kde_cv        ScalableKernelDensity with a cross-validated bandwidth on 4 devices vs 1.
  kde_cv_collectives  the largest collective of the compiled CV objective and gradient, per scheme.
  gp_fit        [N [SCHEMES]]: ScalableGPRegressor (BBMM) fit and predictions on 4 devices vs 1.
  preconditioner  the GP's pivoted-Cholesky preconditioner built shard-wise on 4 devices vs one
                device (pivots, solve, log-determinant), and the largest collective it compiles to.
  multiprocess  PORT NUM_PROCESSES PROCESS_ID: one process of a jax.distributed run on
                localhost; sharded K v over all processes' devices vs this process alone.
"""

from __future__ import annotations

import functools
import json
import sys
import warnings

import numpy as np


def rel_err(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def problem(n, m, d=3, o=2, seed=0):
    rng = np.random.default_rng(seed)
    x1 = rng.standard_normal((n, d)).astype(np.float32)
    x2 = (rng.standard_normal((m, d)) + 0.3).astype(np.float32)
    v = (rng.standard_normal((m, o)) + 1.0).astype(np.float32)
    lengthscale = np.array([0.7, 1.1, 0.9][:d], np.float32)
    weights = rng.uniform(0.1, 1.0, m).astype(np.float32)
    return x1, x2, v, lengthscale, weights


def agreement(which="xla", schemes="allgather,ring"):
    import jax
    import jax.numpy as jnp

    from scalegp.ops import (
        data_mesh,
        rbf_kde_density,
        rbf_kernel_mv,
        sharded_kde_density,
        sharded_kernel_mv,
    )

    mesh = data_mesh()
    assert len(mesh.devices.ravel()) == 4, mesh
    tiles = {"block_q": 16, "block_k": 16}  # several tiles per shard
    results = {}

    def value_and_grads(f, args, cot):
        # one compiled function per variant: the output and the gradients of sum(f * cot)
        def loss(*a):
            out = f(*a)
            return jnp.sum(out * cot), out

        argnums = tuple(range(len(args)))
        (_, out), g = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*args)
        return out, g

    def compare(tag, single, sharded, args):
        ref = single(*args)
        # Positive cotangents and (mostly) positive values: the lengthscale gradient is then a
        # sum of terms of one sign, so its relative error measures the implementations, not the
        # cancellation of a zero-mean sum (with N(0, 1) cotangents it reaches ~1e-6 from
        # summation order alone).
        cot = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, ref.shape), ref.dtype)
        ref, g_ref = value_and_grads(single, args, cot)
        got, g_got = value_and_grads(sharded, args, cot)
        results[tag] = [rel_err(got, ref)] + [rel_err(g, r) for g, r in zip(g_got, g_ref)]

    # n not divisible by 4 (103, 77 keys), and divisible (64, 48)
    for n, m in ((103, 77), (64, 48)) if which == "xla" else ():
        x1, x2, v, ls, w = problem(n, m)
        far = x1.copy()
        far[:3] += 40.0  # log-density ~ -800: needs the running maximum on every shard
        for scheme in schemes.split(","):
            tag = f"{scheme}/n{n}m{m}"
            if scheme != "replicated":  # the KDE-only scheme (data already on every device)
                compare(
                    f"mv/{tag}",
                    lambda a, b, c, l: rbf_kernel_mv(a, b, c, l, impl="xla", **tiles),
                    lambda a, b, c, l: sharded_kernel_mv(a, b, c, l, mesh=mesh, scheme=scheme,
                                                         impl="xla", **tiles),
                    (x1, x2, v, ls),
                )
            compare(
                f"kde/{tag}",
                lambda q, x, h, ww: rbf_kde_density(q, x, h, ww, log=True, impl="xla", **tiles),
                lambda q, x, h, ww: sharded_kde_density(q, x, h, ww, log=True, mesh=mesh,
                                                        scheme=scheme, impl="xla", **tiles),
                (far, x2, ls, w),
            )
            if n % 4 == 0 or scheme == "replicated":
                continue  # the vector form once, on the uneven sizes
            compare(
                f"mv_vector/{tag}",
                lambda a, b, c, l: rbf_kernel_mv(a, b, c, l, impl="xla", **tiles),
                lambda a, b, c, l: sharded_kernel_mv(a, b, c, l, mesh=mesh, scheme=scheme,
                                                     impl="xla", **tiles),
                (x1, x2, v[:, 0], np.float32(0.8)),
            )
    # the per-device "auto" choice (xla on CPU: auto never picks dense) and pallas (interpret
    # mode on CPU)
    x1, x2, v, ls, w = problem(103, 77)
    for impl in ("auto", "pallas") if which == "impls" else ():
        compare(
            f"mv/ring/{impl}",
            lambda a, b, c, l: rbf_kernel_mv(a, b, c, l, impl="xla"),
            lambda a, b, c, l: sharded_kernel_mv(a, b, c, l, mesh=mesh, scheme="ring", impl=impl),
            (x1, x2, v, ls),
        )
        compare(
            f"kde/ring/{impl}",
            lambda q, x, h, ww: rbf_kde_density(q, x, h, ww, log=True, impl="xla"),
            lambda q, x, h, ww: sharded_kde_density(q, x, h, ww, log=True, mesh=mesh,
                                                    scheme="ring", impl=impl),
            (x1, x2, ls, w),
        )
    return results


def composite_kernel(d=3):
    """Every profile, an ARD Matérn and constants: the sharded expression checks' kernel."""
    from scalegp.ops import RBF, ExpSineSquared, Matern, RationalQuadratic

    return (2.0 * RBF(0.9) + 0.5 * RBF(1.3) * ExpSineSquared(0.8, period=1.7)
            + 0.7 * RationalQuadratic(1.1, alpha=1.5) + Matern(0.8, nu=0.5)
            + 0.4 * Matern(np.linspace(0.6, 1.2, d).astype(np.float32), nu=1.5)
            + Matern(1.4, nu=2.5))


def expression(which="xla", schemes="allgather,ring"):
    """`sharded_expression_mv` and `Engine.kernel_mv` on a mesh against `kernel_mv` on one
    device, forward and the gradients in the kernel (the largest relative error over its
    hyperparameters), x1, x2 and v. WHICH: the per-device impl, "xla" or "pallas"."""
    import jax
    import jax.numpy as jnp

    from scalegp.ops import Engine, data_mesh, kernel_mv, sharded_expression_mv

    mesh = data_mesh()
    assert len(mesh.devices.ravel()) == 4, mesh
    tiles = {"block_q": 16, "block_k": 16}
    kernel = composite_kernel()
    results = {}

    def value_and_grads(f, args, cot):
        def loss(*a):
            out = f(*a)
            return jnp.sum(out * cot), out

        (_, out), g = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*args)
        return out, g

    def compare(tag, single, sharded, args):
        ref = single(*args)
        cot = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, ref.shape), ref.dtype)
        ref, (dk_ref, *g_ref) = value_and_grads(single, args, cot)
        got, (dk_got, *g_got) = value_and_grads(sharded, args, cot)
        dk = max(rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(dk_got),
                                               jax.tree_util.tree_leaves(dk_ref)))
        results[tag] = [rel_err(got, ref), dk] + [rel_err(a, b) for a, b in zip(g_got, g_ref)]

    for n, m in ((103, 77), (64, 48)):
        x1, x2, v, _, _ = problem(n, m)
        for scheme in schemes.split(","):
            compare(
                f"expr/{which}/{scheme}/n{n}m{m}",
                lambda k, a, b, c: kernel_mv(k, a, b, c, impl="xla", **tiles),
                lambda k, a, b, c: sharded_expression_mv(k, a, b, c, mesh=mesh, scheme=scheme,
                                                         impl=which, **tiles),
                (kernel, x1, x2, v),
            )
    x1, x2, v, _, _ = problem(103, 77)
    for scheme in schemes.split(",") if which == "xla" else ():
        # the models' door: Engine on a mesh, its default tiles, vector values
        compare(
            f"engine/{scheme}",
            lambda k, a, b, c: Engine("xla").kernel_mv(a, b, c, k),
            lambda k, a, b, c: Engine("xla", mesh, scheme).kernel_mv(a, b, c, k),
            (kernel, x1, x2, v[:, 0]),
        )
    return results


def memory():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from scalegp.ops import data_mesh, sharded_kernel_mv

    n, d, o = 1 << 16, 8, 8

    def temp_bytes(p, scheme, with_grad):
        mesh = data_mesh(jax.devices()[:p])
        rows = NamedSharding(mesh, PartitionSpec("data"))
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=rows)
                for s in ((n, d), (n, d), (n, o))]
        args.append(jax.ShapeDtypeStruct((d,), jnp.float32,
                                         sharding=NamedSharding(mesh, PartitionSpec())))

        def f(x1, x2, v, ls):
            return sharded_kernel_mv(x1, x2, v, ls, mesh=mesh, scheme=scheme, impl="xla",
                                     block_q=128, block_k=128)

        if with_grad:
            def loss(*a):
                return jnp.sum(f(*a) ** 2)
            fn = jax.grad(loss, argnums=(0, 1, 2, 3))
        else:
            fn = f
        compiled = jax.jit(fn).lower(*args).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)

    return {
        f"{scheme}/{'fwd_bwd' if g else 'fwd'}": [temp_bytes(p, scheme, g) for p in (1, 2, 4)]
        for scheme in ("ring", "allgather")
        for g in (False, True)
    }


def kde_cv():
    """Bandwidth cross-validation and scoring by ScalableKernelDensity on 4 devices vs 1.

    In float64: at a flat optimum the float32 objective (noise ~1e-7 relative) pins the
    bandwidth only to ~sqrt(1e-7) ~ 3e-4, so two correct float32 runs may differ by ~1e-3;
    float64 makes the comparison about the sharded computation, not the optimiser's noise floor.
    """
    import jax

    jax.config.update("jax_enable_x64", True)
    from scalegp.estimators import ScalableKernelDensity

    rng = np.random.default_rng(3)
    X = np.concatenate([rng.standard_normal((150, 2)) * [1.0, 0.3],
                        rng.standard_normal((101, 2)) * 0.5 + [2.5, 1.0]])
    queries = rng.standard_normal((37, 2)) * 1.5
    results = {}
    for bandwidth in ("cv", "cv-diag"):
        one = ScalableKernelDensity(bandwidth=bandwidth, random_state=0).fit(X)
        ref = one.score_samples(queries)
        results[bandwidth + "/n_iter"] = one.cv_result_.n_iter
        for scheme in ("allgather", "ring"):
            many = ScalableKernelDensity(bandwidth=bandwidth, random_state=0, mesh="all",
                                         mesh_scheme=scheme).fit(X)
            tag = f"{bandwidth}/{scheme}"
            results[tag + "/bandwidth"] = float(np.max(
                np.abs(np.asarray(many.bandwidth_) / np.asarray(one.bandwidth_) - 1)))
            results[tag + "/log_likelihood"] = abs(
                many.cv_result_.log_likelihood / one.cv_result_.log_likelihood - 1)
            results[tag + "/score_samples"] = rel_err(many.score_samples(queries), ref)
    return results


def kde_cv_collectives():
    """The LOO objective and its gradient on 4 devices, 3,000 points in 3 groups of 1,000: the
    largest collective of each scheme, against the size of the data (u_pad x d)."""
    import jax.numpy as jnp

    from scalegp.kde._loo import loo_problem, neg_mean_loo_value_and_grad
    from scalegp.ops import Engine, data_mesh

    mesh = data_mesh()
    X = np.random.default_rng(0).standard_normal((3000, 2))
    results = {}
    for scheme in ("allgather", "ring"):
        arrays, static = loo_problem(X, np.ones(3000), np.arange(3000), jnp.float32,
                                     Engine("auto", mesh, scheme))
        compiled = neg_mean_loo_value_and_grad.lower(jnp.zeros(2), *arrays, **static)
        sizes = collective_sizes(compiled.compile().as_text())
        results[scheme] = max(max(c) for c in sizes.values())
        results["group"], results["data"] = static["group"], int(np.prod(arrays[0].shape))
    return results


def gp_fit(n="200", schemes="allgather,ring"):
    """ScalableGPRegressor with the BBMM solver on 4 devices (both schemes) vs 1: fitted
    hyperparameters and predictions (mean, std). float64, for the reason given in kde_cv."""
    import jax

    jax.config.update("jax_enable_x64", True)
    from scalegp import ScalableGPRegressor

    rng = np.random.default_rng(5)
    n = int(n)
    X = rng.uniform(-2, 2, (n, 2))
    y = np.sin(2 * X[:, 0]) * np.cos(X[:, 1]) + 0.1 * rng.standard_normal(n)
    X_test = rng.uniform(-2, 2, (29, 2))
    # the Cholesky phase on a 64-point subset, then L-BFGS-B on all data with BBMM: its objective
    # and gradient (CG, SLQ, the kernel-product VJP) run on the mesh, as do the final solve,
    # the LOVE cache and the predictions
    # and predictions. A tight cg_tol makes the objective smooth: with the default 1e-3, a CG
    # column whose residual sits at the threshold stops one iteration earlier or later under a
    # 1e-14 perturbation, the objective jumps by ~1e-3, and the L-BFGS-B paths part.
    settings = dict(solver="bbmm", subset_size=64, max_iter=20, max_iter_full=8, num_probes=8,
                    preconditioner_rank=20, cg_tol=1e-10, random_state=0)

    def fitted(**mesh):
        with warnings.catch_warnings():
            # L-BFGS-B may stop ABNORMAL on the stochastic objective: the same on 1 and 4 devices
            warnings.simplefilter("ignore")
            model = ScalableGPRegressor(**settings, **mesh).fit(X, y)
        mean, std = model.predict(X_test, return_std=True)
        hyper = np.concatenate([model.lengthscale_, [model.outputscale_, model.noise_]])
        return hyper, mean, std, model.n_iter_

    hyper, mean, std, n_iter = fitted()
    results = {"n_iter": n_iter}
    for scheme in schemes.split(","):
        h, m, s, _ = fitted(mesh="all", mesh_scheme=scheme)
        results[f"{scheme}/hyperparameters"] = float(np.max(np.abs(h / hyper - 1)))
        results[f"{scheme}/mean"] = rel_err(m, mean)
        results[f"{scheme}/std"] = rel_err(s, std)
    return results


def collective_sizes(hlo_text: str) -> dict:
    """Elements moved by each kind of collective in compiled HLO: {kind: [elements, ...]}."""
    import re

    kinds = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
    sizes = {}
    for line in hlo_text.splitlines():
        match = re.search(r"= (.+?) (%s)(?:-start)?\(" % "|".join(kinds), line)
        if match:
            shapes = re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", match.group(1))
            count = sum(int(np.prod([int(x) for x in dims.split(",") if x])) for dims in shapes)
            sizes.setdefault(match.group(2), []).append(count)
    return sizes


def preconditioner():
    """`scalegp.gp._bbmm._preconditioner` with a 4-device mesh (shard_map, TSQR) against one device,
    float64, offset inputs: same pivots, and P⁻¹V, log|P| and probes drawn from N(0, P) with
    the same key, to rounding; and the collectives of
    the sharded build, none of which may move a kernel column, the factor or the points."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    from scalegp import linalg, ops
    from scalegp.gp._bbmm import _preconditioner
    from scalegp.gp._params import Hyperparameters
    from scalegp.ops import data_mesh, shard_map, shard_rows

    mesh = data_mesh()
    n, d, rank = 2048, 3, 32
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, d)) * [1.0, 2.0, 0.5] + 4.0
    v = rng.standard_normal((n, 5))
    lengthscale = jnp.asarray([0.8, 1.5, 0.6])
    hp = Hyperparameters(mean=jnp.zeros(1),
                         kernel=1.7 * ops.RBF(lengthscale), noise=jnp.asarray(1e-2))
    xs = shard_rows(jnp.asarray(x), mesh)

    one = jax.jit(lambda x: _preconditioner(hp, x, rank, ops.Engine()))(jnp.asarray(x))
    build = jax.jit(lambda x: _preconditioner(hp, x, rank, ops.Engine.create(mesh=mesh)))
    many = build(xs)

    def pivots(axis_name):
        def local(x):
            column = lambda i: jnp.exp(-0.5 * jnp.sum(
                ((x - linalg.sharded_row(x, i, axis_name)) / lengthscale) ** 2, axis=1))
            return linalg.pivoted_cholesky(jnp.ones(x.shape[0]), column, max_rank=rank,
                                           axis_name=axis_name).pivots
        if axis_name is None:
            return np.asarray(jax.jit(local)(jnp.asarray(x)))
        spec = jax.sharding.PartitionSpec("data")
        fn = shard_map(local, mesh=mesh, in_specs=(spec,),
                               out_specs=jax.sharding.PartitionSpec())
        return np.asarray(jax.jit(fn)(xs))

    sizes = collective_sizes(build.lower(xs).compile().as_text())

    # The eigen-form by Gram matrices (a TPU's "auto"), its k×k steps on the host: the
    # devices sum their rows' Gram matrices, and every device's callback sees the same sums.
    factor = one.basis * jnp.sqrt(one.scaled_eigenvalues) * jnp.sqrt(one.noise)[:, None]
    by_gram = functools.partial(linalg.LowRankPreconditioner.from_factor, method="gram")
    gram_one = jax.jit(lambda f: by_gram(f, 1e-2))(factor)
    spec = jax.sharding.PartitionSpec("data")
    gram_many = jax.jit(shard_map(lambda f: by_gram(f, 1e-2, axis_name="data"), mesh=mesh,
                                  in_specs=(spec,), out_specs=linalg.LowRankPreconditioner(
                                      spec, jax.sharding.PartitionSpec(), spec)))(
        shard_rows(factor, mesh))
    return {
        "gram_solve": rel_err(gram_many.solve(jnp.asarray(v)), one.solve(jnp.asarray(v))),
        "gram_logdet": abs(float(gram_many.logdet()) / float(one.logdet()) - 1),
        "gram_one_solve": rel_err(gram_one.solve(jnp.asarray(v)), one.solve(jnp.asarray(v))),
        "pivots_equal": bool(np.array_equal(pivots(None), pivots("data"))),
        "solve": rel_err(many.solve(jnp.asarray(v)), one.solve(jnp.asarray(v))),
        "logdet": abs(float(many.logdet()) / float(one.logdet()) - 1),
        "sample": rel_err(many.sample(jax.random.PRNGKey(0), 3),
                          one.sample(jax.random.PRNGKey(0), 3)),
        "basis_row_sharded": many.basis.sharding.spec == jax.sharding.PartitionSpec("data"),
        "largest_collective": max(max(c) for c in sizes.values()),
        "n_times_d": n * d,
        "p_k_squared": 4 * rank * rank,
    }


def multiprocess(port, num_processes, process_id):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=int(num_processes),
        process_id=int(process_id),
        initialization_timeout=60,
    )
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from scalegp.ops import data_mesh, rbf_kernel_mv, sharded_kernel_mv

    mesh = data_mesh()  # every device of every process
    x1, x2, v, ls, _ = problem(96, 70)  # the same data in every process (same seed)

    def global_array(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    rows = PartitionSpec("data")
    args = (global_array(x1, rows), global_array(x2, PartitionSpec()),
            global_array(v, PartitionSpec()), global_array(ls, PartitionSpec()))
    results = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "global_devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
    }
    single = np.asarray(rbf_kernel_mv(x1, x2, v, ls, impl="xla"))
    for scheme in ("allgather", "ring"):
        out = sharded_kernel_mv(*args, mesh=mesh, scheme=scheme, impl="xla")
        gathered = np.asarray(multihost_utils.process_allgather(out, tiled=True))
        results[scheme] = rel_err(gathered, single)
    jax.distributed.shutdown()
    return results


if __name__ == "__main__":
    check, *rest = sys.argv[1:]
    checks = {"agreement": agreement, "expression": expression, "memory": memory, "kde_cv": kde_cv,
              "kde_cv_collectives": kde_cv_collectives, "gp_fit": gp_fit,
              "preconditioner": preconditioner, "multiprocess": multiprocess}
    out = checks[check](*rest)
    print("RESULT " + json.dumps(out), flush=True)
