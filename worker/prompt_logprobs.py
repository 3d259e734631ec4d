"""The prompt's log-probabilities (vLLM's `prompt_logprobs`): which positions of a step a request
scores, and scoring them from the step's hidden states.

The hidden state at prompt position p (0 <= p < P - 1) gives the entry of prompt token p + 1: its raw
log-probability (log_softmax of the model's logits there, as a sampled token's), its rank in the
vocabulary (1 + the tokens more likely than it) and the most likely alternatives. A request keeps its
entries by position (`Request.prompt_logprobs`), so a prefill computed again after a preemption
scores nothing twice, and takes no prefix-cache hits past the entries it has
(`Request.max_cached_tokens`): a cached position has no hidden state to score.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from shared.sampling_params import PromptLogprob, TopLogprobs
from worker.sampler import top_logprobs

# Bytes of float32 logits scored at once: a prompt of any length holds at most this much of them (and a
# quarter as much again of comparisons) beyond what the KV pool was sized around.
SCORE_BYTES = 32 * 2**20
# A token the model rules out (a logit of -inf) is given this, as vLLM gives it: JSON has no -inf.
FLOOR = -9999.0
# Candidates past the k most likely that are ordered too, so ties at the k-th are settled in one batched sort
# (low-precision logits tie often); a tie that reaches past them takes the sampler's exact rule.
_TIE_ROOM = 8


@dataclass(slots=True)
class PromptScoring:
    """One sequence's prompt positions to score in a step, and (once the runner has) their entries."""
    first: int  # where they start among the sequence's new tokens of the step
    position: int  # the prompt position of the first
    targets: Sequence[int]  # the prompt token each position predicts (the one after it)
    num_top: int  # alternatives per entry
    entries: list[PromptLogprob] | None = None
    error: str = ""  # set instead of entries when the logits were not finite


def scoring_for(prompt_token_ids: Sequence[int], num_scored: int, start: int, num_new: int,
                num_top: int) -> PromptScoring | None:
    """The positions in [start, start + num_new) not yet scored (the first `num_scored` are) that have a
    prompt token after them; None when there are none."""
    first = max(start, num_scored)
    stop = min(start + num_new, len(prompt_token_ids) - 1)
    if first >= stop:
        return None
    return PromptScoring(first - start, first, prompt_token_ids[first + 1:stop + 1], num_top)


def score_prompt_positions(hidden: torch.Tensor, scored: list[tuple[int, PromptScoring]],
                           compute_logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int) -> None:
    """Fill each PromptScoring's entries from `hidden` [T, H], the step's hidden states; `scored` pairs
    each with the row of its sequence's first new token."""
    rows: list[int] = []
    targets: list[int] = []
    for row, scoring in scored:
        start = row + scoring.first
        rows.extend(range(start, start + len(scoring.targets)))
        targets.extend(scoring.targets)
    device = hidden.device
    logprobs, ranks, tops, broken = [], [], [], []
    num_top = max(s.num_top for _, s in scored)
    chunk = max(1, SCORE_BYTES // (4 * vocab_size))
    for begin in range(0, len(rows), chunk):
        index = torch.tensor(rows[begin:begin + chunk], device=device)
        target = torch.tensor(targets[begin:begin + chunk], device=device).unsqueeze(1)
        logits = compute_logits(hidden.index_select(0, index)).float()  # [R, V]
        # logit - logsumexp is log_softmax's value without writing out the [R, V] of them.
        log_total = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
        chosen = logits.gather(1, target)  # [R, 1]
        # An infinite total or a NaN: an activation overflowed, and no value of the row means anything.
        broken += (~torch.isfinite(log_total) | torch.isnan(chosen)).squeeze(1).tolist()
        logprobs += (chosen - log_total).clamp(min=FLOOR).squeeze(1).tolist()
        ranks += (torch.gt(logits, chosen).sum(dim=1, dtype=torch.int32) + 1).tolist()
        if num_top:
            tops += _top_logprobs(logits, log_total, num_top)
    at = 0
    for _, scoring in scored:
        n = len(scoring.targets)
        values = logprobs[at:at + n]
        if any(broken[at:at + n]):
            scoring.error = "the model's logits over this request's prompt are not finite (NaN or inf)"
        else:
            k = scoring.num_top
            scoring.entries = [(values[i], ranks[at + i], tops[at + i][:k] if k else ()) for i in range(n)]
        at += n


def _top_logprobs(logits: torch.Tensor, log_total: torch.Tensor, k: int) -> list[TopLogprobs]:
    """Each row's k most likely (token id, logprob), by descending logprob, ties by ascending id (the
    sampler's rule, worker/sampler.py top_logprobs), for all rows at once."""
    vocab = logits.shape[1]
    m = min(k + _TIE_ROOM, vocab)
    values, ids = torch.topk(logits, m, dim=-1)  # [R, m], descending, ties in any order
    # Ordered by logprob, not logit: two logits a float apart may have the same logprob, a tie.
    values = (values - log_total).clamp(min=FLOOR)
    by_id = ids.argsort(dim=1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.argsort(dim=1, descending=True, stable=True)  # equal values stay in id order
    values, ids = values.gather(1, by_value), ids.gather(1, by_value)
    # A row whose k-th value is also its m-th may tie with tokens past the m candidates: the exact rule there.
    spilled = (values[:, k - 1] == values[:, m - 1]).nonzero().flatten().tolist() if m < vocab else []
    values, ids = values[:, :k].tolist(), ids[:, :k].tolist()
    out = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]
    for r in spilled:
        out[r] = tuple((t, max(v, FLOOR)) for t, v in top_logprobs(logits[r] - log_total[r], k))
    return out
