"""The list of backends and `plan` (`scalegp.ops._plan`): what runs where, what ``impl="auto"``
and ``impl="pallas"`` mean on each platform, the tiles a call gets, and "dense" on a mesh as on
one device."""

import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    IMPLEMENTATIONS,
    BlockSizes,
    auto_config,
    available_implementations,
    data_mesh,
    lapack_on_host,
    rbf_kde_density,
    rbf_kernel_mv,
    sharded_kde_density,
    sharded_kernel_mv,
)
from scalegp.ops._plan import BACKENDS, backend_of, plan, register, unregister
from scalegp.ops.backends.triton import TritonLaunch
from tests.conftest import rel_err


def test_available_implementations():
    cpu = available_implementations("cpu")
    assert set(cpu) == {"dense", "xla", "triton", "mosaic", "pallas"}
    assert "interpret" in cpu["triton"] and cpu["pallas"].startswith("triton")
    assert "interpret" in cpu["mosaic"]
    assert "Triton" in available_implementations("gpu")["pallas"]
    tpu = available_implementations("tpu")
    assert set(tpu) == {"dense", "xla", "mosaic", "pallas"} and "Mosaic" in tpu["pallas"]


def test_auto_depends_on_the_platform_and_the_keys_only():
    impl, bs = auto_config(100, 3, backend="cpu")
    assert impl == "xla" and isinstance(bs, BlockSizes)
    # a fixed query tile; keys split into near-equal tiles (3000 -> three of 1000, not 3 x 1024)
    assert auto_config(16384, 8, backend="cpu")[1].block_q == auto_config(3000, 2)[1].block_q
    assert auto_config(3000, 2, backend="cpu")[1].block_k == 1000
    impl, bs = auto_config(16384, 8, backend="gpu")
    assert impl == "triton" and bs.block_q & (bs.block_q - 1) == 0
    assert auto_config(16384, 8, dtype=jnp.float64, backend="gpu")[0] == "xla"
    assert auto_config(16384, 8, backend="tpu")[0] == "mosaic"
    assert auto_config(16384, 8, dtype=jnp.float64, backend="tpu")[0] == "xla"


def test_pallas_means_the_platforms_fused_kernels():
    assert backend_of("pallas", platform="gpu").name == "triton"
    assert plan("pallas", 100, 3, jnp.float32, backend="cpu").interpret  # tests, on CPU
    assert not plan("pallas", 100, 3, jnp.float32, backend="gpu").interpret
    assert backend_of("pallas", platform="tpu").name == "mosaic"
    assert not plan("pallas", 100, 3, jnp.float32, backend="tpu").interpret
    mosaic = BACKENDS["mosaic"]
    unregister("mosaic")  # a platform without fused kernels
    try:
        with pytest.raises(ValueError, match="fused kernels, and there are none for tpu"):
            backend_of("pallas", platform="tpu")
    finally:
        register(mosaic)
    with pytest.raises(ValueError, match="impl='triton' does not run on tpu"):
        backend_of("triton", platform="tpu")
    with pytest.raises(ValueError, match="impl='mosaic' does not run on gpu"):
        backend_of("mosaic", platform="gpu")
    with pytest.raises(ValueError, match="impl must be one of"):
        backend_of("cuda")
    with pytest.raises(ValueError, match="computes in float32 only"):  # no float64 on a TPU
        backend_of("pallas", jnp.float64, platform="tpu")
    assert backend_of("auto", jnp.float64, platform="tpu").name == "xla"
    assert set(IMPLEMENTATIONS) == set(BACKENDS) | {"pallas"}  # model files may say "pallas"


def test_gpu_tiles_shrink_as_points_widen():
    """Fewer registers per thread for wide points (why: the Triton RBF kernels' defaults)."""
    def tiles(d):
        _, bs = auto_config(16384, d, backend="gpu")
        return bs.block_q, bs.block_k, bs.launch

    assert tiles(3) == tiles(8) == tiles(16) == (64, 64, TritonLaunch(4, 2))
    assert tiles(17) == tiles(32) == (64, 64, TritonLaunch(8, 2))
    assert tiles(33) == tiles(64) == tiles(300) == (32, 32, TritonLaunch(8, 2))


