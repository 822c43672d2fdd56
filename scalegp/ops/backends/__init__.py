"""The engine's backends, one sub-package each, each exporting one `scalegp.ops._interface.Backend`
as ``BACKEND``: `dense` (the oracle), `xla` (blocked XLA loops, the CPU default), `triton` (fused
Pallas kernels compiled by Triton on a GPU). Nothing outside a backend's folder imports its
modules: the products ask `scalegp.ops._plan.plan`, which holds the one list of backends.
docs/architecture.md says how to add one; the TPU's Mosaic kernels are to be the next,
`mosaic/` (fused, compiling on "tpu", so that ``impl="pallas"`` and "auto" take them there)."""
