"""`python -m bench.load_generator --address localhost:50051 --rate 4 --num-requests 100`: load a running cluster.

An asyncio gRPC client (grpc.aio, one channel) that plays a seeded workload (bench/load_workload.py):
open loop, each request sent at its Poisson arrival time whatever the cluster's state, or closed
loop with `--concurrency N` streams kept busy. Requests carry prompt_token_ids and greedy sampling
with EOS ignored, so every output length is exact. It records each stream's messages as they
arrive and prints throughput and TTFT / ITL / end-to-end latency p50 and p99, overall, per length
bucket and per priority class (bench/load_stats.py). `run_load` is the reusable entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc

from bench.load_stats import DEFAULT_BUCKET_BOUNDS, LoadResult, RequestRecord, report
from bench.load_workload import LoadRequest, LoadSpec, make_load_workload, workload_totals
from protos import inference_pb2, inference_pb2_grpc

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in inference_pb2.FinishReason.items()}
CONNECT_TIMEOUT_S = 30.0
STATUS_POLL_S = 0.25
# Large enough for a thousand concurrent streams on one connection.
CHANNEL_OPTIONS = [("grpc.max_concurrent_streams", 4096)]


def build_request(req: LoadRequest, request_id: str) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=req.prompt_token_ids, priority=req.priority, request_id=request_id,
        sampling=inference_pb2.SamplingOptions(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True))


async def _play_one(stub, req: LoadRequest, record: RequestRecord, t0: float, prefix: str,
                    timeout_s: float | None) -> None:
    record.sent_s = time.perf_counter() - t0
    call = stub.Generate(build_request(req, f"{prefix}-{req.index}"), timeout=timeout_s)
    try:
        async for response in call:
            # Time first: everything after this line is the client's own cost, not the server's.
            now = time.perf_counter() - t0
            if response.token_ids:
                record.chunks.append((now, len(response.token_ids)))
            if response.finish_reason:
                record.finish_reason = FINISH_NAMES.get(response.finish_reason, str(response.finish_reason))
                timing = response.timing
                record.server_queue_ms = timing.queue_ms
                record.server_ttft_ms = timing.time_to_first_token_ms
                record.server_total_ms = timing.total_ms
                if response.error:
                    record.error = f"FINISH_ERROR: {response.error[:80]}"
        record.end_s = time.perf_counter() - t0
    except grpc.aio.AioRpcError as e:
        record.error = e.code().name
    except asyncio.CancelledError:
        record.error = "CANCELLED_BY_CLIENT"
        call.cancel()
        raise


async def _poll_queue(stub, samples: list[tuple[float, int, int]], t0: float, stop: asyncio.Event) -> None:
    """Sample the gateway's queue depth and the workers' running count, to show whether a run saturated."""
    while not stop.is_set():
        try:
            status = await stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=2)
            samples.append((time.perf_counter() - t0, status.num_queued,
                            sum(w.num_running for w in status.workers)))
        except grpc.aio.AioRpcError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), STATUS_POLL_S)
        except asyncio.TimeoutError:
            pass


async def run_load_async(address: str, workload: list[LoadRequest], *, concurrency: int = 0,
                         label: str = "cluster", request_timeout_s: float | None = 600.0,
                         run_timeout_s: float = 1800.0, bucket_bounds: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS,
                         poll_status: bool = True, request_prefix: str | None = None) -> LoadResult:
    """Play the workload against the gateway at address. concurrency 0: open loop at each request's arrival_s;
    N > 0: closed loop, N streams at a time in workload order (arrival times ignored)."""
    prefix = request_prefix or f"load-{int(time.time() * 1e3) % 10**9}"
    records = [RequestRecord(index=r.index, priority=r.priority, prompt_len=r.prompt_len, max_tokens=r.max_tokens,
                             scheduled_s=r.arrival_s if concurrency <= 0 else 0.0) for r in workload]
    samples: list[tuple[float, int, int]] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        stop = asyncio.Event()
        t0 = time.perf_counter()
        poller = asyncio.create_task(_poll_queue(stub, samples, t0, stop)) if poll_status else None

        async def open_loop(req: LoadRequest, record: RequestRecord) -> None:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await _play_one(stub, req, record, t0, prefix, request_timeout_s)

        async def closed_loop(queue: asyncio.Queue) -> None:
            while not queue.empty():
                i = queue.get_nowait()
                records[i].scheduled_s = time.perf_counter() - t0  # due the moment a stream frees up
                await _play_one(stub, workload[i], records[i], t0, prefix, request_timeout_s)

        if concurrency > 0:
            queue: asyncio.Queue = asyncio.Queue()
            for i in range(len(workload)):
                queue.put_nowait(i)
            tasks = [asyncio.create_task(closed_loop(queue)) for _ in range(min(concurrency, len(workload)))]
        else:
            tasks = [asyncio.create_task(open_loop(r, rec)) for r, rec in zip(workload, records)]
        try:
            done, pending = await asyncio.wait(tasks, timeout=run_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            stop.set()
            if poller is not None:
                await asyncio.gather(poller, return_exceptions=True)
    ends = [r.end_s for r in records if r.end_s is not None] + [r.sent_s or 0.0 for r in records]
    extra = {"mode": f"closed loop, concurrency {concurrency}" if concurrency > 0 else "open loop (Poisson)",
             "t0_perf_counter": t0}  # record times are relative to this (CLOCK_MONOTONIC on Linux)
    if samples:
        extra["queue_depth_max"] = max(s[1] for s in samples)
        extra["queue_depth_mean"] = sum(s[1] for s in samples) / len(samples)
        extra["running_mean"] = sum(s[2] for s in samples) / len(samples)
    return LoadResult(label=label, records=records, wall_s=max(ends, default=0.0), bucket_bounds=bucket_bounds,
                      extra=extra)


def run_load(address: str, workload: list[LoadRequest], **kwargs) -> LoadResult:
    """Synchronous wrapper around run_load_async (its own event loop)."""
    return asyncio.run(run_load_async(address, workload, **kwargs))


def _vocab_and_context(args) -> tuple[int, int]:
    if args.vocab_size and args.max_model_len:
        return args.vocab_size, args.max_model_len
    from bench.serving_model import model_limits
    vocab, ctx = model_limits(Path(args.model_dir))
    return args.vocab_size or vocab, args.max_model_len or ctx


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.load_generator", description=__doc__)
    p.add_argument("--address", default="localhost:50051")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--concurrency", type=int, default=0, help="> 0: closed loop with this many streams")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-fraction", type=float, default=LoadSpec.long_fraction)
    p.add_argument("--urgent-fraction", type=float, default=LoadSpec.urgent_fraction)
    p.add_argument("--short-prompt", type=_range, default=LoadSpec.short_prompt, metavar="LO,HI")
    p.add_argument("--long-prompt", type=_range, default=LoadSpec.long_prompt, metavar="LO,HI")
    p.add_argument("--short-output", type=_range, default=LoadSpec.short_output, metavar="LO,HI")
    p.add_argument("--long-output", type=_range, default=LoadSpec.long_output, metavar="LO,HI")
    p.add_argument("--urgent-priority", type=int, default=LoadSpec.urgent_priority)
    p.add_argument("--bulk-priority", type=int, default=LoadSpec.bulk_priority)
    p.add_argument("--model-dir", default="models/default",
                   help="read vocab_size and max_position_embeddings from its config.json")
    p.add_argument("--vocab-size", type=int, default=0, help="overrides the model's (prompt ids are drawn below it)")
    p.add_argument("--max-model-len", type=int, default=0, help="overrides the model's context length")
    p.add_argument("--bucket-bounds", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=DEFAULT_BUCKET_BOUNDS, help="the gateway's queues.bucket_bounds, for per-bucket rows")
    p.add_argument("--request-timeout", type=float, default=600.0, help="each request's gRPC deadline, seconds")
    p.add_argument("--json", metavar="PATH", help="also write the summary (and every record) as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    vocab, ctx = _vocab_and_context(args)
    spec = LoadSpec(num_requests=args.num_requests, rate=args.rate, long_fraction=args.long_fraction,
                    short_prompt=args.short_prompt, long_prompt=args.long_prompt, short_output=args.short_output,
                    long_output=args.long_output, urgent_fraction=args.urgent_fraction,
                    urgent_priority=args.urgent_priority, bulk_priority=args.bulk_priority, seed=args.seed)
    workload = make_load_workload(spec, vocab, ctx)
    print(f"workload: {spec.describe()}; {workload_totals(workload)}", file=sys.stderr)
    result = run_load(args.address, workload, concurrency=args.concurrency, label=args.address,
                      request_timeout_s=args.request_timeout, bucket_bounds=args.bucket_bounds)
    return report(result, spec, len(workload), args.json)


if __name__ == "__main__":
    sys.exit(main())
