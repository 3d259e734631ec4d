"""Tests for worker.block_manager: allocation and prefix caching, with exact block ids."""

import pytest

from block_manager_harness import make, run_request


# ---- allocation -------------------------------------------------------------------------------


def test_growth_across_block_boundaries():
    bm = make()
    assert bm.allocate_slots("a", 1)
    assert bm.block_table("a") == [0] and bm.num_tokens("a") == 1
    assert bm.allocate_slots("a", 4)  # still fits in block 0
    assert bm.block_table("a") == [0]
    assert bm.allocate_slots("a", 5)
    assert bm.block_table("a") == [0, 1]
    assert bm.allocate_slots("a", 13)
    assert bm.block_table("a") == [0, 1, 2, 3]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (4, 4)
    with pytest.raises(ValueError):
        bm.allocate_slots("a", 12)
    bm.check_integrity()


def test_block_table_is_a_copy_and_unknown_queries():
    bm = make()
    bm.allocate_slots("a", 4)
    bm.block_table("a").append(99)
    assert bm.block_table("a") == [0]
    assert not bm.has_request("x") and bm.num_tokens("x") == 0
    with pytest.raises(KeyError):
        bm.block_table("x")


def test_exhausted_pool_is_all_or_nothing():
    bm = make(num_blocks=4)
    assert bm.allocate_slots("a", 8)
    assert bm.allocate_slots("b", 4)
    assert not bm.allocate_slots("a", 13)  # needs 2 more, only 1 free
    assert bm.block_table("a") == [0, 1] and bm.num_tokens("a") == 8
    assert not bm.allocate_slots("c", 8)
    assert not bm.has_request("c")
    assert bm.num_free_blocks == 1
    assert bm.allocate_slots("a", 12)
    assert bm.block_table("a") == [0, 1, 3]
    bm.check_integrity()


def test_free_returns_blocks_and_is_idempotent():
    bm = make(num_blocks=4)
    bm.allocate_slots("a", 12)
    bm.allocate_slots("b", 4)
    bm.free("a")
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 1
    assert not bm.has_request("a")
    bm.free("a")  # double free
    bm.free("never-seen")
    assert bm.num_free_blocks == 3
    # FIFO free list: a's blocks come back in reverse table order.
    assert bm.allocate_slots("c", 12)
    assert bm.block_table("c") == [2, 1, 0]
    bm.check_integrity()


def test_allocate_prefix_twice_is_an_error():
    bm = make()
    bm.allocate_prefix("a", [1, 2, 3, 4], 4)
    with pytest.raises(ValueError):
        bm.allocate_prefix("a", [1, 2, 3, 4], 4)


# ---- prefix caching ---------------------------------------------------------------------------


def test_prefix_hit_reuses_exact_blocks():
    bm = make()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert run_request(bm, "a", tokens) == 0
    assert bm.block_table("a") == [0, 1, 2]
    # b shares both full blocks; its third block differs and the trailing partial block is not shared.
    assert bm.allocate_prefix("b", tokens[:8] + [9, 10, 11], 11) == 8
    assert bm.block_table("b") == [0, 1] and bm.num_tokens("b") == 8
    assert bm.allocate_slots("b", 11)
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.num_used_blocks == 4
    bm.check_integrity()


def test_partial_trailing_block_is_never_shared():
    bm = make()
    run_request(bm, "a", [1, 2, 3, 4, 5, 6])
    # Identical tokens, but the second block was never full, so it was never cached.
    assert bm.allocate_prefix("b", [1, 2, 3, 4, 5, 6], 6) == 4
    assert bm.block_table("b") == [0]


