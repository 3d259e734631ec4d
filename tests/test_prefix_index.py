"""The gateway's prefix index: it computes the block manager's own keys, follows the workers'
register/evict reports, recovers from a lost report by snapshot, forgets a dead worker, and tells a
prefix that routed prompts branch from (shared) from one conversation's own chain."""
from __future__ import annotations

import random

from gateway.prefix_index import MAX_CHILDREN, SNAPSHOT_RETRY_S, PrefixIndex
from protos import worker_pb2
from shared.block_hash import chain_hashes
from worker.block_manager import BlockManager

BLOCK = 4


def events(seq, stored=(), removed=(), snapshot=False):
    return worker_pb2.KvEvents(seq=seq, stored=list(stored), removed=list(removed), snapshot=snapshot,
                               block_size=BLOCK)


def test_the_gateway_hashes_are_the_block_managers_keys():
    rng = random.Random(3)
    tokens = [rng.randrange(32000) for _ in range(37)]
    blocks = BlockManager(num_blocks=32, block_size=BLOCK)
    blocks.track_cache_changes()
    blocks.allocate_slots("r", len(tokens))
    blocks.cache_blocks("r", tokens, len(tokens))
    stored, removed = blocks.drain_cache_changes()
    assert stored == chain_hashes(tokens, BLOCK) and len(stored) == 37 // BLOCK and removed == []
    assert set(blocks.cached_hashes()) == set(chain_hashes(tokens, BLOCK))


def test_the_index_follows_registered_and_evicted_blocks():
    index = PrefixIndex()
    a, b = chain_hashes(list(range(16)), BLOCK), chain_hashes(list(range(8)) + [99] * 8, BLOCK)
    index.on_events("w0", events(1, stored=a))
    index.on_events("w1", events(1, stored=b))
    assert index.match(a, ["w0", "w1"]) == {"w0": 4, "w1": 2}  # b shares a's first two blocks
    index.on_events("w0", events(2, removed=a[2:]))
    assert index.match(a, ["w0", "w1"]) == {"w0": 2, "w1": 2}
    index.on_events("w1", events(2, removed=[b[0]]))  # a chain without its head matches nothing
    assert index.match(a, ["w0", "w1"]) == {"w0": 2, "w1": 0}
    assert len(index) == len(set(a[:2]) | set(b[1:]))  # the union of the cached blocks, each once
    assert index.num_blocks("w0") == 2 and index.num_blocks("w1") == 3
    index.on_events("w0", events(3, removed=[b"never stored"]))  # stored and evicted within one report
    assert index.num_blocks("w0") == 2 and not index.needs_snapshot("w0", 0.0)


def test_a_lost_report_is_recovered_by_a_snapshot():
    index = PrefixIndex()
    h = chain_hashes(list(range(40)), BLOCK)
    index.on_events("w0", events(1, stored=h[:3]))
    assert not index.needs_snapshot("w0", 0.0)
    index.on_events("w0", events(3, stored=h[5:6]))  # report 2 (h[3:5], and h[0] evicted) was lost
    assert index.needs_snapshot("w0", 0.0)
    assert not index.needs_snapshot("w0", 0.1)  # asked once; again only after the retry interval
    assert index.needs_snapshot("w0", SNAPSHOT_RETRY_S + 0.1)
    index.on_events("w0", events(4, stored=h[1:6], snapshot=True))
    assert index.num_blocks("w0") == 5 and index.match(h, ["w0"]) == {"w0": 0}  # h[0] is gone
    assert not index.needs_snapshot("w0", 10.0)
    index.on_events("w0", events(4, stored=[h[0]]))  # a repeat of what the snapshot covered: ignored
    index.on_events("w0", events(5, stored=[h[0]]))
    assert index.match(h, ["w0"]) == {"w0": 6} and not index.needs_snapshot("w0", 20.0)


def test_a_report_a_heartbeat_announced_that_never_arrives_is_lost():
    index = PrefixIndex()
    h = chain_hashes(list(range(12)), BLOCK)
    index.on_heartbeat("w0", 0)
    index.on_events("w0", events(1, stored=h[:1]))
    index.on_heartbeat("w0", 2)  # report 2 may still be on its way: one heartbeat of slack
    assert not index.needs_snapshot("w0", 0.0)
    index.on_events("w0", events(2, stored=h[1:2]))
    index.on_heartbeat("w0", 3)
    assert not index.needs_snapshot("w0", 0.0)
    index.on_heartbeat("w0", 3)  # report 3 did not come by the next heartbeat
    assert index.needs_snapshot("w0", 0.0)


def test_a_gateway_that_never_followed_a_worker_asks_it_for_a_snapshot():
    index = PrefixIndex()
    index.on_heartbeat("w0", 7)  # a restarted gateway meets a worker that has been reporting
    assert index.needs_snapshot("w0", 0.0)
    fresh = PrefixIndex()
    fresh.on_heartbeat("w1", 0)  # a worker that has cached nothing yet
    assert not fresh.needs_snapshot("w1", 0.0)


def test_a_dead_or_restarted_worker_is_forgotten():
    index = PrefixIndex()
    h = chain_hashes(list(range(16)), BLOCK)
    index.on_events("w0", events(1, stored=h))
    index.on_events("w1", events(1, stored=h[:2]))
    index.forget("w0")
    assert index.match(h, ["w0", "w1"]) == {"w0": 0, "w1": 2}
    assert len(index) == 2 and index.num_blocks("w0") == 0
    index.on_events("w0", events(1, stored=h[:1]))  # the new incarnation starts from nothing
    assert index.match(h, ["w0", "w1"]) == {"w0": 1, "w1": 2}
    index.forget("w1")
    index.forget("w0")
    assert len(index) == 0


def test_a_prefix_that_routed_prompts_continue_differently_is_shared():
    index = PrefixIndex()
    system = list(range(16))  # 4 blocks, cached on w0
    index.on_events("w0", events(1, stored=chain_hashes(system, BLOCK)))
    first = chain_hashes(system + [50] * 8, BLOCK)
    assert not index.is_shared(first, 4) and not index.is_shared(first, 0)
    index.note_chain(first)  # one conversation went on from the system prompt
    second = chain_hashes(system + [60] * 8, BLOCK)
    assert index.is_shared(second, 4)  # another prompt continued it differently: a shared prefix
    assert not index.is_shared(first, 4)  # its own continuation is no branch
    assert not index.is_shared(second, 2)  # inside the system prompt every prompt goes on alike
    assert index.is_shared(chain_hashes(system, BLOCK), 4)  # a prompt that is all shared prefix
    index.note_chain(chain_hashes(system + [70] * 8, BLOCK))
    index.note_chain(chain_hashes(system + [80] * 8, BLOCK))
    assert len(index._children[first[3]]) == MAX_CHILDREN  # bounded, however many conversations go on
    assert index.is_shared(first, 4) and index.is_shared(second, 4)
    # Blocks cached nowhere get no entry, and an evicted block's entry goes with it.
    assert set(index._children) == set(first[:4])
    index.on_events("w0", events(2, removed=first[2:4]))
    assert not index.is_shared(second, 4) and set(index._children) == set(first[:2])
    index.forget("w0")
    assert index._children == {}
