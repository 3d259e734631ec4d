"""The seed experiments (docs/experiments.md) reproduced on this system: one module per experiment, run by
`python -m bench.experiments [names...] [--quick]` (see registry.py and docs/experiments.md)."""
