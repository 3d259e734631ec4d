"""`python -m bench.openai_load --base-url http://localhost:8080 --concurrency 16`: load an OpenAI-compatible API.

The HTTP twin of bench/load_generator.py: it plays the same seeded LoadRequest workload
(bench/load_workload.py), open loop at each request's Poisson arrival time or closed loop with
`--concurrency N` streams kept busy, against any OpenAI-compatible server (this cluster's gateway
with `gateway.http_port` set, or llama.cpp's llama-server). Each request is a streamed
/v1/completions call with the prompt as token ids, greedy, `ignore_eos` (both servers accept it),
so every output length is exact, and `stream_options.include_usage`. Each chunk's arrival time
goes into the same RequestRecord / LoadResult as the gRPC client's (bench/load_stats.py), so
throughput, TTFT, ITL and end-to-end latency come from one code path.

Tokens per chunk: a chunk's `token_ids` where the server returns them (this cluster, asked with
`return_token_ids`); otherwise one per chunk without a finish_reason, which is what llama-server
sends (one partial chunk per sampled token, then a text-less final chunk with the finish reason
and usage). Either way the count is checked against the final usage chunk's completion_tokens,
and a request whose counts disagree is recorded as failed (TOKEN_COUNT_MISMATCH) rather than
counted wrong. A request whose kept-alive connection the server closed before answering
("Server disconnected without sending a response", which llama-server does now and then) is sent
once more at once, as the official client's retries would, and listed in `extra["resent_after_drop"]`.

Clients: `openai` (default), the official AsyncOpenAI client, what users drive; or `httpx`,
the same requests straight through httpx2 with a minimal SSE reader. The official client parses
every chunk into pydantic models, which costs the client CPU on the same 2 cores the server
runs on; `bench/http_vs_grpc.py` reports the client's CPU per token for each run so that cost
is visible, and `--client httpx` shows what a lighter client leaves to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx2 as httpx
import openai

from bench.load_stats import DEFAULT_BUCKET_BOUNDS, LoadResult, RequestRecord, report
from bench.load_workload import LoadRequest, LoadSpec, make_load_workload, workload_totals

CONNECT_TIMEOUT_S = 30.0
# Below llama-server's 5 s keep-alive timeout, so the pool never reuses a connection the server is closing.
KEEPALIVE_EXPIRY_S = 2.0
CLIENTS = ("openai", "httpx")
# "Server disconnected without sending a response": llama-server now and then closes a kept-alive
# connection just as the next request goes out on it (1 request in 60-200 at 16 streams here).
DROPPED = "CONNECTION: RemoteProtocolError"
RESEND_ON_DROP = 1
# What this cluster's gateway is asked for on top of the OpenAI fields (vLLM's extensions).
CLUSTER_EXTRA = {"return_token_ids": True}


def request_body(req: LoadRequest, model: str, extra: dict | None = None) -> dict:
    """The /v1/completions body for one LoadRequest: token-id prompt, greedy, exact length, streamed."""
    return {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "priority": req.priority, **(extra or {})}


class ChunkCounter:
    """Turns parsed stream chunks (plain dicts) into a record's (time, tokens) entries."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.usage_tokens: int | None = None

    def add(self, now: float, chunk: dict) -> None:
        if chunk.get("error"):
            error = chunk["error"]
            code = error.get("code") if isinstance(error, dict) else None
            self.record.error = f"STREAM_ERROR: {code or str(error)[:60]}"
            return
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids")
            finish = choice.get("finish_reason")
            n = len(ids) if ids is not None else (1 if finish is None else 0)
            if n:
                self.record.chunks.append((now, n))
            if finish:
                self.record.finish_reason = finish
        usage = chunk.get("usage")
        if usage:
            self.usage_tokens = usage.get("completion_tokens")

    def finish(self, end_s: float) -> None:
        r = self.record
        r.end_s = end_s
        if r.error is None and self.usage_tokens is not None and self.usage_tokens != r.num_tokens:
            r.error = f"TOKEN_COUNT_MISMATCH: counted {r.num_tokens}, usage {self.usage_tokens}"
        elif r.error is None and r.finish_reason is None:
            r.error = "NO_FINISH_REASON"


def _status_error(status: int, body) -> str:
    """HTTP_429, or HTTP_400: <the error's code> where the body says (OpenAI's {"error": {"code"}})."""
    error = body.get("error", body) if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return f"HTTP_{status}: {code}" if code else f"HTTP_{status}"


