"""The backend table (`scalegp.ops._backends`): availability, what ``impl="auto"`` picks, and
`plan`, the one decision the one-device and the sharded products share."""

import jax.numpy as jnp
import numpy as np
import pytest

from scalegp.ops import (
    BlockSizes,
    auto_config,
    available_implementations,
    data_mesh,
    rbf_kde_density,
    rbf_kernel_mv,
    sharded_kde_density,
    sharded_kernel_mv,
)
from scalegp.ops._backends import BACKENDS, IMPLEMENTATIONS, plan
from tests.conftest import rel_err


def test_available_implementations():
    cpu = available_implementations("cpu")
    assert set(cpu) == {"dense", "xla", "pallas"} and "interpret" in cpu["pallas"]
    assert "Triton" in available_implementations("gpu")["pallas"]


def test_auto_config_depends_on_the_keys_only():
    impl, bs = auto_config(100, 3, backend="cpu")
    assert impl == "xla" and isinstance(bs, BlockSizes)
    # a fixed query tile; keys split into near-equal tiles (3000 -> three of 1000, not 3 x 1024)
    assert auto_config(16384, 8, backend="cpu")[1].block_q == auto_config(3000, 2)[1].block_q
    assert auto_config(3000, 2, backend="cpu")[1].block_k == 1000
    impl, bs = auto_config(16384, 8, backend="gpu")
    assert impl == "pallas" and bs.block_q & (bs.block_q - 1) == 0
    assert auto_config(16384, 8, dtype=jnp.float64, backend="gpu")[0] == "xla"


def test_gpu_tiles_shrink_as_points_widen():
    """Fewer registers per thread for wide points (why: `pallas.default_block_sizes`)."""
    def tiles(d):
        _, bs = auto_config(16384, d, backend="gpu")
        return bs.block_q, bs.block_k, bs.num_warps

    assert tiles(3) == tiles(8) == tiles(16) == (64, 64, 4)
    assert tiles(17) == tiles(32) == (64, 64, 8)
    assert tiles(33) == tiles(64) == tiles(300) == (32, 32, 8)


def test_every_implementation_is_one_entry_of_the_table():
    assert IMPLEMENTATIONS == tuple(BACKENDS) == ("dense", "xla", "pallas")


@pytest.mark.parametrize("n", [None, 37])
def test_dense_means_the_whole_matrix_everywhere(n):
    """"dense" on one device (n None) and on a shard (n queries): no tile overrides, no
    coordinate differences; untiled on one device, one tile covering the shard on a mesh."""
    chosen = plan("dense", 29, 2, jnp.float32, n=n, block_q=16, block_k=8, block_o=4)
    assert chosen.impl == "dense" and not chosen.differences and not chosen.interpret
    if n is None:
        assert chosen.blocks is None
    else:
        assert (chosen.blocks.block_q, chosen.blocks.block_k) == (40, 32)


def test_plan_applies_overrides_and_decides_interpret_mode():
    xla = plan("xla", 3000, 2, jnp.float32, block_k=48, block_o=16)
    assert (xla.blocks.block_q, xla.blocks.block_k, xla.blocks.block_o) == (1024, 48, 16)
    assert xla.differences and not xla.interpret
    assert not plan("xla", 3000, 17, jnp.float32).differences  # above DIRECT_MAX_D
    assert plan("pallas", 100, 3, jnp.float32, backend="cpu").interpret
    assert not plan("pallas", 100, 3, jnp.float32, backend="gpu").interpret
    pruned = plan("pallas", 100, 3, jnp.float32, family="pruned", block_k=32)
    assert (pruned.blocks.block_q, pruned.blocks.block_k) == (32, 32)


def test_dense_on_a_one_device_mesh_equals_dense_on_one_device():
    """The same meaning of "dense" on both paths, here on keys spread over many lengthscales
    (where xla and pallas would take the coordinate differences, dense does not)."""
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
