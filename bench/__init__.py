"""Benchmarks: the engine's throughput, single-stream decode and KV utilisation against HF baselines and hardware bounds.

Run with `python -m bench.engine_throughput` (or `make bench`)."""
