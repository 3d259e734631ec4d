"""Prefix siblings: a queued request waits, within a step, for another request of the same step that is
still computing the full blocks they share, then takes them from the prefix cache (worker/scheduler.py)."""
from __future__ import annotations

import pytest

import worker.scheduler as scheduler_module
from scheduler_steps import play_step
from shared.sampling_params import SamplingParams
from worker.block_manager import BlockManager
from worker.request import Request, RequestStatus
from worker.scheduler import Scheduler, SchedulerConfig

BLOCK = 4
PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks within all but the last token


def make(num_blocks=64, enable_prefix_caching=True, **config) -> Scheduler:
    config.setdefault("admission_watermark", 0.0)
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, BLOCK, enable_prefix_caching))


def req(request_id, prompt, max_tokens=4, priority=0) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), priority=priority)


def step(s: Scheduler) -> dict[str, int]:
    out = play_step(s, token_id=7)
    for r in s.waiting:
        assert not s.blocks.has_request(r.request_id)
    return out


def drain(s: Scheduler, max_steps=200) -> list[dict[str, int]]:
    steps = []
    while s.num_unfinished:
        steps.append(step(s))
        assert len(steps) < max_steps, "the scheduler stopped making progress"
    return steps


def test_siblings_wait_one_step_and_hit_the_leaders_blocks_and_the_budget_goes_on():
    s = make(max_num_batched_tokens=64)
    for name in ("a", "b", "c"):
        s.add(req(name, PROMPT))
    s.add(req("other", range(500, 506)))
    # b and c wait for a's two blocks; their budget goes to the next request in line.
    assert step(s) == {"a": 10, "other": 6}
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert step(s) == {"a": 1, "other": 1, "b": 2, "c": 2}  # 8 tokens each from the cache
    assert [s.requests[n].num_cached_tokens for n in "abc"] == [0, 8, 8]
    drain(s)


def test_a_follower_waits_only_for_the_shared_blocks_of_a_chunked_leader():
    s = make(max_num_batched_tokens=64, max_prefill_chunk_tokens=4)
    leader = list(range(100, 120))  # 20 tokens, 5 chunks
    s.add(req("a", leader))
    s.add(req("b", leader[:8] + list(range(900, 906))))  # shares two blocks, then differs
    assert step(s) == {"a": 4}  # a computes block 0
    assert step(s) == {"a": 4}  # block 1: still shared
    assert step(s) == {"a": 4, "b": 4}  # both shared blocks cached: b starts while a is mid-prefill
    assert s.requests["b"].num_cached_tokens == 8
    assert s.requests["a"].num_computed_tokens < len(leader)
    drain(s)


def test_whole_shared_prompt_of_a_chunked_leader():
    s = make(max_num_batched_tokens=64, max_prefill_chunk_tokens=4)
    prompt = list(range(100, 114))  # 14 tokens: 3 blocks the follower can take from the cache
    s.add(req("a", prompt))
    s.add(req("b", prompt))
    assert [step(s) for _ in range(4)] == [{"a": 4}, {"a": 4}, {"a": 4}, {"a": 2, "b": 2}]
    assert s.requests["b"].num_cached_tokens == 12


def test_siblings_behind_a_cached_system_prompt_share_what_follows_it():
    s = make(max_num_batched_tokens=64)
    system = list(range(100, 108))  # 2 blocks
    s.add(req("warm", system + [1], max_tokens=1))
    drain(s)
    user = system + list(range(300, 309))  # 2 more full blocks within all but the last token
    s.add(req("a", user))
    s.add(req("b", user))
    assert step(s) == {"a": 9}  # a takes the system prompt from the cache; b waits for a's 2 new blocks
    assert s.requests["a"].num_cached_tokens == 8
    assert step(s) == {"a": 1, "b": 1}
    assert s.requests["b"].num_cached_tokens == 16


def test_a_request_whose_prefix_is_cached_never_waits():
    s = make(max_num_batched_tokens=64)
    s.add(req("warm", PROMPT, max_tokens=1))
    drain(s)
    s.add(req("a", PROMPT))
    s.add(req("b", PROMPT))
    assert step(s) == {"a": 2, "b": 2}
    assert s.requests["a"].num_cached_tokens == s.requests["b"].num_cached_tokens == 8


@pytest.mark.parametrize("prompts", [
    ([1, 2, 3, 10, 11], [1, 2, 3, 20, 21]),  # 3 shared tokens: less than a block
    ([1, 2, 3, 4], [1, 2, 3, 4]),  # a whole block, but the follower must compute it anyway (its last token)
    ([1, 2, 3, 4, 5], [9, 2, 3, 4, 5]),  # different first block
], ids=["partial-block", "last-token-block", "different"])
def test_no_wait_without_a_full_block_to_share(prompts):
    s = make(max_num_batched_tokens=64)
    s.add(req("a", prompts[0]))
    s.add(req("b", prompts[1]))
    assert set(step(s)) == {"a", "b"}


