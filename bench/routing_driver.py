"""The routing benchmark's clients and clusters (bench/routing.py): plays conversations over gRPC and
starts the clusters it plays them against.

One grpc.aio channel carries every conversation; each sends a turn when its previous one ends and
records it as a load_stats RequestRecord (so TTFT and throughput come from bench/load_stats.py)
plus the prompt tokens the worker found cached and the worker that served it. Clusters come from
bench/cluster_process.py, which kills every process on the way out; the gateway's Prometheus
counters are read before and after a run so each run reports its own routing decisions.
"""
from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.cluster_process import ClusterProcess, free_port
from bench.load_generator import CHANNEL_OPTIONS, CONNECT_TIMEOUT_S, FINISH_NAMES
from bench.load_stats import RequestRecord
from bench.routing_workload import ChatSpec, Conversation
from protos import inference_pb2, inference_pb2_grpc

POLICIES = ("cache_aware", "least_loaded", "round_robin")
# Gateway counters each run reports as deltas: name -> the label that splits it (None: summed).
COUNTERS = {"inference_routing_decisions_total": "outcome",
            "inference_routing_predicted_cached_tokens_total": None,
            "inference_routing_reported_cached_tokens_total": None,
            "inference_prefix_cache_queries_total": None, "inference_prefix_cache_hits_total": None,
            "inference_kv_snapshot_requests_total": None}


@dataclass
class TurnRecord(RequestRecord):
    conversation: int = 0
    turn: int = 0
    cached_tokens: int = 0  # the final message's usage.cached_prompt_tokens
    worker_id: str = ""


@dataclass(frozen=True)
class FakeWorkers:
    """bench/fake_worker.py settings: prefill dominates TTFT, and each worker's cache is small."""
    step_ms: float = 20.0
    prefill_us_per_token: float = 1000.0
    cache_blocks: int = 256

    def module(self, cache_blocks: int) -> list[str]:
        return ["bench.fake_worker", "--step-ms", str(self.step_ms), "--prefill-us-per-token",
                str(self.prefill_us_per_token), "--cache-blocks", str(cache_blocks), "--trace", os.devnull]


def start_cluster(model_dir: Path, num_workers: int, policy: str, fake: FakeWorkers | None,
                  worker_section: dict | None = None, cache_scale: int = 1) -> ClusterProcess:
    """A started cluster of `num_workers` (fake when `fake` is given) routing by `policy`, its metrics on
    a free loopback port; `cache_scale` multiplies each worker's cache (the one-worker baseline)."""
    metrics_port = free_port()
    sections = {"gateway": {"metrics_port": metrics_port, "metrics_host": "127.0.0.1"},
                "dispatch": {"policy": policy}, "worker": dict(worker_section or {})}
    if fake is None:
        if "num_kv_blocks" in sections["worker"]:
            sections["worker"]["num_kv_blocks"] *= cache_scale
        cluster = ClusterProcess(model_dir, num_workers, sections)
    else:
        cluster = ClusterProcess(model_dir, num_workers, sections,
                                 worker_module=fake.module(fake.cache_blocks * cache_scale))
    cluster.metrics_port = metrics_port
    return cluster.start()


def read_counters(cluster: ClusterProcess) -> dict[str, float]:
    """The COUNTERS of the gateway's /metrics, flattened to "name" or "name{label}" -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in COUNTERS:
                label = COUNTERS[s.name]
                key = f"{s.name}{{{s.labels.get(label, '')}}}" if label else s.name
                out[key] = out.get(key, 0.0) + s.value
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v - before.get(k, 0.0)}


async def _play_turn(stub, prompt: list[int], record: TurnRecord, t0: float, max_tokens: int,
                     timeout_s: float) -> list[int]:
    """One request; returns the reply's token ids (empty on failure, with record.error set)."""
    reply: list[int] = []
    record.sent_s = time.perf_counter() - t0
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=prompt, request_id=f"c{record.conversation}-t{record.turn}-{int(t0 * 1e3) % 10**9}",
        sampling=inference_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter() - t0
            if response.token_ids:
                record.chunks.append((now, len(response.token_ids)))
                reply.extend(response.token_ids)
            record.worker_id = response.worker_id or record.worker_id
            if response.finish_reason:
                record.finish_reason = FINISH_NAMES.get(response.finish_reason, str(response.finish_reason))
                record.cached_tokens = response.usage.cached_prompt_tokens
                record.server_ttft_ms = response.timing.time_to_first_token_ms
                if response.error:
                    record.error = f"FINISH_ERROR: {response.error[:80]}"
        record.end_s = time.perf_counter() - t0
    except grpc.aio.AioRpcError as e:
        record.error = e.code().name
    return reply if record.error is None else []


async def play_async(address: str, conversations: list[Conversation], spec: ChatSpec,
                     request_timeout_s: float = 300.0, run_timeout_s: float = 1200.0) -> tuple[list[TurnRecord], float]:
    """Every conversation, each starting at its arrival time; returns the records and the wall time
    (the first arrival slot to the last completion)."""
    records: list[TurnRecord] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        t0 = time.perf_counter()

        async def converse(conv: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + conv.arrival_s - time.perf_counter()))
            history: list[int] | None = None
            for turn in range(spec.num_turns):
                if turn and conv.think_s[turn]:
                    await asyncio.sleep(conv.think_s[turn])
                prompt = conv.prompt(turn, history)
                # Due now: the previous reply ended (and the user thought): closed loop within a conversation.
                record = TurnRecord(index=len(records), priority=0, prompt_len=len(prompt),
                                    max_tokens=conv.reply_lens[turn], scheduled_s=time.perf_counter() - t0,
                                    conversation=conv.index, turn=turn)
                records.append(record)
                reply = await _play_turn(stub, prompt, record, t0, conv.reply_lens[turn], request_timeout_s)
                if not reply:
                    return  # a failed turn ends its conversation (the next prompt would need its reply)
                history = prompt + reply

        tasks = [asyncio.create_task(converse(c)) for c in conversations]
        _, pending = await asyncio.wait(tasks, timeout=run_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    ends = [r.end_s for r in records if r.end_s is not None]
    return records, max(ends, default=0.0)


def play(address: str, conversations: list[Conversation], spec: ChatSpec, **kwargs) -> tuple[list[TurnRecord], float]:
    return asyncio.run(play_async(address, conversations, spec, **kwargs))
