"""The worker loop with a real engine and a fake socket: what it does at HIGH and CRITICAL memory,
out-of-memory errors in the forward, and a request that cannot fit alone."""
from __future__ import annotations

import pytest
import torch

from shared.config import load_config
from worker.engine import Engine
from worker.memory import MemoryReading
from worker.watchdog import MemoryLevel
from worker_service_harness import GREEDY, PROMPTS, Pressure, SEEDED, drain, make_service, reference_outputs, submit


@pytest.fixture(scope="module")
def reference(llama_dir):
    return reference_outputs(llama_dir)


# ---- memory levels: the loop decides, the scheduler acts --------------------------------------
def test_high_stops_admission_and_evicts_prefix_cache_blocks(llama_dir):
    pressure = Pressure()
    service = make_service(llama_dir, pressure)
    usage = service.engine.kv_pool_usage()
    pressure.pool_bytes = usage.pool_bytes
    limit = 40 * usage.bytes_per_block
    service.config = load_config(None, {"model_dir": str(llama_dir), "worker.memory_limit_bytes": limit})
    service.watchdog._limit_bytes = limit
    submit(service, "warm", PROMPTS["p0"])
    drain(service)
    cached = service.engine.block_manager.num_evictable_blocks
    assert cached >= 5  # the finished request's full blocks stay in the prefix cache
    submit(service, "running", PROMPTS["p1"])
    service.run_once()
    blocks = service.engine.block_manager
    used = blocks.num_used_blocks
    # Something else takes memory: 35 of 40 blocks' worth with the cache counted (HIGH from 34).
    # Evicting 4 cached blocks leaves HIGH (below 32): only those go, the rest of the cache stays.
    pressure.extra = (35 - cached - used) * usage.bytes_per_block
    service.run_once()
    assert blocks.num_evictable_blocks == cached - 4 and service.watchdog.status.level == MemoryLevel.OK
    # More pressure than the whole cache can relieve: everything cached goes, and HIGH stays.
    pressure.extra = (34 - used) * usage.bytes_per_block
    submit(service, "new", PROMPTS["p2"])
    service.run_once()
    assert blocks.num_evictable_blocks == 0
    assert service.watchdog.status.level == MemoryLevel.HIGH and service.engine.scheduler.admission_paused
    assert [r.request_id for r in service.engine.scheduler.waiting] == ["new"]
    assert service.engine.scheduler.requests["running"].status.name == "RUNNING"  # running ones go on
    hb = service.heartbeat.heartbeat().heartbeat
    assert hb.memory_level == "HIGH" and hb.ready  # HIGH is still ready (only CRITICAL is not)
    pressure.extra = 0  # pressure gone: admission resumes
    service.run_once()
    assert not service.engine.scheduler.admission_paused
    assert service.engine.scheduler.requests["new"].status.name == "RUNNING"
    drain(service)
    blocks.check_integrity()


def test_critical_preempts_lowest_priority_until_under_and_outputs_match(llama_dir, reference):
    pressure = Pressure()
    service = make_service(llama_dir, pressure)
    usage = service.engine.kv_pool_usage()
    pressure.pool_bytes = usage.pool_bytes
    # 4 requests of 10 + 20 tokens need 8 blocks each at the end: 32 blocks against a 24-block limit.
    service.watchdog._limit_bytes = 24 * usage.bytes_per_block
    scheduler = service.engine.scheduler
    victims = []
    preempt = scheduler.preempt_lowest

    def record():
        victim = preempt()
        if victim is not None:
            victims.append(victim.request_id)
        return victim

    scheduler.preempt_lowest = record
    for priority, request_id in enumerate(PROMPTS):
        submit(service, request_id, PROMPTS[request_id], priority=priority)
    for _ in range(2000):
        if not service.engine.has_unfinished_requests():
            break
        service._check_memory()
        status = service.watchdog.status
        # Relieved: below CRITICAL's exit line, unless one request is all that is left running.
        assert status.used_bytes < service.watchdog.leave_bytes(MemoryLevel.CRITICAL) or len(scheduler.running) <= 1
        service.run_once()
        service.engine.check_integrity()
    tokens = {}
    for d in service.socket.deltas():
        tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert tokens == reference["greedy"]
    assert victims and victims[0] == "p3" and "p0" not in victims
    finals = {d.request_id: d for d in service.socket.deltas() if d.finished}
    assert finals["p3"].num_preemptions >= 1 and finals["p0"].num_preemptions == 0
    assert service.heartbeat.heartbeat().heartbeat.num_preemptions == len(victims)
    assert service.engine.block_manager.num_used_blocks == 0