def test_no_wait_without_prefix_caching():
    s = make(max_num_batched_tokens=64, enable_prefix_caching=False)
    s.add(req("a", PROMPT))
    s.add(req("b", PROMPT))
    assert step(s) == {"a": 10, "b": 10}


def test_a_deferred_request_keeps_its_place():
    s = make(max_num_batched_tokens=64, max_num_seqs=2)
    s.add(req("a", PROMPT, max_tokens=2))
    s.add(req("b", PROMPT))
    s.add(req("x", range(500, 506)))
    s.add(req("y", range(600, 606)))
    assert step(s) == {"a": 10, "x": 6}  # b waits; x takes the second seat
    assert [r.request_id for r in s.waiting] == ["b", "y"]
    assert step(s) == {"a": 1, "x": 1}  # a finishes here (2 tokens), freeing a seat
    assert step(s) == {"x": 1, "b": 2}  # b, ahead of y, gets it and its cache hits
    assert s.requests["b"].num_cached_tokens == 8


def test_an_aborted_leader_lets_its_followers_go():
    s = make(max_num_batched_tokens=64, max_prefill_chunk_tokens=4)
    for name in ("a", "b", "c"):
        s.add(req(name, PROMPT))
    assert step(s) == {"a": 4}
    s.abort("a")
    # b leads now (it finds a's first block cached) and c waits for b's second block.
    assert step(s) == {"b": 4}
    assert s.requests["b"].num_cached_tokens == 4
    assert step(s) == {"b": 2, "c": 2}
    assert s.requests["c"].num_cached_tokens == 8
    drain(s)


def test_a_preempted_leader_never_stalls_its_followers():
    s = make(max_num_batched_tokens=64, max_prefill_chunk_tokens=4)
    s.add(req("hi", range(500, 503), max_tokens=20, priority=0))
    s.add(req("a", PROMPT, priority=5))
    s.add(req("b", PROMPT, priority=5))
    assert step(s) == {"hi": 3, "a": 4}
    assert s.preempt_lowest().request_id == "a"
    assert s.requests["a"].status == RequestStatus.PREEMPTED
    # a resumes first (preempted requests lead the queue) from its cached block and leads again.
    assert step(s) == {"hi": 1, "a": 4}
    assert step(s) == {"hi": 1, "a": 2, "b": 2}
    assert s.requests["b"].num_cached_tokens == 8
    drain(s)


def test_a_finished_leader_lets_its_followers_go():
    s = make(max_num_batched_tokens=64, max_prefill_chunk_tokens=4)
    s.add(req("a", PROMPT))
    s.add(req("b", PROMPT))
    assert step(s) == {"a": 4}
    s.finish(s.requests["a"], RequestStatus.FINISHED_ERROR, "failed")
    assert step(s) == {"b": 4}
    assert s.requests["b"].num_cached_tokens == 4


def test_block_hashes_are_computed_once_per_request(monkeypatch):
    calls = []
    real = scheduler_module.hash_block
    monkeypatch.setattr(scheduler_module, "hash_block", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    s = make(max_num_batched_tokens=64, max_prefill_chunk_tokens=4)
    prompt = list(range(100, 140))  # 10 blocks, 10 chunks
    s.add(req("a", prompt))
    s.add(req("b", prompt))
    steps = drain(s)
    assert "b" not in steps[8] and steps[9]["b"] == 4  # b waited for all 9 shared blocks
    assert s.requests == {} and s._block_hashes == {}
    # At most each of the two requests' 10 blocks, however many steps b waited.
    assert len(calls) <= 20


def test_the_engine_computes_a_shared_prompt_once_and_outputs_do_not_change(llama_dir):
    from worker.engine import Engine

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i) % 250 + 3 for i in range(45)]  # 2 full blocks of 16 within all but the last token
    alone = Engine.from_model_dir(llama_dir, num_kv_blocks=64).generate([prompt], params, use_tqdm=False)[0]
    for options in ({}, {"max_prefill_chunk_tokens": 16}):
        engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, **options)
        for i in range(4):
            engine.add_request(f"n{i}", prompt, params)
        final = {}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.final is not None:
                    final[delta.request_id] = delta.final
            engine.check_integrity()
        outs = [final[f"n{i}"] for i in range(4)]
        assert all(o.token_ids == alone.token_ids for o in outs), options
        cached = sorted(o.num_cached_tokens for o in outs)
        assert cached[0] == 0 and all(c >= 32 for c in cached[1:]), (options, cached)
