"""The fixed, seeded benchmark workloads: the throughput mix and the single-stream decode request.

Every system under test receives exactly these token ids and per-request output lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOAD_SEED = 1234


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int  # exact number of tokens to generate; EOS is ignored


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 32
    prompt_len: tuple[int, int] = (64, 512)  # inclusive range
    output_len: tuple[int, int] = (32, 256)  # inclusive range


FULL = WorkloadSpec()
QUICK = WorkloadSpec(num_requests=8, prompt_len=(16, 96), output_len=(8, 32))

# Single-stream decode: one request, 128 prompt tokens, 256 generated.
DECODE_PROMPT_LEN = 128
DECODE_NEW_TOKENS = 256
QUICK_DECODE_NEW_TOKENS = 32


def make_requests(spec: WorkloadSpec, vocab_size: int, seed: int = WORKLOAD_SEED) -> list[Request]:
    """Draw prompt/output lengths and prompt ids from one seeded generator, so the workload never drifts."""
    rng = np.random.default_rng(seed)
    p_lo, p_hi = spec.prompt_len
    o_lo, o_hi = spec.output_len
    prompt_lens = rng.integers(p_lo, p_hi + 1, size=spec.num_requests)
    output_lens = rng.integers(o_lo, o_hi + 1, size=spec.num_requests)
    # Avoid ids 0..2 (unk/bos/eos in Llama's convention) so prompts look like ordinary text tokens.
    return [
        Request(rng.integers(3, vocab_size, size=int(p)).tolist(), int(o))
        for p, o in zip(prompt_lens, output_lens)
    ]


def make_decode_prompt(vocab_size: int, prompt_len: int = DECODE_PROMPT_LEN,
                       seed: int = WORKLOAD_SEED + 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab_size, size=prompt_len).tolist()


def make_warmup_requests(vocab_size: int) -> list[Request]:
    """A short generation to run before timing, so lazy init, allocator growth and kernel selection are not timed."""
    rng = np.random.default_rng(WORKLOAD_SEED + 2)
    return [Request(rng.integers(3, vocab_size, size=n).tolist(), 8) for n in (24, 40)]
