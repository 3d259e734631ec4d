"""The OpenAI-compatible HTTP API against a real gateway and two real workers, driven by the
official `openai` client (sync and async): outputs equal the gRPC path's and the in-process
engine's, n, logprobs, stop, echo, streaming, concurrency, cancellation and the side endpoints."""
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

from bench.cluster_process import free_port
from cluster_harness import LONG_MAX_TOKENS, SERVED_MAX_POSITIONS, Cluster, generate, wait_all_free

pytestmark = pytest.mark.timeout(300)
MODEL = "llama"  # the served checkpoint's folder name


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=2, sections={"gateway": {"http_port": free_port()}}) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(cluster):
    return f"http://127.0.0.1:{cluster.http_port}"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine(served_checkpoint):
    from worker.engine import Engine
    return Engine.from_model_dir(served_checkpoint, num_kv_blocks=256)


def greedy(engine, prompt_ids: list[int], max_tokens: int, **params):
    from worker.engine import SamplingParams
    [out] = engine.generate([prompt_ids], [SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)],
                            use_tqdm=False)
    return out


def request_records(cluster) -> list[dict]:
    records = []
    for line in cluster.logs("gateway").splitlines():
        if '"event":"request"' in line:
            records.append(json.loads(line[line.index("{"):]))
    return records


# ---- equality with the gRPC path and the engine -----------------------------------------------------
def test_greedy_completion_equals_grpc_and_engine(client, cluster, engine, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    expected = greedy(engine, ids, 24, ignore_eos=True).token_ids
    grpc_ids, grpc_text, _ = generate(cluster.stub, prompt=prompt,
                                      sampling=dict(max_tokens=24, temperature=0.0, ignore_eos=True))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    [choice] = r.choices
    assert choice.token_ids == expected == grpc_ids
    assert choice.prompt_token_ids == ids
    assert choice.text == grpc_text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == len(ids) + 24
    assert r.model == MODEL and r.object == "text_completion"


def test_streamed_chat_equals_unstreamed_and_engine(client, engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld"}]
    ids = tokenizer.encode_chat(messages)
    expected = greedy(engine, ids, 20, ignore_eos=True).token_ids
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    assert whole.choices[0].token_ids == expected
    assert whole.prompt_token_ids == ids
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert content == whole.choices[0].message.content == tokenizer.decode(expected)
    assert streamed_ids == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == len(ids)


def test_a_chat_without_max_tokens_runs_to_the_context_within_the_kv_pool(served_checkpoint):
    """OpenAI's and vLLM's default for a chat: as many tokens as fit, here the worker's 8-block
    pool (128 tokens), not the model's 8192 positions; a plain prompt keeps the gateway's default."""
    sections = {"gateway": {"http_port": free_port(), "default_max_tokens": 5},
                "worker": {"num_kv_blocks": 8, "block_size": 16}}
    with Cluster(served_checkpoint, num_workers=1, sections=sections) as small, \
            openai.OpenAI(base_url=f"http://127.0.0.1:{small.http_port}/v1", api_key="unused", max_retries=0,
                          timeout=60) as c:
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                         extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 8 * 16
        plain = c.completions.create(model=MODEL, prompt="go on", extra_body={"ignore_eos": True})
        assert plain.usage.completion_tokens == 5


def test_text_parts_render_like_a_string(client):
    as_string = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a\nb"}],
                                               max_tokens=6, temperature=0)
    as_parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_tokens=6, temperature=0)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


def test_async_client_prompt_forms(base_url, engine, tokenizer):
    prompts = ["The quick brown fox", "Paged attention"]
    ids = [tokenizer.encode(p) for p in prompts]
    expected = [greedy(engine, i, 12, ignore_eos=True).token_ids for i in ids]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
            extra = {"return_token_ids": True, "ignore_eos": True}
            by_text = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                                      extra_body=extra)
            by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                                     extra_body=extra)
            one_ids = await client.completions.create(model=MODEL, prompt=ids[1], max_tokens=12, temperature=0,
                                                      extra_body=extra)
            stream = await client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0,
                                                     stream=True, extra_body=extra)
            streamed = [c async for c in stream]
            return by_text, by_ids, one_ids, streamed

    by_text, by_ids, one_ids, streamed = asyncio.run(run())
    assert [c.token_ids for c in by_text.choices] == expected == [c.token_ids for c in by_ids.choices]
    assert [c.index for c in by_text.choices] == [0, 1]
    assert one_ids.choices[0].token_ids == expected[1]
    assert [t for c in streamed for t in (c.choices[0].model_extra.get("token_ids") or [])] == expected[0]
    assert "".join(c.choices[0].text for c in streamed) == by_text.choices[0].text


# ---- n, logprobs, stop, echo ------------------------------------------------------------------------
def test_n_choices_identical_when_greedy_and_distinct_when_seeded(client):
    greedy_choices = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=0,
                                               extra_body={"return_token_ids": True, "ignore_eos": True}).choices
    assert [c.index for c in greedy_choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in greedy_choices}) == 1
    seeded = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=1.0, seed=7,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len({tuple(c.token_ids) for c in seeded.choices}) == 3
    again = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=1.0, seed=7,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in seeded.choices]
    assert seeded.usage.completion_tokens == 48 and seeded.usage.prompt_tokens == len(seeded.choices[0].prompt_token_ids)
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                                   max_tokens=8, temperature=0, stream=True))
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    assert sorted(by_index) == [0, 1, 2] and len(set(by_index.values())) == 1


