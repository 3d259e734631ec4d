"""The OpenAI sampling features through the in-process engine on a tiny checkpoint: top_logprobs and penalties
against transformers' logits, min_tokens against a forced EOS, resume and crowd invariance, refusals."""
from __future__ import annotations

import pytest
import torch
import transformers

from worker.engine import Engine, RequestRejectedError, SamplingParams

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine.from_model_dir(llama_dir, num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def _hf_logits(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output) + 1, V]: row i is the distribution of output token i."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1:]


def _run(engine: Engine, request_id: str, prompt, params, output_token_ids=()) -> list:
    engine.add_request(request_id, prompt, params, output_token_ids=output_token_ids)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [d for d in engine.step() if d.request_id == request_id]
        engine.check_integrity()
    return deltas


def test_top_logprobs_match_transformers_log_softmax_for_the_greedy_sequence(engine, hf_model):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    out = engine.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs) == 8
    raw = torch.log_softmax(_hf_logits(hf_model, PROMPT, out.token_ids), dim=-1)
    for i, (token, logprob, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        values, ids = raw[i].topk(3)
        assert logprob == pytest.approx(raw[i, token].item(), abs=1e-5), i
        assert [t for t, _ in top] == ids.tolist(), i
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-5), i
        assert top[0][0] == token  # greedy: the chosen token is the most likely one
    # The step API's deltas carry the same values, one entry per new token.
    deltas = _run(engine, "steps", PROMPT, params)
    assert [d.new_top_logprobs for d in deltas if d.new_token_ids] == [[t] for t in out.top_logprobs]
    assert [lp for d in deltas for lp in d.new_logprobs] == out.logprobs
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, logprobs=True), use_tqdm=False)
    assert plain[0].top_logprobs == [] and len(plain[0].logprobs) == len(plain[0].token_ids)


def test_min_tokens_holds_off_an_eos_that_a_bias_forces(engine):
    eos = engine.model_config.eos_token_ids[0]
    forced = dict(max_tokens=12, temperature=0.0, logit_bias={eos: 100.0})
    assert engine.generate([PROMPT], SamplingParams(**forced), use_tqdm=False)[0].token_ids == [eos]
    for params in (SamplingParams(**forced, min_tokens=5),
                   SamplingParams(**{**forced, "temperature": 1.0}, seed=3, min_tokens=5)):
        out = engine.generate([PROMPT], params, use_tqdm=False)[0]
        assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5], out
        assert out.finish_reason == "stop"
    # A stop token id is held off the same way (here with EOS ignored).
    out = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, min_tokens=3,
                                                   stop_token_ids=[7], logit_bias={7: 100.0}), use_tqdm=False)[0]
    assert out.token_ids[-1] == 7 and 7 not in out.token_ids[:3] and len(out.token_ids) == 4


def _reference_greedy(hf_model, prompt, n, presence, frequency, bias, count_prompt=False) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = _hf_logits(hf_model, prompt, out)[-1]
        for token, b in bias.items():
            logits[token] += b
        counted = prompt + out if count_prompt else out
        for token in set(counted):
            logits[token] -= presence + frequency * counted.count(token)
        out.append(int(logits.argmax()))
    return out


def test_penalties_and_bias_follow_a_reference_loop_over_transformers_logits(engine, hf_model):
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    # A prompt full of what the model would say next: penalising prompt tokens would change the output.
    prompt = PROMPT + [plain[0]] * 3 + [plain[1]]
    expected = _reference_greedy(hf_model, prompt, 10, 1.0, 0.5, {9: 0.5})
    assert expected != _reference_greedy(hf_model, prompt, 10, 1.0, 0.5, {9: 0.5}, count_prompt=True)
    assert expected != _reference_greedy(hf_model, prompt, 10, 0.0, 0.0, {})
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.0,
                            frequency_penalty=0.5, logit_bias={9: 0.5})
    assert engine.generate([prompt], params, use_tqdm=False)[0].token_ids == expected


FEATURES = [
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
                   logit_bias={9: 0.5, 11: -2.0}, logprobs=True, top_logprobs=2),
    SamplingParams(max_tokens=16, temperature=1.0, top_k=30, seed=11, presence_penalty=0.8, frequency_penalty=0.4,
                   logit_bias={2: 2.0}, min_tokens=8, logprobs=True, top_logprobs=4),
]


@pytest.mark.parametrize("params", FEATURES, ids=["greedy", "seeded"])
def test_a_resumed_request_counts_its_streamed_tokens_and_continues_identically(engine, params):
    full = engine.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(full.token_ids) >= 9
    for cut in (1, 4, len(full.token_ids) - 1):
        deltas = _run(engine, f"resume-{cut}", PROMPT, params, output_token_ids=full.token_ids[:cut])
        assert deltas[-1].final.token_ids == full.token_ids, cut
        assert [lp for d in deltas for lp in d.new_logprobs] == pytest.approx(full.logprobs[cut:], abs=1e-6)
        tops = [t for d in deltas for t in d.new_top_logprobs]
        assert [[i for i, _ in t] for t in tops] == [[i for i, _ in t] for t in full.top_logprobs[cut:]], cut


def test_requests_with_the_features_give_the_same_tokens_alone_and_in_a_crowd(llama_dir, engine):
    alone = [engine.generate([PROMPT], p, use_tqdm=False)[0] for p in FEATURES]
    crowd = Engine.from_model_dir(llama_dir, num_kv_blocks=64, seed=5)
    noise = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True),
             SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)]
    outs = crowd.generate([[1, 2], PROMPT, [3, 4, 5, 6], PROMPT, [11] * 9],
                          [noise[0], FEATURES[0], noise[1], FEATURES[1], noise[0]], use_tqdm=False)
    for mine, reference in zip((outs[1], outs[3]), alone):
        assert mine.token_ids == reference.token_ids
        assert mine.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in mine.top_logprobs] == [[t for t, _ in top]
                                                                     for top in reference.top_logprobs]


def test_a_logit_bias_outside_the_vocabulary_is_refused_when_added(engine):
    with pytest.raises(RequestRejectedError, match=r"logit_bias token ids out of range \[0, 256\): \[256\]"):
        engine.add_request("bias", PROMPT, SamplingParams(logit_bias={3: 1.0, 256: 1.0}))
    assert not engine.has_unfinished_requests()
