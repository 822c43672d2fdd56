"""The sharded engine (`scalegp.ops.sharded_kernel_mv` and friends): agreement with one device, memory, several processes.

Several CPU devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before JAX starts,
so those checks run `tests/ops/sharding/checks.py` in a child process and assert on the numbers it
prints. The tests in this process use a one-device mesh (this session has one CPU device).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    as_mesh,
    data_mesh,
    mesh_axis,
    rbf_kde_density,
    rbf_kernel_mv,
    sharded_kde_density,
    sharded_kernel_mv,
)
from scalegp.ops._matmul import RBF_EXPANSION_MEAN_LIMIT
from tests.conftest import rel_err

pytestmark = pytest.mark.x64  # float64 references (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("checks.py")
# float32, relative (norm-wise), sharded vs single device: the same sums in another order (a
# bandwidth gradient sums over every pair, so a few ulps of float32 add up to about 1e-6)
TOL = 2e-6


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child printed no RESULT line; output:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def run_check(*args, devices: int = 4, timeout: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, str(CHECKS), *map(str, args)],
        env=_env(devices), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    assert proc.returncode == 0, f"child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return _result(proc.stdout)


# ----------------------------------------------------------------------------------------------
# four devices in a child process


def _assert_agree(results):
    names = ("out", "d_arg1", "d_arg2", "d_arg3", "d_arg4")
    assert results
    for tag, errors in results.items():
        for name, err in zip(names, errors):
            assert err <= TOL, f"{tag} {name}: relative error {err:.3g} > {TOL}"


@pytest.mark.parametrize("scheme", ["allgather", "ring"])
@pytest.mark.slow
def test_sharded_forward_and_gradients_match_one_device(scheme):
    """K v (matrix and vector v) and the KDE log-density (with far queries), for
    n not divisible by 4 (103 queries, 77 keys) and divisible (64, 48); xla per device with
    16-row tiles, so each shard has several tiles."""
    results = run_check("agreement", "xla", scheme)
    assert {tag.split("/")[1] for tag in results} == {scheme}
    assert any("n103" in tag for tag in results) and any("n64" in tag for tag in results)
    _assert_agree(results)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["xla", "pallas"])
def test_sharded_kernel_expression_matches_one_device(which):
    """`sharded_expression_mv` for a composite kernel (every profile, an ARD Matérn, constants)
    with both schemes, n not divisible by 4 (103 x 77) and divisible (64 x 48), and (xla)
    `Engine.kernel_mv` on the mesh with vector values: forward and the gradients in every
    hyperparameter (replicated; summed over the devices), x1, x2 and v as on one device."""
    results = run_check("expression", which)
    expected = {f"expr/{which}/{s}/{size}" for s in ("allgather", "ring")
                for size in ("n103m77", "n64m48")}
    if which == "xla":
        expected |= {"engine/allgather", "engine/ring"}
    assert set(results) == expected
    _assert_agree(results)


@pytest.mark.slow
def test_sharded_kde_with_replicated_data_matches_one_device():
    """The KDE's "replicated" scheme (data already on every device, as cross-validation puts
    them): forward and the gradients in queries, data, bandwidth and weights, as on one device."""
    results = run_check("agreement", "xla", "replicated")
    assert set(results) == {"kde/replicated/n103m77", "kde/replicated/n64m48"}
    _assert_agree(results)


@pytest.mark.slow
def test_sharded_ring_with_auto_and_pallas_per_device():
    """The per-device "auto" (xla) and pallas (interpret mode) kernels."""
    results = run_check("agreement", "impls")
    assert set(results) == {"mv/ring/auto", "kde/ring/auto", "mv/ring/pallas", "kde/ring/pallas"}
    _assert_agree(results)


@pytest.mark.slow
def test_ring_temporary_memory_shrinks_with_devices():
    """Compiled temporary bytes per device (n = m = 2^16, d = o = 8, 128-row tiles) for 1, 2, 4
    devices: the ring's fall with p in the forward and forward+backward pass, and stay below the
    all-gather's, which hold every key on every device."""
    temps = run_check("memory")
    for kind in ("fwd", "fwd_bwd"):
        t1, t2, t4 = temps[f"ring/{kind}"]
        assert t1 > t2 > t4, (kind, temps)
        assert t4 < 0.6 * t1 and t4 < 0.75 * t2, (kind, temps)
        assert t4 < temps[f"allgather/{kind}"][2], (kind, temps)


