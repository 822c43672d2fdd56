"""scalegp._validation: requests beyond the memory of this process, or of an accelerator,
refused before any work with the size, the limit and the ways out."""

import pytest

from scalegp import _validation
from scalegp._validation import MemoryLimitError, check_memory


def test_beyond_an_accelerators_memory_is_refused_with_the_size_and_the_ways_out(monkeypatch):
    monkeypatch.setattr(_validation, "memory_limit", lambda: 10**12)  # not the host's to say
    check_memory(1_000, "the arrays", "use fewer", device=("tpu", 1_000))  # at the limit
    with pytest.raises(MemoryLimitError) as refused:
        check_memory(1_001, "the arrays", "use fewer", device=("tpu", 1_000))
    message = str(refused.value)
    assert message.startswith("the arrays need about 1,001 bytes, more than the 1,000 bytes "
                              "of the TPU device's memory: use fewer")
    assert message.endswith("or run it on the host CPU (JAX_PLATFORMS=cpu)")


def test_without_a_device_the_refusal_names_the_processs_memory(monkeypatch):
    monkeypatch.setattr(_validation, "memory_limit", lambda: 1_000)
    check_memory(1_000, "the arrays", "use fewer")
    with pytest.raises(MemoryLimitError, match="this process can hold.*: use fewer$"):
        check_memory(2_000, "the arrays", "use fewer")
