"""The Mosaic kernels compiled for a TPU v5e on a machine without one, by libtpu's compile-only
topology (``pip install "libtpu==0.0.42.*"``, the version jax[tpu] 0.10.2 pins; skipped where
it is missing, as in CI): every product and gradient passes Mosaic's compiler (which interpret
mode never runs), and XLA's compiled memory analysis for the chip keeps the 1,048,576² forward
under 1 GB and the products memory-linear. That analysis matched the one on a TPU v5e to the
byte for the same code (docs/decisions.md #48)."""

import jax
import jax.numpy as jnp
import pytest

from scalegp.ops import (
    RBF,
    ExpSineSquared,
    Matern,
    kernel_mv,
    rbf_kde_density,
    rbf_kernel_mv,
)

pytest.importorskip("libtpu")


@pytest.fixture(autouse=True)
def _plans_for_a_tpu(plans_for_a_tpu):
    """Every test here plans for a TPU (`plans_for_a_tpu`)."""


def _compiled(device, fn, *shapes):
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]
    return jax.jit(fn).lower(*args).compile()


def _bytes(compiled):
    mem = compiled.memory_analysis()
    return (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)


def _mv(d, **kw):
    def value_and_grads(x1, x2, v, ls):
        return jax.value_and_grad(lambda *a: jnp.sum(rbf_kernel_mv(*a, impl="mosaic", **kw)
                                                     ** 2), (0, 1, 2, 3))(x1, x2, v, ls)
    return value_and_grads


def _kde(**kw):
    def value_and_grads(q, x, h):
        return jax.value_and_grad(lambda *a: jnp.sum(rbf_kde_density(
            *a, log=True, impl="mosaic", **kw)), (0, 1, 2))(q, x, h)
    return value_and_grads


@pytest.mark.parametrize("d", [2, 8, 17])  # differences, the run-time switch, the expansion
def test_kernel_mv_and_gradients_compile(tpu_compile_device, d):
    _compiled(tpu_compile_device, _mv(d, prune=False), (1000, d), (3000, d), (3000, 5), ())


@pytest.mark.parametrize("d", [2, 8])
def test_kde_and_gradients_compile(tpu_compile_device, d):
    _compiled(tpu_compile_device, _kde(prune=False), (1000, d), (3000, d), ())


def test_pruned_products_and_gradients_compile(tpu_compile_device):
    _compiled(tpu_compile_device, _mv(2, prune=True), (1000, 2), (3000, 2), (3000, 5), ())
    _compiled(tpu_compile_device, _kde(prune=True), (1000, 2), (3000, 2), ())


@pytest.mark.parametrize("make, d", [
    (lambda: Matern(0.7, 1.5), 3),  # a lone Matérn: the RBF's kernels, differences
    (lambda: Matern(0.7, 2.5), 8),  # ... the run-time switch
    (lambda: Matern(0.7, 1.5) + RBF(1.0) + ExpSineSquared(1.2, 2.0) * RBF(3.0), 3),
    # past d = 4: the forward's run-time switch to the expansion for the shared distance
    (lambda: RBF(1.0) + ExpSineSquared(1.2, 2.0) * RBF(3.0), 8),
])
def test_expression_and_gradients_compile(tpu_compile_device, make, d):
    def value_and_grads(kernel, x1, x2, v):
        return jax.value_and_grad(lambda *a: jnp.sum(kernel_mv(*a, impl="mosaic") ** 2),
                                  (0, 1, 2, 3))(kernel, x1, x2, v)

    _compiled(tpu_compile_device, lambda *a: value_and_grads(make(), *a), (1000, d), (3000, d),
              (3000, 4))


def test_the_million_point_forward_takes_under_1_gb(tpu_compile_device):
    n = 1 << 20
    kv = _compiled(tpu_compile_device, lambda x, v: rbf_kernel_mv(x, x, v, 1.0, impl="mosaic",
                                                          prune=False), (n, 8), (n, 16))
    assert _bytes(kv) < 1e9
    kde = _compiled(tpu_compile_device, lambda q: rbf_kde_density(q, q, 0.3, log=True, impl="mosaic",
                                                          prune=False), (n, 2))
    assert _bytes(kde) < 0.5e9


@pytest.mark.parametrize("what", ["mv", "kde"])
def test_forward_and_backward_are_memory_linear(tpu_compile_device, what):
    def temp(n):
        if what == "mv":
            fn, shapes = _mv(8, prune=False), [(n, 8), (n, 8), (n, 16), ()]
        else:
            fn, shapes = _kde(prune=False), [(n, 2), (n, 2), ()]
        return _compiled(tpu_compile_device, fn, *shapes).memory_analysis().temp_size_in_bytes

    assert temp(1 << 20) < 6 * temp(1 << 18)  # 4x the points: quadratic would be 16x


