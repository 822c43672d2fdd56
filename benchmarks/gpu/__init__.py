"""GPU verification tools, not benchmarks: they check that the Pallas (Triton) path compiles, is
correct and fits on a GPU, and run the prepared GPU session (gpu_check.sh). See
benchmarks/README.md, "gpu/"."""
