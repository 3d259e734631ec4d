"""The in-process engine API: add_request / abort / step / generate, refusal, seeds, memory, and a
request whose logits are not finite."""
from __future__ import annotations

import random

import psutil
import pytest

from engine_steps import drain
from worker.engine import Engine, RequestRejectedError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_generate_returns_outputs_in_order_with_finish_reasons(llama_dir):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64)
    outs = engine.generate([[5, 6, 7], [8] * 20], [GREEDY, SamplingParams(max_tokens=3, temperature=0.0,
                                                                             ignore_eos=True)], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [12, 3]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[1].num_prompt_tokens == 20


def test_stop_token_ids_and_eos_stop_generation(llama_dir):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64)
    free_run = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    stop_at = free_run[4]
    first = free_run.index(stop_at)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                      stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.token_ids == free_run[:first + 1] and out.finish_reason == "stop"


def test_refusals_are_immediate_and_clear(llama_dir):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=4, block_size=16, max_model_len=128)
    with pytest.raises(RequestRejectedError, match="max_model_len 128"):
        engine.add_request("too-long", [5] * 100, SamplingParams(max_tokens=50))
    with pytest.raises(RequestRejectedError, match="KV blocks"):
        engine.add_request("too-big", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejectedError, match="out of range"):
        engine.add_request("bad-ids", [5, 256, -1])
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.add_request("empty", [])
    with pytest.raises(TypeError, match="unknown engine options"):
        Engine.from_model_dir(llama_dir, num_kv_blockz=4)
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks_within_the_step_and_reports_once(llama_dir):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=32, max_prefill_chunk_tokens=8)
    engine.add_request("a", list(range(3, 40)), GREEDY)
    engine.add_request("b", [4, 5, 6], GREEDY)
    engine.step()  # a is mid-prefill, b has decoded once
    assert engine.block_manager.has_request("a")
    engine.abort("a")
    engine.abort("a")  # idempotent
    engine.abort("nobody")  # unknown: no-op
    assert not engine.block_manager.has_request("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].finished
    final = drain(engine)
    assert set(final) == {"b"}
    engine.block_manager.evict()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_does_not_depend_on_the_batch(llama_dir):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = Engine.from_model_dir(llama_dir, num_kv_blocks=64).generate([[9, 8, 7]], params, use_tqdm=False)
    crowd = Engine.from_model_dir(llama_dir, num_kv_blocks=64, seed=5)
    noise = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True) for _ in range(3)]
    outs = crowd.generate([[1, 2], [3, 4, 5, 6], [9, 8, 7], [11] * 9], [noise[0], noise[1], params, noise[2]],
                          use_tqdm=False)
    assert outs[2].token_ids == alone[0].token_ids
    other_seed = Engine.from_model_dir(llama_dir, num_kv_blocks=64).generate(
        [[9, 8, 7]], SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=99, ignore_eos=True),
        use_tqdm=False)
    assert other_seed[0].token_ids != alone[0].token_ids


def test_logprobs_are_reported_when_asked(llama_dir):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                      logprobs=True), use_tqdm=False)[0]
    assert len(out.logprobs) == 4 and all(lp <= 0.0 for lp in out.logprobs)


def test_memory_stays_flat_over_1000_mixed_steps(llama_dir):
    """The runner reuses its step buffers: after warm-up, resident memory must not creep.

    Margin: 8 MiB, against a per-step allocation pattern that would leak far more
    (1000 steps x even 16 KiB of buffers = 16 MiB)."""
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=64,
                                   max_prefill_chunk_tokens=32)
    buffers_before = {name: t.data_ptr() for name, t in engine.runner._host.items()}
    rng = random.Random(0)
    process = psutil.Process()
    counter = 0

    def top_up():
        nonlocal counter
        while engine.scheduler.num_unfinished < 10:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 70))]
            engine.add_request(f"m{counter}", prompt, SamplingParams(max_tokens=rng.randint(1, 40),
                                                                     temperature=0.0, ignore_eos=True))
            counter += 1

    rss_after_warmup = None
    for i in range(1000):
        top_up()
        engine.step()
        if i == 200:
            rss_after_warmup = process.memory_info().rss
    growth = process.memory_info().rss - rss_after_warmup
    assert counter > 100, "the workload should have cycled many requests"
    assert growth < 8 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB after warm-up"
    assert {name: t.data_ptr() for name, t in engine.runner._host.items()} == buffers_before


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=7,
                                                   ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_request_resumed_from_streamed_tokens_continues_identically(checkpoints, params):
    """What the gateway does when a worker dies: resend prompt + tokens already streamed."""
    engine = Engine.from_model_dir(checkpoints["llama"], num_kv_blocks=64)
    prompt = list(range(3, 40))
    full = engine.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert len(full) == 24
    for cut in (1, 10, 23):
        engine.add_request(f"resume-{cut}", prompt, params, output_token_ids=full[:cut])
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [t for o in outputs for t in o.new_token_ids] == full[cut:], cut
        assert outputs[-1].final.token_ids == full and outputs[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="already has 24"):
        engine.add_request("done", prompt, params, output_token_ids=full)


def test_a_request_whose_logits_are_not_finite_fails_alone(llama_dir):
    """Its neighbours in every step keep the tokens they get alone; it ends with an error, not token 0s."""
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64)
    prompts = [list(range(5, 25)), [7, 8, 9, 10, 11], list(range(40, 52))]
    alone = [engine.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    marked, sample = prompts[1], engine.runner.sampler

    def poisoned(logits, batch):  # the marked request's rows turn NaN from its 4th token on
        logits = logits.clone()
        for row, history in enumerate(batch.token_histories):
            if list(history[:len(marked)]) == marked and len(history) >= len(marked) + 3:
                logits[row] = float("nan")
        return sample(logits, batch)
    engine.runner.sampler = poisoned
    first, failed, last = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert first.token_ids == alone[0] and last.token_ids == alone[2]
    assert failed.finish_reason == "error" and failed.token_ids == alone[1][:3]
    assert "not finite" in failed.error
