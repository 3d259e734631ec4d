"""The worker loop with a real engine and a fake or real socket: what it does at HIGH and
CRITICAL memory, out-of-memory errors in the forward, per-request timings on the deltas,
heartbeat fields, memory-report probes, KV events (prefix-cache reports and snapshots), a hung
step and a fatal error."""
from __future__ import annotations

import faulthandler
import logging
import signal
import threading
import time

import pytest
import torch
import zmq

from cluster_harness import free_port
from protos import worker_pb2
from shared.block_hash import chain_hashes
from shared.config import load_config
from shared.curve import GATEWAY, cluster_keys_dir, load_server_keys
from shared.ipc import decode, encode
from shared.wire import logprobs_from_wire, sampling_to_wire
from worker.engine import Engine, SamplingParams
from worker.memory import MemoryReading
from worker.service import WorkerService
from worker.watchdog import MemoryLevel

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, temperature=1.0, top_k=40, seed=7, ignore_eos=True)


class FakeSocket:
    """Stands in for the worker's routed socket: frames to deliver, frames sent."""

    def __init__(self):
        self.inbox: list[worker_pb2.Envelope] = []
        self.sent: list[worker_pb2.Envelope] = []
        self.closed_with_linger_ms: int | None = None

    def send(self, envelope: worker_pb2.Envelope) -> bool:
        self.sent.append(envelope)
        return True

    def recv_all(self, timeout_s: float) -> list[worker_pb2.Envelope]:
        frames, self.inbox = self.inbox, []
        return frames

    def close(self, linger_ms: int = 0) -> None:
        self.closed_with_linger_ms = linger_ms

    def deltas(self) -> list[worker_pb2.TokenDelta]:
        return [d for e in self.sent if e.WhichOneof("body") == "outputs" for d in e.outputs.deltas]

    def kv_events(self) -> list[worker_pb2.KvEvents]:
        return [e.kv_events for e in self.sent if e.WhichOneof("body") == "kv_events"]


class Pressure:
    """A memory reading of the KV pool alone plus `extra` bytes, so the level follows block use."""

    def __init__(self):
        self.pool_bytes = 0
        self.extra = 0

    def __call__(self, detailed: bool = False) -> MemoryReading:
        return MemoryReading(used_bytes=self.pool_bytes + self.extra, total_bytes=1 << 40)


def curve_router(endpoint: str) -> zmq.Socket:
    """A bare ROUTER in the gateway's place: a CURVE server with the cluster's own keys
    (<run_dir>/keys, shared/curve.py), as a worker requires on ipc://."""
    keys = load_server_keys(cluster_keys_dir(load_config(None, {}), GATEWAY))
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.curve_server = True
    router.curve_secretkey, router.curve_publickey = keys.secret, keys.public
    router.bind(endpoint)
    return router


def make_service(model_dir, read_memory=None, endpoint=None, engine=None, **worker) -> WorkerService:
    engine = engine or Engine.from_model_dir(model_dir, num_kv_blocks=64, block_size=4, max_num_seqs=8)
    config = load_config(None, {"model_dir": str(model_dir),
                                "gateway.worker_endpoint": endpoint or f"tcp://127.0.0.1:{free_port()}",
                                **{f"worker.{k}": v for k, v in worker.items()}})
    service = WorkerService(config, "worker-t", engine=engine, read_memory=read_memory)
    if endpoint is None:
        service.socket.close()
        service.socket = FakeSocket()
    service._loaded = True
    return service


def submit(service: WorkerService, request_id: str, prompt: list[int], params=GREEDY, priority: int = 0) -> None:
    wire = worker_pb2.WireRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_wire(params),
                                  priority=priority)
    service._handle(worker_pb2.Envelope(submit=worker_pb2.SubmitBatch(requests=[wire])))


