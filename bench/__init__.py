"""Benchmarks: our engine's throughput, batch-1 decode and KV utilisation against transformers baselines and
measured hardware bounds. Run with `python -m bench.engine_throughput` (or `make bench`)."""
