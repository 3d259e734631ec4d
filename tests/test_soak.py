"""Soak: 2,000 mixed requests through a real two-worker cluster. Afterwards every KV pool is
all-free and the workers' resident memory grew less than 5% after warm-up."""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import psutil
import pytest

from cluster_harness import Cluster
from protos import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.timeout(600)
NUM_REQUESTS = 2000
NUM_WARMUP = 300
CONCURRENCY = 48
MAX_RSS_GROWTH = 0.05


def _request(rng: random.Random, i: int) -> inference_pb2.GenerateRequest:
    sampling = inference_pb2.SamplingOptions(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.5:
        sampling.temperature = 0.0
    else:
        sampling.seed = i
    prompt = [rng.randrange(3, 320) for _ in range(rng.choice([2, 8, 40, 150, 300]))]
    if rng.random() < 0.2:  # shared prefixes exercise the prefix cache
        prompt = list(range(3, 67)) + prompt[:20]
    return inference_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling, priority=rng.choice([0, 5]))


async def _play(address: str, requests: list, cancel_every: int) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)

        async def one(i: int, request) -> None:
            async with semaphore:
                call = stub.Generate(request, timeout=120)
                try:
                    async for response in call:
                        if i % cancel_every == 0 and response.token_ids:
                            call.cancel()  # some clients walk away mid-stream
                            break
                    key = "cancelled" if i % cancel_every == 0 else "ok"
                except grpc.aio.AioRpcError as e:
                    key = e.code().name
                outcomes[key] = outcomes.get(key, 0) + 1

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return outcomes


def _worker_rss(cluster) -> dict[str, int]:
    return {w: sum(psutil.Process(p).memory_info().rss for p in cluster.model_pids(w)) for w in ("worker-0", "worker-1")}


def test_soak_2000_requests_leaves_pools_free_and_memory_flat(served_checkpoint):
    rng = random.Random(0)
    requests = [_request(rng, i) for i in range(NUM_REQUESTS)]
    with Cluster(served_checkpoint, num_workers=2, sections={"worker": {"num_kv_blocks": 256}}) as cluster:
        started = time.monotonic()
        warm = asyncio.run(_play(cluster.address, requests[:NUM_WARMUP], cancel_every=7))
        rss_warm = _worker_rss(cluster)
        rest = asyncio.run(_play(cluster.address, requests[NUM_WARMUP:], cancel_every=7))
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 10
        while True:
            status = cluster.status()
            if all(w.num_running == 0 and w.kv_blocks_free == w.kv_blocks_total for w in status.workers):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        rss_end = _worker_rss(cluster)
    outcomes = {k: warm.get(k, 0) + rest.get(k, 0) for k in set(warm) | set(rest)}
    growth = {w: rss_end[w] / rss_warm[w] - 1 for w in rss_warm}
    print(f"\nsoak: {NUM_REQUESTS} requests in {elapsed:.1f} s, outcomes {outcomes}; worker RSS after warm-up "
          + ", ".join(f"{w} {rss_warm[w] / 2**20:.1f} -> {rss_end[w] / 2**20:.1f} MiB ({growth[w]:+.2%})"
                      for w in rss_warm))
    assert set(outcomes) <= {"ok", "cancelled"}, outcomes
    assert sum(outcomes.values()) == NUM_REQUESTS
    assert all(g < MAX_RSS_GROWTH for g in growth.values()), growth