def drain(service: WorkerService, max_steps: int = 2000) -> dict[str, list[int]]:
    for _ in range(max_steps):
        if not service.engine.has_unfinished_requests():
            break
        service.run_once()
        service.engine.check_integrity()
    tokens: dict[str, list[int]] = {}
    for d in service.socket.deltas():
        tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return tokens


PROMPTS = {f"p{i}": [3 + i, 40 + 7 * i, 9, 100 + i, 11, 12 + i, 13, 14, 15, 16 + i] for i in range(4)}


@pytest.fixture(scope="module")
def reference(llama_dir):
    engine = Engine.from_model_dir(llama_dir, num_kv_blocks=64, block_size=4, max_num_seqs=8)
    outs = engine.generate(list(PROMPTS.values()), GREEDY, use_tqdm=False)
    seeded = engine.generate([PROMPTS["p0"]], SEEDED, use_tqdm=False)[0]
    return {"greedy": dict(zip(PROMPTS, (o.token_ids for o in outs))), "seeded": seeded.token_ids}


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
def test_deltas_carry_worker_timings_and_heartbeats_every_field(llama_dir):
    service = make_service(llama_dir)
    submit(service, "a", PROMPTS["p0"])  # 10 prompt + 20 output tokens: 29 slots, 8 blocks of 4
    drain(service)
    submit(service, "b", PROMPTS["p0"])  # the same prompt: a prefix-cache hit
    drain(service)
    for request_id in ("a", "b"):
        deltas = [d for d in service.socket.deltas() if d.request_id == request_id]
        assert deltas[0].new_token_ids and deltas[0].worker_queue_ms >= 0 and deltas[0].prefill_ms > 0
        assert all(d.worker_queue_ms == 0 and d.prefill_ms == 0 for d in deltas[1:])
        assert deltas[-1].finished and deltas[-1].peak_kv_blocks == 8 and deltas[-1].num_preemptions == 0
        assert all(d.peak_kv_blocks == 0 for d in deltas[:-1])
    hb = service.heartbeat.heartbeat().heartbeat
    assert hb.ready and not hb.is_hung and not hb.is_draining and hb.memory_level == "OK"
    assert hb.num_steps == 40 and hb.num_prefix_hit_tokens == 8 and hb.num_prefix_query_tokens == 16
    assert hb.num_preemptions == 0 and hb.num_oom_recoveries == 0
    assert hb.memory_resident_bytes > 0 and hb.memory_used_bytes > 0 and hb.memory_limit_bytes > 0
    assert hb.kv_blocks_total == 64 and hb.kv_blocks_free == 64 and hb.kv_blocks_cached > 0
    service._stopping = True
    service._publish()
    hb = service.heartbeat.heartbeat().heartbeat
    assert hb.is_draining and not hb.ready


def test_memory_report_probe_returns_the_resident_set_and_the_kv_pool_layout(llama_dir):
    service = make_service(llama_dir)
    submit(service, "held", PROMPTS["p1"])
    service.run_once()
    service._handle(worker_pb2.Envelope(probe=worker_pb2.Probe(probe_id=5, memory_report=True)))
    reply = service.socket.sent[-1].probe_reply
    assert reply.probe_id == 5 and reply.ok
    report = reply.memory_report
    assert "resident set (rss)" in report and "MiB" in report
    assert "KV pool: 64 blocks x 4 tokens" in report and "'held': 3 blocks" in report
    assert "memory level OK" in report
    service._handle(worker_pb2.Envelope(probe=worker_pb2.Probe(probe_id=6)))
    assert service.socket.sent[-1].probe_reply.memory_report == ""
    service._handle(worker_pb2.Envelope(probe=worker_pb2.Probe(probe_id=7, deep=True, memory_report=True)))
    drain(service)
    [deep] = [e.probe_reply for e in service.socket.sent if e.WhichOneof("body") == "probe_reply"
              and e.probe_reply.probe_id == 7]
    assert deep.ok and "KV pool" in deep.memory_report


