"""Speculative decoding by prompt lookup, the pure-Python half: the n-gram proposer, its adaptive draft
length, and the scheduler's drafts and verification played by hand (no model), with the block pool
checked after every step."""
from __future__ import annotations

import random

import pytest

from shared.sampling_params import SamplingParams
from worker.block_manager import BlockManager
from worker.request import Request, RequestStatus
from worker.scheduler import Scheduler, SchedulerConfig
from worker.speculative import MAX_PAUSE_STEPS, MISSES_BEFORE_PAUSE, PAUSE_STEPS, NgramIndex, NgramSpeculation


# ---- the index ---------------------------------------------------------------------------------------------
def test_the_longest_suffix_match_wins_and_copies_what_followed():
    index = NgramIndex(1, 3)
    # "7 8" occurs twice; "6 7 8" once (followed by 1 2 3): the 3-gram is more specific, so it decides.
    tokens = [6, 7, 8, 1, 2, 3, 5, 7, 8, 4, 0, 6, 7, 8]
    assert index.propose(tokens, 3) == [1, 2, 3]
    # With only 1- and 2-grams the latest occurrence of "7 8" wins (followed by 4 0 6).
    assert NgramIndex(1, 2).propose(tokens, 3) == [4, 0, 6]


def test_no_match_proposes_nothing_and_the_suffix_never_matches_itself():
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 3, 4, 5], 4) == []
    assert index.propose([1], 4) == []
    assert NgramIndex(1, 1).propose([3, 9], 2) == []  # "9" occurs only as the suffix


def test_a_match_near_the_end_continues_into_its_own_copy():
    # What followed "1 2" is "3 1 2", then the draft continues with the copy it is making: a loop of 3.
    assert NgramIndex(2, 2).propose([1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]
    assert NgramIndex(1, 1).propose([5, 5], 4) == [5, 5, 5, 5]


def test_incremental_indexing_gives_what_a_fresh_index_gives():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(40)]
    grown = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        assert grown.propose(tokens[:end], 5) == NgramIndex(1, 3).propose(tokens[:end], 5)


# ---- adaptivity --------------------------------------------------------------------------------------------
LOOP = [1, 2, 3, 4] * 4  # every proposal matches


def test_failing_drafts_shrink_then_pause_and_the_pause_grows():
    spec = NgramSpeculation(8, 1, 2)
    assert len(spec.propose(LOOP, 100)) == 8
    spec.record(8, 0)
    assert spec.k == 4 and len(spec.propose(LOOP, 100)) == 4  # one miss: shorter, still proposing
    for miss in range(MISSES_BEFORE_PAUSE, MISSES_BEFORE_PAUSE + 3):
        spec.record(spec.k, 0)
        pause = min(MAX_PAUSE_STEPS, PAUSE_STEPS << (miss - MISSES_BEFORE_PAUSE))
        assert [spec.propose(LOOP, 100) for _ in range(pause)] == [[]] * pause
        assert spec.propose(LOOP, 100) == LOOP[:spec.k]  # back after the pause, with k halved per miss
    assert spec.k == 1


def test_the_pause_is_bounded_and_one_accepted_token_ends_the_streak():
    spec = NgramSpeculation(4, 1, 2)
    for _ in range(30):
        spec.record(1, 0)
    assert spec._pause == MAX_PAUSE_STEPS
    spec._pause = 0
    spec.record(1, 1)  # a wholly accepted draft: the streak ends and k grows back
    assert spec.k == 2 and spec.propose(LOOP, 100) == [1, 2]
    spec.record(2, 2)
    spec.record(4, 4)
    assert spec.k == 4  # never past the request's k
    spec.record(4, 1)
    assert spec.k == 2  # partly accepted: about as long as copies run here
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (34, 41, 8)


def test_a_proposal_respects_the_limit():
    spec = NgramSpeculation(8, 1, 2)
    assert spec.propose(LOOP, 3) == [1, 2, 3]
    assert spec.propose(LOOP, 0) == []


# ---- the scheduler's drafts and verification, played by hand -------------------------------------------------
def scheduler(num_blocks=32, block_size=4, budget=64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=256),
                     BlockManager(num_blocks, block_size))


def add(s: Scheduler, rid: str, prompt: list[int], k: int = 4, **params) -> Request:
    request = Request(rid, prompt, SamplingParams(temperature=0.0, **{"max_tokens": 50, **params}),
                      eos_token_ids=(2,))
    request.speculation = NgramSpeculation(k, 1, 3) if k else None
    s.add(request)
    return request


def play(s: Scheduler, model) -> dict:
    """One step: `model(tokens)` is the next token after `tokens`; results as the runner gives them."""
    out = s.schedule()
    assert out.num_tokens <= s.config.max_num_batched_tokens
    results = []
    for item in out.scheduled:
        r = item.request
        known = r.token_ids[:r.num_computed_tokens + item.num_new_tokens - len(item.draft_token_ids)]
        if item.draft_token_ids:
            draft = list(item.draft_token_ids)
            results.append([(model(known + draft[:j]), None, None) for j in range(len(draft) + 1)])
        elif r.num_computed_tokens + item.num_new_tokens == r.num_tokens:
            results.append((model(known), None, None))
        else:
            results.append(None)
    updates = s.update(out.scheduled, results)
    s.blocks.check_integrity()
    for r in s.running:
        assert r.num_tokens - r.num_computed_tokens >= 1
        assert s.blocks.num_tokens(r.request_id) == r.num_computed_tokens or not any(
            u.request is r and u.num_draft_tokens for u in updates)
    return {u.request.request_id: u for u in updates}


