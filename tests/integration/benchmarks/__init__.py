"""The benchmarks still run end to end, at a tiny size."""