def test_hit_stops_at_first_miss():
    bm = make()
    run_request(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    # Second block's tokens match a's, but its parent differs, so the chained hash misses.
    assert bm.allocate_prefix("b", [9, 9, 9, 9, 5, 6, 7, 8], 8) == 0


def test_max_cached_tokens_limits_the_hit():
    bm = make()
    tokens = list(range(12))
    run_request(bm, "a", tokens)
    assert bm.allocate_prefix("b", tokens, 11) == 8  # only whole blocks of the first 11 tokens
    assert bm.allocate_prefix("c", tokens, 3) == 0
    assert bm.allocate_prefix("d", tokens, -1) == 0


def test_caching_off_never_hits():
    bm = make(caching=False)
    tokens = list(range(8))
    assert run_request(bm, "a", tokens) == 0
    bm.free("a")
    assert bm.num_evictable_blocks == 0 and bm.num_free_blocks == 8
    assert bm.allocate_prefix("b", tokens, 8) == 0
    assert bm.block_table("b") == []
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (0, 0)


def test_statistics_counters():
    bm = make()
    tokens = list(range(10))
    run_request(bm, "a", tokens)  # queries 2 whole blocks, hits none
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (8, 0)
    bm.allocate_prefix("b", tokens, 10)
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (8, 0)  # counted once it has its slots
    assert bm.allocate_slots("b", 10)
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (16, 8)
    bm.allocate_prefix("c", tokens[:4] + [0, 0, 0, 0], 6)  # one whole block considered, hit
    assert bm.allocate_slots("c", 4)  # within the block it hit: nothing taken, still counted
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (20, 12)
    bm.free("a"), bm.free("b"), bm.free("c")
    assert bm.evict() == 2
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (20, 12)


def test_a_request_looked_up_while_it_waits_for_room_counts_its_lookup_once():
    bm = make()
    tokens = list(range(10))
    run_request(bm, "a", tokens)
    assert bm.allocate_slots("big", 5 * 4)  # the rest of the pool
    for _ in range(3):  # each step the scheduler looks "b" up, finds no room and gives its hits back
        assert bm.allocate_prefix("b", tokens + [7] * 8, 17) == 8
        assert not bm.allocate_slots("b", 18)
        bm.free("b")
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (8, 0)  # "a"'s alone
    bm.free("big")
    assert bm.allocate_prefix("b", tokens + [7] * 8, 17) == 8
    assert bm.allocate_slots("b", 18)
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (8 + 16, 8)
    bm.check_integrity()


def test_freed_cached_blocks_are_evictable_then_hit_again():
    bm = make()
    tokens = list(range(8))
    run_request(bm, "a", tokens)
    bm.free("a")
    assert bm.num_evictable_blocks == 2
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert bm.allocate_prefix("b", tokens, 8) == 8
    assert bm.block_table("b") == [0, 1]
    assert bm.num_evictable_blocks == 0 and bm.num_used_blocks == 2
    bm.check_integrity()


def test_lru_evicts_chain_tail_first_and_least_recently_freed_first():
    bm = make(num_blocks=6)
    run_request(bm, "a", list(range(12)))  # blocks 0, 1, 2
    run_request(bm, "b", list(range(100, 108)))  # blocks 3, 4
    bm.free("a")  # LRU order 2, 1, 0
    bm.free("b")  # then 4, 3
    assert bm.num_evictable_blocks == 5
    # Block 5 is on the free list and goes first; then evictions in LRU order.
    assert bm.allocate_slots("c", 12)
    assert bm.block_table("c") == [5, 2, 1]
    assert bm.num_evictable_blocks == 3
    # a's head block is still cached; its dropped tail is a miss.
    assert bm.allocate_prefix("d", list(range(12)), 12) == 4
    assert bm.block_table("d") == [0]
    assert bm.evict(1) == 1  # block 4 (b's tail)
    assert bm.allocate_prefix("e", list(range(100, 108)), 8) == 4
    assert bm.block_table("e") == [3]
    assert bm.evict() == 0
    bm.check_integrity()


def test_evict_moves_blocks_to_free_list():
    bm = make(num_blocks=4)
    run_request(bm, "a", list(range(12)))
    bm.free("a")
    assert bm.evict(2) == 2
    assert bm.num_evictable_blocks == 1 and bm.num_free_blocks == 4
    assert bm.evict() == 1
    assert bm.allocate_prefix("b", list(range(12)), 12) == 0
    bm.check_integrity()


def test_duplicate_content_block_stays_unregistered():
    bm = make()
    tokens = list(range(8))
    # Both computed concurrently: neither saw the other's blocks at lookup time.
    for request_id in ("a", "b"):
        assert bm.allocate_prefix(request_id, tokens, 8) == 0
        assert bm.allocate_slots(request_id, 8)
    bm.cache_blocks("a", tokens, 8)
    bm.cache_blocks("b", tokens, 8)
    assert bm.block_table("b") == [2, 3]
    bm.free("b")
    assert bm.num_evictable_blocks == 0  # b's duplicates went straight to the free list
    bm.free("a")
    assert bm.num_evictable_blocks == 2
    assert bm.allocate_prefix("c", tokens, 8) == 8
    assert bm.block_table("c") == [0, 1]
    bm.check_integrity()


def test_cache_blocks_is_incremental_and_validates():
    bm = make()
    tokens = list(range(12))
    bm.allocate_prefix("a", tokens, 12)
    bm.allocate_slots("a", 12)
    bm.cache_blocks("a", tokens, 5)  # only block 0 is full and computed
    assert bm.allocate_prefix("b", tokens, 12) == 4
    bm.cache_blocks("a", tokens, 12)
    assert bm.allocate_prefix("c", tokens, 12) == 12
    with pytest.raises(ValueError):
        bm.cache_blocks("a", tokens, 13)
    bm.check_integrity()


def test_num_new_blocks_needed_matches_allocation():
    bm = make(num_blocks=16)
    assert bm.num_new_blocks_needed("new", 0) == 0
    assert bm.num_new_blocks_needed("new", 9) == 3
    assert bm.allocate_slots("new", 9)
    assert bm.num_free_blocks == 13
    for num_tokens in (9, 10, 12, 13, 20, 33):
        needed = bm.num_new_blocks_needed("new", num_tokens)
        before = bm.num_free_blocks
        assert bm.allocate_slots("new", num_tokens)
        assert before - bm.num_free_blocks == needed
    assert bm.num_new_blocks_needed("new", 1) == 0  # would shrink: nothing to take
