"""The cluster end to end: real gateway and worker processes on loopback and ipc sockets.

One shared two-worker cluster serves the streaming, bad-input, abort and cancel tests;
tests/test_cluster_queues.py and tests/test_cluster_failures.py start their own.
"""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster_harness import SERVED_MAX_POSITIONS, TEST_KV_BLOCKS, Cluster, generate, wait_all_free
from protos import inference_pb2

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=2) as c:
        yield c


def test_sixteen_concurrent_streams_match_the_in_process_engine(cluster, served_checkpoint, tokenizer):
    from worker.engine import Engine, SamplingParams
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(4, 150))] for _ in range(12)]
    texts = ["Once upon a time", "héllo wörld 日本語", "The quick brown fox", "Paged attention"]
    prompts += [tokenizer.encode(t) for t in texts]
    max_tokens = [rng.randint(8, 40) for _ in prompts]
    engine = Engine.from_model_dir(served_checkpoint, num_kv_blocks=256)
    expected = engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens],
                               use_tqdm=False)
    results: dict[int, tuple] = {}

    def client(i: int) -> None:
        fields = dict(prompt=texts[i - 12]) if i >= 12 else dict(prompt_token_ids=prompts[i])
        results[i] = generate(cluster.stub, sampling=dict(max_tokens=max_tokens[i], temperature=0.0), **fields)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(16))
    for i, want in enumerate(expected):
        ids, text, last = results[i]
        assert ids == want.token_ids, f"stream {i}"
        assert text == tokenizer.decode(ids)
        assert inference_pb2.FinishReason.Name(last.finish_reason) == f"FINISH_REASON_{want.finish_reason.upper()}"
        assert last.usage.prompt_tokens == len(prompts[i]) and last.usage.completion_tokens == len(ids)
        assert last.timing.time_to_first_token_ms > 0 and last.timing.total_ms >= last.timing.time_to_first_token_ms
    assert {results[i][2].worker_id for i in results} == {"worker-0", "worker-1"}, "one worker idled"
    wait_all_free(cluster)


def test_chat_messages_use_the_chat_template(cluster, tokenizer):
    messages = [inference_pb2.ChatMessage(role="user", content="hello")]
    ids, _, last = generate(cluster.stub, messages=messages, sampling=dict(max_tokens=4, temperature=0.0))
    rendered = tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert last.usage.prompt_tokens == len(rendered)
    same, _, _ = generate(cluster.stub, prompt_token_ids=rendered, sampling=dict(max_tokens=4, temperature=0.0))
    assert ids == same


