"""goodput.bench: load generator and benchmarks (see bench/README.md)."""
