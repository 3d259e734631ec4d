"""The OpenAI-compatible HTTP API serving a real gateway's load over two real workers: concurrent streams,
cancellation and disconnects, deadlines, bad requests beside good ones, sessions and n on one worker, and
the side endpoints and headers."""
from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
import urllib.request

import httpx2 as httpx
import openai
import pytest

import openai_api_harness as harness
from cluster_harness import LONG_MAX_TOKENS, SERVED_MAX_POSITIONS, wait_all_free
from openai_api_harness import MODEL, greedy, request_records

pytestmark = pytest.mark.timeout(300)
# The harness's module-scoped fixtures, bound here for pytest to find: each module starts its own cluster.
cluster, base_url, client, engine = harness.cluster, harness.base_url, harness.client, harness.engine


# ---- concurrency and cancellation -------------------------------------------------------------------
def test_sixteen_concurrent_sse_streams(base_url, engine, tokenizer):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(4, 100))] for _ in range(16)]
    max_tokens = [rng.randint(8, 32) for _ in prompts]
    expected = [greedy(engine, p, m, ignore_eos=True).token_ids for p, m in zip(prompts, max_tokens)]

    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i],
                                                 temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True})
        return [t async for c in stream for t in (c.choices[0].model_extra.get("token_ids") or [])]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    assert asyncio.run(run()) == expected


def test_cancel_storm_leaves_every_pool_free(base_url, cluster):
    rng = random.Random(1)

    async def dropped(http, i):
        body = {"model": MODEL, "prompt": [rng.randrange(3, 320) for _ in range(rng.randint(4, 200))],
                "max_tokens": LONG_MAX_TOKENS // 4, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            chunks = rng.randint(0, 6)
            async for _ in response.aiter_lines():
                chunks -= 1
                if chunks <= 0:
                    break  # leaving the block closes the connection mid-stream

    async def abandoned(http):
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            await http.post("/v1/completions", json=body, timeout=rng.uniform(0.02, 0.1))  # far inside a long generation, however fast the engine

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            await asyncio.gather(*(dropped(http, i) for i in range(24)), *(abandoned(http) for _ in range(6)))

    asyncio.run(run())
    wait_all_free(cluster)


def test_a_client_that_disconnects_mid_stream_costs_no_further_compute(base_url, cluster):
    request_id = f"gone-{time.monotonic_ns()}"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG_MAX_TOKENS, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body, headers={"x-request-id": request_id}) as response:
            assert response.headers["x-request-id"] == request_id
            assert response.headers["x-worker-id"].startswith("worker-")
            for i, _ in enumerate(response.iter_lines()):
                if i >= 6:
                    break
    deadline = time.monotonic() + 5
    while not (records := [r for r in request_records(cluster) if r["request_id"] == request_id]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    [record] = records
    assert record["status_code"] == "CANCELLED"
    assert record["completion_tokens"] < LONG_MAX_TOKENS // 4
    # Nothing is computed for it after the cancel: the worker goes idle and the pools free. (Waited
    # for after the record, not before: the cluster status is the workers' last heartbeats, and a
    # fast engine can stream six tokens inside one heartbeat, so a status read at the disconnect
    # may still be the idle one from before the request.)
    wait_all_free(cluster, timeout_s=5)


# ---- the side endpoints -----------------------------------------------------------------------------
def test_models_health_metrics_openapi_and_headers(client, base_url):
    [card] = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == SERVED_MAX_POSITIONS
    assert client.models.retrieve(MODEL).id == MODEL
    with urllib.request.urlopen(f"{base_url}/health", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "inference_request_status_total" in text
    with urllib.request.urlopen(f"{base_url}/openapi.json", timeout=5) as r:
        schema = json.loads(r.read())
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "logprobs", "echo", "top_k", "return_token_ids", "stream_options"} <= set(props)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                      extra_headers={"x-request-id": "my-id-1"})
    assert raw.headers["x-request-id"] == "my-id-1" and raw.parse().id == "my-id-1"
    assert raw.headers["x-worker-id"].startswith("worker-")
    assert float(raw.headers["x-total-ms"]) >= float(raw.headers["x-ttft-ms"]) > 0
    assert not math.isnan(float(raw.headers["x-queue-ms"]))


def test_timeout_ends_a_request_504_and_frees_its_blocks(client, cluster):
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=LONG_MAX_TOKENS,
                                  extra_body={"ignore_eos": True, "timeout": 0.1})  # far inside a long generation, however fast the engine
    assert e.value.status_code == 504
    assert "deadline" in e.value.message
    wait_all_free(cluster, timeout_s=5)


