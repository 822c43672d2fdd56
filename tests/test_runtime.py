"""scalegp._runtime: the compilation cache's folder and setup, and the bounded host BLAS."""

import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import jax
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from scalegp import _runtime
from scalegp._runtime import CACHE_ENV, bounded_host_blas, cache_dir, enable_compilation_cache

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", ["off", "OFF", " Off "])
def test_cache_dir_off(value):
    assert cache_dir({CACHE_ENV: value, "XDG_CACHE_HOME": "/x"}) is None


def test_cache_dir_default_and_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir({}) == tmp_path / ".cache" / "scalegp"
    assert cache_dir({CACHE_ENV: ""}) == tmp_path / ".cache" / "scalegp"  # empty: unset
    assert cache_dir({"XDG_CACHE_HOME": "/var/cache/me"}) == Path("/var/cache/me/scalegp")
    # The XDG specification: a relative path is invalid and ignored.
    assert cache_dir({"XDG_CACHE_HOME": "relative"}) == tmp_path / ".cache" / "scalegp"
    assert cache_dir({CACHE_ENV: "~/jaxcache", "XDG_CACHE_HOME": "/x"}) == tmp_path / "jaxcache"


def _blas_threads():
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_bounded_host_blas_bounds_and_restores(monkeypatch):
    monkeypatch.setattr(_runtime, "host_blas_threads", lambda: 1)
    with threadpool_limits(2, user_api="blas"):
        with bounded_host_blas():
            assert set(_blas_threads()) == {1}
            with bounded_host_blas():  # nested: the bound stays
                assert set(_blas_threads()) == {1}
            assert set(_blas_threads()) == {1}
        assert set(_blas_threads()) == {2}


def test_bounded_host_blas_never_raises_the_callers_limit(monkeypatch):
    monkeypatch.setattr(_runtime, "host_blas_threads", lambda: 2)
    with threadpool_limits(1, user_api="blas"):
        with bounded_host_blas():
            assert set(_blas_threads()) == {1}


def test_an_early_search_does_not_hold_up_the_bound_and_is_done_once(monkeypatch):
    # search_host_blas_early: the search runs in a thread; a bound entered while it runs
    # leaves the BLAS as it is, one entered after it bounds; the search is never repeated.
    monkeypatch.setattr(_runtime, "_BLAS_SEARCHES", {})
    monkeypatch.setattr(_runtime, "host_blas_threads", lambda: 1)
    release, searches = threading.Event(), []
    search = _runtime._search_blas

    def slow_search(future, with_scipy):
        searches.append(with_scipy)
        release.wait(10)
        search(future, with_scipy)

    monkeypatch.setattr(_runtime, "_search_blas", slow_search)
    with threadpool_limits(2, user_api="blas"):
        _runtime.search_host_blas_early()
        _runtime.search_host_blas_early()  # a second start: the same search
        with bounded_host_blas():
            assert set(_blas_threads()) == {2}  # still searching: not held up, not bounded
        release.set()
        _runtime._blas_controller(True)  # waits for the search's end
        with bounded_host_blas():
            assert set(_blas_threads()) == {1}
    assert searches == [True]


def test_host_blas_threads_is_half_the_cores_at_least_one(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    assert _runtime.host_blas_threads() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert _runtime.host_blas_threads() == 1


def test_enable_compilation_cache_off_leaves_jax_alone(monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None


def test_unusable_cache_folder_is_one_warning_not_an_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="not usable") as caught:
        assert enable_compilation_cache(blocker / "cache") is None
    assert len(caught) == 1 and str(blocker) in str(caught[0].message)
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.numpy.add(1.0, 2.0) == 3.0  # and JAX works as before


def test_configure_command_line_sets_jax_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.delitem(sys.modules, "jax")  # as in the command line: JAX not imported yet
    assert _runtime.configure_command_line() is None
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "cache")
    assert os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a-file" / "cache"))
    (tmp_path / "a-file").write_text("")
    assert "not usable" in _runtime.configure_command_line()