@pytest.mark.parametrize("make", [lambda: None, lambda: Matern(0.7, 1.5) + RBF(2.0)],
                         ids=["rbf", "expression"])
def test_wide_values_and_their_gradients_compile_within_vmem(tpu_compile_device, make):
    """800 value columns, as the GP's control-variate gradient passes (its right-hand sides
    include the preconditioner's basis): a chunk of columns per kernel call keeps each call's
    VMEM as a narrow one's. Whole, the RBF's backward exceeded the chip's VMEM
    (docs/decisions.md #52)."""
    kernel = make()
    if kernel is None:
        fn = _mv(4, prune=False)
        _compiled(tpu_compile_device, fn, (2048, 4), (2048, 4), (2048, 800), ())
        return

    def value_and_grads(x1, x2, v):
        return jax.value_and_grad(lambda *a: jnp.sum(kernel_mv(kernel, *a, impl="mosaic")
                                                     ** 2), (0, 1, 2))(x1, x2, v)

    _compiled(tpu_compile_device, value_and_grads, (2048, 4), (2048, 4), (2048, 800))


@pytest.mark.parametrize("near", [True, False], ids=["near", "rest"])
@pytest.mark.parametrize("d", [2, 8])
def test_the_planned_passes_compile_and_stay_small(tpu_compile_device, near, d):
    """The host-planned KDE's kernels (`mosaic._planned`) for one call of `MAX_STEPS` steps
    over 64 query tiles against 10^7 keys: Mosaic compiles them, and the keys' operands are
    read in place (no copy of them among the temporaries); and the near pass's gather of each
    row's largest bound."""
    from scalegp.ops.backends.mosaic import _planned

    sharding = jax.sharding.SingleDeviceSharding(tpu_compile_device)

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    block, m = _planned.PLANNED_BLOCK, 10 * (1 << 20)
    n, tk = 64 * block, m // block
    operands = _planned.KeyOperands(spec((d + 2, m)), spec((-(-(2 * d + 2) // 8) * 8, tk)),
                                    spec((tk,)))
    column = spec((n, 1))
    steps = spec((_planned.MAX_STEPS,), jnp.int32)
    compiled = _planned._call.lower(
        steps, steps, spec((), jnp.int32), spec((d,)), spec((n, d)), operands,
        (column,) if near else (column,) * 4, (column,) * (2 if near else 1), block=block,
        near=near, log_tol=-16.0, depth=_planned.PREFETCH_DEPTH, interpret=False).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 64 << 20
    if near:  # each row's largest bound over the near list's pairs, gathered beforehand
        pairs = spec((_planned.TOPS_PAIRS,), jnp.int32)
        _planned._tops.lower(spec((64, block)), spec((64, block, d)), pairs, pairs,
                             operands.boxes, spec((d,)), safety=0.99).compile()


@pytest.mark.parametrize("n, k, t", [(10_000, 768, 768), (100_000, 1100, 31), (37, 8, 600)])
def test_the_dense_products_compile(tpu_compile_device, n, k, t):
    """`scalegp.ops.dense_products` on a TPU: both Mosaic products compile, with their
    gradients, over a whole basis, wide and ragged short axes, and a short long axis."""
    from scalegp.ops import dense_products

    matmul, matmul_tn = dense_products()

    def both(a, b, s):
        return jax.value_and_grad(lambda a, b, s: jnp.sum(matmul(a, s) ** 2)
                                  + jnp.sum(matmul_tn(a, b) ** 2), (0, 1, 2))(a, b, s)

    _compiled(tpu_compile_device, both, (n, k), (n, t), (k, t))


def test_the_gp_preconditioner_compiles_on_mosaic_products(tpu_compile_device):
    """The BBMM preconditioner's eigen-form (the Gram route, a TPU's default) compiles with
    the Mosaic products, not XLA's dot: each product is one Mosaic kernel in the program."""
    from scalegp import linalg

    compiled = _compiled(tpu_compile_device, lambda factor: linalg.LowRankPreconditioner
                         .from_factor(factor, 0.1).basis, (10_000, 768))
    text = compiled.as_text()
    assert text.count("scalegp_dense_tn") >= 3 and text.count("scalegp_dense_nn") >= 2
