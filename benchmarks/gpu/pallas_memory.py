"""Estimate, without a GPU, the device memory the GPU (Pallas) path needs: the runner's own fwd and
fwd_bwd programs compiled on the CPU, with every Pallas kernel replaced by an opaque call.

    PYTHONPATH=. python benchmarks/gpu/pallas_memory.py                # max_n ladder, d = 8, o = 16
    PYTHONPATH=. python benchmarks/gpu/pallas_memory.py --sizes 65536 --dims 8 32 --outs 1 16 \\
        --out /tmp/pallas_memory.json

What is compiled is exactly what `kernel_mv.py` times on a GPU (`benchmarks.kmv.ours.JaxBench`,
impl="pallas", with JAX's default backend reported as "gpu" so that dispatch picks the compiled
kernels), except that each ``pallas_call`` becomes a host callback with the same operands and
results. XLA's buffer assignment then sees what it would see around the Triton custom calls: the
centred and scaled inputs, the padded copies, the kernels' outputs, the gradient epilogue.
``xla_arg_mb + xla_out_mb + xla_temp_mb`` is the estimate of the device peak that the runner's
max_n section measures (it counts inputs, G and outputs too).

It is an estimate. The CPU and GPU compilers fuse and schedule differently. By default XLA's CPU
YNNPACK fusions are switched off here (``--xla_cpu_experimental_ynn_fusion_type=``): they
materialise broadcasts that a GPU fusion would not. The kernels' own scratch (registers, shared
memory) is not device memory and is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

NO_YNN_FUSION = "--xla_cpu_experimental_ynn_fusion_type="


def _opaque_pallas_call(kernel, *, out_shape, **_):
    """Stand-in for ``pl.pallas_call``: same operands and results, no kernel."""
    import jax
    import numpy as np

    def host(*_args):
        leaves, tree = jax.tree.flatten(out_shape)
        return jax.tree.unflatten(tree, [np.zeros(s.shape, s.dtype) for s in leaves])

    return lambda *args: jax.pure_callback(host, out_shape, *args)


@contextlib.contextmanager
def gpu_program_on_cpu():
    """Within: dispatch believes the backend is a GPU, and Pallas kernels are opaque calls."""
    import jax
    from jax.experimental import pallas as pl

    with mock.patch.object(pl, "pallas_call", _opaque_pallas_call), \
            mock.patch.object(jax, "default_backend", lambda: "gpu"):
        yield


def estimate(family: str, mode: str, n: int, d: int, o: int) -> dict:
    """xla_arg_mb, xla_out_mb, xla_temp_mb and their sum, total_mb, for one configuration."""
    from benchmarks.kmv.ours import JaxBench
    from benchmarks.kmv.problems import make_inputs

    with gpu_program_on_cpu():
        bench = JaxBench("pallas", family, mode, make_inputs(family, n, n, d, o))
        fields = bench.setup()
    row = {"family": family, "impl": "pallas", "mode": mode, "n": n, "m": n, "dim": d, "out": o}
    row.update({k: round(v, 2) for k, v in fields.items() if k.startswith("xla_")})
    row["total_mb"] = round(row["xla_arg_mb"] + row["xla_out_mb"] + row["xla_temp_mb"], 2)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("kernel_mv", "kde_density"), default="kernel_mv")
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd_bwd"), default=["fwd", "fwd_bwd"])
    p.add_argument("--sizes", nargs="+", type=int, default=[16384, 65536, 262144, 1048576])
    p.add_argument("--dims", nargs="+", type=int, default=[8])
    p.add_argument("--outs", nargs="+", type=int, default=[16])
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if "jax" not in sys.modules:  # XLA reads its flags once, when the backend starts
        os.environ.setdefault("XLA_FLAGS", NO_YNN_FUSION)

    from benchmarks import harness

    outs = [1] if args.family == "kde_density" else args.outs
    rows = []
    for mode in args.modes:
        for d in args.dims:
            for o in outs:
                for n in args.sizes:
                    rows.append(estimate(args.family, mode, n, d, o))
                    r = rows[-1]
                    print(f"{mode:8s} n={n} d={d} o={o}: args {r['xla_arg_mb']:.0f} + out "
                          f"{r['xla_out_mb']:.0f} + temp {r['xla_temp_mb']:.0f} = "
                          f"{r['total_mb']:.0f} MB", flush=True)
    doc = {"device": harness.machine_info("cpu"), "command": harness.command_line(__file__, argv),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": rows}
    if args.out:
        harness.write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