def test_configure_command_line_asks_libtpu_for_a_small_transfer_pool(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    for name in _runtime._TPU_POOL_ENV:
        monkeypatch.delenv(name, raising=False)
    _runtime.configure_command_line()
    assert [os.environ[name] for name in _runtime._TPU_POOL_ENV] == [
        str(_runtime.TPU_TRANSFER_POOL_BYTES)] * 2
    # the user's own setting of either is left as it is, and the other not set
    monkeypatch.delenv(_runtime._TPU_POOL_ENV[1])
    monkeypatch.setenv(_runtime._TPU_POOL_ENV[0], "1073741824")
    _runtime.configure_command_line()
    assert os.environ[_runtime._TPU_POOL_ENV[0]] == "1073741824"
    assert _runtime._TPU_POOL_ENV[1] not in os.environ


def test_repeated_cache_warnings_are_shown_once(monkeypatch):
    monkeypatch.setattr(_runtime, "_first_cache_warning_only", _runtime._FirstCacheWarningOnly())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _runtime.quiet_repeated_cache_warnings()
        _runtime.quiet_repeated_cache_warnings()  # idempotent
        for name in ("jit_a", "jit_b", "jit_c"):
            warnings.warn(f"Error reading persistent compilation cache entry for '{name}': "
                          "ZstdError: bad frame")
        warnings.warn("something else")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "jit_a" in messages[0] and messages[1] == "something else"


_PROGRAMS = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("default")
    import jax, jax.numpy as jnp
    from scalegp._runtime import enable_compilation_cache
    print("cache:", enable_compilation_cache(sys.argv[1]))
    x = jnp.arange(8.0)
    print("values:", float(jax.jit(lambda v: (v * v).sum())(x)),
          float(jax.jit(lambda v: jnp.sin(v).sum())(x)), float(jax.jit(jnp.cumsum)(x)[-1]))
""")


def _programs(cache):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run([sys.executable, "-c", _PROGRAMS, str(cache)], capture_output=True,
                          text=True, env=env, timeout=300, check=True)


def test_corrupt_cache_entries_are_one_warning_and_recompiled(tmp_path):
    cache = tmp_path / "cache"
    first = _programs(cache)
    entries = [p for p in cache.iterdir() if p.name.endswith("-cache")]
    assert len(entries) >= 3, first.stderr  # small programs are cached too
    for entry in entries:
        entry.write_bytes(b"garbage")
    second = _programs(cache)
    values = [line for line in first.stdout.splitlines() if line.startswith("values:")]
    assert values == ["values: 140.0 0.5537326335906982 28.0"]
    assert values[0] in second.stdout
    assert second.stderr.count("persistent compilation cache entry") == 1, second.stderr


def test_attached_accelerator_is_read_off_the_bus_without_a_client(monkeypatch):
    from jax._src import hardware_utils

    for chips, expected in ((4, "tpu"), (0, None)):
        monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id",
                            lambda chips=chips: (chips, "v5e" if chips else None))
        assert _runtime.attached_accelerator() == expected

    def unreadable():
        raise PermissionError("/sys/bus/pci")

    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", unreadable)
    assert _runtime.attached_accelerator() is None


def test_backends_started_early_are_the_ones_jax_then_uses():
    # decisions #67: the command line starts JAX's backends in a thread while it imports and
    # reads; the process's first use of JAX finds them up, and a second call starts nothing
    script = textwrap.dedent("""
        import threading
        from scalegp import _runtime
        from jax._src import xla_bridge

        _runtime.start_backends_early()
        started = _runtime._EARLY_BACKENDS
        started.join(timeout=60)
        print(xla_bridge.backends_are_initialized(), started.name)
        _runtime.start_backends_early()
        print(_runtime._EARLY_BACKENDS is started, threading.active_count())
        import jax
        print(jax.devices()[0].platform)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "scalegp-backends", "True", "1", "cpu"]


def test_a_backend_start_that_fails_early_is_reported_where_jax_is_used():
    # the thread raises nothing (no "Exception in thread" on stderr); JAX's first use in the
    # main thread tries again and raises JAX's own error, which the command line reports
    script = textwrap.dedent("""
        from scalegp import _runtime

        _runtime.start_backends_early()
        _runtime._EARLY_BACKENDS.join(timeout=60)
        import jax
        try:
            jax.devices()
        except RuntimeError as error:
            print("raised:", error)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "JAX_PLATFORMS": "no_such_platform"})
    assert result.returncode == 0, result.stderr
    assert "raised:" in result.stdout and "no_such_platform" in result.stdout, result.stdout
    assert "Exception in thread" not in result.stderr and "Traceback" not in result.stderr


def test_host_only_keeps_a_fresh_process_to_the_cpu_and_respects_a_choice():
    jax.devices()  # here JAX's backends are up: nothing changes
    assert _runtime.host_only() is False
    script = textwrap.dedent("""
        import jax
        from scalegp import _runtime
        print(_runtime.host_only(), jax.config.jax_platforms, jax.devices()[0].platform,
              _runtime.host_only())
    """)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=env, check=True, timeout=120)
    assert fresh.stdout.split() == ["True", "cpu", "cpu", "False"]
    chosen = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**env, "JAX_PLATFORMS": "cpu"}, check=True, timeout=120)
    assert chosen.stdout.split()[0] == "False"  # the user's choice stands
