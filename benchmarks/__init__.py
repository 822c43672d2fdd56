"""Benchmark runners (see benchmarks/README.md). A package so that `python -m benchmarks.X` works."""