def test_deltas_carry_the_logprobs_asked_for_on_the_wire(llama_dir):
    service = make_service(llama_dir)
    with_top = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3,
                              presence_penalty=0.5, logit_bias={9: 1.0})
    chosen_only = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    submit(service, "top", PROMPTS["p0"], with_top)
    submit(service, "chosen", PROMPTS["p1"], chosen_only)
    submit(service, "none", PROMPTS["p2"], GREEDY)
    submit(service, "bad-bias", PROMPTS["p3"], SamplingParams(logit_bias={256: 1.0}))
    drain(service)
    deltas = service.socket.deltas()
    [bad] = [d for d in deltas if d.request_id == "bad-bias"]
    assert bad.finished and bad.finish_reason == "error" and "logit_bias token ids out of range" in bad.error
    assert all(not d.logprobs for d in deltas if d.request_id in ("none", "bad-bias"))
    # The in-process engine's values for the same requests: the wire must carry them (as float32).
    reference = make_service(llama_dir).engine.generate([PROMPTS["p0"], PROMPTS["p1"]], [with_top, chosen_only],
                                                        use_tqdm=False)
    for request_id, expected in zip(("top", "chosen"), reference):
        mine = [d for d in deltas if d.request_id == request_id]
        assert all(len(d.logprobs) == len(d.new_token_ids) for d in mine)
        got = [entry for d in mine for entry in logprobs_from_wire(d)]
        assert [e.token_id for e in got] == expected.token_ids
        assert [e.logprob for e in got] == pytest.approx(expected.logprobs, abs=1e-6)
        if request_id == "top":
            assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in top] for top in expected.top_logprobs]
            assert [lp for e in got for _, lp in e.top] == pytest.approx(
                [lp for top in expected.top_logprobs for _, lp in top], abs=1e-6)
        else:
            assert all(e.top == () for e in got)


# ---- KV events: the prefix cache reported to the gateway ---------------------------------------
SNAPSHOT_REQUEST = worker_pb2.Envelope(kv_snapshot_request=worker_pb2.KvSnapshotRequest())


def test_kv_events_report_cached_blocks_in_seq_order_and_heartbeats_follow(llama_dir, reference):
    service = make_service(llama_dir)
    assert service.heartbeat.heartbeat().heartbeat.kv_events_seq == 0
    submit(service, "a", PROMPTS["p0"])
    for _ in range(200):
        if not service.engine.has_unfinished_requests():
            break
        service.run_once()
        # Published after the send: a heartbeat's seq is always one already sent.
        sent = [e.seq for e in service.socket.kv_events()]
        assert service.heartbeat.heartbeat().heartbeat.kv_events_seq == (sent[-1] if sent else 0)
    assert not service.engine.has_unfinished_requests()
    events = service.socket.kv_events()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert all(not e.snapshot and e.block_size == 4 and e.stored and not e.removed for e in events)
    # The scheduler caches the computed tokens: the prompt and every output token but the last.
    computed = (PROMPTS["p0"] + reference["greedy"]["p0"])[:-1]
    expected = chain_hashes(computed, 4)
    assert len(expected) == 7 and [h for e in events for h in e.stored] == expected
    assert len(events) == 6  # the prefill's two blocks, then one report per block the decode fills
    assert set(service.engine.cached_block_hashes()) == set(expected)

    # Changes not reported yet are part of the snapshot, so they are never reported after it.
    assert service.engine.evict_prefix_cache(2) == 2
    service.socket.inbox.append(SNAPSHOT_REQUEST)
    service.run_once()
    snapshot = service.socket.sent[-1].kv_events
    assert snapshot.snapshot and snapshot.seq == len(events) + 1 and snapshot.block_size == 4
    assert set(snapshot.stored) == set(expected[:5]) and len(snapshot.stored) == 5 and not snapshot.removed
    assert service.heartbeat.heartbeat().heartbeat.kv_events_seq == snapshot.seq
    service.run_once()
    assert service.socket.kv_events()[-1] == snapshot  # nothing pending after the snapshot

    # The reports after a snapshot follow from its seq; the same prompt re-registers only what went.
    submit(service, "b", PROMPTS["p0"])
    drain(service)
    after = service.socket.kv_events()[len(events) + 1:]
    assert [e.seq for e in after] == list(range(snapshot.seq + 1, snapshot.seq + 1 + len(after)))
    assert [h for e in after for h in e.stored] == expected[5:] and not any(e.removed for e in after)
    assert service.heartbeat.heartbeat().heartbeat.kv_events_seq == after[-1].seq


