"""The OpenAI-API load generator (bench/openai_load.py) against a tiny in-process SSE server that
streams the way this cluster's gateway does (token_ids per chunk, some chunks carrying two tokens,
a usage chunk with no choices) and the way llama-server does (one token per chunk, then a
text-less final chunk with usage): token counts, chunk times, errors and the requests it sends."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench.load_stats import RequestRecord
from bench.load_workload import LoadSpec, make_load_workload
from bench.openai_load import CLUSTER_EXTRA, ChunkCounter, run_openai_load_async

pytestmark = pytest.mark.timeout(60)
STEP_S = 0.002


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _cluster_style(n: int, prompt: list[int]):
    """Token ids per chunk: 1 first, then 2 at a time; the last token chunk has the finish reason."""
    sent = 0
    while sent < n:
        k = 1 if sent == 0 else min(2, n - sent)
        sent += k
        choice = {"index": 0, "text": "ab" * k, "finish_reason": "length" if sent == n else None,
                  "token_ids": [100] * k}
        if sent == k:
            choice["prompt_token_ids"] = prompt
        yield _sse({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]})
        await asyncio.sleep(STEP_S)
    yield _sse({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}})
    yield "data: [DONE]\n\n"


async def _llama_style(n: int, prompt: list[int], usage_tokens: int):
    for _ in range(n):
        yield _sse({"id": "l", "object": "text_completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "text": "[t1]", "logprobs": None, "finish_reason": None}]})
        await asyncio.sleep(STEP_S)
    yield _sse({"id": "l", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": usage_tokens,
                          "total_tokens": len(prompt) + usage_tokens}})
    yield "data: [DONE]\n\n"


class FakeOpenAi:
    """Behaves by the body's model name: "cluster", "llama", "liar" (usage disagrees) or "busy" (429)."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.request_ids: list[str] = []
        self.app = Starlette(routes=[Route("/v1/models", self.models), Route("/v1/completions", self.completions,
                                                                             methods=["POST"])])

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "cluster", "object": "model"}]})

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("x-request-id", ""))
        n, prompt, model = body["max_tokens"], body["prompt"], body["model"]
        if model == "busy":
            return JSONResponse({"error": {"message": "full", "type": "rate_limit", "code": "resource_exhausted"}},
                                status_code=429)
        stream = (_cluster_style(n, prompt) if model == "cluster"
                  else _llama_style(n, prompt, n + (1 if model == "liar" else 0)))
        return StreamingResponse(stream, media_type="text/event-stream")


async def _with_server(fake: FakeOpenAi, work):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        return await work(f"http://127.0.0.1:{sock.getsockname()[1]}")
    finally:
        server.should_exit = True
        await task


WORKLOAD = make_load_workload(LoadSpec(num_requests=6, rate=50.0, long_fraction=0.0, short_prompt=(4, 12),
                                       short_output=(3, 9), seed=3), vocab_size=1000, max_model_len=64)


@pytest.mark.parametrize("client", ["openai", "httpx"])
@pytest.mark.parametrize("model,extra", [("cluster", CLUSTER_EXTRA), ("llama", None)])
def test_closed_loop_counts_every_token_and_sends_the_workload(client, model, extra):
    fake = FakeOpenAi()
    result = asyncio.run(_with_server(fake, lambda url: run_openai_load_async(
        url, WORKLOAD, model=model, concurrency=3, client=client, extra_body=extra, request_prefix="t")))
    assert [r.error for r in result.records] == [None] * len(WORKLOAD)
    for req, rec in zip(WORKLOAD, result.records):
        assert rec.ok and rec.num_tokens == req.max_tokens and rec.finish_reason == "length"
        times = [t for t, _ in rec.chunks]
        assert times == sorted(times) and rec.sent_s <= times[0] <= rec.end_s
        assert rec.ttft_s > 0 and len(rec.itl_samples()) == req.max_tokens - 1
    s = result.summary()
    assert s.completed == len(WORKLOAD) and s.output_tokens == sum(r.max_tokens for r in WORKLOAD)
    assert s.itl_ms[0] is not None and s.tokens_per_s > 0
    by_id = {rid: body for rid, body in zip(fake.request_ids, fake.bodies)}
    for req in WORKLOAD:
        body = by_id[f"t-{req.index}"]
        assert body["prompt"] == req.prompt_token_ids and body["max_tokens"] == req.max_tokens
        assert body["ignore_eos"] is True and body["temperature"] == 0 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["priority"] == req.priority
        assert body.get("return_token_ids") is (True if extra else None)
    assert result.extra["client"] == client and result.extra["model"] == model


@pytest.mark.parametrize("client", ["openai", "httpx"])
def test_open_loop_waits_for_arrivals_and_failures_are_recorded(client):
    fake = FakeOpenAi()

    async def work(url):
        opened = await run_openai_load_async(url, WORKLOAD, client=client, extra_body=CLUSTER_EXTRA)  # model: listed
        busy = await run_openai_load_async(url, WORKLOAD[:2], model="busy", concurrency=2, client=client)
        liar = await run_openai_load_async(url, WORKLOAD[:2], model="liar", concurrency=2, client=client)
        return opened, busy, liar

    opened, busy, liar = asyncio.run(_with_server(fake, work))
    assert opened.extra["model"] == "cluster" and opened.summary().completed == len(WORKLOAD)
    for req, rec in zip(WORKLOAD, opened.records):
        assert rec.scheduled_s == req.arrival_s and rec.sent_s >= req.arrival_s
    assert [r.error for r in busy.records] == ["HTTP_429: resource_exhausted"] * 2 and busy.summary().completed == 0
    assert all(r.error.startswith("TOKEN_COUNT_MISMATCH") for r in liar.records)


def test_chunk_counter_rules():
    rec = RequestRecord(index=0, priority=0, prompt_len=3, max_tokens=3, scheduled_s=0.0)
    counter = ChunkCounter(rec)
    counter.add(0.1, {"choices": [{"token_ids": [], "finish_reason": None}]})  # an opening chunk: no tokens
    counter.add(0.2, {"choices": [{"token_ids": [5, 6], "finish_reason": None}]})
    counter.add(0.3, {"choices": [{"finish_reason": None}]})  # no ids: one token
    counter.add(0.4, {"choices": [{"finish_reason": "length"}], "usage": {"completion_tokens": 3}})
    counter.finish(0.5)
    assert rec.chunks == [(0.2, 2), (0.3, 1)] and rec.ok and rec.finish_reason == "length"
    failed = RequestRecord(index=1, priority=0, prompt_len=3, max_tokens=3, scheduled_s=0.0)
    counter = ChunkCounter(failed)
    counter.add(0.1, {"error": {"message": "worker died", "code": "unavailable"}})
    counter.finish(0.2)
    assert failed.error == "STREAM_ERROR: unavailable" and not failed.ok
