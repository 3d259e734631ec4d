"""The fake worker's prefix cache (bench/fake_prefix_cache.py): hits up to the block before the last
token, LRU eviction of unheld blocks only when the pool needs room, events in their end state, and
snapshots; and what bench/fake_worker.py sends of it (KvEvents seqs, heartbeats, snapshots).
Pure Python, no processes."""
from __future__ import annotations

from bench.fake_prefix_cache import FakePrefixCache
from shared.block_hash import chain_hashes

BS = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run(cache: FakePrefixCache, rid: str, token_ids: list[int], num_generated: int = 0) -> int:
    """A whole request: admit, prefill, generate, finish (as the fake worker drives it)."""
    cached = cache.admit(rid, token_ids)
    cache.register(rid, token_ids)
    full = token_ids + [100] * num_generated
    cache.grow(rid, len(full))
    cache.register(rid, full[:-1] if num_generated else full)
    cache.release(rid)
    return cached


def test_hits_cover_full_blocks_before_the_last_token():
    cache = FakePrefixCache(64, BS)
    prompt = tokens(10, 10)  # 2 full blocks + 2 tokens
    assert run(cache, "a", prompt) == 0
    assert cache.num_prefix_query_tokens == 8 and cache.num_prefix_hit_tokens == 0
    assert run(cache, "b", prompt) == 8
    assert run(cache, "c", prompt[:8]) == 4  # 8 tokens: the second block holds the last token
    assert run(cache, "d", prompt[:5] + [999] * 5) == 4  # diverges in block 2
    assert run(cache, "e", [7] + prompt[1:]) == 0  # the chain: a different first block shares nothing
    assert cache.num_prefix_hit_tokens == 8 + 4 + 4
    assert cache.num_free_blocks == 64 and cache.num_used_blocks == 0


def test_generated_tokens_are_cached_for_the_next_turn():
    cache = FakePrefixCache(64, BS)
    prompt = tokens(10, 6)
    run(cache, "t1", prompt, num_generated=7)  # 6 + 7 = 13 tokens, 12 with KV: 3 full blocks
    next_prompt = prompt + [100] * 7 + tokens(50, 3)
    assert run(cache, "t2", next_prompt) == 12


def test_held_blocks_are_never_evicted_and_unheld_go_least_recent_first():
    cache = FakePrefixCache(5, BS)
    a, b = tokens(10, 8), tokens(30, 8)  # 2 blocks each
    run(cache, "a", a)
    run(cache, "b", b)
    assert cache.num_evictable_blocks == 4 and cache.num_free_blocks == 5
    assert run(cache, "a2", a + [1]) == 8  # touches a: b is now least recent
    cache.drain_events()
    c = tokens(50, 9)  # 3 blocks while it runs: the pool evicts the two least recent, b's
    run(cache, "c", c)
    stored, removed = cache.drain_events()
    assert set(removed) == set(chain_hashes(b, BS)) and set(stored) == set(chain_hashes(c, BS))
    assert run(cache, "a3", a + [1]) == 8

    # While a request holds blocks they stay, even over capacity; its own blocks count as used.
    cache.admit("big", a + tokens(70, 13))  # 21 tokens: 2 held + 4 of its own = 6 > 5
    assert cache.num_used_blocks == 6 and cache.num_free_blocks == 0
    assert all(cache.is_cached(h) for h in chain_hashes(a, BS))
    assert cache.num_evictable_blocks == 0  # c's blocks made what room they could
    cache.release("big")
    assert cache.num_used_blocks == 0 and cache.num_free_blocks == 5


def test_events_hold_each_hash_once_in_its_end_state():
    cache = FakePrefixCache(2, BS)
    a, b = tokens(10, 8), tokens(30, 8)
    run(cache, "a", a)
    run(cache, "b", b)  # a's blocks stored, then evicted, within one interval
    stored, removed = cache.drain_events()
    assert set(stored) == set(chain_hashes(b, BS)) and set(removed) == set(chain_hashes(a, BS))
    assert not set(stored) & set(removed)
    run(cache, "a", a)  # evicts b, brings a back
    stored, removed = cache.drain_events()
    assert set(stored) == set(chain_hashes(a, BS)) and set(removed) == set(chain_hashes(b, BS))
    assert cache.drain_events() == ([], [])
    run(cache, "a", a + [1])  # a pure hit (over capacity while it runs, so nothing to evict) changes nothing
    assert cache.drain_events() == ([], [])


