"""The prompt's log-probabilities (vLLM's prompt_logprobs) through the in-process engine: equal to
transformers' log_softmax on the same checkpoint, however the prefill is chunked, cached or preempted,
reported once, and leaving the sampled tokens unchanged."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from worker import prompt_logprobs
from worker.prompt_logprobs import PromptScoring
from worker.sampler import top_logprobs
from worker.engine import Engine, SamplingParams

PROMPT = random.Random(7).choices(range(3, 256), k=45)
TOP = 3


@pytest.fixture(scope="module")
def hf_log_softmax(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)  # [P, V]


def _params(**overrides) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 3, "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": TOP,
                             **overrides})


def _run(engine: Engine, request_id: str, prompt, params, on_step=None) -> list:
    engine.add_request(request_id, prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        if on_step is not None:
            on_step(engine)
        deltas += [d for d in engine.step() if d.request_id == request_id]
        engine.check_integrity()
    return deltas


def _assert_matches_transformers(entries, raw: torch.Tensor, num_top: int = TOP) -> None:
    assert len(entries) == len(PROMPT) - 1
    for p, (logprob, rank, top) in enumerate(entries):
        row, token = raw[p], PROMPT[p + 1]
        assert logprob == pytest.approx(row[token].item(), abs=1e-5), p
        assert rank == 1 + int((row > row[token]).sum()), p
        values, ids = row.topk(num_top)
        assert [t for t, _ in top] == ids.tolist(), p
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-5), p


@pytest.mark.parametrize("chunk", [0, 7, 1], ids=["whole", "chunks-of-7", "chunks-of-1"])
def test_prompt_logprobs_equal_transformers_log_softmax_however_the_prefill_is_chunked(llama_dir, hf_log_softmax,
                                                                                     chunk):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, block_size=8, max_prefill_chunk_tokens=chunk)
    deltas = _run(engine, "r", PROMPT, _params())
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    # Reported once, with the first token, and kept whole in the final output.
    assert len(carrying) == 1 and carrying[0] is next(d for d in deltas if d.new_token_ids)
    _assert_matches_transformers(carrying[0].prompt_logprobs, hf_log_softmax)
    assert deltas[-1].final.prompt_logprobs == carrying[0].prompt_logprobs
    # Scoring the prompt changes nothing sampled.
    plain = engine.generate([PROMPT], _params(prompt_logprobs=None), use_tqdm=False)[0]
    assert plain.token_ids == deltas[-1].final.token_ids and plain.prompt_logprobs is None


def test_no_alternatives_a_one_token_prompt_and_logits_scored_a_few_rows_at_a_time(llama_dir, hf_log_softmax,
                                                                                   monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "SCORE_BYTES", 4 * 256 * 5)  # 5 rows of this vocabulary at a time
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64)
    out = engine.generate([PROMPT, PROMPT[:1]], _params(prompt_logprobs=0), use_tqdm=False)
    _assert_matches_transformers(out[0].prompt_logprobs, hf_log_softmax, num_top=0)
    assert out[1].prompt_logprobs == [] and len(out[1].token_ids) == 3


def test_a_cached_prefix_is_computed_again_for_its_log_probabilities(llama_dir, hf_log_softmax):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, block_size=8)
    warm = engine.generate([PROMPT], _params(prompt_logprobs=None), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    scored = engine.generate([PROMPT], _params(), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # every position is computed, so none comes from the cache
    _assert_matches_transformers(scored.prompt_logprobs, hf_log_softmax)
    # A request that does not score its prompt still takes the cached prefix.
    again = engine.generate([PROMPT], _params(prompt_logprobs=None), use_tqdm=False)[0]
    assert again.num_cached_tokens == 40 and again.token_ids == warm.token_ids


def test_a_prefill_preempted_midway_scores_each_position_once(llama_dir, hf_log_softmax):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, block_size=8, max_prefill_chunk_tokens=8)
    engine.add_request("other", [9, 10, 11], _params(prompt_logprobs=None, max_tokens=40))
    preempted = []

    def preempt_after_two_chunks(engine: Engine) -> None:
        request = next((r for r in engine.scheduler.running if r.request_id == "r"), None)
        if request is not None and request.num_computed_tokens == 16 and not preempted:
            preempted.append(engine.preempt_lowest())

    deltas = _run(engine, "r", PROMPT, _params(), on_step=preempt_after_two_chunks)
    assert [r.request_id for r in preempted] == ["r"]
    final = deltas[-1].final
    assert final.num_preemptions == 1
    _assert_matches_transformers(final.prompt_logprobs, hf_log_softmax)


def test_tied_alternatives_are_ordered_by_token_id_as_the_samplers_are():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [3.0, 2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    # bf16-rounded logits tie often, inside the candidates and (coarser still) past them.
    coarse = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    for rows, k in ((logits, 2), (coarse.bfloat16().float(), 5), ((coarse * 2).round() / 2, 3), (coarse, 20)):
        got = prompt_logprobs._top_logprobs(rows, torch.logsumexp(rows, dim=-1, keepdim=True), k)
        expected = [top_logprobs(torch.log_softmax(row, dim=-1), k) for row in rows]
        assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in expected]
        assert [v for row in got for _, v in row] == pytest.approx([v for row in expected for _, v in row], abs=1e-5)
    assert [[t for t, _ in row] for row in prompt_logprobs._top_logprobs(
        logits, torch.logsumexp(logits, dim=-1, keepdim=True), 2)] == [[1, 2], [0, 1], [0, 1]]


def test_logits_that_are_not_finite_fail_the_request_and_a_ruled_out_token_is_floored():
    """JSON has no NaN or infinity: a row whose total overflowed fails its request; a token with a logit
    of -inf (ruled out) gets vLLM's -9999."""
    hidden = torch.tensor([[1.0, float("inf"), 0.0], [0.0, 1.0, 2.0], [0.0, float("-inf"), 1.0]])
    overflowed = PromptScoring(0, 0, [2], 2)
    fine = PromptScoring(0, 0, [0, 1], 2)
    prompt_logprobs.score_prompt_positions(hidden, [(0, overflowed), (1, fine)], lambda h: h, vocab_size=3)
    assert overflowed.entries is None and "not finite" in overflowed.error
    assert fine.entries is not None and not fine.error
    [(value, rank, top)] = fine.entries[1:]
    assert value == -9999.0 and rank == 3 and top[1][0] == 0
