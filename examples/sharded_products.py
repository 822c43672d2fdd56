"""The engine's products over several devices: query rows sharded over a mesh.

    python examples/sharded_products.py               # 4 CPU devices made from this machine
    python examples/sharded_products.py --devices 8 --n 20000 --m 15000

On a machine with several GPUs the same calls shard over them (``--devices`` at most their
number); on a CPU, XLA's ``--xla_force_host_platform_device_count`` splits the host into
devices, which shows the layout and checks the numbers (not the speed).

For each product and each scheme (keys all-gathered, or passed around a ring) it prints the
norm-wise relative error against float64 numpy, beside the one-device product's, and for the RBF
product also the error of the lengthscale's gradient. The dense matrices (`rbf_kernel_matrix`,
`rbf_log_kernel_matrix`) are the small-problem form of the same products and are checked too.
Exits 1 if any error exceeds ``--tol``. The data are offset from the origin (uncentred), as real
coordinates are.
"""

from __future__ import annotations

import argparse
import os
import sys


def _force_host_devices(count: int) -> None:
    """Split the host into ``count`` XLA devices; only effective before jax is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4, help="devices in the mesh")
    parser.add_argument("--n", type=int, default=2048,
                        help="query rows (sharded when the device count divides them)")
    parser.add_argument("--m", type=int, default=1500, help="key rows")
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--o", type=int, default=4, help="value columns")
    parser.add_argument("--tol", type=float, default=1e-4, help="largest relative error allowed")
    args = parser.parse_args(argv)
    _force_host_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from scipy.special import logsumexp

    from scalegp.ops import (
        RBF,
        Kernel,
        Matern,
        as_mesh,
        kernel_mv,
        rbf_kde_density,
        rbf_kernel_matrix,
        rbf_kernel_mv,
        rbf_log_kernel_matrix,
        shard_rows,
        sharded_expression_mv,
        sharded_kde_density,
        sharded_kernel_mv,
    )

    mesh = as_mesh(args.devices)  # the first k devices, as the estimators' mesh=k
    rng = np.random.default_rng(0)
    offset = 100.0
    x1 = rng.standard_normal((args.n, args.d)) + offset
    x2 = rng.standard_normal((args.m, args.d)) + offset
    v = rng.standard_normal((args.m, args.o))
    weights = rng.uniform(0.5, 2.0, args.m)
    lengthscale = np.linspace(0.5, 1.5, args.d)
    q, k, vals, w = (shard_rows(jnp.asarray(a, jnp.float32), mesh) for a in (x1, x2, v, weights))
    print(f"jax {jax.__version__}: {mesh.devices.size} {jax.devices()[0].platform} devices; "
          f"n = {args.n}, m = {args.m}, d = {args.d}, o = {args.o}; queries sharded as "
          f"{q.sharding.spec}")

    errors = {}

    def record(name, got, expected):
        got = np.asarray(got, np.float64)
        errors[name] = np.linalg.norm(got - expected) / np.linalg.norm(expected)

    # float64 references by direct differences (small n, m)
    diff2 = (x1[:, None, :] - x2[None, :, :]) ** 2  # (n, m, d)
    log_k = -0.5 * (diff2 / lengthscale**2).sum(-1)
    mv = np.exp(log_k) @ v
    # d/dl_c sum(K @ v) = sum_ij K_ij (v_j . 1) (x1_ic - x2_jc)^2 / l_c^3
    grad = np.einsum("ij,ijc->c", np.exp(log_k) * v.sum(axis=1)[None, :], diff2) / lengthscale**3

    # The RBF product, its lengthscale gradient, and the dense matrix.
    scale = jnp.asarray(lengthscale, jnp.float32)
    record("rbf_kernel_mv, one device", rbf_kernel_mv(q, k, vals, scale), mv)
    record("rbf_kernel_matrix @ v", rbf_kernel_matrix(q, k, scale) @ vals, mv)
    for scheme in ("allgather", "ring"):
        def total(ls, q, k, vals, scheme=scheme):
            return sharded_kernel_mv(q, k, vals, ls, mesh=mesh, scheme=scheme).sum()

        record(f"sharded_kernel_mv, {scheme}",
               sharded_kernel_mv(q, k, vals, scale, mesh=mesh, scheme=scheme), mv)
        record(f"  d/d lengthscale, {scheme}", jax.jit(jax.grad(total))(scale, q, k, vals), grad)

    # A kernel expression: 0.7 RBF + Matern-3/2, the kind the GP estimator builds.
    kernel: Kernel = 0.7 * RBF(scale) + Matern(jnp.float32(1.2), nu=1.5)
    r = np.sqrt(3.0) * np.sqrt(diff2.sum(-1)) / 1.2  # Matern-3/2: (1 + r) exp(-r)
    expected = 0.7 * mv + ((1 + r) * np.exp(-r)) @ v
    record("kernel_mv, one device", kernel_mv(kernel, q, k, vals), expected)
    for scheme in ("allgather", "ring"):
        record(f"sharded_expression_mv, {scheme}",
               sharded_expression_mv(kernel, q, k, vals, mesh=mesh, scheme=scheme), expected)

    # The weighted KDE log-density, and its dense form from rbf_log_kernel_matrix.
    log_norm = np.log(weights.sum()) + 0.5 * args.d * np.log(2 * np.pi) + np.log(lengthscale).sum()
    log_p = logsumexp(log_k + np.log(weights)[None, :], axis=1) - log_norm
    dense = jax.nn.logsumexp(rbf_log_kernel_matrix(q, k, scale) + jnp.log(w)[None, :], axis=1)
    record("rbf_kde_density, one device", rbf_kde_density(q, k, scale, w, log=True), log_p)
    record("logsumexp(rbf_log_kernel_matrix)", np.asarray(dense) - log_norm, log_p)
    for scheme in ("allgather", "ring"):
        record(f"sharded_kde_density, {scheme}",
               sharded_kde_density(q, k, scale, w, mesh=mesh, log=True, scheme=scheme), log_p)

    print(f"{'product':<36} {'rel. error vs float64':>22}")
    for name, error in errors.items():
        print(f"{name:<36} {error:22.2e}")
    worst = max(errors, key=errors.get)
    if errors[worst] > args.tol:
        print(f"FAILED: {worst} is off by {errors[worst]:.2e} > --tol {args.tol:g}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
