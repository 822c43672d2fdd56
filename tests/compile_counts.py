"""Counts the programs JAX compiles for one call in a fresh process (tests of how few a first
call compiles: eager operations each compile a program of their own, on a TPU each a
compilation for the chip). ``program_count(source)`` runs ``source``, which defines a
no-argument function ``call``, in a child process, and returns the number of programs
compiled while ``call()`` runs (JAX's compile log)."""

import json
import os
import subprocess
import sys
import textwrap

_HARNESS = """
import json, logging
import jax
finished = []
class _Log(logging.Handler):
    def emit(self, record):
        if "Finished XLA compilation" in record.getMessage():
            finished.append(record.getMessage())
logging.getLogger("jax").addHandler(_Log())
{source}
if {all_threads}:  # the setting, not the context: a context is the calling thread's alone
    jax.config.update("jax_log_compiles", True)
    call()
else:
    with jax.log_compiles():
        call()
print(json.dumps({{"programs": len(finished), "names": finished}}))
"""


def program_count(source: str, all_threads: bool = False) -> tuple[int, list[str]]:
    """``(programs, their log lines)``; with ``all_threads``, those that other threads compile
    while ``call()`` runs too (`scalegp._ahead`'s)."""
    script = _HARNESS.format(source=textwrap.dedent(source), all_threads=all_threads)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["programs"], result["names"]
