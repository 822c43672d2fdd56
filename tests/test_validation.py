"""scalegp._validation: the device-memory limit and the refusal before work beyond it."""

import jax
import pytest

from scalegp import _validation
from scalegp._validation import MemoryLimitError, check_device_memory, device_memory_limit


class _Accelerator:
    """A device as JAX shows a TPU: its platform and its runtime's memory statistics."""

    platform = "tpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


@pytest.fixture
def accelerator(monkeypatch):
    """Makes JAX's default device a fake accelerator with the given memory statistics."""
    def use(stats):
        monkeypatch.setattr(jax, "devices", lambda *args: [_Accelerator(stats)])
    return use


def test_an_accelerators_limit_is_its_runtimes_bytes_limit(accelerator, monkeypatch):
    accelerator({"bytes_limit": 16_909_336_064, "bytes_in_use": 26_624})  # a TPU v5e's
    assert device_memory_limit() == 16_909_336_064
    monkeypatch.setattr(_validation, "memory_limit", lambda: 1234)
    accelerator(None)  # a runtime that says nothing (JAX's CPU): the process's own limit
    assert device_memory_limit() == 1234
    accelerator(NotImplementedError("memory_stats"))
    assert device_memory_limit() == 1234


def test_the_host_cpus_limit_is_the_processs(monkeypatch):
    monkeypatch.setattr(_validation, "memory_limit", lambda: 1234)
    assert jax.default_backend() == "cpu"
    assert device_memory_limit() == 1234


def test_beyond_an_accelerators_memory_is_refused_with_the_size_and_the_ways_out(accelerator):
    accelerator({"bytes_limit": 1_000})
    check_device_memory(1_000, "the arrays", "use fewer")  # at the limit: allowed
    with pytest.raises(MemoryLimitError) as refused:
        check_device_memory(1_001, "the arrays", "use fewer")
    message = str(refused.value)
    assert message.startswith("the arrays need about 1,001 bytes, more than the 1,000 bytes "
                              "of the TPU device's memory: use fewer")
    assert message.endswith("or run it on the host CPU (JAX_PLATFORMS=cpu)")


def test_on_the_host_cpu_the_refusal_names_the_processs_memory(monkeypatch):
    monkeypatch.setattr(_validation, "memory_limit", lambda: 1_000)
    with pytest.raises(MemoryLimitError, match="this process can hold.*: use fewer$"):
        check_device_memory(2_000, "the arrays", "use fewer")
