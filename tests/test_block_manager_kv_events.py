"""worker.block_manager's change tracking for KV events (what registering, evicting and reusing blocks
report), and the gateway's chain hashes as the keys it caches under."""

from block_manager_harness import BS, make, run_request
from shared.block_hash import chain_hashes
from worker.block_manager import BlockManager


# ---- change tracking (KV events) ----------------------------------------------------------------


def tracked(num_blocks=8) -> BlockManager:
    bm = make(num_blocks)
    bm.track_cache_changes()
    return bm


def test_tracking_is_off_by_default_and_records_nothing():
    bm = make()
    run_request(bm, "a", list(range(8)))
    bm.free("a")
    bm.evict()
    assert bm.drain_cache_changes() == ([], [])
    assert bm._changes is None  # nothing accumulates in offline use
    run_request(bm, "b", list(range(8)))
    assert set(bm.cached_hashes()) == set(chain_hashes(list(range(8)), BS))  # snapshots work regardless


def test_registering_blocks_stores_the_shared_chain_hashes():
    bm = tracked()
    tokens = list(range(10, 21))  # 11 tokens: 2 full blocks and a partial one
    run_request(bm, "a", tokens)
    stored, removed = bm.drain_cache_changes()
    assert stored == chain_hashes(tokens, BS) and removed == []
    assert bm.drain_cache_changes() == ([], [])  # drained: cleared
    # A prefix hit registers nothing new; the extra computed block does.
    longer = tokens + [21, 22, 23, 24, 25]
    assert run_request(bm, "b", longer) == 8
    assert bm.drain_cache_changes() == (chain_hashes(longer, BS)[2:], [])
    bm.check_integrity()


def test_a_caching_off_manager_tracks_nothing():
    bm = make(caching=False)
    bm.track_cache_changes()
    run_request(bm, "a", list(range(8)))
    assert bm.drain_cache_changes() == ([], []) and bm.cached_hashes() == []


def test_evict_reports_removed_hashes():
    bm = tracked()
    tokens = list(range(12))
    run_request(bm, "a", tokens)
    hashes = chain_hashes(tokens, BS)
    bm.drain_cache_changes()
    bm.free("a")
    assert bm.drain_cache_changes() == ([], [])  # evictable is still cached
    assert bm.evict(1) == 1
    assert bm.drain_cache_changes() == ([], [hashes[2]])  # the chain's tail goes first
    assert bm.evict() == 2
    stored, removed = bm.drain_cache_changes()
    assert stored == [] and sorted(removed) == sorted(hashes[:2])
    assert bm.cached_hashes() == []
    bm.check_integrity()


def test_reusing_an_evictable_block_under_allocation_pressure_reports_removed():
    bm = tracked(num_blocks=4)
    first = list(range(8))
    run_request(bm, "a", first)
    bm.free("a")
    bm.drain_cache_changes()
    assert bm.allocate_slots("b", 12)  # 2 free blocks, then the LRU evictable one
    assert bm.drain_cache_changes() == ([], [chain_hashes(first, BS)[1]])
    bm.check_integrity()


def test_changes_coalesce_to_the_state_at_the_end_of_the_interval():
    bm = tracked(num_blocks=4)
    tokens = list(range(8))
    hashes = chain_hashes(tokens, BS)
    run_request(bm, "a", tokens)
    bm.free("a")
    bm.evict()  # stored then dropped within one interval: removed only
    stored, removed = bm.drain_cache_changes()
    assert stored == [] and sorted(removed) == sorted(hashes)
    run_request(bm, "b", tokens)
    bm.drain_cache_changes()
    bm.free("b")
    bm.evict()
    run_request(bm, "c", tokens)  # dropped then registered again: stored only
    stored, removed = bm.drain_cache_changes()
    assert sorted(stored) == sorted(hashes) and removed == []
    bm.check_integrity()


def test_cached_hashes_mirror_the_applied_changes_after_mixed_operations():
    bm = tracked(num_blocks=6)
    mirror: set[bytes] = set()

    def apply():
        stored, removed = bm.drain_cache_changes()
        assert len(stored) == len(set(stored)) and len(removed) == len(set(removed))
        assert not set(stored) & set(removed)
        mirror.difference_update(removed)
        mirror.update(stored)

    run_request(bm, "a", list(range(8)))
    run_request(bm, "b", list(range(100, 108)))
    apply()
    bm.free("a")
    run_request(bm, "c", list(range(200, 212)))  # needs 3: 2 free, then one of a's
    bm.free("b")
    bm.evict(1)
    apply()
    run_request(bm, "d", list(range(4)) + [9, 9, 9, 9])  # a prefix hit on a's head if it survived
    apply()
    assert mirror == set(bm.cached_hashes()) == set(bm._hash_to_block_id)
    assert mirror and len(bm.cached_hashes()) == len(mirror)
    bm.check_integrity()


def test_the_shared_chain_hashes_are_the_keys_the_block_manager_caches_under():
    # What the gateway computes from a prompt (shared/block_hash.py, no worker code) is exactly
    # what a worker registers, block for block, so an index of the workers' caches can be looked
    # up from the gateway's side.
    from shared.block_hash import chain_hashes
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(7, 26))  # 19 tokens: 4 full blocks and a partial one
    bm.allocate_prefix("r", tokens, max_cached_tokens=0)
    assert bm.allocate_slots("r", len(tokens))
    bm.cache_blocks("r", tokens, len(tokens))
    hashes = chain_hashes(tokens, 4)
    assert len(hashes) == 4
    assert [bm._hash_to_block_id[h] for h in hashes] == bm.block_table("r")[:4]
    assert set(bm._hash_to_block_id) == set(hashes)
    # A different first block changes every later hash (the chain), not just the first.
    other = chain_hashes([0] + tokens[1:], 4)
    assert not set(other) & set(hashes)
