"""The kernel_mv benchmark: child-process runner, float64 references and peer baselines.

Modules:
  options   command line, per-device presets
  sections  what each section (grid, kde, peak, max_n, tiles, crossover, kernels) runs
  runner    the parent: child processes with timeouts, error rows, JSON output
  child     what runs inside a child: one or more configurations
  problems  deterministic inputs (the Matérn-3/2 and composite kernels too), the float64
            reference, relative errors
  ours      scalegp.ops under JAX (dense, xla, pallas, auto)
  peers     numpy, torch (also Matérn-3/2), pykeops, scipy.stats.gaussian_kde, sklearn
            KernelDensity
  catalog   what each implementation name means and what it needs

Timing, peak memory, the "device" block and the results file come from benchmarks/harness.py,
which every runner shares.

The parent imports none of jax, torch or numpy's heavy peers: everything that touches a device
runs in a child, so the parent never holds device memory and a crash never takes the run down.
"""