def test_logprobs_equal_the_engines(client, engine, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    expected = greedy(engine, ids, 10, ignore_eos=True, logprobs=True, top_logprobs=3)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].token_ids == expected.token_ids
    assert all(abs(a - b) <= 1e-5 for a, b in zip(lp.token_logprobs, expected.logprobs, strict=True))
    for top, chosen_lp in zip(lp.top_logprobs, lp.token_logprobs):
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert abs(max(values) - chosen_lp) <= 1e-6  # greedy: the chosen token is the most likely one
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0.8, seed=3, logprobs=True, top_logprobs=20,
                                          extra_body={"return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].token_ids)
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 20 and tops == sorted(tops, reverse=True)  # OpenAI's chat bound
        # Sampled, not greedy: the chosen token is at most as likely as the most likely one.
        assert entry.logprob <= tops[0] + 1e-6 and entry.logprob <= 0
        # A whole character's token has its text's bytes; a part of one has its raw bytes.
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token


def test_stop_strings_and_echo(client, tokenizer):
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    assert stop and stop not in base[:5]
    stopped = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.text == base[:base.index(stop)] and stopped.finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, stop=stop,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == stopped.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text == "Hello" + base
    echoed_ids = client.completions.create(model=MODEL, prompt=tokenizer.encode("Hello"), max_tokens=4,
                                           temperature=0, echo=True).choices[0]
    assert echoed_ids.text.startswith(tokenizer.decode(tokenizer.encode("Hello")))


def test_sampling_extensions_reach_the_worker(client, engine, tokenizer):
    ids = tokenizer.encode("Hello")
    eos = tokenizer.special.eos_ids[0]
    # Pushing EOS up makes it the greedy choice at once, unless min_tokens holds it back.
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0, logit_bias={str(eos): 100},
                                  extra_body={"min_tokens": 5, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and len(choice.token_ids) == 6 and choice.token_ids[-1] == eos
    expected = greedy(engine, ids, 12, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5).token_ids
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, presence_penalty=1.5,
                                  frequency_penalty=0.5, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == expected


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
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
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


def test_grpc_logprobs_match_http(client, cluster, tokenizer):
    ids = tokenizer.encode("Hello")
    from protos import inference_pb2
    request = inference_pb2.GenerateRequest(prompt_token_ids=ids, sampling=inference_pb2.SamplingOptions(
        max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True))
    entries = [lp for response in cluster.stub.Generate(request, timeout=30) for lp in response.logprobs]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [e.token_id for e in entries] == r.choices[0].token_ids
    assert [round(e.logprob, 5) for e in entries] == [round(x, 5) for x in r.choices[0].logprobs.token_logprobs]
    assert all(len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob for e in entries)


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


def test_logprob_bytes_rebuild_the_text_and_streamed_offsets_equal_whole(client):
    # Special tokens (ids 0-2) are kept out, so the bytes of the tokens are exactly the text's.
    no_specials = {str(t): -100 for t in (0, 1, 2)}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "héllo wörld 日本語"}],
                                          max_tokens=24, temperature=0, logprobs=True, logit_bias=no_specials,
                                          extra_body={"ignore_eos": True})
    raw = b"".join(bytes(e.bytes) for e in chat.choices[0].logprobs.content)
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content
    fields = dict(model=MODEL, prompt="héllo wörld", max_tokens=24, temperature=0, logprobs=2, echo=False,
                  logit_bias=no_specials, extra_body={"ignore_eos": True})
    whole = client.completions.create(**fields).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **fields)
                if c.choices[0].logprobs is not None]
    assert [o for lp in streamed for o in lp.text_offset] == whole.text_offset
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens


def test_the_end_of_sequence_token_has_no_logprob_entry(client):
    """An answer that ends on EOS counts it in usage, but its text has none of it, and neither do
    its log-probabilities (OpenAI lists no end token), whole or streamed."""
    eos_after_four = dict(model=MODEL, max_tokens=16, temperature=0, logit_bias={"0": -100, "1": -100, "2": 100},
                          extra_body={"min_tokens": 4})
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hello"}], logprobs=True,
                                          **eos_after_four)
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and chat.usage.completion_tokens == 5
    assert len(choice.logprobs.content) == 4
    raw = b"".join(bytes(e.bytes) for e in choice.logprobs.content)
    assert raw.decode("utf-8", errors="replace") == choice.message.content
    whole = client.completions.create(prompt="hello", logprobs=1, **eos_after_four).choices[0]
    assert whole.finish_reason == "stop" and "".join(whole.logprobs.tokens) == whole.text
    assert len(whole.logprobs.tokens) == len(whole.logprobs.text_offset) == 4
    streamed = [c.choices[0].logprobs for c in client.completions.create(prompt="hello", logprobs=1, stream=True,
                                                                         **eos_after_four)
                if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset


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