@pytest.mark.slow
def test_kde_cross_validation_on_four_devices_matches_one():
    """ScalableKernelDensity(bandwidth="cv" and "cv-diag", mesh="all") with both schemes: same
    bandwidth, LOO log-likelihood and score_samples as on one device (float64: see kde_cv)."""
    results = run_check("kde_cv")
    assert results["cv/n_iter"] > 0 and results["cv-diag/n_iter"] > 0
    for bandwidth in ("cv", "cv-diag"):
        for scheme in ("allgather", "ring"):
            for what in ("bandwidth", "log_likelihood", "score_samples"):
                err = results[f"{bandwidth}/{scheme}/{what}"]
                assert err <= 1e-3, (bandwidth, scheme, what, err)


@pytest.mark.slow
def test_kde_cross_validation_gathers_the_data_once():
    """With the all-gather scheme the CV objective and gradient (3 groups of 1,000 held-out rows)
    compile to collectives of at most a group's (d + 1) numbers per held-out row plus a few
    scalars: the data (3,072 x 2 padded) are put on every device once, not gathered per group,
    and no key gradient is reduced. (The ring moves data blocks by design.)"""
    results = run_check("kde_cv_collectives")
    assert results["group"] == 1000 and results["data"] == 3072 * 2, results
    assert results["allgather"] <= results["group"] * 3 + 16 < results["data"], results


@pytest.mark.slow
@pytest.mark.parametrize("n, schemes", [(200, "allgather"), (202, "allgather,ring")])
def test_gp_fit_on_four_devices_matches_one(n, schemes):
    """ScalableGPRegressor (BBMM phase on all data) with mesh="all": fitted lengthscales,
    outputscale, noise and the predictive mean and std equal the one-device ones."""
    results = run_check("gp_fit", n, schemes)
    assert results["n_iter"] > 0
    for scheme in schemes.split(","):
        assert results[f"{scheme}/hyperparameters"] <= 1e-3, results
        assert results[f"{scheme}/mean"] <= 1e-3 and results[f"{scheme}/std"] <= 1e-3, results


