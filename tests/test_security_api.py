"""Who may call, on a real cluster with API keys: gRPC (grpcio) and HTTP (the official `openai`
client) refuse a missing or wrong key before any work, enforce each key's request and token
rates, stream cap and priority floor, keep each key's requests its own (Abort of another's is
NOT_FOUND), keep ProbeWorker for admins, leave health open, and never write a key anywhere."""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bench.cluster_process import free_port
from cluster_harness import LONG_MAX_TOKENS, Cluster
from protos import inference_pb2

pytestmark = pytest.mark.timeout(300)
KEYS = {
    "admin": ("admin-key-6f1c2e9a0b7d4c3e", "role=admin"),
    "user": ("user-key-0d9e8f7a6b5c4d3e", ""),
    "other": ("other-key-1a2b3c4d5e6f7a8b", ""),
    "limited": ("limited-key-9f8e7d6c5b4a", "rpm=2"),
    "tokens": ("tokens-key-5e4d3c2b1a0f", "tpm=100"),
    "early": ("early-key-4d3c2b1a0f9e", "tpm=100"),
    "prompts": ("prompts-key-2b1a0f9e8d7c", "tpm=100"),
    "floor": ("floor-key-3c2b1a0f9e8d7c", "priority_floor=0"),
    "single": ("single-key-7b6a5f4e3d2c1b", "streams=1"),
    "once": ("once-key-8c7b6a5f4e3d2c1b", "rpm=1"),
}


ORIGIN = "https://chat.example"


def bearer(name: str) -> tuple:
    return (("authorization", f"Bearer {KEYS[name][0]}"),)


@pytest.fixture(scope="module")
def cluster(served_checkpoint, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "api_keys"
    keys_file.write_text("".join(f"{key} name={name} {extra}\n" for name, (key, extra) in KEYS.items()))
    sections = {"gateway": {"api_keys_file": str(keys_file), "http_port": free_port(),
                            "cors_allow_origins": [ORIGIN]}}
    with Cluster(served_checkpoint, num_workers=1, sections=sections, api_key=KEYS["admin"][0]) as c:
        yield c


def generate(cluster, name: str | None, request_id: str = "", max_tokens: int = 4, priority: int = 0,
             prompt=(5, 6, 7, 8)):
    request = inference_pb2.GenerateRequest(prompt_token_ids=list(prompt), request_id=request_id, priority=priority,
                                            sampling=inference_pb2.SamplingOptions(max_tokens=max_tokens,
                                                                                   ignore_eos=True))
    call = cluster.stub.Generate(request, timeout=60, metadata=bearer(name) if name else ())
    return call, [r for r in call]


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


def records(cluster) -> list[dict]:
    text = (cluster.run_dir / "gateway.log").read_text(errors="replace")
    return [json.loads(line[line.index("{"):]) for line in text.splitlines() if '"event":"request"' in line]


def test_a_missing_or_wrong_key_is_refused_before_any_work(cluster):
    for metadata in ((), (("authorization", "Bearer not-a-key-at-all-0000"),), (("authorization", "Basic xyz"),)):
        request = inference_pb2.GenerateRequest(prompt="hello", request_id="no-key")
        e = code_of(lambda: list(cluster.stub.Generate(request, timeout=10, metadata=metadata)))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.details()
        e = code_of(lambda: cluster.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=5,
                                                          metadata=metadata))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    refused = [r for r in records(cluster) if r["request_id"] == "no-key"]
    assert len(refused) == 3 and all(r["status_code"] == "UNAUTHENTICATED" and "prompt_tokens" not in r
                                     for r in refused)
    _, responses = generate(cluster, "user")
    assert len([t for r in responses for t in r.token_ids]) == 4


def test_health_and_reflection_need_no_key(cluster):
    health = health_pb2_grpc.HealthStub(cluster.channel)
    # Answered without a key; SERVING once a worker's heartbeat is current (a loaded host can let
    # one lapse for a moment), so the status is polled, bounded.
    deadline = time.monotonic() + 20
    while (status := health.Check(health_pb2.HealthCheckRequest(), timeout=5).status) != \
            health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5)
    assert "inference.v1.InferenceService" in {s.name for a in answers for s in a.list_services_response.service}
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/health", timeout=5) as r:
        assert r.status == 200


