"""Speculative decoding keeps the target distribution exactly: a draft token x is accepted with
probability p(x), a rejected position takes a token from p with x removed and renormalised, and every
position's token is what an unspeculated step would sample there with the same seed, whatever the draft.

Verification samples each draft position from the target (the Sampler's inverse-CDF draw of one uniform,
seeded by (seed, output index)) and keeps the draft up to the first position where the sample differs: for a
point-mass draft this is the standard speculative-sampling rule, accept with min(1, p(x) / 1) and
resample from norm(max(0, p - 1{x})) on rejection, and it draws the very token plain decoding would.
Checked here on many seeded and unseeded draws with chi-square bounds (fixed seeds, so deterministic)."""
from __future__ import annotations

import math

import pytest
import torch

from shared.sampling_params import SamplingParams
from worker.model_runner import SequenceStep, sampling_batch
from worker.sampler import Sampler
from worker.sampling_draws import make_generator, token_seed

V = 6
NUM_DRAWS = 20000
Z = 3.719  # one-sided normal quantile of 1e-4: a correct sampler fails a bound once in 10,000 runs


def chi2_bound(df: int, z: float = Z) -> float:
    """The chi-square quantile for the tail probability of z (Wilson-Hilferty): no scipy needed."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def verify(logits_rows: torch.Tensor, draft: list[int], params: SamplingParams, num: int, seeded: bool):
    """`num` independent verifications of `draft`, each over the same logits rows [1 + len(draft), V] (row j:
    the target at the position after draft[:j]), through the runner's sampling rows and the Sampler.
    Returns per verification the tokens taken: up to and including the first that differs from the draft."""
    steps = []
    for n in range(num):
        generator = make_generator(n) if seeded else None
        steps.append(SequenceStep(new_token_ids=[0, *draft], context_len=0, block_table=[], needs_sample=True,
                                  params=params, generator=generator, token_history=[0], output_token_ids=[],
                                  seed=token_seed(n, 0) if seeded else None, draft_token_ids=draft,
                                  draft_seeds=[token_seed(n, j) for j in range(1, len(draft) + 1)] if seeded else ()))
    batch = sampling_batch(steps)
    logits = logits_rows.repeat(num, 1)  # [num * (1 + len(draft)), V]
    tokens = Sampler(seed=7)(logits, batch).token_ids
    width = len(draft) + 1
    taken = []
    for n in range(num):
        row = tokens[n * width:(n + 1) * width]
        kept = []
        for j, token in enumerate(row):
            kept.append(token)
            if j == len(draft) or token != draft[j]:
                break
        taken.append(kept)
    return taken


def target(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature, dim=-1)


LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.5],
                       [-0.3, 1.2, 0.4, -0.8, 0.9, 0.1],
                       [0.5, 0.5, 0.5, -2.0, 1.0, 0.0]])


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_a_draft_token_is_accepted_with_its_target_probability_and_rejections_follow_the_residual(seeded):
    params = SamplingParams(temperature=0.9, seed=0 if seeded else None)
    p = target(LOGITS[0], 0.9)
    x = 3  # p(x) about 0.23
    taken = verify(LOGITS[:2], [x], params, NUM_DRAWS, seeded)
    first = torch.tensor([t[0] for t in taken])
    accepted = (first == x).float().mean().item()
    assert abs(accepted - p[x].item()) <= Z * math.sqrt(p[x].item() * (1 - p[x].item()) / NUM_DRAWS)
    rejected = first[first != x]
    residual = p.clone()
    residual[x] = 0
    residual /= residual.sum()
    assert chi2(torch.bincount(rejected, minlength=V).float(), residual) < chi2_bound(V - 2)
    # Together: the first token follows the target exactly, as if nothing had been drafted.
    assert chi2(torch.bincount(first, minlength=V).float(), p) < chi2_bound(V - 1)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_every_verified_position_follows_its_own_target(seeded):
    # Two draft tokens: after an accepted first, the second position is sampled from its own row, and
    # after an accepted second the bonus token from the third.
    params = SamplingParams(temperature=1.0, top_k=5, seed=0 if seeded else None)
    draft = [0, 1]
    taken = verify(LOGITS, draft, params, NUM_DRAWS, seeded)
    rows = [target(row, 1.0) for row in LOGITS]
    for row in rows:  # top_k=5 removes each row's least likely token
        row[row.argmin()] = 0
        row /= row.sum()
    for position in range(3):
        reached = [t[position] for t in taken if len(t) > position]
        assert len(reached) > 1000
        counts = torch.bincount(torch.tensor(reached), minlength=V).float()
        assert chi2(counts, rows[position]) < chi2_bound(V - 2), position


def plain_draws(params: SamplingParams, row: torch.Tensor, num: int, output_index: int) -> list[int]:
    """What an unspeculated step samples from `row` at `output_index`, for seeds 0..num-1."""
    steps = [SequenceStep(new_token_ids=[0], context_len=0, block_table=[], needs_sample=True, params=params,
                          generator=make_generator(n), token_history=[0], seed=token_seed(n, output_index))
             for n in range(num)]
    return Sampler(seed=7)(row.repeat(num, 1), sampling_batch(steps)).token_ids


def test_a_seeded_position_draws_the_same_token_whatever_was_drafted_before_it():
    # Row j is seeded by (seed, output index j), never by the draft: any k gives the tokens plain decoding gives.
    params = SamplingParams(temperature=1.5, seed=0)
    rows = LOGITS[0].repeat(3, 1)  # the same target at every position, so only the seeds tell them apart
    plain = [plain_draws(params, LOGITS[0], 300, j) for j in range(3)]
    for draft in ([0], [2], [0, 0], [4, 4], [0, 4]):
        taken = verify(rows[:len(draft) + 1], draft, params, 300, seeded=True)
        for n, tokens in enumerate(taken):
            assert tokens == [plain[j][n] for j in range(len(tokens))]
