"""Cache-aware routing on a real cluster (gateway + 2 workers, tiny checkpoint): multi-turn
conversations find their previous turns cached under `cache_aware` and measurably less under
`least_loaded`, greedy outputs are the same under every policy, the gateway's predictions equal
what the workers report, and a saturated prefix holder sheds work to the other worker."""
from __future__ import annotations

import os
import random
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster_harness import Cluster, drain, generate
from protos import inference_pb2

pytestmark = pytest.mark.timeout(600)
BLOCK = 16  # the engine's default block size
CONVERSATIONS, TURNS = 12, 4
VOCAB = 320  # conftest.served_checkpoint


def metrics(cluster) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def conversation(stub, c: int) -> list[dict]:
    """Four turns in order; each prompt is the previous prompt, its reply and a new message."""
    rng = random.Random(c)
    history = [rng.randrange(3, VOCAB) for _ in range(40)]
    turns = []
    for _ in range(TURNS):
        ids, _, last = generate(stub, prompt_token_ids=history,
                                sampling={"max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        turns.append({"prompt": len(history), "reply": ids, "worker": last.worker_id,
                      "cached": last.usage.cached_prompt_tokens})
        history = history + ids + [rng.randrange(3, VOCAB) for _ in range(20)]
    return turns


def run_conversations(model_dir, policy: str) -> tuple[list[list[dict]], dict]:
    with Cluster(model_dir, num_workers=2, sections={"dispatch": {"policy": policy}}) as cluster:
        with ThreadPoolExecutor(CONVERSATIONS) as pool:
            results = list(pool.map(lambda c: conversation(cluster.stub, c), range(CONVERSATIONS)))
        reported = sum(t["cached"] for turns in results for t in turns)
        deadline = time.monotonic() + 10
        while total(samples := metrics(cluster), "inference_prefix_cache_hits_total") < reported:
            assert time.monotonic() < deadline, "the workers' hit counters never reached the reported hits"
            time.sleep(0.1)  # they come with heartbeats
        return results, samples


@pytest.fixture(scope="module")
def runs(served_checkpoint):
    return {policy: run_conversations(served_checkpoint, policy)
            for policy in ("cache_aware", "least_loaded", "round_robin")}


def previous_blocks(turn: dict) -> int:
    """The previous turn's full blocks: its prompt and reply, less the last reply token (never computed)."""
    return (turn["prompt"] + len(turn["reply"]) - 1) // BLOCK * BLOCK


def test_every_turn_after_the_first_finds_the_previous_turn_cached(runs):
    conversations, samples = runs["cache_aware"]
    for turns in conversations:
        for before, turn in zip(turns, turns[1:]):
            assert turn["worker"] == before["worker"]
            assert turn["cached"] >= previous_blocks(before)
    assert len({turns[0]["worker"] for turns in conversations}) == 2  # the first turns spread
    assert total(samples, "inference_routing_decisions_total", outcome="cache_hit") >= CONVERSATIONS * (TURNS - 1)


def test_least_loaded_finds_measurably_fewer_cached_tokens(runs):
    def cached(policy):
        return sum(t["cached"] for turns in runs[policy][0] for t in turns[1:])

    def whole_hits(policy):  # follow-up turns that found all of the previous turn
        pairs = [(a, b) for turns in runs[policy][0] for a, b in zip(turns, turns[1:])]
        return sum(b["cached"] >= previous_blocks(a) for a, b in pairs) / len(pairs)

    assert whole_hits("cache_aware") == 1.0
    for policy in ("least_loaded", "round_robin"):
        assert cached(policy) < 0.95 * cached("cache_aware") and whole_hits(policy) < 0.9, policy


def test_greedy_outputs_are_the_same_under_every_policy(runs):
    replies = {policy: [[t["reply"] for t in turns] for turns in run[0]] for policy, run in runs.items()}
    assert replies["least_loaded"] == replies["cache_aware"] == replies["round_robin"]


def test_the_index_predicts_exactly_what_the_workers_find_cached(runs):
    for policy, (conversations, samples) in runs.items():
        reported = sum(t["cached"] for turns in conversations for t in turns)
        assert total(samples, "inference_routing_reported_cached_tokens_total") == reported, policy
        assert total(samples, "inference_routing_predicted_cached_tokens_total") == reported, policy
        assert total(samples, "inference_prefix_cache_hits_total") == reported, policy
        assert total(samples, "inference_prefix_index_blocks") > 0, policy