def test_kv_events_report_evictions_and_coalesce_within_an_iteration(llama_dir):
    service = make_service(llama_dir)
    prompt = list(range(20, 36))  # 16 tokens: 4 full blocks, all computed and cached by the prefill
    submit(service, "a", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    drain(service)
    [stored] = service.socket.kv_events()
    hashes = chain_hashes(prompt, 4)
    assert list(stored.stored) == hashes and stored.seq == 1
    # Evicted by the loop itself (what HIGH memory does) between reports: removed, never stored.
    service.engine.evict_prefix_cache()
    service.run_once()
    removed = service.socket.kv_events()[-1]
    assert removed.seq == 2 and not removed.stored and sorted(removed.removed) == sorted(hashes)
    # Registered and evicted again within one iteration: reported as removed only.
    submit(service, "b", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    engine = service.engine
    outputs = engine.step()
    assert outputs[-1].finished
    engine.evict_prefix_cache()
    service.run_once()
    last = service.socket.kv_events()[-1]
    assert last.seq == 3 and not last.stored and sorted(last.removed) == sorted(hashes)
    service.socket.inbox.append(SNAPSHOT_REQUEST)
    service.run_once()
    empty = service.socket.kv_events()[-1]
    assert empty.snapshot and empty.seq == 4 and not empty.stored  # an empty cache is a snapshot too


def test_kv_events_and_snapshots_travel_the_real_wire(llama_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/gw.ipc"
    router = curve_router(endpoint)
    service = make_service(llama_dir, endpoint=endpoint, heartbeat_interval_s=0.05)
    service.heartbeat.start()
    try:
        submit(service, "a", PROMPTS["p1"])
        for _ in range(200):
            if not service.engine.has_unfinished_requests():
                break
            service.run_once()
        assert not service.engine.has_unfinished_requests()
        last_seq = service._kv_seq
        assert last_seq >= 2
        events, beat_seqs, deadline = [], [], time.monotonic() + 10
        while not (events and events[-1].seq == last_seq and last_seq in beat_seqs):
            assert time.monotonic() < deadline, (events, beat_seqs)
            if router.poll(100):
                envelope = decode(router.recv_multipart()[1])
                if envelope.WhichOneof("body") == "kv_events":
                    events.append(envelope.kv_events)
                elif envelope.WhichOneof("body") == "heartbeat":
                    beat_seqs.append(envelope.heartbeat.kv_events_seq)
        assert [e.seq for e in events] == list(range(1, last_seq + 1))
        cached = set(service.engine.cached_block_hashes())
        assert {h for e in events for h in e.stored} == cached
        # The gateway asks for a snapshot; the worker answers it in its next iteration.
        router.send_multipart([b"worker-t", encode(SNAPSHOT_REQUEST)])
        reply, deadline = None, time.monotonic() + 10
        while reply is None:
            assert time.monotonic() < deadline
            service.run_once()
            while reply is None and router.poll(0):
                envelope = decode(router.recv_multipart()[1])
                if envelope.WhichOneof("body") == "kv_events":
                    reply = envelope
        snapshot = reply.kv_events
        assert snapshot.snapshot and snapshot.seq == last_seq + 1 and set(snapshot.stored) == cached
        assert reply.worker_id == "worker-t" and reply.incarnation == service.incarnation
    finally:
        service.heartbeat.stop()
        service.heartbeat.join(5)
        service.socket.close()
        router.close()


# ---- health: a hung loop, a fatal error --------------------------------------------------------
def test_a_hung_step_turns_the_worker_not_ready_while_heartbeats_keep_flowing(llama_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/gw.ipc"
    router = curve_router(endpoint)
    service = make_service(llama_dir, endpoint=endpoint, heartbeat_interval_s=0.05, hung_after_s=0.4)
    release = threading.Event()
    service.engine.runner.fault_hook = lambda seqs: release.wait(10)  # the step hangs until released
    service.heartbeat.start()
    try:
        service._publish()
        submit(service, "stuck", [5, 6, 7])
        loop = threading.Thread(target=service.run_once)
        started = time.monotonic()
        loop.start()
        beats = []
        while time.monotonic() - started < 1.5:
            if router.poll(100):
                envelope = decode(router.recv_multipart()[1])
                if envelope.WhichOneof("body") == "heartbeat":
                    beats.append((time.monotonic() - started, envelope.heartbeat))
        hung = [t for t, hb in beats if hb.is_hung]
        assert hung and all(not hb.ready for t, hb in beats if hb.is_hung)
        assert 0.4 <= hung[0] < 1.2  # within the configured time (plus a heartbeat or two)
        assert len([t for t, _ in beats if t > hung[0]]) >= 3  # liveness: heartbeats keep flowing
        release.set()
        loop.join(10)
        service.run_once()
        deadline = time.monotonic() + 5
        while True:
            assert router.poll(5000)
            envelope = decode(router.recv_multipart()[1])
            if envelope.WhichOneof("body") == "heartbeat" and envelope.heartbeat.ready:
                assert not envelope.heartbeat.is_hung
                break
            assert time.monotonic() < deadline
    finally:
        release.set()
        service.heartbeat.stop()
        service.heartbeat.join(5)
        service.socket.close()
        router.close()


def test_a_fatal_error_tells_the_gateway_and_exits_non_zero(llama_dir):
    service = make_service(llama_dir)
    service._loaded = False
    service.engine.runner.fault_hook = lambda seqs: (_ for _ in ()).throw(
        RuntimeError("injected fatal fault")) if seqs[0].token_history[0] == 77 else None
    wire = worker_pb2.WireRequest(request_id="doomed", prompt_token_ids=[77, 5], sampling=sampling_to_wire(GREEDY))
    service.socket.inbox.append(worker_pb2.Envelope(submit=worker_pb2.SubmitBatch(requests=[wire])))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert service.run() == 1
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        faulthandler.unregister(signal.SIGUSR1)
    last = service.socket.sent[-1]
    assert last.WhichOneof("body") == "exit" and "injected fatal fault" in last.exit.reason
    assert service.socket.closed_with_linger_ms > 0  # the exit frame is given time to leave
    assert not service.heartbeat.is_alive()


def test_a_worker_no_gateway_hears_says_so_every_interval_until_one_does(caplog):
    from worker.transport import NO_GATEWAY_WARN_S, Unheard
    caplog.set_level(logging.INFO, logger="worker.transport")
    unheard = Unheard("tcp://127.0.0.1:1", clock=lambda: 0.0)
    for now in (1.0, NO_GATEWAY_WARN_S - 0.1, NO_GATEWAY_WARN_S, NO_GATEWAY_WARN_S + 1, 2 * NO_GATEWAY_WARN_S + 0.5):
        unheard.after_send(False, now)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("tcp://127.0.0.1:1" in w for w in warnings)
    unheard.after_send(True, 3 * NO_GATEWAY_WARN_S)
    assert "a gateway at tcp://127.0.0.1:1 takes" in caplog.records[-1].getMessage()
    unheard.after_send(False, 3 * NO_GATEWAY_WARN_S + 1)  # lost again: counts from here
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
