"""The engine's backends, one sub-package each, each exporting one `scalegp.ops._interface.Backend`
as ``BACKEND``: `dense` (the oracle), `xla` (blocked XLA loops, the CPU default), `triton` (fused
Pallas kernels compiled by Triton on a GPU), `mosaic` (fused Pallas kernels compiled by Mosaic
on a TPU). Nothing outside a backend's folder imports its modules: the products ask
`scalegp.ops._plan.plan`, which holds the one list of backends. docs/architecture.md says how to
add one."""