@pytest.mark.parametrize("n", [None, 37])
def test_dense_means_the_whole_matrix_everywhere(n):
    """"dense" on one device (n None) and on a shard (n queries): untiled, no tile overrides,
    no coordinate differences."""
    chosen = plan("dense", 29, 2, jnp.float32, n=n, block_q=16, block_k=8, block_o=4)
    assert chosen.impl == "dense" and not chosen.differences and not chosen.interpret
    assert chosen.blocks is None


def test_plan_applies_overrides_and_short_tiles():
    xla = plan("xla", 3000, 2, jnp.float32, block_k=48, block_o=16)
    assert (xla.blocks.block_q, xla.blocks.block_k, xla.blocks.block_o) == (1024, 48, 16)
    assert xla.differences and not xla.interpret
    assert not plan("xla", 3000, 17, jnp.float32).differences  # above DIRECT_MAX_D
    short = plan("xla", 3000, 2, jnp.float32, queries=7, columns=1)
    assert short.blocks.block_q == 8 and short.full_blocks.block_q == 1024
    assert plan("xla", 300, 2, jnp.float32, queries=7, columns=1).blocks.block_q == 1024
    assert plan("xla", 3000, 2, jnp.float32, queries=7, columns=2).blocks.block_q == 1024
    assert plan("xla", 3000, 2, jnp.float32, queries=7, columns=1, block_q=32).blocks.block_q == 32
    pruned = plan("pallas", 100, 3, jnp.float32, family="pruned", block_k=32)
    assert (pruned.blocks.block_q, pruned.blocks.block_k) == (32, 32)


def test_lapack_on_host_is_the_cpu():
    assert lapack_on_host("cpu") and not lapack_on_host("gpu") and not lapack_on_host("tpu")


def test_a_fit_compiles_ahead_on_a_tpu_and_on_a_host_of_many_cores(monkeypatch):
    # decisions #62 and #63: the chip, and a host CPU whose cores would otherwise wait
    from scalegp.ops import _plan, compiles_ahead

    for cores, on_cpu in ((2, False), (_plan.COMPILE_AHEAD_MIN_CORES - 1, False),
                          (_plan.COMPILE_AHEAD_MIN_CORES, True), (13, True)):
        monkeypatch.setattr(_plan, "usable_cores", lambda cores=cores: cores)
        assert compiles_ahead("cpu") is on_cpu
        assert compiles_ahead("tpu") and not compiles_ahead("gpu")


def test_the_default_device_s_platform_is_the_one_planned_for(monkeypatch):
    """On a TPU machine (faked: JAX's default backend "tpu") the products plan for the chip,
    and inside `jax.default_device` of the host CPU (an estimator's `host_scope`) for the CPU:
    there the chip's compiled Mosaic kernels would refuse to run ("Only interpret mode is
    supported on CPU backend", as a fitted exact GP's predictions did on a v5e)."""
    import jax

    from scalegp.ops import _plan, dense_work_on_host

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert _plan._platform(None) == "tpu" and dense_work_on_host()
    assert backend_of("auto").name == "mosaic"
    with jax.default_device(jax.devices("cpu")[0]):
        assert _plan._platform(None) == "cpu" and not dense_work_on_host()
        assert backend_of("auto").name == "xla"
        assert plan("pallas", 64, 2, jnp.float32).interpret
    with jax.default_device("cpu"):
        assert _plan._platform(None) == "cpu"
    assert _plan._platform("gpu") == "gpu"


def test_dense_on_a_one_device_mesh_equals_dense_on_one_device():
    """The same meaning of "dense" on both paths, here on keys spread over many lengthscales
    (where xla and triton would take the coordinate differences, dense does not)."""
    rng = np.random.default_rng(0)
    x1, x2 = rng.standard_normal((37, 2)), 30 * rng.standard_normal((29, 2))
    x1, x2, v = (np.float32(a) for a in (x1, x2, rng.standard_normal((29, 3))))
    mesh = data_mesh()
    for scheme in ("allgather", "ring"):
        one = rbf_kernel_mv(x1, x2, v, 1.0, impl="dense")
        many = sharded_kernel_mv(x1, x2, v, 1.0, mesh=mesh, scheme=scheme, impl="dense")
        assert rel_err(many, one) <= 2e-6, scheme
        one = rbf_kde_density(x1, x2, 1.0, log=True, impl="dense", prune=False)
        many = sharded_kde_density(x1, x2, 1.0, mesh=mesh, scheme=scheme, log=True,
                                   impl="dense")
        assert rel_err(many, one) <= 2e-6, scheme
