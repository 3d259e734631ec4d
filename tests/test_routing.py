"""The routing policies on hand-made worker states: cache_aware's longest prefix, its balance rule
(both thresholds), sticky sessions, spreading, least_loaded, round_robin and the prediction."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.prefix_index import PrefixIndex
from gateway.routing import Router
from gateway.workers import WorkerRegistry
from protos import worker_pb2
from shared.block_hash import chain_hashes
from shared.config import ConfigError, DispatchConfig, load_config

BLOCK = 4
SYSTEM = list(range(100, 132))  # 8 blocks


def request(tokens, session_id=""):
    return SimpleNamespace(prompt_ids=list(tokens), output_ids=[], session_id=session_id, block_hashes=None)


def setup(policy="cache_aware", num_workers=2, abs_tokens=100, rel=1.5):
    registry = WorkerRegistry([f"w{i}" for i in range(num_workers)], heartbeat_timeout_s=1.0)
    for worker_id in registry.workers:
        registry.on_message(worker_pb2.Envelope(worker_id=worker_id, incarnation="i", heartbeat=worker_pb2.Heartbeat(
            ready=True, max_num_seqs=8, max_queued=8, kv_blocks_total=1000, kv_blocks_free=1000, block_size=BLOCK,
            memory_level="OK")), 0.0)
    index = PrefixIndex()
    router = Router(DispatchConfig(policy=policy, balance_abs_tokens=abs_tokens, balance_rel=rel), index)
    return registry, index, router


def cache(index, worker_id, tokens, seq=1):
    index.on_events(worker_id, worker_pb2.KvEvents(seq=seq, stored=chain_hashes(tokens, BLOCK), block_size=BLOCK))


def workers(registry):
    return list(registry.workers.values())


def test_cache_aware_picks_the_longest_cached_prefix_and_predicts_its_tokens():
    registry, index, router = setup()
    cache(index, "w0", SYSTEM[:8])
    cache(index, "w1", SYSTEM)
    route = router.route(request(SYSTEM + [7, 8, 9]), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w1", "cache_hit", 32)
    # The last prompt token is always computed: a fully cached prompt predicts one block less.
    assert router.route(request(SYSTEM), workers(registry), {}).predicted_cached_tokens == 28


def test_equal_prefixes_go_to_the_less_loaded_worker():
    registry, index, router = setup()
    for worker_id in ("w0", "w1"):
        cache(index, worker_id, SYSTEM)
    registry.assign("w0", "busy", 50)
    assert router.route(request(SYSTEM + [1]), workers(registry), {}).worker.worker_id == "w1"
    assert router.route(request(SYSTEM + [1]), workers(registry), {"w1": 60}).worker.worker_id == "w0"


def test_balance_wins_only_when_both_thresholds_are_exceeded():
    registry, index, router = setup(abs_tokens=100, rel=1.5)
    cache(index, "w0", SYSTEM)
    registry.assign("w1", "r1", 300)
    registry.assign("w0", "r0", 420)  # 120 more (> 100) but only 1.4x (< 1.5): the cache wins
    route = router.route(request(SYSTEM + [1]), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w0", "cache_hit")
    registry.assign("w0", "r2", 40)  # 160 more and 1.53x: balance wins
    route = router.route(request(SYSTEM + [1]), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w1", "balanced", 0)
    # Tokens routed in the same pass count as load.
    registry.release("w0", "r2")
    route = router.route(request(SYSTEM + [1]), workers(registry), {"w0": 40})
    assert route.outcome == "balanced"


def test_a_prefix_cached_nowhere_goes_to_its_session_else_spreads():
    registry, index, router = setup()
    registry.assign("w1", "r", 10)  # w0 has the most room
    route = router.route(request([1, 2, 3, 4, 5], session_id="chat"), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w0", "spread")
    router.committed([request([1], session_id="chat")], registry.workers["w1"])
    route = router.route(request([9, 9, 9, 9, 9], session_id="chat"), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w1", "sticky")
    registry.assign("w1", "big", 1000)  # the session's worker is overloaded: spread instead
    route = router.route(request([9, 9, 9, 9, 9], session_id="chat"), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w0", "spread")
    # A session's worker that cannot take the request is not a candidate at all.
    route = router.route(request([9, 9, 9, 9, 9], session_id="chat"), [registry.workers["w0"]], {})
    assert route.worker.worker_id == "w0"
    assert router.route(request([1]), [], {}) is None


def test_least_loaded_ignores_the_cache_and_round_robin_takes_turns():
    registry, index, router = setup(policy="least_loaded")
    cache(index, "w0", SYSTEM)
    registry.assign("w0", "r", 10)
    route = router.route(request(SYSTEM + [1]), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w1", "spread", 0)

    registry, index, router = setup(policy="round_robin", num_workers=3)
    cache(index, "w1", SYSTEM)
    chosen = []
    for _ in range(6):
        route = router.route(request(SYSTEM + [1]), workers(registry), {})
        chosen.append(route.worker.worker_id)
        router.committed([], route.worker)
    assert chosen == ["w0", "w1", "w2"] * 2
    assert router.route(request(SYSTEM + [1]), workers(registry)[1:2], {}).predicted_cached_tokens == 32


def test_the_dispatch_section_is_validated():
    assert load_config().dispatch.policy == "cache_aware"
    assert load_config(overrides={"dispatch.policy": "round_robin"}).dispatch.policy == "round_robin"
    for key, value in (("policy", "random"), ("balance_rel", 0.5), ("balance_abs_tokens", -1)):
        with pytest.raises(ConfigError, match=f"dispatch.{key}"):
            load_config(overrides={f"dispatch.{key}": value})


def test_new_conversations_spread_over_idle_workers_by_what_they_cache():
    registry, index, router = setup(num_workers=3)
    cache(index, "w0", list(range(40)))
    cache(index, "w2", list(range(200, 208)))
    route = router.route(request([9] * 20), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w1", "spread")
