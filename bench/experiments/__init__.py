"""The seed experiments (issue 7) reproduced on this system: one module per experiment, run by
`python -m bench.experiments [names...] [--quick]` (see registry.py and docs/experiments.md)."""