def test_a_key_over_its_request_rate_gets_resource_exhausted_with_a_retry_hint(cluster):
    for _ in range(2):
        generate(cluster, "limited")
    e = code_of(lambda: generate(cluster, "limited"))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 requests per minute" in e.details()
    assert 1 <= int(dict(e.trailing_metadata())["retry-after-ms"]) <= 60_000
    generate(cluster, "user")  # other keys are not affected


def test_a_key_over_its_token_rate_is_refused_after_tokenizing(cluster):
    generate(cluster, "tokens", max_tokens=56)  # 4 prompt + 56 = 60 of 100
    e = code_of(lambda: generate(cluster, "tokens", max_tokens=56))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "100 tokens per minute" in e.details()
    e = code_of(lambda: generate(cluster, "tokens", max_tokens=200))
    assert "more than the key may use in a minute" in e.details()
    # Over HTTP: a 429 the openai client is told not to retry (it never fits), with no Retry-After.
    request = urllib.request.Request(
        f"http://127.0.0.1:{cluster.http_port}/v1/completions", method="POST",
        data=json.dumps({"model": "llama", "prompt": [5, 6, 7, 8], "max_tokens": 200}).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {KEYS['tokens'][0]}"})
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(request, timeout=30)
    assert http_error.value.code == 429 and http_error.value.headers["x-should-retry"] == "false"
    assert "retry-after" not in http_error.value.headers


def test_a_request_that_ends_early_gives_its_unused_tokens_back(cluster):
    def greedy(name: str, max_tokens: int, stop_token_ids=()):
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7, 8], sampling=inference_pb2.SamplingOptions(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=list(stop_token_ids)))
        return [r for r in cluster.stub.Generate(request, timeout=60, metadata=bearer(name))]

    # Greedy, so the same prompt generates the same tokens: stop at the second one.
    second = [t for r in greedy("user", 4) for t in r.token_ids][1]
    for _ in range(3):  # 84 charged each time, of 100 a minute: only the 2 generated stay spent
        responses = greedy("early", 80, [second])
        assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_STOP
        assert len([t for r in responses for t in r.token_ids]) <= 2


def test_a_request_refused_part_way_gives_its_charge_back(cluster, served_checkpoint):
    base_url = f"http://127.0.0.1:{cluster.http_port}/v1"
    vocab = json.loads((served_checkpoint / "config.json").read_text())["vocab_size"]
    with openai.OpenAI(base_url=base_url, api_key=KEYS["prompts"][0], max_retries=0, timeout=30) as client:
        for _ in range(3):  # the first prompt is charged 44 of 100 before the second is refused
            with pytest.raises(openai.BadRequestError, match="vocab"):
                client.completions.create(model="llama", prompt=[[5, 6, 7, 8], [vocab + 5]],
                                          max_tokens=40)
        done = client.completions.create(model="llama", prompt=[[5, 6, 7, 8]], max_tokens=40,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 40


def test_a_priority_floor_is_applied_not_refused(cluster):
    generate(cluster, "floor", request_id="floored", priority=-5)
    generate(cluster, "user", request_id="urgent", priority=-5)
    by_id = {r["request_id"]: r for r in records(cluster) if r.get("status_code") == "OK"}
    assert by_id["floored"]["priority"] == 0 and by_id["floored"]["api_key"] == "floor"
    assert by_id["urgent"]["priority"] == -5 and by_id["urgent"]["api_key"] == "user"


def test_a_request_belongs_to_its_key(cluster):
    call, done = None, threading.Event()

    def run():
        nonlocal call
        call = cluster.stub.Generate(inference_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7], request_id="mine",
            sampling=inference_pb2.SamplingOptions(max_tokens=LONG_MAX_TOKENS, ignore_eos=True)),
            timeout=60, metadata=bearer("user"))
        try:
            for _ in call:
                done.set()
        except grpc.RpcError:
            pass
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert done.wait(30)
    # Another key sees no request of that id, exactly as if there were none, and may use the id itself.
    e = code_of(lambda: cluster.stub.Abort(inference_pb2.AbortRequest(request_id="mine"), timeout=5,
                                           metadata=bearer("other")))
    assert e.code() == grpc.StatusCode.NOT_FOUND
    unknown = code_of(lambda: cluster.stub.Abort(inference_pb2.AbortRequest(request_id="mine"), timeout=5,
                                                 metadata=bearer("admin")))  # no request of that id in its name
    assert (e.code(), e.details()) == (unknown.code(), unknown.details())
    _, responses = generate(cluster, "other", request_id="mine")
    assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    cluster.stub.Abort(inference_pb2.AbortRequest(request_id="mine"), timeout=5, metadata=bearer("user"))
    thread.join(30)
    assert call.code() == grpc.StatusCode.OK and not thread.is_alive()


