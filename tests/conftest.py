"""Shared test configuration.

Tests run in the configuration users have: JAX's default float32, x64 off. A test that needs a
float64 reference says so with the ``x64`` marker (per test, or ``pytestmark`` for a module), and
runs with ``jax_enable_x64`` on. The setting is restored after every test, so a test that turns
x64 on (the CLI's ``--float64`` does) cannot leak it into the next one. The persistent
compilation cache is off unless a test sets ``SCALEGP_CACHE_DIR``.
"""

import os

import jax
import numpy as np
import pytest

from scalegp.ops._plan import BACKENDS

# The CLI's subprocesses would fill the user's compilation cache (scalegp._runtime): tests that
# are about the cache set their own folder.
os.environ.setdefault("SCALEGP_CACHE_DIR", "off")


def pytest_configure(config):
    config.addinivalue_line("markers", "x64: run with jax_enable_x64 on (float64 references)")


@pytest.fixture(autouse=True)
def _x64_only_where_marked(request):
    jax.config.update("jax_enable_x64", request.node.get_closest_marker("x64") is not None)
    yield
    jax.config.update("jax_enable_x64", False)


def engine_impls(*in_ci):
    """The backends this platform offers (`scalegp.ops._plan.BACKENDS`: those that compile or
    interpret here) as test parameters. CI runs "xla", the path CPU users get, and those named
    in ``in_ci``; the others under ``-m slow``: the dense oracle's own float32 arithmetic, and
    the fused kernels, which interpret mode compiles for seconds per case (each test file keeps
    a few of their cases in CI)."""
    platform = jax.default_backend()
    names = [name for name, entry in BACKENDS.items() if entry.runs_on(platform)]
    return [name if name == "xla" or name in in_ci else pytest.param(name, marks=pytest.mark.slow)
            for name in names]


def needs(impl, capability):
    """Skips the calling test where backend ``impl`` does not declare ``capability``."""
    from scalegp.ops._plan import BACKENDS

    if not BACKENDS[impl].can(capability):
        pytest.skip(f"{impl} does not declare {capability!r}")


def rel_err(actual, expected, axis=None):
    """``‖actual - expected‖ / ‖expected‖`` in float64; with ``axis``, per slice along it (e.g.
    ``axis=0``: one error per column)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(actual - expected, axis=axis) / np.linalg.norm(expected, axis=axis)


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches_per_module():
    """Drop JAX's compiled executables after each test module. One session compiles thousands of
    them; late in a full run, XLA's CPU compiler crashed (segmentation fault in
    backend_compile_and_load) compiling a BBMM objective that compiles fine in any shorter run
    (tests/persistence alone, or after tests/ops or tests/estimators)."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="module")
def tpu_compile_device():
    """A TPU v5e device of libtpu's compile-only topology, for programs compiled (not run) for
    a TPU on a machine without one (``pip install "libtpu==0.0.42.*"``, the version jax[tpu]
    0.10.2 pins); the test is skipped where libtpu or the topology is missing, as in CI."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1",
                                                chips_per_host_bounds=(1, 1, 1))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no compile-only TPU topology: {exc}"[:200])
    return topology.devices[0]


@pytest.fixture
def plans_for_a_tpu(monkeypatch):
    """The products plan for a TPU (the Mosaic backend compiled, not interpreted), for programs
    compiled on `tpu_compile_device`."""
    from scalegp.ops import _plan

    monkeypatch.setattr(_plan, "_platform", lambda backend: backend or "tpu")
    yield
    jax.clear_caches()
