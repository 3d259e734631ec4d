"""Speculative decoding by prompt lookup in the engine, on real tiny checkpoints: greedy and seeded outputs
are token-identical with and without it (alone, batched, with penalties, logprobs, stop tokens, max_tokens,
preemption and resumption), the copying checkpoint verifies most drafts, and the counters add up."""
from __future__ import annotations

import random

import pytest

from bench.copy_checkpoint import make_copy_checkpoint
from shared.engine_config import ConfigError
from shared.sampling_params import SamplingParams
from worker.engine import Engine

PERIOD = 12


@pytest.fixture(scope="module")
def copy_dir(tmp_path_factory):
    """A llama that repeats its prompt's last PERIOD tokens (bench/copy_checkpoint.py)."""
    return make_copy_checkpoint(tmp_path_factory.mktemp("copy") / "llama", period=PERIOD)


def engine(path, **overrides) -> Engine:
    return Engine.from_model_dir(path, **{"num_kv_blocks": 96, "max_num_seqs": 8, "block_size": 8, **overrides})


def prompts(seed=0, lengths=(20, 33, 13, 41)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def generate(e: Engine, token_ids, params):
    outs = e.generate(token_ids, params, use_tqdm=False)
    e.check_integrity()
    assert e.block_manager.num_used_blocks == 0
    return outs


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7], [9] * 20, list(range(10, 40)) * 2, [3, 4]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_outputs_are_identical_on_random_checkpoints(checkpoints, arch):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = generate(engine(checkpoints[arch]), REPETITIVE, params)
    for k in (1, 4, 8):
        spec = generate(engine(checkpoints[arch], speculative_ngram_k=k), REPETITIVE, params)
        same(plain, spec)


def test_the_copying_checkpoint_takes_most_tokens_from_drafts(copy_dir):
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    # No step-token cap: four requests at once may all draft their full k.
    plain_engine = engine(copy_dir)
    spec_engine = engine(copy_dir, speculative_ngram_k=8, speculative_ngram_max_step_tokens=0)
    plain, spec = generate(plain_engine, prompts(), params), generate(spec_engine, prompts(), params)
    same(plain, spec)
    for p, o in zip(prompts(), spec):
        assert o.token_ids == (p[-PERIOD:] * 10)[:100]  # it copies, as built
        assert o.num_accepted_draft_tokens >= 0.8 * o.num_draft_tokens > 0
    stats = spec_engine.stats()
    assert stats.num_spec_accepted_tokens == sum(o.num_accepted_draft_tokens for o in spec)
    assert stats.num_spec_draft_tokens == sum(o.num_draft_tokens for o in spec)
    assert stats.num_steps < plain_engine.stats().num_steps / 4


@pytest.mark.parametrize("extra", [
    {},
    dict(top_k=20, top_p=0.9),
    dict(min_p=0.05, repetition_penalty=1.1),
    dict(presence_penalty=0.4, frequency_penalty=0.3, min_tokens=60),
    dict(logprobs=True, top_logprobs=3, logit_bias={7: 2.0}),
], ids=["plain", "top-k-p", "min-p-repetition", "penalties-min-tokens", "logprobs-bias"])
def test_seeded_sampling_is_identical_for_every_k(copy_dir, extra):
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=seed, **extra) for seed in range(4)]
    plain = generate(engine(copy_dir), prompts(1), params)
    drafted = 0
    for k in (1, 3, 8):
        spec = generate(engine(copy_dir, speculative_ngram_k=k), prompts(1), params)
        same(plain, spec)
        if extra.get("logprobs"):
            for a, b in zip(plain, spec):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
                assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
        drafted += sum(o.num_accepted_draft_tokens for o in spec)
    assert drafted > 0  # the speculative path really ran, and some drafts held


def test_stop_tokens_and_max_tokens_end_output_exactly_where_plain_decoding_does(copy_dir):
    ps = prompts(2)
    # A stop token inside the repeated span, an EOS one, and lengths that end mid-draft.
    params = [SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=(ps[0][-5],)),
              SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=False),
              SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]
    ps[1] = ps[1][:-4] + [2] + ps[1][-3:]  # EOS (id 2) will be copied 8 tokens in
    plain = generate(engine(copy_dir), ps, params)
    spec = generate(engine(copy_dir, speculative_ngram_k=8), ps, params)
    same(plain, spec)
    assert [o.finish_reason for o in spec] == ["stop", "stop", "length", "length"]
    assert [len(o.token_ids) for o in spec] == [PERIOD - 4, PERIOD - 3, 17, 1]