def test_gp_preconditioner_is_built_shard_wise():
    """The pivoted-Cholesky preconditioner on 4 devices (rows split, tall-skinny QR) picks the
    same pivots and gives the same P⁻¹V, log|P| and probes (same key) as on one device
    (float64), its basis stays
    row-sharded, and no collective in its compiled build moves more than the p k×k triangles of
    the QR: no kernel column, factor or copy of the points is gathered. Built again by Gram
    matrices (a TPU's route), on one device and shard-wise: the same P⁻¹V and log|P|."""
    results = run_check("preconditioner")
    assert results["pivots_equal"], results
    assert results["solve"] <= 1e-10 and results["logdet"] <= 1e-12, results
    assert results["sample"] <= 1e-10, results
    assert results["basis_row_sharded"], results
    assert results["largest_collective"] <= results["p_k_squared"] < results["n_times_d"], results
    # built again by Gram matrices, on one device and shard-wise (the devices' Gram sums)
    assert results["gram_one_solve"] <= 1e-10 and results["gram_solve"] <= 1e-10, results
    assert results["gram_logdet"] <= 1e-12, results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_localhost():
    """jax.distributed with the coordinator on 127.0.0.1, two processes of two CPU devices each
    (gloo collectives): the sharded K v over all four devices equals one process's result."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHECKS), "multiprocess", str(port), "2", str(i)],
            env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        )
        for i in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=100)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]
    results = [_result(out) for out in outputs]
    assert sorted(r["process_index"] for r in results) == [0, 1]
    for r in results:
        assert (r["process_count"], r["global_devices"], r["local_devices"]) == (2, 4, 2)
        assert r["allgather"] <= TOL and r["ring"] <= TOL, r


# ----------------------------------------------------------------------------------------------
# one device, in this process


def _problem(n=37, m=29, d=2, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)).astype(np.float32),
            rng.standard_normal((m, d)).astype(np.float32),
            rng.standard_normal((m, 3)).astype(np.float32),
            rng.uniform(0.2, 1.0, m).astype(np.float32))


@pytest.mark.parametrize("scheme", ["allgather", pytest.param("ring", marks=pytest.mark.slow)])
def test_one_device_mesh_equals_unsharded_engine(scheme):
    x1, x2, v, w = _problem()
    mesh = data_mesh(jax.devices()[:1])
    got = sharded_kernel_mv(x1, x2, v, 0.9, mesh=mesh, scheme=scheme, impl="xla")
    want = rbf_kernel_mv(x1, x2, v, 0.9, impl="xla")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    got = sharded_kde_density(x1, x2, 0.5, w, mesh=mesh, scheme=scheme, impl="xla")
    want = rbf_kde_density(x1, x2, 0.5, w, impl="xla")
    np.testing.assert_allclose(got, want, rtol=5e-6)  # exp() of log-densities equal to ~1e-7
    # gradients through the ring's custom VJP (p = 1: no hops, same kernels)
    def f(h):
        return jnp.sum(sharded_kde_density(x1, x2, h, w, log=True, mesh=mesh, scheme=scheme,
                                           impl="xla"))

    def g(h):
        return jnp.sum(rbf_kde_density(x1, x2, h, w, log=True, impl="xla"))

    np.testing.assert_allclose(jax.grad(f)(jnp.float32(0.5)), jax.grad(g)(jnp.float32(0.5)),
                               rtol=1e-5)


@pytest.mark.parametrize("scheme", [pytest.param("allgather", marks=pytest.mark.slow), "ring"])
def test_one_device_mesh_kernel_expressions(scheme):
    """`sharded_expression_mv` and `Engine.kernel_mv` on a one-device mesh: a composite kernel
    as `kernel_mv` gives it, gradients included; ``c · RBF`` takes the RBF kernels."""
    from scalegp.ops import (
        RBF,
        Engine,
        ExpSineSquared,
        Matern,
        kernel_mv,
        sharded_expression_mv,
    )

    x1, x2, v, _ = _problem()
    mesh = data_mesh(jax.devices()[:1])
    kernel = 1.5 * Matern(np.array([0.7, 1.2], np.float32), nu=2.5) + RBF(0.8) * ExpSineSquared(
        1.0, period=1.3)

    def sharded(k, a):
        return sharded_expression_mv(k, a, x2, v, mesh=mesh, scheme=scheme, impl="xla")

    def single(k, a):
        return kernel_mv(k, a, x2, v, impl="xla")

    np.testing.assert_allclose(sharded(kernel, x1), single(kernel, x1), rtol=1e-6, atol=1e-6)
    engine = Engine("xla", mesh, scheme)
    np.testing.assert_allclose(engine.kernel_mv(x1, x2, v, kernel), single(kernel, x1),
                               rtol=1e-6, atol=1e-6)
    loss = lambda f: lambda k, a: jnp.sum(f(k, a) ** 2)  # noqa: E731
    got = jax.grad(loss(sharded), argnums=(0, 1))(kernel, x1)
    want = jax.grad(loss(single), argnums=(0, 1))(kernel, x1)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert rel_err(g, w) <= 1e-5
    np.testing.assert_allclose(
        sharded_expression_mv(2.0 * RBF(0.9), x1, x2, v, mesh=mesh, scheme=scheme, impl="xla"),
        2.0 * sharded_kernel_mv(x1, x2, v, 0.9, mesh=mesh, scheme=scheme, impl="xla"))
    assert sharded_expression_mv(kernel, x1, x2, v[:, 0], mesh=mesh, scheme=scheme).shape == (37,)
    assert sharded_expression_mv(kernel, x1[:0], x2, v, mesh=mesh).shape == (0, 3)
    with pytest.raises(ValueError, match="scheme must be one of"):
        sharded_expression_mv(kernel, x1, x2, v, mesh=mesh, scheme="tree")
    with pytest.raises(ValueError, match="must be a scalar"):
        sharded_expression_mv(Matern(np.ones(3), nu=0.5), x1, x2, v, mesh=mesh)


@pytest.mark.parametrize("scheme, impl", [("allgather", "xla"), ("ring", "xla"),
                                          pytest.param("ring", "pallas", marks=pytest.mark.slow)])
def test_one_device_mesh_short_lengthscales_take_the_differences(scheme, impl):
    """K(x, x) v of clustered points offset by 1e3 (tests/ops/test_rbf_expansion.py's check on
    one device): at ARD lengthscales 0.01 of the spread the keys are too spread for the
    distance expansion and the sharded RBF product takes the coordinate differences (the same
    ``lax.cond`` as `rbf_kernel_mv`), at 0.3 the expansion; forward and every gradient within
    2e-5 / 1e-4 of the float64 oracle either way."""
    from scalegp.ops import RBF
    from tests.ops.test_kernel_expressions import (
        assert_near_float64,
        cast,
        value_and_grads,
    )
    from tests.ops.backends.xla.test_matern import clustered
    from tests.ops.test_rbf_expansion import mean_sq

    mesh = data_mesh(jax.devices()[:1])

    @value_and_grads
    def f(kernel, x1, x2, v):
        return sharded_kernel_mv(x1, x2, v, kernel.lengthscale, mesh=mesh, scheme=scheme,
                                 impl=impl)

    ard = np.array([1.0, 0.6])
    for scale in (0.3, 0.01):
        x, v, cot = clustered(43, 96, 2, scale, 1e3)
        assert (mean_sq(x, scale * ard) <= RBF_EXPANSION_MEAN_LIMIT) == (scale == 0.3)
        kernel = cast(RBF(scale * ard), jnp.float32)
        out, grads = f(kernel, x, x, v, cot)
        assert_near_float64(kernel, x, x, v, cot, out, grads, scale)


@pytest.mark.parametrize("scheme, impl", [
    ("allgather", "xla"), ("ring", "xla"), ("replicated", "xla"),
    pytest.param("ring", "pallas", marks=pytest.mark.slow)])
def test_one_device_mesh_kde_at_small_bandwidths(scheme, impl):
    """The sharded KDE takes the same choice as `rbf_kde_density` (tests/ops/test_rbf_expansion.py's
    check on one device): data on a unit square offset by 100 at bandwidth 0.01, too spread for
    the distance expansion, so the log-sum-exp kernels' differences variants; densities and
    gradients against float64 (with the expansion the densities err by ~3e-4 here)."""
    from tests.ops.test_rbf_expansion import assert_kde_near_float64, offset_cube

    mesh = data_mesh(jax.devices()[:1])
    queries, data = offset_cube(2, 100, 400, 2)

    def log_density(q, x):
        return sharded_kde_density(q, x, 0.01, log=True, mesh=mesh, scheme=scheme, impl=impl)

    assert_kde_near_float64(log_density, queries, data, 0.01)


@pytest.mark.parametrize("scheme", ["allgather", "ring", "replicated"])
def test_one_device_mesh_one_outlier_key(scheme):
    """A key at 1e15 adds nothing and costs the other keys no digits on a mesh either (the
    centre is `scalegp.ops._prepare.centre_of`'s median; a mean followed the outlier)."""
    x1, x2, v, w = _problem()
    x2, v, w = x2 + 50, v.copy(), w.copy()
    outlier = np.vstack([x2[:3], np.full((1, x2.shape[1]), 1e15, np.float32), x2[3:]])
    v_out, w_out = np.insert(v, 3, 1.0, axis=0), np.insert(w, 3, 1.0)
    mesh = data_mesh(jax.devices()[:1])
    if scheme != "replicated":  # a KDE scheme only
        got = sharded_kernel_mv(x1 + 50, outlier, v_out, 0.3, mesh=mesh, scheme=scheme)
        want = sharded_kernel_mv(x1 + 50, x2, v, 0.3, mesh=mesh, scheme=scheme)
        assert rel_err(got, want) <= 1e-5
    got = sharded_kde_density(x1 + 50, outlier, 0.3, w_out, log=True, mesh=mesh, scheme=scheme)
    want = sharded_kde_density(x1 + 50, x2, 0.3, w, log=True, mesh=mesh, scheme=scheme)
    np.testing.assert_allclose(got, want + np.log(np.sum(w) / np.sum(w_out)), rtol=0, atol=1e-5)


def test_vector_values_and_empty_inputs():
    x1, x2, v, _ = _problem()
    mesh = data_mesh(jax.devices()[:1])
    out = sharded_kernel_mv(x1, x2, v[:, 0], 1.0, mesh=mesh, scheme="ring")
    assert out.shape == (x1.shape[0],)
    assert sharded_kernel_mv(x1[:0], x2, v, 1.0, mesh=mesh).shape == (0, 3)
    assert sharded_kde_density(x1[:0], x2, 1.0, mesh=mesh).shape == (0,)


def test_errors_name_the_fix():
    x1, x2, v, w = _problem()
    mesh = data_mesh(jax.devices()[:1])
    with pytest.raises(ValueError, match="scheme must be one of"):
        sharded_kernel_mv(x1, x2, v, 1.0, mesh=mesh, scheme="tree")
    with pytest.raises(ValueError, match="unbatched x1"):
        sharded_kernel_mv(x1[None], x2[None], v[None], 1.0, mesh=mesh)
    with pytest.raises(ValueError, match="v must have shape"):
        sharded_kernel_mv(x1, x2, v[:-1], 1.0, mesh=mesh)
    with pytest.raises(ValueError, match="weights must be finite and non-negative"):
        sharded_kde_density(x1, x2, 1.0, -w, mesh=mesh)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        sharded_kernel_mv(x1, x2, v, 1.0, mesh=mesh, axis="model")
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        sharded_kernel_mv(x1, x2, v, 1.0, mesh=jax.devices())


def test_distributed_settings_from_env():
    from scalegp.distributed import settings_from_env

    assert settings_from_env({}) is None
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "SCALEGP_NUM_PROCESSES": "2",
           "SCALEGP_PROCESS_ID": "1"}
    assert settings_from_env(env) == {"coordinator_address": "10.0.0.1:1234",
                                      "num_processes": 2, "process_id": 1}
    with pytest.raises(ValueError, match="SCALEGP_PROCESS_ID missing"):
        settings_from_env({k: v for k, v in env.items() if k != "SCALEGP_PROCESS_ID"})
    with pytest.raises(ValueError, match="0 <= SCALEGP_PROCESS_ID"):
        settings_from_env({**env, "SCALEGP_PROCESS_ID": "2"})
    with pytest.raises(ValueError, match="host:port"):
        settings_from_env({**env, "JAX_COORDINATOR_ADDRESS": "10.0.0.1"})


def test_as_mesh_settings():
    assert as_mesh(None) is None
    mesh = as_mesh("all")
    assert mesh_axis(mesh) == ("data", jax.device_count())
    assert as_mesh(mesh) is mesh
    assert as_mesh(1).devices.size == 1
    assert as_mesh(jax.devices()[:1]).devices.size == 1
    with pytest.raises(ValueError, match="are available"):
        as_mesh(jax.device_count() + 1)
    with pytest.raises(ValueError, match="'all'"):
        as_mesh("gpu")