def test_a_deadline_after_the_stream_started_ends_it_with_an_error_event(base_url, client, cluster):
    """Once the first chunk is out the status is 200, so a later failure is the stream's last event:
    OpenAI's error body, no [DONE], and the `openai` client raises it."""
    # return_token_ids: every token is a chunk, even one whose text waits on a character's next bytes.
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG_MAX_TOKENS, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    lines: list[str] = []
    with httpx.Client(base_url=base_url, timeout=60) as http:
        # The shortest deadline that still lets the first tokens out on this machine: a longer one
        # only when the previous ended before the stream began (a plain 504).
        for timeout_s in (0.5, 1.0, 2.0, 4.0):
            with http.stream("POST", "/v1/completions", json={**body, "timeout": timeout_s}) as response:
                if response.status_code == 504:
                    continue
                assert response.status_code == 200
                # SSE ends lines at \n only; iter_lines also at the Unicode breaks (\x1c, \x85, U+2028)
                # that a generated text may hold.
                lines = [line for line in response.read().decode().split("\n") if line.startswith("data: ")]
                break
    assert len(lines) > 1, "every deadline ended the request before its stream began"
    assert "data: [DONE]" not in lines
    last = json.loads(lines[-1].removeprefix("data: "))
    assert set(last) == {"error"}
    assert last["error"]["code"] == "deadline_exceeded" and "deadline" in last["error"]["message"]
    assert last["error"]["type"] == "timeout"
    assert all("choices" in json.loads(line.removeprefix("data: ")) for line in lines[:-1])

    chunks = 0
    for timeout_s in (0.5, 1.0, 2.0, 4.0):
        try:
            stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=LONG_MAX_TOKENS, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True,
                                                           "timeout": timeout_s})
        except openai.APIStatusError as e:  # ended before the stream began: a plain 504
            assert e.status_code == 504
            continue
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                chunks += 1
        break
    assert chunks >= 1, "every deadline ended the request before its stream began"
    assert type(e.value) is openai.APIError and "deadline" in str(e.value)  # the event, not a status
    wait_all_free(cluster, timeout_s=5)


def test_other_streams_keep_being_served_beside_bad_requests(base_url, engine, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    expected = greedy(engine, ids, 40, ignore_eos=True).token_ids
    result: dict = {}

    def good():
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as c:
            result["ids"] = c.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True}
                                                 ).choices[0].token_ids

    thread = threading.Thread(target=good)
    thread.start()
    with httpx.Client(base_url=base_url, timeout=30) as http:
        for body in (b"{not json", b'{"model": "llama", "prompt": 5}', b'{"model": "llama", "prompt": "x", "n": 99}'):
            r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    thread.join(60)
    assert result["ids"] == expected


def test_turns_of_one_session_find_the_previous_turns_cached_on_their_worker(base_url, cluster, tokenizer):
    """Six conversations of three turns at once over two workers: with `user` as the session, each
    turn goes to the worker of the turn before and finds that turn's prompt in its prefix cache."""
    rng = random.Random(7)

    async def conversation(client, c: int) -> list[tuple[str, int, int]]:
        history = [rng.randrange(3, 320) for _ in range(40 + 10 * c)]
        turns = []
        for _ in range(3):
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt=history, max_tokens=12, temperature=0, user=f"conversation-{c}",
                extra_body={"return_token_ids": True, "ignore_eos": True})
            r = raw.parse()
            turns.append((raw.headers["x-worker-id"], len(history), r.usage.prompt_tokens_details.cached_tokens))
            history = history + r.choices[0].token_ids + [rng.randrange(3, 320) for _ in range(20)]
        return turns

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(conversation(client, c) for c in range(6)))

    conversations = asyncio.run(run())
    for turns in conversations:
        for (worker, prompt_len, _), (next_worker, _, cached) in zip(turns, turns[1:]):
            assert next_worker == worker
            assert cached >= prompt_len // 16 * 16  # every full block of the previous turn's prompt
    assert len({turns[0][0] for turns in conversations}) == 2  # the sessions themselves spread


def test_n_choices_of_a_prompt_run_on_one_worker_and_prefill_it_once(client, cluster):
    prompt = [random.Random(3).randrange(3, 320) for _ in range(100)]
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, n=4, max_tokens=8, temperature=1.0,
                                                      seed=1, extra_headers={"x-request-id": "four-choices"})
    assert raw.headers["x-worker-id"].count(",") == 0  # one worker for all four
    deadline = time.monotonic() + 5
    while len(records := [r for r in request_records(cluster) if r["request_id"].startswith("four-choices-")]) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cached = sorted(r["cached_prompt_tokens"] for r in records)
    assert cached[0] == 0 and all(c >= 96 for c in cached[1:])  # the prompt's six full blocks, computed once
