"""The routing policies on hand-made worker states: cache_aware's cost rule (uncached tokens and load,
in prefill tokens), new conversations against a conversation's own history, sticky sessions,
spreading, what a worker can take, least_loaded, round_robin and the prediction."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.dispatcher import Dispatcher
from gateway.prefix_index import PrefixIndex
from gateway.queues import QueuedItem
from gateway.routing import Router
from gateway.workers import WorkerRegistry
from protos import worker_pb2
from shared.block_hash import chain_hashes
from shared.config import ConfigError, DispatchConfig, load_config

BLOCK = 4
SYSTEM = list(range(100, 132))  # 8 blocks


def request(tokens, session_id="", max_tokens=1, prompt_logprobs=None):
    return SimpleNamespace(prompt_ids=list(tokens), output_ids=[], session_id=session_id, block_hashes=None,
                           params=SimpleNamespace(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs))


def heartbeat(worker_id, **fields):
    values = dict(ready=True, max_num_seqs=8, max_queued=8, kv_blocks_total=1000, kv_blocks_free=1000,
                  block_size=BLOCK, memory_level="OK") | fields
    return worker_pb2.Envelope(worker_id=worker_id, incarnation="i", heartbeat=worker_pb2.Heartbeat(**values))


def setup(policy="cache_aware", num_workers=2):
    registry = WorkerRegistry([f"w{i}" for i in range(num_workers)], heartbeat_timeout_s=1.0)
    for worker_id in registry.workers:
        registry.on_message(heartbeat(worker_id), 0.0)
    index = PrefixIndex()
    router = Router(DispatchConfig(policy=policy), index)
    return registry, index, router


def send(registry, router, worker_id, state, request_id):
    """What the dispatcher does with a routed request: commit it to the router, assign it to the worker."""
    router.committed([state], registry.workers[worker_id])
    registry.assign(worker_id, request_id, len(state.prompt_ids) + 1)


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
    # A request scoring its prompt (prompt_logprobs) computes every position: it finds nothing cached.
    scoring = request(SYSTEM + [7, 8, 9], prompt_logprobs=0)
    route = router.route(scoring, workers(registry), {})
    assert (route.predicted_cached_tokens, route.outcome) == (0, "spread")


def test_equal_prefixes_go_to_the_less_loaded_worker():
    registry, index, router = setup()
    for worker_id in ("w0", "w1"):
        cache(index, worker_id, SYSTEM)
    registry.assign("w0", "busy", 50)
    assert router.route(request(SYSTEM + [1]), workers(registry), {}).worker.worker_id == "w1"
    assert router.route(request(SYSTEM + [1]), workers(registry), {"w1": 60}).worker.worker_id == "w0"


def test_requests_sharing_a_prompt_in_one_pass_follow_the_first_to_its_worker():
    """n choices of one prompt, or a burst with one preamble: the worker the first goes to will
    compute the prefix, so within the pass it counts as holding it, although nothing is reported
    yet and the pending load counts against it; a new pass forgets it."""
    registry, index, router = setup()
    prompt = SYSTEM + [7, 8, 9]
    router.begin_pass()
    first = router.route(request(prompt), workers(registry), {})
    router.note_routed(request(prompt), first.worker)
    pending = {first.worker.worker_id: len(prompt) + 1}
    second = router.route(request(prompt), workers(registry), pending)
    assert (second.worker, second.outcome, second.predicted_cached_tokens) == (first.worker, "cache_hit", 32)
    router.begin_pass()
    assert router.route(request(prompt), workers(registry), pending).worker is not first.worker


def test_balance_wins_once_the_load_outweighs_the_cached_prefix():
    registry, index, router = setup()
    cache(index, "w0", SYSTEM)  # no other prompt went on from it: this conversation's own history
    prompt = SYSTEM + [1]  # 33 tokens: 1 uncached on w0, 33 on w1
    registry.assign("w0", "r0", 900)  # 1 + 128 x 933 / 4000 = 30.9 against 33 + 128 x 33 / 4000 = 34.1
    route = router.route(request(prompt), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w0", "cache_hit", 32)
    registry.assign("w0", "r1", 200)  # 37.3 against 34.1
    route = router.route(request(prompt), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w1", "balanced", 0)
    # Tokens routed in the same pass count as load.
    registry.release("w0", "r1")
    route = router.route(request(prompt), workers(registry), {"w0": 200})
    assert route.outcome == "balanced"
    assert router.route(request(prompt), workers(registry), {}).outcome == "cache_hit"


def test_a_short_shared_prefix_on_one_busy_worker_does_not_pull_every_new_conversation():
    """Two conversations went through the system prompt on w0, so a third that matches only it is a new
    conversation: it weighs w0's load at new_conversation_load_cost_tokens, and goes to the idle w1 as
    soon as that load outweighs computing the system prompt there."""
    registry, index, router = setup()
    cache(index, "w0", SYSTEM)
    for c in range(2):
        send(registry, router, "w0", request(SYSTEM + [c] * 8), f"c{c}")
    new = SYSTEM + [9] * 8  # 40 tokens: 8 uncached on w0, 40 on w1
    assert index.is_shared(chain_hashes(new, BLOCK), 8)
    # w0 holds 82 tokens: 8 + 1024 x 122 / 4000 = 39.2 against 40 + 1024 x 40 / 4000 = 50.2 on w1.
    route = router.route(request(new), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w0", "cache_hit")
    registry.assign("w0", "busy", 60)  # 142 tokens held: 54.6 against 50.2
    route = router.route(request(new), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w1", "balanced", 0)
    # Once w1 holds the system prompt too, new conversations take whichever is less loaded at no cost.
    cache(index, "w1", SYSTEM)
    route = router.route(request(new), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w1", "cache_hit", 32)


def test_a_long_conversation_prefix_holds_against_a_modest_load_difference():
    """The same load that sends a new conversation away keeps a conversation whose own history w0
    caches: it would recompute that history elsewhere, and its load term is load_cost_tokens."""
    registry, index, router = setup()
    history = SYSTEM + list(range(500, 700))  # 232 tokens cached on w0; w1 holds only the system prompt
    cache(index, "w0", history)
    cache(index, "w1", SYSTEM)
    for c in range(2):  # other conversations went through the system prompt: it is shared
        send(registry, router, "w1", request(SYSTEM + [c] * 8), f"c{c}")
        registry.release("w1", f"c{c}")
    registry.assign("w0", "busy", 1000)  # a quarter of w0's KV in use, w1 idle
    turn = history + [3] * 8
    assert not index.is_shared(chain_hashes(turn, BLOCK), len(history) // BLOCK)
    route = router.route(request(turn), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w0", "cache_hit", 232)
    route = router.route(request(SYSTEM + [9] * 8), workers(registry), {})  # a new conversation
    assert (route.worker.worker_id, route.outcome) == ("w1", "cache_hit")
    # Balance still wins once the load there outweighs the history: 8 + 128 x 8240 / 4000 > 208 + ...
    registry.assign("w0", "huge", 7000)
    route = router.route(request(turn), workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w1", "balanced", 32)


def test_nothing_routes_beyond_what_a_worker_can_take():
    """The dispatcher offers the policy only workers with blocks for the prompt (counting those taken
    earlier in the pass); a worker holding the whole prompt but lacking the room is not chosen."""
    dispatcher = Dispatcher(load_config())
    registry, router = dispatcher.registry, dispatcher.router
    for worker_id, free in (("worker-0", 9), ("worker-1", 1000)):
        registry.on_message(heartbeat(worker_id, kv_blocks_free=free), 0.0)
    cache(router.index, "worker-0", SYSTEM)
    state = request(SYSTEM + [1])  # 34 tokens with the one it samples: 9 blocks of 4
    item = QueuedItem(request_id="r", num_tokens=33, priority=0, arrival_s=0.0, deadline_s=None, max_wait_s=None,
                      payload=state)
    takers = workers(registry)
    assert dispatcher._route(item, takers, {}, {}).worker.worker_id == "worker-0"
    route = dispatcher._route(item, takers, {"worker-0": 4}, {"worker-0": 1})  # one block taken this pass
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("worker-1", "spread", 0)
    assert dispatcher._route(item, takers[:1], {"worker-0": 4}, {"worker-0": 1}) is None
    assert router.route(state, [], {}) is None


def test_a_worker_whose_whole_pool_cannot_hold_the_sequence_is_never_chosen():
    """Free blocks for the prompt are not enough: prompt + max_tokens must fit the worker's whole
    pool, or it would refuse the request (a fleet of unequal pools)."""
    dispatcher = Dispatcher(load_config())
    registry = dispatcher.registry
    registry.on_message(heartbeat("worker-0", kv_blocks_total=10, kv_blocks_free=10), 0.0)  # 40 tokens
    registry.on_message(heartbeat("worker-1", kv_blocks_total=1000, kv_blocks_free=5), 0.0)
    takers = workers(registry)

    def routed(max_tokens, candidates):
        state = request([1, 2, 3, 4], max_tokens=max_tokens)
        item = QueuedItem(request_id="r", num_tokens=4, priority=0, arrival_s=0.0, deadline_s=None, max_wait_s=None,
                          payload=state)
        route = dispatcher._route(item, candidates, {}, {})
        return route and route.worker.worker_id

    assert routed(36, takers[:1]) == "worker-0"  # 40 tokens: its whole pool
    assert routed(37, takers[:1]) is None
    assert routed(37, takers) == "worker-1"
    for _ in range(8):  # whatever the policy's turn or load, never the pool that is too small
        assert routed(200, takers) == "worker-1"


def test_a_prefix_cached_nowhere_goes_to_its_session_else_spreads():
    registry, index, router = setup()
    registry.assign("w1", "r", 10)  # w0 has the most room
    first_turn = list(range(1, 9))  # two blocks, not reported by any worker yet
    route = router.route(request(first_turn, session_id="chat"), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w0", "spread")
    router.committed([request(first_turn, session_id="chat")], registry.workers["w1"])
    next_turn = request(first_turn + [9, 9, 9], session_id="chat")
    route = router.route(next_turn, workers(registry), {})
    assert (route.worker.worker_id, route.outcome, route.predicted_cached_tokens) == ("w1", "sticky", 8)
    # Another request of the session that does not continue its last prompt gains nothing there.
    route = router.route(request([9, 9, 9, 9, 9], session_id="chat"), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w0", "spread")
    registry.assign("w1", "big", 1000)  # the session's worker is overloaded: spread instead
    route = router.route(next_turn, workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w0", "spread")
    # A session's worker that cannot take the request is not a candidate at all.
    route = router.route(next_turn, [registry.workers["w0"]], {})
    assert route.worker.worker_id == "w0"
    assert router.route(request([1]), [], {}) is None


def test_one_session_shared_by_unrelated_requests_spreads_them():
    """An application sending one `user` with every request: its unrelated prompts go where they
    cost least, not all to the worker that served the first."""
    registry, index, router = setup()
    chosen = []
    for i in range(8):
        state = request([50 + i] * 12, session_id="my-app")
        route = router.route(state, workers(registry), {})
        chosen.append(route.worker.worker_id)
        send(registry, router, route.worker.worker_id, state, f"r{i}")
    assert chosen.count("w0") == chosen.count("w1") == 4


def test_a_request_goes_where_it_starts_at_once_before_where_its_prefix_is_cached():
    """Cached history or session, a worker whose running slots are all taken would queue the
    request behind them: a worker with a free slot wins, even recomputing the whole prompt."""
    for policy in ("cache_aware", "least_loaded"):
        registry, index, router = setup(policy)
        cache(index, "w0", SYSTEM)
        router.committed([request(SYSTEM, session_id="chat")], registry.workers["w0"])
        turn = request(SYSTEM + [1, 2, 3, 4, 5], session_id="chat")
        assert router.route(turn, workers(registry), {}).worker.worker_id == "w0"
        for i in range(7):
            registry.assign("w0", f"running-{i}", 10)
        assert router.route(turn, workers(registry), {}).worker.worker_id == "w0"  # one slot of 8 left
        router.begin_pass()
        router.note_routed(request([7] * 4), registry.workers["w0"])  # this pass takes it
        assert router.route(turn, workers(registry), {}).worker.worker_id == "w1"
        router.begin_pass()
        registry.assign("w0", "running-7", 10)
        assert router.route(turn, workers(registry), {}).worker.worker_id == "w1"
        registry.assign("w1", "elsewhere", 10)
        for i in range(7):  # both would queue it: the cache decides again
            registry.assign("w1", f"elsewhere-{i}", 10)
        if policy == "cache_aware":
            assert router.route(turn, workers(registry), {}).worker.worker_id == "w0"


def test_a_workers_load_grows_with_what_its_requests_generate():
    registry, index, router = setup()
    for worker_id in ("w0", "w1"):
        cache(index, worker_id, SYSTEM)
        registry.assign(worker_id, f"{worker_id}-long", 40)
    assert router.route(request(SYSTEM + [1]), workers(registry), {}).worker.worker_id == "w0"  # a tie
    registry.note_tokens("w0", "w0-long", 500)
    assert registry.workers["w0"].load_tokens() == 540
    assert router.route(request(SYSTEM + [1]), workers(registry), {}).worker.worker_id == "w1"
    registry.note_tokens("w0", "gone", 5)  # a request already released counts nothing
    assert registry.workers["w0"].load_tokens() == 540


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
    for key, value in (("policy", "random"), ("load_cost_tokens", -1), ("new_conversation_load_cost_tokens", -0.5)):
        with pytest.raises(ConfigError, match=f"dispatch.{key}"):
            load_config(overrides={f"dispatch.{key}": value})


def test_new_conversations_spread_over_idle_workers_by_what_they_cache():
    registry, index, router = setup(num_workers=3)
    cache(index, "w0", list(range(40)))
    cache(index, "w2", list(range(200, 208)))
    route = router.route(request([9] * 20), workers(registry), {})
    assert (route.worker.worker_id, route.outcome) == ("w1", "spread")


def test_the_index_gauge_follows_a_worker_declared_dead():
    async def scenario():
        dispatcher = Dispatcher(load_config())
        ours = dispatcher.model_check.fingerprint
        dispatcher._on_envelope(heartbeat("worker-0", model_fingerprint=ours), 0.0)
        cache(dispatcher.prefix_index, "worker-0", SYSTEM)
        dispatcher._on_envelope(heartbeat("worker-0", kv_events_seq=1, model_fingerprint=ours), 0.1)

        def indexed():
            return dispatcher.metrics.registry.get_sample_value("inference_prefix_index_blocks", {"worker": "worker-0"})

        assert indexed() == 8
        dispatcher._check_liveness(5.0)  # its heartbeats stopped: the index forgets its blocks, and so does /metrics
        assert dispatcher.prefix_index.num_blocks("worker-0") == 0 and indexed() == 0

    asyncio.run(scenario())
