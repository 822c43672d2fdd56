"""KDE bandwidth cross-validation on several processes (hosts) with JAX's distributed runtime.

Every process runs this same script. The processes find each other through the environment
(`scalegp.distributed`):

    JAX_COORDINATOR_ADDRESS=host0:12345   # process 0's host and a free port, the same everywhere
    SCALEGP_NUM_PROCESSES=2               # how many processes
    SCALEGP_PROCESS_ID=0                  # 0 on the first host, 1 on the second, ...

Then the mesh spans every device of every process, the held-out queries of the leave-one-out
objective are sharded over all of them, and every process prints the same bandwidth. Each process
builds the same data (same seed); real data would be read by every process the same way (or
assembled with `jax.make_array_from_process_local_data`).

    # on each of two hosts (CPU: gloo collectives; GPU: NCCL)
    JAX_COORDINATOR_ADDRESS=10.0.0.1:12345 SCALEGP_NUM_PROCESSES=2 SCALEGP_PROCESS_ID=<0|1> \\
        python examples/multihost_kde.py
    # or try it on one machine: two local processes of two CPU devices each
    python examples/multihost_kde.py --launch 2

Without the variables (and without --launch) it runs as one process on the local devices.
Prints, per process: process index, devices, the cross-validated bandwidth and its LOO
log-likelihood, and the one-process answer for comparison.
"""

import argparse
import os
import socket
import subprocess
import sys
import time


def launch(num_processes: int, devices_per_process: int) -> int:
    """Starts num_processes copies of this script on localhost and waits for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(num_processes):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   SCALEGP_NUM_PROCESSES=str(num_processes), SCALEGP_PROCESS_ID=str(i),
                   JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
        procs.append(subprocess.Popen([sys.executable, __file__], env=env))
    try:
        return max(proc.wait(timeout=600) for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def main():
    from scalegp.distributed import initialize_from_env

    multi = initialize_from_env()  # before any JAX computation

    import jax
    import numpy as np

    from scalegp import kde
    from scalegp.ops import data_mesh

    rng = np.random.default_rng(0)
    X = np.concatenate([rng.standard_normal((3000, 3)) * [1.0, 0.5, 0.3],
                        rng.standard_normal((2000, 3)) * 0.4 + [2.0, 1.0, 0.0]]).astype(np.float32)
    mesh = data_mesh()  # all devices of all processes
    start = time.perf_counter()
    result = kde.cross_validate_bandwidth(X, diagonal=True, cv_subsample=2048, random_state=0,
                                          mesh=mesh, scheme="ring")
    seconds = time.perf_counter() - start
    print(f"process {jax.process_index()}/{jax.process_count()} "
          f"({'distributed' if multi else 'single process'}), {jax.device_count()} devices "
          f"({jax.local_device_count()} local): bandwidth {np.round(result.bandwidth, 5)}, "
          f"LOO log-likelihood {result.log_likelihood:.5f}, {seconds:.1f} s", flush=True)
    if jax.process_index() == 0:
        # The same objective on this process's first device only (no other process takes part).
        with jax.default_device(jax.local_devices()[0]):
            alone = kde.cross_validate_bandwidth(X, diagonal=True, cv_subsample=2048,
                                                 random_state=0)
        print(f"one device: bandwidth {np.round(alone.bandwidth, 5)}, "
              f"LOO log-likelihood {alone.log_likelihood:.5f}", flush=True)
    if multi:
        jax.distributed.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launch", type=int, default=0, metavar="N",
                        help="start N local processes (2 CPU devices each) and wait for them")
    args = parser.parse_args()
    sys.exit(launch(args.launch, 2) if args.launch else main())