def test_preemption_mid_speculation_changes_nothing(copy_dir):
    # 14 blocks of 8 for four requests of up to 41 + 60 tokens: they preempt one another all along.
    params = [SamplingParams(max_tokens=60, temperature=t, seed=3, ignore_eos=True) for t in (0.0, 1.0, 0.0, 1.0)]
    plain = generate(engine(copy_dir, num_kv_blocks=14), prompts(3), params)
    e = engine(copy_dir, num_kv_blocks=14, speculative_ngram_k=6)
    for i, (p, sp) in enumerate(zip(prompts(3), params)):
        e.add_request(f"r{i}", p, sp)
    finals = {}
    while e.has_unfinished_requests():
        for delta in e.step():
            if delta.final is not None:
                finals[delta.request_id] = delta.final
        e.check_integrity()
    assert e.stats().num_preemptions > 0 and e.stats().num_spec_accepted_tokens > 0
    assert [finals[f"r{i}"].token_ids for i in range(4)] == [o.token_ids for o in plain]


def test_a_resumed_request_continues_identically(copy_dir):
    p = prompts(4)[0]
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=9, ignore_eos=True)
    full = generate(engine(copy_dir), [p], params)[0].token_ids
    e = engine(copy_dir, speculative_ngram_k=5)
    e.add_request("r", p, params, output_token_ids=full[:23])  # another worker streamed 23 tokens
    tokens = []
    while e.has_unfinished_requests():
        for delta in e.step():
            tokens.extend(delta.new_token_ids)
    assert full[:23] + tokens == full


def test_deltas_carry_every_token_once_with_its_logprob(copy_dir):
    e = engine(copy_dir, speculative_ngram_k=8)
    e.add_request("r", prompts(5)[0], SamplingParams(max_tokens=40, temperature=0.0, logprobs=True, ignore_eos=True))
    tokens, logprobs, drafted, accepted, final = [], [], 0, 0, None
    while e.has_unfinished_requests():
        for delta in e.step():
            assert len(delta.new_logprobs) == len(delta.new_token_ids)
            tokens += delta.new_token_ids
            logprobs += delta.new_logprobs
            drafted += delta.num_draft_tokens
            accepted += delta.num_accepted_draft_tokens
            final = delta.final or final
    assert tokens == final.token_ids and logprobs == final.logprobs
    assert (drafted, accepted) == (final.num_draft_tokens, final.num_accepted_draft_tokens)
    assert max(len(t) for t in [tokens]) == 40 and accepted > 20


def test_the_request_chooses_within_the_servers_cap(copy_dir):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    off_by_default = engine(copy_dir)
    assert generate(off_by_default, prompts()[:1], params)[0].num_draft_tokens == 0
    opted_in = generate(off_by_default, prompts()[:1], SamplingParams(max_tokens=40, temperature=0.0,
                                                                      ignore_eos=True, speculative_ngram_k=4))
    assert opted_in[0].num_draft_tokens > 0
    on_by_default = engine(copy_dir, speculative_ngram_k=4)
    opted_out = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative_ngram_k=0)
    assert generate(on_by_default, prompts()[:1], opted_out)[0].num_draft_tokens == 0
    capped = engine(copy_dir, speculative_ngram_max_k=2)
    request = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative_ngram_k=30)
    capped.add_request("r", prompts()[0], request)
    assert capped.scheduler.requests["r"].speculation.max_k == 2
    none_allowed = engine(copy_dir, speculative_ngram_max_k=0)
    none_allowed.add_request("r", prompts()[0], request)
    assert none_allowed.scheduler.requests["r"].speculation is None


def test_constrained_requests_do_not_speculate(copy_dir):
    e = engine(copy_dir, speculative_ngram_k=4)
    assert e._speculation(SamplingParams(grammar='{"grammars": []}')) is None
    assert e._speculation(SamplingParams()) is not None


def test_the_settings_are_checked():
    for bad in (dict(speculative_ngram_k=-1), dict(speculative_ngram_k=9), dict(speculative_ngram_max_k=33),
                dict(speculative_ngram_min_n=0), dict(speculative_ngram_min_n=3, speculative_ngram_max_n=2),
                dict(speculative_ngram_max_n=17)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            Engine.from_model_dir("unused", **bad)
    with pytest.raises(ValueError, match="speculative_ngram_k"):
        SamplingParams(speculative_ngram_k=33)


def test_a_constrained_request_decodes_as_before_beside_speculating_ones(served_checkpoint, tokenizer):
    from gateway.constraints import ConstraintCompiler
    from protos import inference_pb2 as pb
    grammar = ConstraintCompiler(served_checkpoint, tokenizer.vocab_size, tokenizer.special.eos_ids).grammar(
        pb.StructuredOutput(regex="(ab|cd){3,12}"))
    constrained = SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batch = [[5, 6, 7, 5, 6, 7], [9, 10, 9, 10, 9, 10]]
    plain = generate(engine(served_checkpoint), batch, [constrained, free])
    spec = generate(engine(served_checkpoint, speculative_ngram_k=6), batch, [constrained, free])
    same(plain, spec)
    assert spec[0].num_draft_tokens == 0 and spec[1].num_draft_tokens > 0
