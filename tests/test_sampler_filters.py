"""worker.sampler's top-k, top-p and min-p filters: exact kept sets at the boundaries, their order, and
different settings per row against a plain-Python reference."""

from __future__ import annotations

import pytest
import torch

from sampler_harness import log_probs, make_batch, reference_keep
from shared.sampling_params import SamplingParams
from worker.sampler import Sampler, apply_top_k_top_p_min_p

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def kept(row: torch.Tensor) -> set[int]:
    """Token ids a filter left finite."""
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def filter_rows(logits, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """Run apply_top_k_top_p_min_p on a copy with per-row lists (None = filter unused by every row)."""
    out = torch.tensor(logits, dtype=torch.float32) if not isinstance(logits, torch.Tensor) else logits.clone()
    return apply_top_k_top_p_min_p(
        out,
        None if top_k is None else torch.tensor(top_k, dtype=torch.long),
        None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
    )


# ------------------------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("with_top_p_path", [False, True])
def test_top_k_keeps_exactly_the_k_largest(with_top_p_path):
    gen = torch.Generator().manual_seed(3)
    vocab_size = 40
    logits = torch.stack([torch.randperm(vocab_size, generator=gen).float() for _ in range(5)])  # distinct values
    top_k = [1, 3, 0, 40, 100]
    # top_p all 1 forces the sort-based code path, which must agree with the partial-topk one.
    out = filter_rows(logits, top_k=top_k, top_p=[1.0] * 5 if with_top_p_path else None)
    for row, k in enumerate(top_k):
        expected = set(range(vocab_size)) if k == 0 else set(logits[row].topk(min(k, vocab_size)).indices.tolist())
        assert kept(out[row]) == expected, (row, k)
        finite = torch.isfinite(out[row])
        assert torch.equal(out[row][finite], logits[row][finite])  # survivors unchanged


@pytest.mark.parametrize("with_top_p_path", [False, True])
def test_top_k_keeps_all_ties_at_the_boundary(with_top_p_path):
    logits = [[1.0, 3.0, 3.0, 2.0], [1.0, 3.0, 3.0, 2.0], [1.0, 3.0, 2.0, 2.0]]
    out = filter_rows(logits, top_k=[1, 2, 2], top_p=[1.0] * 3 if with_top_p_path else None)
    assert kept(out[0]) == {1, 2}
    assert kept(out[1]) == {1, 2}
    assert kept(out[2]) == {1, 2, 3}


# ------------------------------------------------------------------------------------------- top-p


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    # Dyadic probabilities are exact in float32, so cumulative sums hit 0.5 / 0.75 / 0.875 exactly.
    row = log_probs(0.125, 0.5, 0.125, 0.25)  # descending order: token 1, 3, then 0 and 2 (tie: lower id first)
    assert torch.softmax(torch.tensor(row), -1).tolist() == [0.125, 0.5, 0.125, 0.25]
    cases = [
        (0.1, {1}),
        (0.5, {1}),  # boundary: token 1 alone reaches 0.5 exactly
        (0.5000001, {1, 3}),
        (0.6, {1, 3}),
        (0.75, {1, 3}),  # boundary
        (0.8, {1, 3, 0}),
        (0.875, {1, 3, 0}),  # boundary, and the 0.125 tie goes to the lower id
        (0.9, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ]
    out = filter_rows([row] * len(cases), top_p=[p for p, _ in cases])
    for (top_p, expected), out_row in zip(cases, out):
        assert kept(out_row) == expected, top_p


def test_top_p_one_keeps_all_even_with_negligible_tails():
    # The float32 cumsum saturates at 1.0 after the first token; top_p = 1 must still keep everything.
    row = [0.0] + [-100.0] * 7
    out = filter_rows([row, row], top_p=[1.0, 0.999])
    assert kept(out[0]) == set(range(8))
    assert kept(out[1]) == {0}


def test_top_p_uses_probabilities_after_top_k():
    row = log_probs(0.4, 0.3, 0.2, 0.1)
    # Alone, top_p = 0.5 needs tokens 0 and 1 (0.4 < 0.5). After top-k = 2 renormalises to 4/7, 3/7, token 0 suffices.
    assert kept(filter_rows([row], top_p=[0.5])[0]) == {0, 1}
    assert kept(filter_rows([row], top_k=[2], top_p=[0.5])[0]) == {0}


# ------------------------------------------------------------------------------------------- min-p


def test_min_p_keeps_tokens_with_p_at_least_min_p_times_p_max():
    row = log_probs(0.125, 0.5, 0.25, 0.125)
    cases = [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2, 3}), (0.2500001, {1, 2}), (0.5, {1, 2}), (0.6, {1}), (1.0, {1})]
    out = filter_rows([row] * len(cases), min_p=[m for m, _ in cases])
    for (min_p, expected), out_row in zip(cases, out):
        assert kept(out_row) == expected, min_p

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 200, generator=gen) * 3
    min_ps = [0.0, 0.01, 0.05, 0.2, 0.5, 0.9]
    out = filter_rows(logits, min_p=min_ps)
    probs = torch.softmax(logits.double(), -1)
    for row, m in enumerate(min_ps):
        expected = set(torch.nonzero(probs[row] >= m * probs[row].max()).flatten().tolist())
        assert kept(out[row]) == expected, m