def run(s: Scheduler, model, max_steps=500) -> int:
    steps = 0
    while s.num_unfinished and steps < max_steps:
        play(s, model)
        steps += 1
    assert not s.num_unfinished
    return steps


def cycle(period):
    """A 'model' that repeats the last `period` tokens: prompt lookup predicts it perfectly."""
    return lambda tokens: tokens[-period]


def test_a_copying_sequence_is_verified_in_few_steps_and_gives_the_same_tokens():
    prompt = [10, 11, 12, 13, 14, 15]
    outputs = {}
    for k in (0, 1, 4):
        s = scheduler()
        r = add(s, "r", prompt, k=k, max_tokens=30)
        outputs[k] = (run(s, cycle(6)), list(r.output_token_ids), r.status)
    assert outputs[0][1] == outputs[1][1] == outputs[4][1] == (prompt * 6)[:30]
    assert all(status == RequestStatus.FINISHED_LENGTH for _, _, status in outputs.values())
    assert outputs[4][0] < outputs[1][0] < outputs[0][0]  # 1 prefill + 29 decodes without drafts


def test_max_tokens_is_never_exceeded_whatever_the_draft():
    for max_tokens in range(1, 12):
        s = scheduler()
        r = add(s, "r", [3, 4, 5, 3, 4, 5], k=8, max_tokens=max_tokens)
        run(s, cycle(3))
        assert r.num_output_tokens == max_tokens and r.status == RequestStatus.FINISHED_LENGTH


def test_a_stop_token_inside_a_draft_ends_the_request_there():
    s = scheduler()
    r = add(s, "r", [7, 8, 9, 2, 5, 6], k=6, stop_token_ids=(9,), ignore_eos=True)
    steps = run(s, cycle(6))
    assert r.output_token_ids == [7, 8, 9] and r.status == RequestStatus.FINISHED_STOPPED
    s = scheduler()
    r = add(s, "eos", [7, 8, 2, 5, 6], k=6)
    run(s, cycle(5))
    assert r.output_token_ids == [7, 8, 2] and r.status == RequestStatus.FINISHED_STOPPED
    assert steps >= 2


def test_rejected_drafts_give_their_blocks_back():
    s = scheduler(block_size=4)
    r = add(s, "r", [3, 4, 5, 6, 3, 4, 5], k=8, max_tokens=40)
    play(s, cycle(4))  # prefill
    # The model disagrees with every draft (it counts up), so each verified draft keeps one token.
    counting = lambda tokens: (tokens[-1] + 1) % 50 + 3  # noqa: E731
    update = play(s, counting)["r"]
    assert update.num_draft_tokens > 0 and update.num_accepted_tokens == 0
    assert s.blocks.num_blocks_held("r") == -(-r.num_computed_tokens // 4)


def test_a_draft_never_preempts_and_stays_within_the_budget():
    # 3 blocks of 4: the decode fits, a long draft does not; the request decodes one token instead.
    s = scheduler(num_blocks=3, block_size=4)
    add(s, "r", [4, 5, 6, 4, 5, 6, 4], k=8, max_tokens=5)
    play(s, cycle(3))
    update = play(s, cycle(3))["r"]
    assert s.num_preemptions == 0 and update.num_draft_tokens <= 3
    s = scheduler(budget=3)  # play checks every step keeps to the budget
    b = add(s, "b", [4, 5, 4, 5], k=8, max_tokens=20)
    run(s, cycle(2))
    assert b.output_token_ids == [4, 5] * 10 and b.speculation.num_draft_tokens > 0


def test_random_workloads_keep_the_pool_exact():
    rng = random.Random(1)
    s = scheduler(num_blocks=20, block_size=4, budget=24)
    for i in range(8):
        prompt = [rng.randrange(3, 20) for _ in range(rng.randrange(3, 12))]
        add(s, f"r{i}", prompt, k=rng.choice([0, 2, 5]), max_tokens=rng.randrange(1, 25))

    def model(tokens):  # sometimes copies, sometimes not: drafts of every fate
        return tokens[-3] if rng.random() < 0.8 else rng.randrange(3, 20)

    run(s, model, max_steps=2000)
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    assert s.num_accepted_draft_tokens <= s.num_draft_tokens and s.num_drafts > 0
    assert s.num_preemptions > 0  # the pool is small enough that drafts meet preemption


@pytest.mark.parametrize("k", [1, 3])
def test_counters_add_up(k):
    s = scheduler()
    r = add(s, "r", [4, 5, 6, 4, 5, 6], k=k, max_tokens=20)
    run(s, cycle(3))
    spec = r.speculation
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_draft_tokens) == (
        spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0  # a perfect copy: every draft token holds


def test_drafts_fill_a_step_only_up_to_the_step_token_cap():
    for cap, expected in ((10, 6), (4, 0), (0, 4 * 8)):
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                                      max_step_tokens_with_drafts=cap), BlockManager(64, 4))
        for i in range(4):
            add(s, f"r{i}", [5 + i, 9, 5 + i, 9, 5 + i, 9], k=8, max_tokens=40)
        play(s, cycle(2))  # prefill
        out = s.schedule()
        assert sum(len(item.draft_token_ids) for item in out.scheduled) == expected, cap