async def _play_openai(client: openai.AsyncOpenAI, body: dict, headers: dict, record: RequestRecord, t0: float,
                       timeout_s: float | None) -> None:
    extra = {k: v for k, v in body.items() if k not in ("model", "prompt", "max_tokens", "temperature", "stream",
                                                         "stream_options")}
    counter = ChunkCounter(record)
    record.sent_s = time.perf_counter() - t0
    try:
        stream = await client.completions.create(
            model=body["model"], prompt=body["prompt"], max_tokens=body["max_tokens"],
            temperature=body["temperature"], stream=True, stream_options=body["stream_options"], extra_body=extra,
            extra_headers=headers, timeout=timeout_s)
        async with stream:
            async for chunk in stream:
                now = time.perf_counter() - t0
                choices = [{"token_ids": (c.model_extra or {}).get("token_ids"), "finish_reason": c.finish_reason}
                           for c in chunk.choices]
                usage = {"completion_tokens": chunk.usage.completion_tokens} if chunk.usage else None
                counter.add(now, {"choices": choices, "usage": usage})
        counter.finish(time.perf_counter() - t0)
    except openai.APIStatusError as e:
        record.error = _status_error(e.status_code, e.body)
    except openai.APITimeoutError:
        record.error = "TIMEOUT"
    except openai.APIConnectionError as e:
        cause = e.__cause__ or e
        record.error = f"CONNECTION: {type(cause).__name__}: {str(cause)[:60]}"
    except openai.APIError as e:  # an error event inside the stream
        record.error = f"STREAM_ERROR: {str(e)[:60]}"
    except asyncio.CancelledError:
        record.error = "CANCELLED_BY_CLIENT"
        raise


async def _play_httpx(http: httpx.AsyncClient, body: dict, headers: dict, record: RequestRecord, t0: float,
                      timeout_s: float | None) -> None:
    counter = ChunkCounter(record)
    record.sent_s = time.perf_counter() - t0
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers,
                               timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)) as response:
            if response.status_code != 200:
                await response.aread()
                try:
                    body = response.json()
                except ValueError:
                    body = None
                record.error = _status_error(response.status_code, body)
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                counter.add(time.perf_counter() - t0, chunk)
        counter.finish(time.perf_counter() - t0)
    except httpx.TimeoutException:
        record.error = "TIMEOUT"
    except httpx.TransportError as e:
        record.error = f"CONNECTION: {type(e).__name__}: {str(e)[:60]}"
    except asyncio.CancelledError:
        record.error = "CANCELLED_BY_CLIENT"
        raise


