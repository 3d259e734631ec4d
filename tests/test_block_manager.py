"""Tests for worker.block_manager: exact block ids in unit tests, change tracking for KV events,
plus a stateful model-based check."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shared.block_hash import chain_hashes
from worker.block_manager import BlockManager

BS = 4  # block size used by the unit tests


def make(num_blocks=8, caching=True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching)


def run_request(bm, request_id, token_ids, max_cached_tokens=None):
    """Admit a request the way the engine does: prefix lookup, slots for all tokens, then cache."""
    if max_cached_tokens is None:
        max_cached_tokens = len(token_ids)
    hit = bm.allocate_prefix(request_id, token_ids, max_cached_tokens)
    assert bm.allocate_slots(request_id, len(token_ids))
    bm.cache_blocks(request_id, token_ids, len(token_ids))
    bm.check_integrity()
    return hit


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
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (16, 8)
    bm.allocate_prefix("c", tokens[:4] + [0, 0, 0, 0], 6)  # one whole block considered, hit
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (20, 12)
    bm.free("a"), bm.free("b"), bm.free("c")
    assert bm.evict() == 2
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (20, 12)


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


# ---- stateful model-based test ----------------------------------------------------------------

# A tiny vocabulary and a few shared prompts, so different requests share prefixes often.
VOCAB = st.integers(0, 1)
PROMPTS = [[0] * 8, [0, 1] * 4, [1, 1, 0, 0] * 2]


def kv_of(token_ids, pos):
    """Stand-in for the KV of token pos: everything it was computed from."""
    return tuple(token_ids[: pos + 1])


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager like an engine would and checks it against a shadow model.

    The shadow keeps, per request, its known tokens, its slots and how many tokens have KV
    written; and, per block slot, what its KV depends on: the whole token prefix up to and
    including that token (attention makes a token's KV depend on everything before it). A
    prefix hit must return blocks whose slots hold exactly the looked-up prefixes.
    """

    def __init__(self):
        super().__init__()
        self.bm = None

    # Small pools mostly, so allocation failures and eviction-on-allocate are common.
    @initialize(
        num_blocks=st.one_of(st.integers(4, 8), st.integers(4, 24)),
        block_size=st.integers(1, 4),
        caching=st.sampled_from([True, True, False]),
    )
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bm.track_cache_changes()
        self.mirror: set[bytes] = set()  # what a gateway applying the drained changes believes is cached
        self.bs = block_size
        self.tokens: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.content = [[None] * block_size for _ in range(num_blocks)]
        self.next_id = 0
        self.query_tokens = self.hit_tokens = 0

    def pick(self, index):
        ids = sorted(self.tokens)
        return ids[index % len(ids)]

    def admit(self, request_id, token_ids, max_cached):
        hit = self.bm.allocate_prefix(request_id, token_ids, max_cached)
        table = self.bm.block_table(request_id)
        if self.bm.enable_prefix_caching:
            num_query = min(len(token_ids), max(max_cached, 0)) // self.bs * self.bs
            assert hit % self.bs == 0 and hit <= num_query
            self.query_tokens += num_query
            self.hit_tokens += hit
        else:
            assert hit == 0
        assert len(table) * self.bs == hit
        for i, block_id in enumerate(table):
            expected = [kv_of(token_ids, pos) for pos in range(i * self.bs, (i + 1) * self.bs)]
            assert self.content[block_id] == expected, f"prefix hit on block {block_id} with stale KV"
        self.tokens[request_id] = list(token_ids)
        self.slots[request_id] = self.computed[request_id] = hit

    @precondition(lambda self: self.bm is not None)
    @rule(
        prompt=st.sampled_from(PROMPTS),
        prompt_len=st.integers(0, 8),
        suffix=st.lists(VOCAB, max_size=6),
        max_cached=st.integers(-1, 14),
        run_step=st.booleans(),
    )
    def new_request(self, prompt, prompt_len, suffix, max_cached, run_step):
        token_ids = prompt[:prompt_len] + suffix
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.admit(request_id, token_ids, max_cached)
        # Like the scheduler, ask for the whole prompt at once; on failure the request just waits.
        if self.grow(request_id, len(token_ids)) and run_step:
            self.write_kv(request_id, len(token_ids))

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(
        index=st.integers(0, 100),
        num_more=st.integers(0, 6),
        new_tokens=st.lists(VOCAB, max_size=6),
        run_step=st.booleans(),
    )
    def append_slots(self, index, num_more, new_tokens, run_step):
        request_id = self.pick(index)
        self.tokens[request_id] += new_tokens
        if self.grow(request_id, self.slots[request_id] + num_more) and run_step:
            self.write_kv(request_id, self.slots[request_id])

    def grow(self, request_id, num_tokens):
        tokens = self.tokens[request_id]
        tokens += [0] * (num_tokens - len(tokens))  # known tokens always cover the slots
        needed = self.bm.num_new_blocks_needed(request_id, num_tokens)
        num_free, table = self.bm.num_free_blocks, self.bm.block_table(request_id)
        ok = self.bm.allocate_slots(request_id, num_tokens)
        assert ok == (needed <= num_free)
        if not ok:
            assert self.bm.block_table(request_id) == table and self.bm.num_free_blocks == num_free
            return False
        assert num_free - self.bm.num_free_blocks == needed
        self.slots[request_id] = num_tokens
        return True

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(index=st.integers(0, 100), data=st.data())
    def compute(self, index, data):
        request_id = self.pick(index)
        start, end = self.computed[request_id], self.slots[request_id]
        # Any prefix of the pending tokens: a chunked prefill computes part of them.
        self.write_kv(request_id, data.draw(st.integers(start, end)))

    def write_kv(self, request_id, num_computed):
        """A forward pass: write KV for the not yet computed tokens, then register full blocks."""
        start = self.computed[request_id]
        table, tokens = self.bm.block_table(request_id), self.tokens[request_id]
        for pos in range(start, num_computed):
            self.content[table[pos // self.bs]][pos % self.bs] = kv_of(tokens, pos)
        self.bm.cache_blocks(request_id, tokens, num_computed)
        self.computed[request_id] = num_computed

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        request_id = self.pick(index)
        self.bm.free(request_id)
        num_free = self.bm.num_free_blocks
        self.bm.free(request_id)  # double free and unknown ids are harmless
        self.bm.free("unknown")
        assert self.bm.num_free_blocks == num_free and not self.bm.has_request(request_id)
        for shadow in (self.tokens, self.slots, self.computed):
            del shadow[request_id]

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(index=st.integers(0, 100), max_cached=st.integers(0, 12))
    def preempt_and_resume(self, index, max_cached):
        request_id = self.pick(index)
        tokens = self.tokens[request_id]
        self.bm.free(request_id)
        self.admit(request_id, tokens, max_cached)

    @precondition(lambda self: self.bm is not None)
    @rule(max_blocks=st.sampled_from([0, 1, 2, None]))  # mostly partial, so the LRU stays populated
    def evict(self, max_blocks):
        num_evictable = self.bm.num_evictable_blocks
        num_evicted = self.bm.evict(max_blocks)
        limit = num_evictable if max_blocks is None else min(max_blocks, num_evictable)
        assert num_evicted == limit
        assert self.bm.num_evictable_blocks == num_evictable - num_evicted

    @precondition(lambda self: self.bm is not None)
    @rule()
    def report_changes(self):
        """A KV-events report: the drained changes, applied in any order, give the cache exactly."""
        stored, removed = self.bm.drain_cache_changes()
        assert not set(stored) & set(removed) and len(set(stored) | set(removed)) == len(stored) + len(removed)
        self.mirror.difference_update(removed)
        self.mirror.update(stored)
        assert self.mirror == set(self.bm.cached_hashes())

    @invariant()
    def consistent(self):
        if self.bm is None:
            return
        self.bm.check_integrity()
        bm = self.bm
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert all(bm.has_request(request_id) for request_id in self.tokens)
        for request_id, num_tokens in self.slots.items():
            assert bm.num_tokens(request_id) == num_tokens
            assert len(bm.block_table(request_id)) == -(-num_tokens // self.bs)
        assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (self.query_tokens, self.hit_tokens)
        # No request's written KV was clobbered: catches reuse of a live block.
        for request_id, num_computed in self.computed.items():
            table, tokens = bm.block_table(request_id), self.tokens[request_id]
            written = [self.content[table[pos // self.bs]][pos % self.bs] for pos in range(num_computed)]
            assert written == [kv_of(tokens, pos) for pos in range(num_computed)], (
                f"KV of {request_id} was overwritten")

    def teardown(self):
        if self.bm is None:
            return
        for request_id in list(self.tokens):
            self.bm.free(request_id)
        self.bm.evict()
        self.bm.check_integrity()
        self.report_changes()
        assert not self.mirror
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.num_evictable_blocks == 0 and self.bm.num_used_blocks == 0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


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
