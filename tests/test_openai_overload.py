"""The OpenAI HTTP API under overload and shutdown, each on a gateway of its own in front of
model-free workers: 429 with Retry-After past the stream limit, 503 with no live worker and while
draining (streams in flight finish), a request of more sequences than the queue holds (400), and a
drain past its grace (unfinished requests logged CANCELLED)."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx2 as httpx
import openai
import pytest

from bench.cluster_process import free_port
from gateway_fake_cluster import FakeCluster

pytestmark = pytest.mark.timeout(300)
MODEL = "llama"


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def test_stream_limit_is_429_with_retry_after(served_checkpoint):
    gateway = {"http_port": free_port(), "max_concurrent_streams": 1}
    with FakeCluster(served_checkpoint, step_ms=20, sections={"gateway": gateway, "queues": {"retry_after_ms": 1500}}
                     ) as cluster, httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}", timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=completion(max_tokens=100, stream=True)) as first:
            assert first.status_code == 200
            r = http.post("/v1/completions", json=completion())
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["type"] == "rate_limit_error"
            with openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="x",
                               max_retries=0) as client, pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            lines = [line for line in first.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"


def test_no_live_worker_is_503_and_health_says_so(served_checkpoint):
    gateway = {"http_port": free_port(), "heartbeat_timeout_s": 0.5, "resume_grace_s": 0.0}
    with FakeCluster(served_checkpoint, step_ms=5, sections={"gateway": gateway}) as cluster, \
            httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}", timeout=30) as http:
        assert http.get("/health").status_code == 200
        cluster.kill_worker("worker-0")
        deadline = time.monotonic() + 10
        while http.get("/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = http.post("/v1/completions", json=completion())
        assert r.status_code == 503 and "no worker" in r.json()["error"]["message"]


def test_sigterm_drains_http_streams_and_refuses_new_ones_503(served_checkpoint):
    gateway = {"http_port": free_port(), "drain_grace_s": 30.0}
    with FakeCluster(served_checkpoint, step_ms=10, sections={"gateway": gateway}) as cluster, \
            httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}", timeout=30) as http:
        # The fake worker's token is a lone byte: only its ids stream before the end.
        body = completion(max_tokens=150, stream=True, return_token_ids=True)
        with http.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            cluster.procs["gateway"].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while http.get("/health").status_code != 503:  # the gateway has taken the signal
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = http.post("/v1/completions", json=completion())
            assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
            lines = [line for line in stream.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        # Every one of the 150 tokens arrived (a stream that fell behind carries several in a chunk).
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert sum(len(c["choices"][0].get("token_ids") or []) for c in chunks) == 150
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert cluster.procs["gateway"].wait(timeout=30) == 0


def test_more_sequences_than_the_queue_holds_is_400_not_429(served_checkpoint):
    gateway = {"http_port": free_port(), "max_prompts": 8}
    with FakeCluster(served_checkpoint, step_ms=5, sections={"gateway": gateway,
                                                             "queues": {"max_queued_requests": 8}}) as cluster, \
            httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}", timeout=30) as http:
        r = http.post("/v1/completions", json=completion(prompt=["a", "b", "c"], n=3))
        assert r.status_code == 400 and "max_queued_requests" in r.json()["error"]["message"]
        assert cluster.status().num_queued == 0
        assert http.post("/v1/completions", json=completion(prompt=["a", "b"], n=4)).status_code == 200


def test_a_drain_past_its_grace_logs_unfinished_http_requests_cancelled(served_checkpoint):
    gateway = {"http_port": free_port(), "drain_grace_s": 0.5}
    with FakeCluster(served_checkpoint, step_ms=20, sections={"gateway": gateway}) as cluster:
        outcome: dict = {}

        def long_one():
            try:
                outcome["status"] = httpx.post(f"http://127.0.0.1:{cluster.http_port}/v1/completions",
                                               json=completion(max_tokens=1000), headers={"x-request-id": "cut-off"},
                                               timeout=30).status_code
            except httpx.HTTPError as e:
                outcome["status"] = type(e).__name__

        thread = threading.Thread(target=long_one)
        thread.start()
        deadline = time.monotonic() + 10
        while cluster.status().workers[0].num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cluster.procs["gateway"].send_signal(signal.SIGTERM)
        thread.join(30)
        assert cluster.procs["gateway"].wait(timeout=30) == 0
        [record] = [r for r in cluster.request_records() if r["request_id"] == "cut-off"]
        assert record["status_code"] == "CANCELLED" and record["completion_tokens"] < 1000
        assert outcome["status"] != 200
