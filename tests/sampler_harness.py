"""worker.sampler's tests' shared ground: a SamplingBatch for a list of params (a generator per seeded row),
logits as the logs of given probabilities, and a float64 statement of the filters' kept sets."""

from __future__ import annotations

import math

from worker.sampler import SamplingBatch
from worker.sampling_draws import make_generator


def make_batch(params, histories=None, generators=None) -> SamplingBatch:
    if generators is None:
        generators = [None if p.seed is None else make_generator(p.seed, "cpu") for p in params]
    if histories is None:
        histories = [[] for _ in params]
    return SamplingBatch(params=list(params), generators=list(generators), token_histories=list(histories))


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def reference_keep(row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Plain-Python float64 statement of the documented semantics."""
    keep = set(range(len(row)))
    if top_k > 0:
        kth = sorted(row, reverse=True)[min(top_k, len(row)) - 1]
        keep = {i for i in keep if row[i] >= kth}

    def probs(ids):
        top = max(row[i] for i in ids)
        weights = {i: math.exp(row[i] - top) for i in ids}
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    if top_p < 1.0:
        p = probs(keep)
        chosen, cumulative = set(), 0.0
        for i in sorted(keep, key=lambda i: (-row[i], i)):
            if cumulative >= top_p:
                break
            chosen.add(i)
            cumulative += p[i]
        keep = chosen
    if min_p > 0.0:
        p = probs(keep)
        p_max = max(p.values())
        keep = {i for i in keep if p[i] >= min_p * p_max}
    return keep