def test_a_saturated_prefix_holder_sheds_work_to_the_other_worker(served_checkpoint):
    """Every request shares one system prompt, cached on one worker only: the cache alone would send
    them all there. With load priced high (half a prefill token per token held, against a KV of
    16,384), once the load on the holder outweighs computing the system prompt on the other worker,
    the rest go there, at once: none is left waiting in the gateway's queue while a worker has room."""
    rng = random.Random(11)
    system = [rng.randrange(3, VOCAB) for _ in range(160)]
    # Long enough that all twelve still run when the last arrives, however fast a step is (12 x 1,201
    # tokens fit either worker's 1,024 blocks without preemption).
    sampling = inference_pb2.SamplingOptions(max_tokens=1000, temperature=0.0, ignore_eos=True)
    sections = {"dispatch": {"policy": "cache_aware", "new_conversation_load_cost_tokens": 8192},
                "worker": {"num_kv_blocks": 1024}}
    with Cluster(served_checkpoint, num_workers=2, sections=sections) as cluster:
        _, _, first = generate(cluster.stub, prompt_token_ids=system + [5],
                               sampling={"max_tokens": 2, "temperature": 0.0})
        holder = first.worker_id
        prompts = [system + [rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(12)]
        # Every call sent from this thread before any is read: client threads starting one by one
        # on a loaded 2-core host spread the arrivals over longer than a generation takes.
        calls = [cluster.stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=p, sampling=sampling),
                                       timeout=120) for p in prompts]
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(drain, call) for call in calls]
            deadline = time.monotonic() + 60
            while True:  # all twelve on the workers while the first of them still run
                status = cluster.status()
                if status.num_queued == 0 and sum(w.num_running + w.num_waiting for w in status.workers) == 12:
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.02)
            results = [f.result(timeout=120) for f in futures]
        samples = metrics(cluster)
    workers = [last.worker_id for _, _, last in results]
    assert workers.count(holder) >= 2 and len(set(workers)) == 2  # the cache drew work; its cost split it
    assert total(samples, "inference_routing_decisions_total", outcome="balanced") >= 1
    assert total(samples, "inference_routing_decisions_total", outcome="cache_hit") >= 1
    on_holder = [last.usage.cached_prompt_tokens for _, _, last in results if last.worker_id == holder]
    assert all(c >= 160 for c in on_holder)  # the system prompt's ten blocks


def test_a_restarted_gateway_rebuilds_its_index_from_worker_snapshots(served_checkpoint):
    """kill -9 of the gateway loses its index; the workers keep their caches. The new gateway asks
    each worker for a snapshot, and the next turns find their conversations cached again."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(64)] for _ in range(4)]
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with Cluster(served_checkpoint, num_workers=2, supervised_gateway=True) as cluster:
        first = [generate(cluster.stub, prompt_token_ids=p, sampling=sampling) for p in prompts]
        assert len({last.worker_id for _, _, last in first}) == 2
        old = cluster.gateway_pids()
        os.kill(old[0], signal.SIGKILL)  # the gateway itself, not its supervisor
        deadline = time.monotonic() + 60
        while True:
            try:
                samples = metrics(cluster)
                if total(samples, "inference_kv_snapshot_requests_total") >= 2 and all(
                        total(samples, "inference_prefix_index_blocks", worker=w) > 0 for w in ("worker-0", "worker-1")):
                    break
            except OSError:
                pass  # the new gateway is not listening yet
            assert time.monotonic() < deadline, "the new gateway never rebuilt its index"
            time.sleep(0.1)
        assert cluster.gateway_pids() != old
        cluster.channel.close()
        cluster.connect()  # a fresh channel, not one in reconnect backoff
        for prompt, (ids, _, last) in zip(prompts, first):
            _, _, again = generate(cluster.stub, prompt_token_ids=prompt + ids + [7] * 16, sampling=sampling)
            assert again.worker_id == last.worker_id
            assert again.usage.cached_prompt_tokens >= (len(prompt) + len(ids) - 1) // BLOCK * BLOCK
