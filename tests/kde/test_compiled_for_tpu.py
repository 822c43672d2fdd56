"""The KDE's cross-validation programs compiled for a TPU v5e on a machine without one, by
libtpu's compile-only topology (`tpu_compile_device`; skipped where libtpu is missing, as in
CI): at a million keys no step is a cumulative reduction over the keys' whole axis, which XLA
compiles for a TPU as one window that long (slowly: the anchors' running extremes once took
most of a fit's compilation that way), and at ten million keys the programs fit the chip's
scoped VMEM (docs/decisions.md #51)."""

import re

import jax
import jax.numpy as jnp
import pytest

from scalegp.kde import _density, _loo
from scalegp.kde._cv import DEFAULT_CV_SUBSAMPLE
from scalegp.ops import Engine

pytestmark = pytest.mark.usefixtures("plans_for_a_tpu")


def _largest_window(text: str) -> int:
    windows = re.findall(r"window_dimensions = array<i64: ([0-9, ]+)>", text)
    return max((int(v) for w in windows for v in w.split(",")), default=0)


@pytest.mark.parametrize("in_order", [False, True])
def test_loo_objective_at_a_million_keys_has_no_window_over_the_keys(tpu_compile_device,
                                                                     in_order):
    u = 1 << 20
    engine = Engine.create("auto", keys_in_order=in_order)
    sharding = jax.sharding.SingleDeviceSharding(tpu_compile_device)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in (
        ((), jnp.float32), ((u, 2), jnp.float32), ((u,), jnp.float32), ((2048,), jnp.int32))]
    lowered = _loo.neg_mean_loo_value_and_grad.lower(*args, group=1024, remat=False,
                                                      engine=engine)
    assert _largest_window(lowered.as_text()) <= 1024
    lowered.compile()  # and Mosaic compiles it


def test_the_check_reads_a_whole_axis_window(tpu_compile_device):
    """The check itself: `lax.cummax` over 2^20 entries lowers to one window that long."""
    sharding = jax.sharding.SingleDeviceSharding(tpu_compile_device)
    x = jax.ShapeDtypeStruct((1 << 20,), jnp.int32, sharding=sharding)
    text = jax.jit(jax.lax.cummax).lower(x).as_text()
    assert _largest_window(text) == 1 << 20


def test_ten_million_keys_compile_within_scoped_vmem(tpu_compile_device):
    """The scoring and the cross-validation's gradient at 10^7 keys, laid out as a fit lays
    them out: the centring's sample as a strided slice needed more scoped VMEM there than the
    chip allows, and the 10^7-point fit failed on the chip."""
    engine = Engine.create("auto")
    u, s, static = _loo.loo_layout(10_000_000, 2, DEFAULT_CV_SUBSAMPLE, engine)
    sharding = jax.sharding.SingleDeviceSharding(tpu_compile_device)

    def shaped(*shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    _density._log_density_block.lower(shaped(_density.DEFAULT_BATCH_SIZE, 2), shaped(u, 2),
                                      shaped(), shaped(u), engine).compile()
    _loo.neg_mean_loo_value_and_grad.lower(
        shaped(), shaped(u, 2), shaped(u), shaped(s, dtype=jnp.int32), **static).compile()
