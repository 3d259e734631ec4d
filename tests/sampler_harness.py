"""worker.sampler's tests' shared ground: a SamplingBatch for a list of params (a generator per seeded row),
and logits as the logs of given probabilities."""

from __future__ import annotations

import math

from worker.sampler import SamplingBatch, make_generator


def make_batch(params, histories=None, generators=None) -> SamplingBatch:
    if generators is None:
        generators = [None if p.seed is None else make_generator(p.seed, "cpu") for p in params]
    if histories is None:
        histories = [[] for _ in params]
    return SamplingBatch(params=list(params), generators=list(generators), token_histories=list(histories))


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]