def test_probes_need_the_admin_role_and_status_needs_a_key(cluster):
    probe = inference_pb2.ProbeWorkerRequest(worker_id="worker-0", memory_report=True)
    e = code_of(lambda: cluster.stub.ProbeWorker(probe, timeout=10, metadata=bearer("user")))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "admin" in e.details()
    assert cluster.stub.ProbeWorker(probe, timeout=10, metadata=bearer("admin")).ok
    status = cluster.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=5, metadata=bearer("user"))
    assert [w.worker_id for w in status.workers] == ["worker-0"]


def test_a_key_at_its_stream_cap_gets_resource_exhausted(cluster):
    first = cluster.stub.Generate(inference_pb2.GenerateRequest(
        prompt_token_ids=[5, 6], sampling=inference_pb2.SamplingOptions(max_tokens=LONG_MAX_TOKENS, ignore_eos=True)),
        timeout=60, metadata=bearer("single"))
    next(first)  # open and streaming
    e = code_of(lambda: generate(cluster, "single"))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 streams open" in e.details()
    first.cancel()
    deadline = time.monotonic() + 10
    while True:  # the slot comes back when the stream ends
        try:
            generate(cluster, "single")
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.05)


def test_a_browser_page_of_an_allowed_origin_may_call_with_a_key(cluster):
    url = f"http://127.0.0.1:{cluster.http_port}/v1/chat/completions"

    def call(method: str, origin: str, headers: dict, data: bytes | None = None):
        request = urllib.request.Request(url, method=method, data=data, headers={"origin": origin, **headers})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    # A preflight carries no key: answered before the key check, for the allowed origin only.
    status, headers, _ = call("OPTIONS", ORIGIN, preflight)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = call("OPTIONS", "https://elsewhere.example", preflight)
    assert status == 400 and "access-control-allow-origin" not in headers
    body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    status, headers, _ = call("POST", ORIGIN, {"content-type": "application/json",
                                               "authorization": f"Bearer {KEYS['user'][0]}"}, body)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in headers["access-control-expose-headers"]
    # The call itself still needs a key.
    status, _, _ = call("POST", ORIGIN, {"content-type": "application/json"}, body)
    assert status == 401


def test_the_openai_client_needs_a_valid_key(cluster):
    base_url = f"http://127.0.0.1:{cluster.http_port}/v1"
    with openai.OpenAI(base_url=base_url, api_key="wrong-key-0000000000000000", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.AuthenticationError) as e:
            client.completions.create(model="llama", prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and "not valid" in e.value.message and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    no_header = urllib.request.Request(f"{base_url}/completions", data=json.dumps(
        {"model": "llama", "prompt": "hi", "max_tokens": 2}).encode(), headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(no_header, timeout=5)
    assert e.value.code == 401 and "a valid API key is required" in json.loads(e.value.read())["error"]["message"]
    tokenize = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/tokenize", data=json.dumps(
        {"prompt": "hi"}).encode(), headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(tokenize, timeout=5)
    assert e.value.code == 401
    tokenize.add_header("authorization", f"Bearer {KEYS['user'][0]}")
    assert json.loads(urllib.request.urlopen(tokenize, timeout=5).read())["count"] >= 1
    with openai.OpenAI(base_url=base_url, api_key=KEYS["user"][0], max_retries=0, timeout=30) as client:
        assert client.completions.create(model="llama", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    with openai.OpenAI(base_url=base_url, api_key=KEYS["limited"][0], max_retries=0, timeout=30) as client:
        with pytest.raises(openai.RateLimitError) as e:
            for _ in range(3):
                client.completions.create(model="llama", prompt="hi", max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/metrics")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=5)
    assert e.value.code == 401 and e.value.headers["www-authenticate"] == "Bearer"


def test_no_key_appears_in_any_log_line_or_metric(cluster):
    generate(cluster, "user")
    texts = [(cluster.run_dir / name).read_text(errors="replace") for name in ("gateway.log", "worker-0.log")]
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/metrics",
                                     headers={"authorization": f"Bearer {KEYS['admin'][0]}"})
    with urllib.request.urlopen(request, timeout=5) as r:
        texts.append(r.read().decode())
    for key, _ in KEYS.values():
        assert not any(key in text for text in texts)
    assert any(r.get("api_key") == "user" for r in records(cluster))


def unauthenticated_total(cluster) -> float:
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/metrics",
                                     headers={"authorization": f"Bearer {KEYS['admin'][0]}"})
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('inference_request_status_total{code="UNAUTHENTICATED"}'))


