"""The serving benchmark's workload: seeded requests with arrival times, lengths and priority classes.

One `LoadSpec` and a seed fix every request exactly (prompt ids, max_tokens, priority, arrival
offset), so the in-process engine and the cluster replay the very same work. Prompts are a mix
of short and long token-id lists that span the gateway's length buckets; each prompt plus its
max_tokens fits the model's context. Arrivals are Poisson at `rate` requests/s (rate 0: all at
once, for closed-loop or burst runs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

URGENT_PRIORITY = 0  # not -1: a config may put a queue-time limit on priority <= -1
BULK_PRIORITY = 10
FIRST_ORDINARY_ID = 8  # clear of the specials: ids 0..2 in bench-small, 0..5 in models/default


@dataclass(frozen=True)
class LoadRequest:
    index: int
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: list[int] = field(repr=False)
    max_tokens: int  # exact output length: greedy with EOS ignored
    priority: int
    kind: str  # "short" or "long": which prompt-length range it was drawn from

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LoadSpec:
    num_requests: int = 100
    rate: float = 4.0  # Poisson arrivals per second; 0 = every request at t = 0
    long_fraction: float = 0.3
    short_prompt: tuple[int, int] = (16, 100)  # inclusive token ranges
    long_prompt: tuple[int, int] = (300, 900)
    short_output: tuple[int, int] = (16, 96)
    long_output: tuple[int, int] = (16, 64)
    urgent_fraction: float = 0.25
    urgent_priority: int = URGENT_PRIORITY
    bulk_priority: int = BULK_PRIORITY
    seed: int = 0

    def describe(self) -> str:
        arrivals = f"Poisson {self.rate:g} req/s" if self.rate > 0 else "all at t=0"
        return (f"{self.num_requests} requests, {arrivals}; {1 - self.long_fraction:.0%} short prompts "
                f"{self.short_prompt[0]}-{self.short_prompt[1]} tok with {self.short_output[0]}-"
                f"{self.short_output[1]} out, {self.long_fraction:.0%} long {self.long_prompt[0]}-"
                f"{self.long_prompt[1]} tok with {self.long_output[0]}-{self.long_output[1]} out; "
                f"{self.urgent_fraction:.0%} urgent (priority {self.urgent_priority}), rest bulk "
                f"(priority {self.bulk_priority}); seed {self.seed}")


def make_load_workload(spec: LoadSpec, vocab_size: int, max_model_len: int) -> list[LoadRequest]:
    """Draw every request from one random.Random(seed): the same spec always gives the same requests."""
    rng = random.Random(spec.seed)
    requests, t = [], 0.0
    for i in range(spec.num_requests):
        if spec.rate > 0:
            t += rng.expovariate(spec.rate)
        long = rng.random() < spec.long_fraction
        out_lo, out_hi = spec.long_output if long else spec.short_output
        p_lo, p_hi = spec.long_prompt if long else spec.short_prompt
        max_tokens = rng.randint(out_lo, out_hi)
        # A model with a short context caps the long range rather than refusing the spec.
        p_hi = min(p_hi, max_model_len - max_tokens)
        p_lo = min(p_lo, p_hi)
        if p_hi < 1:
            raise ValueError(f"max_tokens {max_tokens} leaves no room for a prompt in a {max_model_len}-token context")
        prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(rng.randint(p_lo, p_hi))]
        urgent = rng.random() < spec.urgent_fraction
        requests.append(LoadRequest(index=i, arrival_s=t, prompt_token_ids=prompt, max_tokens=max_tokens,
                                    priority=spec.urgent_priority if urgent else spec.bulk_priority,
                                    kind="long" if long else "short"))
    return requests


def workload_totals(requests: list[LoadRequest]) -> dict:
    return {"requests": len(requests), "prompt_tokens": sum(r.prompt_len for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
            "duration_s": max((r.arrival_s for r in requests), default=0.0)}