def test_snapshot_is_every_cached_hash_and_drops_pending_events():
    cache = FakePrefixCache(16, BS)
    a = tokens(10, 8)
    run(cache, "a", a)
    cache.admit("live", tokens(30, 9))
    cache.register("live", tokens(30, 9))  # held by a running request: cached too
    assert set(cache.snapshot()) == set(chain_hashes(a, BS)) | set(chain_hashes(tokens(30, 9), BS))
    assert cache.drain_events() == ([], [])
    cache.release("live")
    cache.release("unknown")  # a no-op
    assert len(cache.cached_hashes()) == 4


class _Socket:
    """Stands in for the fake worker's socket: records what it sends, delivers what a test queues."""

    def __init__(self):
        self.sent, self.inbox = [], []

    def send(self, envelope):
        self.sent.append(envelope)
        return True

    def recv_all(self, timeout_s):
        inbox, self.inbox = self.inbox, []
        return inbox

    def close(self):
        pass


def test_fake_worker_reports_its_cache_on_the_wire(monkeypatch, tmp_path):
    from bench import fake_worker
    from protos import worker_pb2
    from shared.config import load_config

    socket = _Socket()
    monkeypatch.setattr(fake_worker, "connect_worker_socket", lambda *a, **k: socket)
    config = load_config(None, {"model_dir": str(tmp_path), "worker.block_size": BS})
    worker = fake_worker.FakeWorker(config, "worker-0", 0.001, tmp_path / "trace.json", cache_blocks=64)
    prompt = tokens(10, 9)  # 2 full blocks + 1 token

    def submit(rid, max_tokens):
        worker._handle(worker_pb2.Envelope(submit=worker_pb2.SubmitBatch(requests=[worker_pb2.WireRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=worker_pb2.WireSampling(max_tokens=max_tokens))])))

    def sent(kind):
        return [e for e in socket.sent if e.WhichOneof("body") == kind]

    submit("a", 4)
    while worker.running:  # one step at a time, each followed by its report, as the loop does
        worker._send([worker._give_token("a", worker.running["a"])])
        worker._send_kv_events()
    worker._heartbeat()
    events = [e.kv_events for e in sent("kv_events")]
    assert [e.seq for e in events] == [1, 2] and not any(e.snapshot for e in events)
    assert {e.block_size for e in events} == {BS} and not any(e.removed for e in events)
    # The prompt's 2 full blocks once prefilled; at the end 9 prompt + 4 generated tokens, the last
    # without KV: 12 tokens, 3 full blocks.
    blocks = chain_hashes(prompt + [fake_worker.TOKEN_ID] * 3, BS)
    assert list(events[0].stored) == blocks[:2] and list(events[1].stored) == blocks[2:]
    hb = sent("heartbeat")[-1].heartbeat
    assert hb.kv_events_seq == 2 and hb.kv_blocks_total == 64 and hb.kv_blocks_cached == 3
    assert hb.num_prefix_query_tokens == 8 and hb.num_prefix_hit_tokens == 0

    submit("b", 2)
    delta = worker._give_token("b", worker.running["b"])
    assert delta.num_cached_tokens == 8 and delta.num_prompt_tokens == 9
    worker._handle(worker_pb2.Envelope(kv_snapshot_request=worker_pb2.KvSnapshotRequest()))
    snapshot = sent("kv_events")[-1].kv_events
    assert snapshot.snapshot and snapshot.seq == 3 and set(snapshot.stored) == set(blocks)
    worker._handle(worker_pb2.Envelope(abort=worker_pb2.AbortRequests(request_ids=["b"])))
    assert not worker.running and worker.cache.num_used_blocks == 0
