"""The scheduler in pure Python: budgets, chunking, preemption order, refusal, abort."""
from __future__ import annotations

import itertools

import pytest

from scheduler_steps import play_step
from shared.sampling_params import SamplingParams
from worker.block_manager import BlockManager
from worker.request import Request, RequestStatus
from worker.scheduler import RequestRejectedError, Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, **config) -> Scheduler:
    config.setdefault("admission_watermark", 0.0)
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


_prompt_starts = itertools.count(1000, 1000)


def req(request_id, prompt_len, max_tokens=8, priority=0, prompt=None) -> Request:
    """A request with a prompt of its own (no two share a block, so none waits for another's
    prefill) unless `prompt` is given."""
    if prompt is None:
        start = next(_prompt_starts)
        prompt = list(range(start, start + prompt_len))
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), priority=priority)


def step(s: Scheduler) -> dict[str, int]:
    return play_step(s, token_id=99)


def test_token_budget_and_max_num_seqs():
    s = make(max_num_batched_tokens=20, max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 8))
    assert step(s) == {"r0": 8, "r1": 8}  # r2 waits: max_num_seqs
    assert step(s) == {"r0": 1, "r1": 1}
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_chunked_prefill_never_makes_decodes_wait_more_than_one_chunk():
    s = make(max_num_batched_tokens=64, max_prefill_chunk_tokens=16)
    s.add(req("decoder", 3, max_tokens=20))
    step(s)
    s.add(req("long", 50))
    steps = [step(s) for _ in range(4)]
    assert [x["long"] for x in steps] == [16, 16, 16, 2]
    assert all(x["decoder"] == 1 for x in steps)


def test_budget_split_between_decodes_and_a_prompt():
    s = make(max_num_batched_tokens=10)
    s.add(req("a", 2, max_tokens=20))
    step(s)
    s.add(req("b", 30))
    assert step(s) == {"a": 1, "b": 9}
    assert step(s) == {"a": 1, "b": 9}


def test_preemption_takes_lowest_priority_then_newest_and_resume_is_first():
    # 6 blocks of 4 tokens; three requests of 7 tokens take 2 blocks each; growth must preempt.
    s = make(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    s.add(req("high", 7, priority=0, max_tokens=10))
    s.add(req("low-old", 7, priority=5, max_tokens=10))
    s.add(req("low-new", 7, priority=5, max_tokens=10))
    assert step(s) == {"high": 7, "low-old": 7, "low-new": 7}
    assert step(s) == {"high": 1, "low-old": 1, "low-new": 1}  # slot 8 still fits in block 2
    out = s.schedule()  # every request now needs a third block; none is free
    assert [r.request_id for r in out.preempted] == ["low-new"]
    assert s.requests["low-new"].status == RequestStatus.PREEMPTED
    assert s.requests["low-new"].num_computed_tokens == 0
    assert s.waiting[0].request_id == "low-new"
    assert s.blocks.num_tokens("low-new") == 0 and not s.blocks.has_request("low-new")


def test_requests_that_can_never_fit_are_refused_at_once():
    s = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        s.add(req("a", 60, max_tokens=8))
    with pytest.raises(RequestRejectedError, match="KV blocks"):
        s.add(req("b", 10, max_tokens=8))  # 18 tokens -> 5 blocks > 4
    with pytest.raises(RequestRejectedError, match="empty"):
        s.add(req("c", 0))
    assert s.num_unfinished == 0


def test_duplicate_request_id_is_refused():
    s = make()
    s.add(req("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("a", 4))


@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "decoding", "preempted"])
def test_abort_from_every_state_frees_blocks_and_is_idempotent(state):
    s = make(num_blocks=6, block_size=4, max_num_batched_tokens=8, max_prefill_chunk_tokens=4)
    target = req("t", 7, max_tokens=10, priority=9)
    s.add(req("other", 7, max_tokens=10))
    s.add(target)
    if state != "waiting":
        step(s)  # both take a 4-token chunk
    if state in ("decoding", "preempted"):
        step(s)
        step(s)
    if state == "preempted":
        while target.status != RequestStatus.PREEMPTED:
            step(s)
    expected_status = {"waiting": RequestStatus.WAITING, "mid-prefill": RequestStatus.RUNNING,
                       "decoding": RequestStatus.RUNNING, "preempted": RequestStatus.PREEMPTED}[state]
    assert target.status == expected_status
    if state == "mid-prefill":
        assert 0 < target.num_computed_tokens < target.num_prompt_tokens
    assert s.abort("t") is target
    assert target.status == RequestStatus.FINISHED_ABORTED and target.finish_reason == "abort"
    assert not s.blocks.has_request("t")
    assert s.abort("t") is None and s.abort("never-seen") is None
    s.blocks.check_integrity()
    while s.num_unfinished:
        step(s)
    s.blocks.evict()
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_prefix_hit_leaves_one_token_to_compute():
    s = make(block_size=4)
    s.add(req("a", 8, max_tokens=1, prompt=range(1, 9)))
    step(s)
    s.add(req("b", 8, max_tokens=1, prompt=range(1, 9)))  # same 8 tokens: both blocks cached
    assert step(s) == {"b": 4}  # the hit is capped so the last token is computed for its logits
    assert s.requests.get("b") is None  # finished after one token


def test_update_keeps_logprobs_and_top_logprobs_only_as_each_request_asked():
    s = make()
    asked = {"none": SamplingParams(max_tokens=4),
             "chosen": SamplingParams(max_tokens=4, logprobs=True),
             "top": SamplingParams(max_tokens=4, logprobs=True, top_logprobs=2)}
    for request_id, params in asked.items():
        s.add(Request(request_id, [1, 2, 3], params))
    out = s.schedule()
    top = ((9, -0.1), (4, -2.5))
    # Whatever the runner hands back, each request keeps only what it asked for.
    updates = s.update(out.scheduled, [(9, -0.1, top)] * len(out.scheduled))
    got = {u.request.request_id: (u.request.output_logprobs, u.request.output_top_logprobs) for u in updates}
    assert got == {"none": ([], []), "chosen": ([-0.1], []), "top": ([-0.1], [top])}
    assert all(u.new_token_ids == (9,) for u in updates)
