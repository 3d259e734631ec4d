"""worker.block_manager against a shadow model: a hypothesis state machine drives it as an engine would
and checks block contents, counters and the drained KV-event changes."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from worker.block_manager import BlockManager


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
        self.lookups: dict[str, tuple[int, int]] = {}  # counted once the request gets its slots

    def pick(self, index):
        ids = sorted(self.tokens)
        return ids[index % len(ids)]

    def admit(self, request_id, token_ids, max_cached):
        hit = self.bm.allocate_prefix(request_id, token_ids, max_cached)
        table = self.bm.block_table(request_id)
        if self.bm.enable_prefix_caching:
            num_query = min(len(token_ids), max(max_cached, 0)) // self.bs * self.bs
            assert hit % self.bs == 0 and hit <= num_query
            self.lookups[request_id] = (num_query, hit)
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
        num_query, hit = self.lookups.pop(request_id, (0, 0))
        self.query_tokens += num_query
        self.hit_tokens += hit
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
        self.lookups.pop(request_id, None)

    @precondition(lambda self: self.bm is not None and self.tokens)
    @rule(index=st.integers(0, 100), max_cached=st.integers(0, 12))
    def preempt_and_resume(self, index, max_cached):
        request_id = self.pick(index)
        tokens = self.tokens[request_id]
        self.bm.free(request_id)
        self.lookups.pop(request_id, None)
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
