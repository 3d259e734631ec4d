"""The worker loop with a real engine and a fake or real socket: per-request timings on the deltas,
heartbeat fields, memory-report probes, KV events (prefix-cache reports and snapshots), a hung step,
a fatal error, and a worker no gateway hears."""
from __future__ import annotations

import faulthandler
import gc
import logging
import signal
import threading
import time

import pytest

from protos import worker_pb2
from shared.block_hash import chain_hashes
from shared.ipc import decode, encode
from shared.wire import logprobs_from_wire, prompt_logprobs_from_wire, sampling_to_wire
from worker.engine import SamplingParams
from worker_service_harness import GREEDY, PROMPTS, curve_router, drain, make_service, reference_outputs, submit


@pytest.fixture(scope="module")
def reference(llama_dir):
    return reference_outputs(llama_dir)


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
        peaks = [d.peak_kv_blocks for d in deltas]  # the figures so far on every delta
        assert peaks[0] >= 3 and peaks == sorted(peaks)
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
                              presence_penalty=0.5, logit_bias={9: 1.0}, prompt_logprobs=2)
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
            # The prompt's, once, with the first token (as float32).
            assert [bool(d.prompt_logprobs) for d in mine if d.new_token_ids] == [True] + [False] * 5
            prompt = prompt_logprobs_from_wire(mine[0], PROMPTS["p0"])
            assert [(e.rank, e.top) for e in prompt] == [(r, tuple((t, pytest.approx(v, abs=1e-6)) for t, v in top))
                                                         for _, r, top in expected.prompt_logprobs]
            assert [e.logprob for e in prompt] == pytest.approx([v for v, _, _ in expected.prompt_logprobs], abs=1e-6)
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
        gc.unfreeze()  # run() froze the test process's objects once warm: the rest of the suite collects as before
        for s, handler in handlers.items():
            signal.signal(s, handler)
        faulthandler.unregister(signal.SIGUSR1)
    last = service.socket.sent[-1]
    assert last.WhichOneof("body") == "exit" and "injected fatal fault" in last.exit.reason
    assert service.socket.closed_with_linger_ms > 0  # the exit frame is given time to leave
    assert not service.heartbeat.is_alive()


def test_a_worker_once_warm_freezes_its_startup_objects_out_of_garbage_collection(llama_dir):
    """A full collection in a model process walked every object loading the model made (230 ms on the
    default model, no step running meanwhile): once warm, run() freezes them, so the engine and its
    model are no longer among the objects a collection walks."""
    service = make_service(llama_dir)
    service.engine.runner.fault_hook = lambda seqs: (_ for _ in ()).throw(
        RuntimeError("stop here")) if seqs[0].token_history[0] == 77 else None  # not the warm-up's step
    wire = worker_pb2.WireRequest(request_id="r", prompt_token_ids=[77, 5], sampling=sampling_to_wire(GREEDY))
    service.socket.inbox.append(worker_pb2.Envelope(submit=worker_pb2.SubmitBatch(requests=[wire])))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    frozen_before = gc.get_freeze_count()
    try:
        assert service.run() == 1  # warm-up, the freeze, then the first step's injected fault
        assert gc.get_freeze_count() > frozen_before
        tracked = {id(o) for o in gc.get_objects()}
        assert id(service.engine) not in tracked and id(service.engine.runner) not in tracked
    finally:
        gc.unfreeze()
        for s, handler in handlers.items():
            signal.signal(s, handler)
        faulthandler.unregister(signal.SIGUSR1)


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
