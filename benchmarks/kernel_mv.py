"""Benchmark of scalegp's kernel product and KDE against peers, in the JSON schema of the RTX 3090
benchmark (../shared/seed/kmv_benchmark_rtx3090.json).

    python benchmarks/kernel_mv.py --device cpu                  # quick: under 15 minutes
    python benchmarks/kernel_mv.py --device cpu --preset full    # the committed CPU run
    python benchmarks/kernel_mv.py --device tpu                  # one TPU chip: ours only, each
        # section in one child (opening the chip costs 10 to 15 s a child); no TPU: exit 2
    python benchmarks/kernel_mv.py --sections grid --sizes 1024 --dims 8 --outs 16 --list
    python benchmarks/kernel_mv.py --preset full --sections kernels --sample-budget-s 30  # RBF,
        # Matérn-3/2 and a composite kernel at the same shapes (opt-in: in no default --sections)

See benchmarks/README.md for what each section measures and how the peers are written, and
``--help`` for every option. Each configuration runs in a child process (this module with
``--child SPEC OUT``) under a timeout, so an out-of-memory error, a compiler crash or a hang is a
row with "error" rather than the end of the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `scalegp` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        if len(argv) != 3:
            print("usage: kernel_mv.py --child SPEC_JSON OUT_JSONL", file=sys.stderr)
            return 2
        from benchmarks.kmv.child import main as child_main

        return child_main(argv[1], argv[2])
    from benchmarks.kmv import options, runner

    return runner.main(options.parse(argv))


if __name__ == "__main__":
    sys.exit(main())