async def served_model(base_url: str) -> str:
    """The first model GET /v1/models lists (this cluster serves one; so does llama-server)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=CONNECT_TIMEOUT_S) as http:
        response = await http.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def run_openai_load_async(base_url: str, workload: list[LoadRequest], *, model: str | None = None,
                                concurrency: int = 0, label: str = "openai", client: str = "openai",
                                extra_body: dict | None = None, request_timeout_s: float | None = 600.0,
                                run_timeout_s: float = 1800.0,
                                bucket_bounds: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS,
                                request_prefix: str | None = None) -> LoadResult:
    """Play the workload against the OpenAI API at base_url (e.g. "http://127.0.0.1:8080", no /v1).
    concurrency 0: open loop at each request's arrival_s; N > 0: closed loop, N streams at a time in
    workload order. extra_body joins every request's body (CLUSTER_EXTRA asks this cluster for token
    ids). Each request carries `x-request-id: {prefix}-{index}`, which this cluster's gateway adopts."""
    if client not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, got {client!r}")
    base_url = base_url.rstrip("/")
    model = model or await served_model(base_url)
    prefix = request_prefix or f"http-{int(time.time() * 1e3) % 10**9}"
    records = [RequestRecord(index=r.index, priority=r.priority, prompt_len=r.prompt_len, max_tokens=r.max_tokens,
                             scheduled_s=r.arrival_s if concurrency <= 0 else 0.0) for r in workload]
    streams = concurrency if concurrency > 0 else len(workload)
    # One connection per stream, no more: llama-server serves connections beyond its fixed HTTP threads
    # (-np + 4) on threads that close them after one request, which a pooled client then finds closed.
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    http = httpx.AsyncClient(base_url=base_url, limits=limits,
                             timeout=httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S))
    sdk = None
    if client == "openai":
        sdk = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http,
                                 timeout=request_timeout_s)

    resent: list[int] = []

    async def play(i: int) -> None:
        body = request_body(workload[i], model, extra_body)
        headers = {"x-request-id": f"{prefix}-{workload[i].index}"}
        record = records[i]
        first_sent = None
        for attempt in range(1 + RESEND_ON_DROP):
            if sdk is not None:
                await _play_openai(sdk, body, headers, record, t0, request_timeout_s)
            else:
                await _play_httpx(http, body, headers, record, t0, request_timeout_s)
            first_sent = record.sent_s if first_sent is None else first_sent
            if not (record.error or "").startswith(DROPPED) or record.chunks or attempt == RESEND_ON_DROP:
                break
            # A kept-alive connection the server closed before answering: sent again at once (the
            # official client's own retries would do the same); its latencies count from the first send.
            resent.append(record.index)
            record.error = None
        record.sent_s = first_sent

    async def open_loop(i: int) -> None:
        delay = t0 + workload[i].arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await play(i)

    async def closed_loop(queue: asyncio.Queue) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            records[i].scheduled_s = time.perf_counter() - t0  # due the moment a stream frees up
            await play(i)

    try:
        t0 = time.perf_counter()
        if concurrency > 0:
            queue: asyncio.Queue = asyncio.Queue()
            for i in range(len(workload)):
                queue.put_nowait(i)
            tasks = [asyncio.create_task(closed_loop(queue)) for _ in range(min(concurrency, len(workload)))]
        else:
            tasks = [asyncio.create_task(open_loop(i)) for i in range(len(workload))]
        done, pending = await asyncio.wait(tasks, timeout=run_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:  # a bug in the client itself should not pass for a slow server
            if task.exception() is not None:
                raise task.exception()
    finally:
        if sdk is not None:
            await sdk.close()
        await http.aclose()
    ends = [r.end_s for r in records if r.end_s is not None] + [r.sent_s or 0.0 for r in records]
    extra = {"mode": f"closed loop, concurrency {concurrency}" if concurrency > 0 else "open loop (Poisson)",
             "t0_perf_counter": t0, "client": client, "model": model, "base_url": base_url,
             "resent_after_drop": resent}
    return LoadResult(label=label, records=records, wall_s=max(ends, default=0.0), bucket_bounds=bucket_bounds,
                      extra=extra)


def run_openai_load(base_url: str, workload: list[LoadRequest], **kwargs) -> LoadResult:
    """Synchronous wrapper around run_openai_load_async (its own event loop)."""
    return asyncio.run(run_openai_load_async(base_url, workload, **kwargs))


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.openai_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://localhost:8080", help="the server's root (without /v1)")
    p.add_argument("--model", default="", help="model name to send; empty = the first one /v1/models lists")
    p.add_argument("--client", choices=CLIENTS, default="openai")
    p.add_argument("--token-ids", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for each chunk's token_ids (this cluster); --no-token-ids for servers without them")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--concurrency", type=int, default=0, help="> 0: closed loop with this many streams")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-fraction", type=float, default=LoadSpec.long_fraction)
    p.add_argument("--short-prompt", type=_range, default=LoadSpec.short_prompt, metavar="LO,HI")
    p.add_argument("--long-prompt", type=_range, default=LoadSpec.long_prompt, metavar="LO,HI")
    p.add_argument("--short-output", type=_range, default=LoadSpec.short_output, metavar="LO,HI")
    p.add_argument("--long-output", type=_range, default=LoadSpec.long_output, metavar="LO,HI")
    p.add_argument("--model-dir", default="models/default",
                   help="read vocab_size and max_position_embeddings from its config.json")
    p.add_argument("--vocab-size", type=int, default=0, help="overrides the model's (prompt ids are drawn below it)")
    p.add_argument("--max-model-len", type=int, default=0, help="overrides the model's context length")
    p.add_argument("--request-timeout", type=float, default=600.0, help="each request's timeout, seconds")
    p.add_argument("--json", metavar="PATH", help="also write the summary (and every record) as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    vocab, ctx = args.vocab_size, args.max_model_len
    if not (vocab and ctx):
        from bench.serving_model import model_limits
        v, c = model_limits(Path(args.model_dir))
        vocab, ctx = vocab or v, ctx or c
    spec = LoadSpec(num_requests=args.num_requests, rate=args.rate, long_fraction=args.long_fraction,
                    short_prompt=args.short_prompt, long_prompt=args.long_prompt, short_output=args.short_output,
                    long_output=args.long_output, seed=args.seed)
    workload = make_load_workload(spec, vocab, ctx)
    print(f"workload: {spec.describe()}; {workload_totals(workload)}", file=sys.stderr)
    result = run_openai_load(args.base_url, workload, model=args.model or None, concurrency=args.concurrency,
                             label=args.base_url, client=args.client,
                             extra_body=CLUSTER_EXTRA if args.token_ids else None,
                             request_timeout_s=args.request_timeout)
    return report(result, spec, len(workload), args.json)


if __name__ == "__main__":
    sys.exit(main())
