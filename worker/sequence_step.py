"""The runner's view of one sequence's share of a step (`SequenceStep`), what a sampled sequence gets
back (`SampledToken`), and the sampler's rows for a step's sampled sequences (`sampling_batch`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shared.sampling_params import SamplingParams, TopLogprobs
from worker.prompt_logprobs import PromptScoring
from worker.sampler import SamplingBatch

# A sampled sequence's result: (token id, raw logprob, top logprobs); the last two are None when its
# request did not ask for them (then none were computed for it).
SampledToken = tuple[int, float | None, TopLogprobs | None]


@dataclass(slots=True)
class SequenceStep:
    """One sequence's share of a step, as the runner needs it."""

    new_token_ids: Sequence[int]  # the tokens computed this step
    context_len: int  # tokens already in the cache
    block_table: list[int]
    needs_sample: bool  # this step reaches the sequence's last known token
    params: SamplingParams
    generator: torch.Generator | None
    token_history: Sequence[int]  # prompt + output, for repetition penalty
    # The generator's seed for this step's token: set again before every attempt, so a step
    # retried after an out-of-memory error draws exactly what the first attempt would have.
    seed: int | None = None
    # Generated tokens only, resumed ones included: what presence/frequency penalties count and
    # min_tokens compares with (the request's own list, not a copy: read, never kept).
    output_token_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()  # banned, with stop_token_ids, while under min_tokens
    constraint: Any = None  # structured output: the request's worker/constraints.Constraint
    # Speculative decoding: the last len(draft_token_ids) of new_token_ids are a draft to verify, and
    # the step samples at the position after each new token, not only the last (1 + len(draft) tokens);
    # draft_seeds are the seeds of the tokens after the first (set when `seed` is).
    draft_token_ids: Sequence[int] = ()
    draft_seeds: Sequence[int] = ()
    # The prompt positions of this step whose log-probabilities the request asked for (prompt_logprobs).
    prompt_scoring: PromptScoring | None = None

    @property
    def num_samples(self) -> int:
        return (1 + len(self.draft_token_ids)) if self.needs_sample else 0


def sampling_batch(seqs: list[SequenceStep]) -> SamplingBatch:
    """The sampler's rows for the sampled sequences, in order: one per sequence, or 1 + len(draft) for a
    sequence verifying a draft. Row j of a draft sees the sequence as if the draft's first j tokens had
    been taken (its histories for penalties and min_tokens, its seed), so it samples exactly what an
    unspeculated step at that position would; histories are extended only for rows that read them."""
    # One tuple per row, in SamplingBatch's field order, transposed into the fields at the end: one
    # append per row rather than one per field.
    rows = []
    for s in seqs:
        draft = s.draft_token_ids
        if not draft:
            # The common row (no draft): the sequence as it stands, without the per-position copies below.
            if s.needs_sample:
                rows.append((s.params, s.generator, s.token_history, s.output_token_ids, s.eos_token_ids,
                             s.constraint, s.seed))
            continue
        if s.constraint is not None:
            # One matcher state cannot mask several positions; the engine never drafts for these.
            raise ValueError("a constrained sequence cannot verify a draft")
        p = s.params
        reads_history = p.repetition_penalty != 1.0
        reads_outputs = bool(p.presence_penalty or p.frequency_penalty or p.min_tokens)
        row_seeds = [s.seed, *s.draft_seeds] if s.seed is not None else [None] * s.num_samples
        for j in range(s.num_samples):
            prefix = draft[:j]
            rows.append((p, s.generator,
                         [*s.token_history, *prefix] if prefix and reads_history else s.token_history,
                         [*s.output_token_ids, *prefix] if prefix and reads_outputs else s.output_token_ids,
                         s.eos_token_ids, None, row_seeds[j]))
    if not rows:
        return SamplingBatch(params=[], generators=[], token_histories=[], output_token_ids=[], eos_token_ids=[])
    params, generators, histories, outputs, eos, constraints, seeds = map(list, zip(*rows))
    num_rows = len(rows)
    return SamplingBatch(params=params, generators=generators, token_histories=histories, output_token_ids=outputs,
                         eos_token_ids=eos, constraints=constraints if constraints.count(None) != num_rows else None,
                         seeds=seeds if seeds.count(None) != num_rows else None)