def test_stop_string_ends_the_text_before_it(cluster, tokenizer):
    ids, text, _ = generate(cluster.stub, prompt="Once upon", sampling=dict(max_tokens=24, temperature=0.0,
                                                                            ignore_eos=True))
    full = tokenizer.decode(ids)
    stop = full[6:9]
    assert stop.strip(), full
    _, stopped_text, last = generate(cluster.stub, prompt="Once upon",
                                     sampling=dict(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    assert stopped_text == full[:full.find(stop)]
    assert last.finish_reason == inference_pb2.FINISH_REASON_STOP


def test_truncate_keeps_the_last_tokens(cluster):
    long_prompt = list(range(3, 300)) * (SERVED_MAX_POSITIONS // 297 + 1)
    assert len(long_prompt) > SERVED_MAX_POSITIONS
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.stub, prompt_token_ids=long_prompt, sampling=dict(max_tokens=4))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ids, _, last = generate(cluster.stub, prompt_token_ids=long_prompt, truncate_prompt_tokens=100,
                            sampling=dict(max_tokens=4, temperature=0.0))
    assert last.usage.prompt_tokens == 100
    tail, _, _ = generate(cluster.stub, prompt_token_ids=long_prompt[-100:], sampling=dict(max_tokens=4,
                                                                                        temperature=0.0))
    assert ids == tail


BAD_INPUTS = [
    ("empty prompt", dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("prompt and ids", dict(prompt="hi", prompt_token_ids=[5]), grpc.StatusCode.INVALID_ARGUMENT,
     "exactly one"),
    ("ids outside vocab", dict(prompt_token_ids=[5, 320]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("max_tokens zero", dict(prompt="hi", sampling=dict(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT,
     "max_tokens"),
    ("max_tokens negative", dict(prompt="hi", sampling=dict(max_tokens=-3)), grpc.StatusCode.INVALID_ARGUMENT,
     "max_tokens"),
    ("max_tokens beyond context", dict(prompt="hi", sampling=dict(max_tokens=SERVED_MAX_POSITIONS + 1)),
     grpc.StatusCode.INVALID_ARGUMENT, "context"),
    ("negative temperature", dict(prompt="hi", sampling=dict(temperature=-0.5)), grpc.StatusCode.INVALID_ARGUMENT,
     "temperature"),
    ("top_p zero", dict(prompt="hi", sampling=dict(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_p above one", dict(prompt="hi", sampling=dict(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("prompt over context", dict(prompt_token_ids=[5] * (SERVED_MAX_POSITIONS + 1)), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    ("bad role", dict(messages=[inference_pb2.ChatMessage(role="robot", content="x")]),
     grpc.StatusCode.INVALID_ARGUMENT, "role"),
    ("bad request id", dict(prompt="hi", request_id="has space"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ("seed too large", dict(prompt="hi", sampling=dict(seed=2**63)), grpc.StatusCode.INVALID_ARGUMENT, "seed"),
]


@pytest.mark.parametrize("name, fields, code, words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_a_clear_status(cluster, name, fields, code, words):
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.stub, timeout=10, **fields)
    assert e.value.code() == code
    assert words in e.value.details(), e.value.details()
    ids, _, _ = generate(cluster.stub, prompt="still serving", sampling=dict(max_tokens=3))
    assert 1 <= len(ids) <= 3


def test_duplicate_request_id_and_abort(cluster):
    request = inference_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], request_id="dup-1",
                                            sampling=inference_pb2.SamplingOptions(max_tokens=400, ignore_eos=True))
    stream = cluster.stub.Generate(request, timeout=60)
    first = next(stream)  # running now
    assert first.request_id == "dup-1"
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.stub, prompt="x", request_id="dup-1", timeout=10)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-1" in e.value.details()
    cluster.stub.Abort(inference_pb2.AbortRequest(request_id="dup-1"), timeout=5)
    rest = list(stream)
    assert rest[-1].finish_reason == inference_pb2.FINISH_REASON_ABORT
    assert rest[-1].usage.completion_tokens < 400
    with pytest.raises(grpc.RpcError) as e:
        cluster.stub.Abort(inference_pb2.AbortRequest(request_id="dup-1"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "dup-1" in e.value.details()
    wait_all_free(cluster)


def test_cancel_storm_frees_every_block(cluster):
    rng = random.Random(1)
    calls = []
    for i in range(200):
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=[rng.randrange(3, 320) for _ in range(rng.randint(1, 200))],
            sampling=inference_pb2.SamplingOptions(max_tokens=rng.randint(1, 200), ignore_eos=True))
        calls.append(cluster.stub.Generate(request, timeout=120))
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.02)
    # Cancel each at a random moment: some queued, some mid-prefill, some decoding, some done.
    order = list(range(200))
    rng.shuffle(order)
    started = time.monotonic()
    for i in order:
        time.sleep(rng.random() * 0.01)
        calls[i].cancel()
    assert time.monotonic() - started < 60
    status = wait_all_free(cluster, timeout_s=15)
    assert all(w.alive and w.ready for w in status.workers)
    ids, _, _ = generate(cluster.stub, prompt="after the storm", sampling=dict(max_tokens=5))
    assert 1 <= len(ids) <= 5


def test_health_per_worker_and_reflection(cluster):
    health = health_pb2_grpc.HealthStub(cluster.channel)
    for service in ("", "inference.v1.InferenceService", "worker-0", "worker-1"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    reflect = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                           timeout=5)
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"inference.v1.InferenceService", "grpc.health.v1.Health"} <= names


def test_status_reports_every_worker(cluster):
    status = cluster.status()
    assert [w.worker_id for w in status.workers] == ["worker-0", "worker-1"]
    for w in status.workers:
        assert w.alive and w.ready and w.kv_blocks_total == TEST_KV_BLOCKS
        assert w.memory_used_bytes > 0 and w.memory_level == "OK" and w.last_heartbeat_age_s < 1.0
        assert w.device == "cpu"


def _scrape(cluster) -> dict[tuple[str, tuple], float]:
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_and_request_log_count_what_was_served(cluster):
    import json
    before = _scrape(cluster)
    ids = [f"counted-{i}" for i in range(5)]
    served = {rid: generate(cluster.stub, request_id=rid, prompt_token_ids=[5, 6, 7 + i],
                            sampling=dict(max_tokens=6, ignore_eos=True)) for i, rid in enumerate(ids)}
    with pytest.raises(grpc.RpcError):
        generate(cluster.stub, prompt="", timeout=5)
    time.sleep(0.5)  # heartbeats refresh the worker gauges
    after = _scrape(cluster)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("inference_request_success_total", finished_reason="length") == 5
    assert delta("inference_request_status_total", code="OK") == 5
    assert delta("inference_request_rejections_total", reason="invalid_argument") == 1
    assert delta("inference_generation_tokens_total") == 30
    assert delta("inference_prompt_tokens_total") == 15
    assert delta("inference_time_to_first_token_seconds_count", bucket="0") == 5
    assert delta("inference_inter_token_latency_seconds_count", bucket="0") == 25
    for worker in ("worker-0", "worker-1"):
        assert after[("inference_worker_up", (("worker", worker),))] == 1
        assert after[("inference_worker_memory_bytes", (("kind", "resident"), ("worker", worker)))] > 0
    lines = [json.loads(line[line.index("{"):]) for line in
             (cluster.run_dir / "gateway.log").read_text().splitlines() if '"event":"request"' in line]
    records = {r["request_id"]: r for r in lines if r["request_id"] in served}
    assert sorted(records) == sorted(ids) and len([r for r in lines if r["request_id"] in served]) == 5
    for rid, record in records.items():
        token_ids, _, last = served[rid]
        assert record["completion_tokens"] == len(token_ids) == 6 and record["prompt_tokens"] == 3
        assert record["finish_reason"] == "length" and record["status_code"] == "OK"
        assert record["worker_id"] == last.worker_id and record["bucket"] == 0
        assert 0 <= record["queue_ms"] <= record["ttft_ms"] <= record["e2e_ms"]
        assert record["per_output_token_ms"] > 0 and record["resumptions"] == 0


def test_a_request_the_gateway_ends_logs_the_kv_blocks_it_held(cluster):
    import json
    call = cluster.stub.Generate(inference_pb2.GenerateRequest(
        request_id="cut-short", prompt_token_ids=list(range(5, 45)),
        sampling=inference_pb2.SamplingOptions(max_tokens=200, ignore_eos=True)), timeout=60)
    for i, _ in enumerate(call):
        if i == 2:
            call.cancel()  # the gateway ends it: the worker's last delta never reaches its log line
            break
    deadline, record = time.monotonic() + 10, None
    while record is None and time.monotonic() < deadline:
        record = next((json.loads(line[line.index("{"):]) for line in cluster.logs("gateway").splitlines()
                       if '"event":"request"' in line and '"cut-short"' in line), None)
        time.sleep(0.05)
    assert record is not None and record["status_code"] == "CANCELLED"
    assert record["peak_kv_blocks"] >= 40 // 16 and record["preemptions"] == 0


def test_probe_worker(cluster):
    reply = cluster.stub.ProbeWorker(inference_pb2.ProbeWorkerRequest(worker_id="worker-1", deep=True), timeout=15)
    assert reply.ok and reply.latency_ms > 0
    with pytest.raises(grpc.RpcError) as e:
        cluster.stub.ProbeWorker(inference_pb2.ProbeWorkerRequest(worker_id="worker-9"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