def test_only_a_generation_refused_for_its_key_is_a_request_in_the_log_and_metrics(cluster):
    """A status, abort or probe call, or a side route, refused for want of a key is not a request:
    no request-log line (an Abort's would name another client's live request), no request counter."""
    before = unauthenticated_total(cluster)
    for call in (lambda: cluster.stub.Abort(inference_pb2.AbortRequest(request_id="abort-no-key"), timeout=5),
                 lambda: cluster.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=5),
                 lambda: cluster.stub.ProbeWorker(inference_pb2.ProbeWorkerRequest(worker_id="worker-0"), timeout=5)):
        assert code_of(call).code() == grpc.StatusCode.UNAUTHENTICATED
    for path in ("/v1/models", "/metrics", "/nowhere"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}{path}",
                                                          headers={"x-request-id": "side-no-key"}), timeout=5)
        assert e.value.code == 401
    assert unauthenticated_total(cluster) == before
    assert not [r for r in records(cluster) if r["request_id"] in ("abort-no-key", "side-no-key")]
    gen = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/v1/completions", data=json.dumps(
        {"model": "llama", "prompt": "hi", "max_tokens": 2}).encode(),
        headers={"content-type": "application/json", "x-request-id": "gen-no-key"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(gen, timeout=5)
    assert e.value.code == 401 and unauthenticated_total(cluster) == before + 1
    [record] = [r for r in records(cluster) if r["request_id"] == "gen-no-key"]
    assert record["status_code"] == "UNAUTHENTICATED"


def test_a_caller_without_a_key_hears_401_before_its_body_is_weighed(cluster):
    connection = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=10)
    try:
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("content-type", "application/json")
        connection.putheader("content-length", str(1 << 40))  # far over gateway.max_body_bytes; never sent
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 401 and "API key" in json.loads(response.read())["error"]["message"]
    finally:
        connection.close()


def test_a_key_over_its_request_rate_hears_429_before_its_body_is_read(cluster):
    """A key with no request left this minute is refused before the gateway reads (and parses, on its
    event loop) a body: sending bodies faster than its limit costs the gateway nothing."""
    generate(cluster, "once")
    connection = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=10)
    try:
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("authorization", f"Bearer {KEYS['once'][0]}")
        connection.putheader("content-type", "application/json")
        connection.putheader("content-length", str(1 << 20))  # within gateway.max_body_bytes; never sent
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 429 and "1 requests per minute" in json.loads(response.read())["error"]["message"]
        assert 1 <= int(response.getheader("retry-after")) <= 60
    finally:
        connection.close()


def test_a_keyed_callers_refusal_is_logged_under_its_key(cluster):
    refused = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/v1/completions", data=json.dumps(
        {"model": "gpt-4", "prompt": "hi", "max_tokens": 2}).encode(),
        headers={"content-type": "application/json", "x-request-id": "keyed-404",
                 "authorization": f"Bearer {KEYS['user'][0]}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(refused, timeout=5)
    assert e.value.code == 404
    long_id = "x" * 200  # over the request id's bound: refused before any other check
    assert code_of(lambda: generate(cluster, "user", request_id=long_id)).code() == grpc.StatusCode.INVALID_ARGUMENT
    by_id = {r["request_id"][:12]: r for r in records(cluster) if r["request_id"] in ("keyed-404",) or
             r["request_id"].startswith("xxxx")}
    assert by_id["keyed-404"]["api_key"] == "user" and by_id["x" * 12]["api_key"] == "user"