def test_fragmentation_at_high_releases_the_allocator_cache_now_and_then(llama_dir, monkeypatch):
    class Fragmented(Pressure):
        def __call__(self, detailed=False):
            # 900 bytes committed beside the (idle) KV pool, 800 of them cached by the allocator.
            reserved = self.pool_bytes + 900
            return MemoryReading(used_bytes=reserved, total_bytes=1000, allocated_bytes=reserved - 800,
                                 reserved_bytes=reserved)

    fragmented = Fragmented()
    service = make_service(llama_dir, fragmented, empty_cache_fragmentation_bytes=500, memory_poll_interval_s=60)
    fragmented.pool_bytes = service.engine.kv_pool_usage().pool_bytes
    calls = []
    monkeypatch.setattr(service.engine, "empty_device_cache", lambda: calls.append(1))
    service.run_once()
    service.run_once()
    assert service.watchdog.status.level == MemoryLevel.HIGH and calls == [1]  # once per poll interval


# ---- out-of-memory errors in the forward ---------------------------------------------------------
def _generate(engine: Engine) -> dict[str, list[int]]:
    outs = engine.generate(list(PROMPTS.values()), GREEDY, use_tqdm=False)
    engine.check_integrity()
    return dict(zip(PROMPTS, (o.token_ids for o in outs)))


@pytest.mark.parametrize("fault", ["batch_above_2", "third_call", "cpu_allocator"])
def test_an_out_of_memory_forward_is_survived_with_identical_outputs(llama_dir, reference, fault):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, block_size=4, max_num_seqs=8)
    calls = []

    def hook(seqs):
        calls.append(len(seqs))
        if fault == "batch_above_2" and len(seqs) > 2:
            raise MemoryError("injected: no room for more than 2 sequences")
        if fault == "third_call" and len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if fault == "cpu_allocator" and len(seqs) == 4 and len(calls) < 6:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    engine.runner.fault_hook = hook
    assert _generate(engine) == reference["greedy"]
    assert engine.num_oom_recoveries > 0


def test_a_step_retried_after_sampling_draws_the_same_seeded_tokens(llama_dir, reference):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, block_size=4, max_num_seqs=8)
    sample = engine.runner.sampler

    def sample_then_fail(logits, batch):
        result = sample(logits, batch)  # the generators have drawn by now
        if len(batch.params) == 2:
            raise MemoryError("injected after sampling")
        return result

    engine.runner.sampler = sample_then_fail
    outs = engine.generate([PROMPTS["p0"], PROMPTS["p1"]], [SEEDED, GREEDY], use_tqdm=False)
    assert outs[0].token_ids == reference["seeded"] and outs[1].token_ids == reference["greedy"]["p1"]
    assert engine.num_oom_recoveries >= 20


def test_other_errors_in_the_forward_are_not_swallowed(llama_dir):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, block_size=4)
    engine.runner.fault_hook = lambda seqs: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal access"))
    with pytest.raises(RuntimeError, match="illegal access"):
        engine.generate([[5, 6]], GREEDY, use_tqdm=False)


def test_a_request_that_cannot_fit_alone_fails_clearly_while_the_others_finish(llama_dir, reference):
    service = make_service(llama_dir)
    huge = [250] * 30

    def hook(seqs):
        if any(seq.token_history[0] == 250 for seq in seqs):
            raise MemoryError("injected: the huge request never fits")

    service.engine.runner.fault_hook = hook
    for request_id, prompt in PROMPTS.items():
        submit(service, request_id, prompt)
    submit(service, "huge", huge)
    tokens = drain(service)
    assert {k: v for k, v in tokens.items() if k != "huge"} == reference["greedy"]
    [failed] = [d for d in service.socket.deltas() if d.request_id == "huge"]
    assert failed.finished and failed.finish_reason == "error" and not failed.new_token_ids
    assert "out of memory" in failed.error and "even alone" in failed.error and "'huge'" in failed.error
    assert service.heartbeat.heartbeat().heartbeat.num_oom_recoveries >= 2
    assert service.engine.block_manager.num_used_blocks == 0


# ---- what the worker reports ---------------------------------------------------------------------