def test_min_p_uses_probabilities_after_top_k_and_top_p():
    row = log_probs(0.5, 0.25, 0.125, 0.125)
    # After top-p = 0.75 only tokens 0 and 1 remain; their ratio (and so min-p's verdict on them) is unchanged.
    assert kept(filter_rows([row], top_p=[0.75], min_p=[0.5])[0]) == {0, 1}
    assert kept(filter_rows([row], top_p=[0.75], min_p=[0.51])[0]) == {0}


# --------------------------------------------------------------------------------------------- combined


def test_combined_filters_with_different_per_row_settings():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 64, generator=gen) * 2
    settings = [  # (top_k, top_p, min_p)
        (0, 1.0, 0.0),  # untouched
        (5, 1.0, 0.0),
        (0, 0.7, 0.0),
        (0, 1.0, 0.2),
        (10, 0.8, 0.0),
        (20, 0.9, 0.05),
        (3, 0.3, 0.9),
    ]
    out = filter_rows(
        logits, top_k=[s[0] for s in settings], top_p=[s[1] for s in settings], min_p=[s[2] for s in settings]
    )
    for row, (k, p, m) in enumerate(settings):
        assert kept(out[row]) == reference_keep(logits[row].double().tolist(), k, p, m), (row, k, p, m)
        finite = torch.isfinite(out[row])
        assert torch.equal(out[row][finite], logits[row][finite])
        # Batch-invariance of the filter: the row filtered on its own gives the identical result.
        alone = filter_rows(logits[row : row + 1], top_k=[k], top_p=[p], min_p=[m])
        assert torch.equal(alone[0], out[row])
    assert torch.equal(out[0], logits[0])


def test_filter_rejects_bad_shapes():
    with pytest.raises(ValueError, match="2-D"):
        apply_top_k_top_p_min_p(torch.zeros(4), None, None, None)
    with pytest.raises(ValueError, match="top_p must have shape"):
        apply_top_k_top_p_min_p(torch.zeros(2, 4), None, torch.ones(3), None)
    with pytest.raises(ValueError, match="integer"):
        apply_top_k_top_p_min_p(torch.zeros(2, 4), torch.ones(2), None, None)


def test_temperature_is_applied_before_top_p():
    # p = [0.4, 0.3, 0.2, 0.1]; at T = 0.5 it becomes [0.533, 0.3, 0.133, 0.033], so top_p = 0.5 keeps token 0 only
    # (applied before temperature it would keep tokens 0 and 1).
    logits = torch.tensor([log_probs(0.4, 0.3, 0.2, 0.1)] * 300)
    out = Sampler(seed=0)(logits, make_batch([SamplingParams(temperature=0.5, top_p=0.5)] * 300))
    assert set(out.token_ids) == {0}
