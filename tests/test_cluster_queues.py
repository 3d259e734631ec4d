"""The gateway's queue on a saturated one-worker cluster: priority order, deadlines while queued
and while running, the queue-time limit, and RESOURCE_EXHAUSTED with a retry hint.

The worker is model-free (bench/fake_worker.py, the real wire and heartbeats): what is tested is
the gateway's queue, and a blocker must hold the only slot for as long as a test needs whatever
the host's speed. A real tiny model streams a long generation in well under a second on a fast
engine, shorter than these tests' deadlines; a fake one at 5 ms a token holds it for seconds."""
from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from cluster_harness import Cluster, LONG_MAX_TOKENS, generate
from gateway_fake_cluster import FakeCluster
from protos import inference_pb2

pytestmark = pytest.mark.timeout(300)

# One worker that runs one request at a time and holds none waiting: everything else
# waits in the gateway's queue, where its order is decided. Interactive traffic (priority -1)
# may wait 0.05 s; a blocker's 2,000 tokens take 10 s at STEP_MS, so the limit or the
# deadline, never the blocker's end, decides.
STEP_MS = 5.0
SECTIONS = {"worker": {"max_num_seqs": 1, "max_queued": 0},
            "queues": {"max_queued_requests": 6, "batch_window_ms": 0.0, "max_queue_wait_s": [[-1, 0.05]]}}


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with FakeCluster(served_checkpoint, num_workers=1, step_ms=STEP_MS, sections=SECTIONS) as c:
        yield c


def blocker(cluster, max_tokens=LONG_MAX_TOKENS):
    """A long request that occupies the only slot; returns its stream after its first token."""
    request = inference_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=inference_pb2.SamplingOptions(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    stream = cluster.stub.Generate(request, timeout=120)
    next(stream)
    return stream


def wait_idle(cluster, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = cluster.status()
        w = s.workers[0]
        if s.num_queued == 0 and w.num_running == 0 and w.kv_blocks_free == w.kv_blocks_total:
            return
        time.sleep(0.05)
    raise AssertionError(f"cluster not idle: {cluster.status()}")


def test_urgent_requests_start_before_queued_bulk(cluster):
    stream = blocker(cluster)
    served: dict[str, int] = {}
    ids = {name: f"{name}-{time.monotonic_ns()}" for name in ("bulk-0", "bulk-1", "bulk-2", "urgent")}

    def client(name, priority):
        request = inference_pb2.GenerateRequest(request_id=ids[name], prompt_token_ids=[9, 10], priority=priority,
                                                # ignore_eos: a sampled EOS would end a stream early
                                                sampling=inference_pb2.SamplingOptions(max_tokens=3, ignore_eos=True))
        served[name] = sum(len(r.token_ids) for r in cluster.stub.Generate(request, timeout=60))

    threads = []
    for name, priority in [("bulk-0", 10), ("bulk-1", 10), ("bulk-2", 10), ("urgent", 0)]:
        threads.append(threading.Thread(target=client, args=(name, priority)))
        threads[-1].start()
        time.sleep(0.05)  # the urgent request arrives last
    deadline = time.monotonic() + 10
    while cluster.status().num_queued < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    stream.cancel()  # the slot frees with all four waiting
    for t in threads:
        t.join(timeout=60)
    assert served == {name: 3 for name in ids}
    # The worker runs one request at a time, so the gateway's request log (a line as each ends)
    # holds them in the order they were dispatched: the gateway's own record, not the clients'
    # clocks, which a busy machine delays by more than a request of three tokens takes.
    deadline = time.monotonic() + 10  # the last line may be written just after its response went out
    while True:
        logged = [json.loads(line[line.index("{"):])["request_id"] for line in
                  (cluster.run_dir / "gateway.log").read_text().splitlines() if '"event":"request"' in line]
        order = [request_id for request_id in logged if request_id in ids.values()]
        if len(order) == len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert order[0] == ids["urgent"] and sorted(order) == sorted(ids.values()), order
    wait_idle(cluster)


def test_deadline_while_queued_never_reaches_the_worker(cluster):
    stream = blocker(cluster)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.stub, timeout=0.3, prompt_token_ids=[11, 12], sampling=dict(max_tokens=2))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    assert cluster.status().num_queued == 0  # dropped from the queue, not left to run later
    stream.cancel()
    wait_idle(cluster)


def test_queue_time_limit_fails_interactive_traffic_fast(cluster):
    stream = blocker(cluster)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.stub, timeout=30, prompt_token_ids=[11, 12], priority=-1, sampling=dict(max_tokens=2))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "queue-time limit" in e.value.details()
    assert time.monotonic() - started < 10
    stream.cancel()
    wait_idle(cluster)


def test_deadline_while_running_aborts_on_the_worker(cluster):
    with pytest.raises(grpc.RpcError) as e:  # the long generation takes many times this deadline
        generate(cluster.stub, timeout=0.3, prompt_token_ids=[5, 6, 7],
                 sampling=dict(max_tokens=LONG_MAX_TOKENS, ignore_eos=True))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(cluster, timeout_s=5)  # its blocks were freed on the worker


def test_full_queue_answers_resource_exhausted_with_a_retry_hint(cluster):
    stream = blocker(cluster)
    queued = [cluster.stub.Generate(inference_pb2.GenerateRequest(
        prompt_token_ids=[20 + i], sampling=inference_pb2.SamplingOptions(max_tokens=2, ignore_eos=True)), timeout=60)
        for i in range(6)]
    deadline = time.monotonic() + 10
    while cluster.status().num_queued < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.stub, timeout=10, prompt_token_ids=[40], sampling=dict(max_tokens=2))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "maximum of 6 requests" in e.value.details()
    assert dict(e.value.trailing_metadata())["retry-after-ms"] == "1000"
    stream.cancel()
    for call in queued:  # the queued ones are served once the slot frees
        assert list(call)[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    wait_idle(cluster)


def test_short_request_is_not_held_behind_a_long_prompt(served_checkpoint):
    sections = {"worker": {"max_num_batched_tokens": 64, "max_prefill_chunk_tokens": 32}}
    with Cluster(served_checkpoint, num_workers=1, sections=sections) as cluster:
        results = {}

        def client(name, ids, max_tokens):
            results[name] = generate(cluster.stub, prompt_token_ids=ids,
                                     sampling=dict(max_tokens=max_tokens, ignore_eos=True))[2]

        long = threading.Thread(target=client, args=("long", list(range(3, 303)) + list(range(3, 183)), 4))
        long.start()
        time.sleep(0.02)
        client("short", [7, 8, 9], 4)
        long.join(timeout=60)
        # Chunked prefill lets the short prompt in between the long prompt's chunks.
        assert results["short"].timing.time_to_first_token_ms < results["long"].timing.time_to_first_token_ms
