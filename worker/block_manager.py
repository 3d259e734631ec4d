"""Paged KV-cache bookkeeping: block tables, refcounts, the free list and the hash-chained prefix cache.
Pure Python and stdlib only: it never touches tensors or runs copies, it only says which block ids to use.

Opt-in change tracking (`track_cache_changes`) records which block hashes the prefix cache
registered and dropped since the last `drain_cache_changes`, one entry per hash in its state at
the end of the interval, so a worker can report its cache to the gateway (KvEvents) in O(changes).
Off by default: offline engine use accumulates nothing."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

from shared.block_hash import ROOT_HASH, hash_block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Request:
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # token slots covered by block_ids
    # Progress of cache_blocks, so each call only hashes blocks it has not seen.
    num_hashed_blocks: int = 0
    last_hash: bytes = ROOT_HASH
    # A prefix lookup's (queried, hit) tokens, counted once the request gets its slots: a request
    # that waits for room is looked up again each step, and counts once.
    lookup: tuple[int, int] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

        self._free_block_ids: deque[int] = deque(range(num_blocks))  # FIFO: deterministic
        # Unreferenced blocks that still hold a cache entry; first = least recently freed.
        self._evictable_block_ids: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._hash_to_block_id: dict[bytes, int] = {}
        self._block_id_to_hash: dict[int, bytes] = {}
        self._requests: dict[str, _Request] = {}
        # Hash -> cached at the end of the interval (True: registered, False: dropped); None: not tracking.
        self._changes: dict[bytes, bool] | None = None

    # ---- pool state -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # ---- per-request queries ----------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table; KeyError if unknown."""
        return list(self._requests[request_id].block_ids)

    def num_blocks_held(self, request_id: str) -> int:
        req = self._requests.get(request_id)
        return len(req.block_ids) if req is not None else 0

    def num_tokens(self, request_id: str) -> int:
        req = self._requests.get(request_id)
        return req.num_tokens if req is not None else 0

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks allocate_slots(request_id, num_tokens) would take from the pool (0 if it would shrink)."""
        req = self._requests.get(request_id)
        if req is None:
            return _cdiv(max(num_tokens, 0), self.block_size)
        return max(_cdiv(num_tokens, self.block_size) - len(req.block_ids), 0)

    # ---- allocation -------------------------------------------------------------------------

    def allocate_prefix(self, request_id: str, token_ids: Sequence[int], max_cached_tokens: int) -> int:
        """Start a request's table from prefix-cache hits; returns the number of tokens covered."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has a block table")
        req = self._requests[request_id] = _Request()
        if not self.enable_prefix_caching:
            return 0

        num_query_blocks = min(len(token_ids), max(max_cached_tokens, 0)) // self.block_size
        for i in range(num_query_blocks):
            start = i * self.block_size
            block_hash = hash_block(req.last_hash, token_ids[start:start + self.block_size])
            block_id = self._hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            if self._ref_counts[block_id] == 0:
                del self._evictable_block_ids[block_id]
            self._ref_counts[block_id] += 1
            req.block_ids.append(block_id)
            req.num_hashed_blocks += 1
            req.last_hash = block_hash

        req.num_tokens = len(req.block_ids) * self.block_size
        req.lookup = (num_query_blocks * self.block_size, req.num_tokens)
        return req.num_tokens

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the table to cover num_tokens slots; all or nothing, False if the pool is short."""
        req = self._requests.get(request_id)
        current = req.num_tokens if req is not None else 0
        if num_tokens < current:
            raise ValueError(f"request {request_id!r} holds {current} slots, cannot shrink to {num_tokens}")
        if req is not None and num_tokens <= len(req.block_ids) * self.block_size:
            # Within the blocks it holds (most decode steps): nothing to take from the pool.
            req.num_tokens = num_tokens
            self._count_lookup(req)
            return True
        if self.num_new_blocks_needed(request_id, num_tokens) > self.num_free_blocks:
            return False
        if req is None:
            req = self._requests[request_id] = _Request()
        self._count_lookup(req)

        while len(req.block_ids) < _cdiv(num_tokens, self.block_size):
            req.block_ids.append(self._take_block())
        req.num_tokens = num_tokens
        return True

    def _count_lookup(self, req: _Request) -> None:
        if req.lookup is not None:
            self.num_prefix_query_tokens += req.lookup[0]
            self.num_prefix_hit_tokens += req.lookup[1]
            req.lookup = None

    def trim_slots(self, request_id: str, num_tokens: int) -> None:
        """Shrink the table to cover num_tokens slots; the blocks past them go back to the front of the free
        list (the request takes them again next). For slots a step wrote but did not keep (speculative
        decoding's rejected drafts): such blocks are past every hashed one and were taken fresh, so the
        request alone holds them."""
        req = self._requests[request_id]
        if num_tokens > req.num_tokens:
            raise ValueError(f"request {request_id!r} holds {req.num_tokens} slots, cannot trim to {num_tokens}")
        keep = _cdiv(num_tokens, self.block_size)
        if keep < req.num_hashed_blocks:
            raise ValueError(f"request {request_id!r}: trimming to {num_tokens} slots would drop hashed blocks")
        while len(req.block_ids) > keep:
            block_id = req.block_ids.pop()
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] or block_id in self._block_id_to_hash:
                raise AssertionError(f"request {request_id!r} trimmed block {block_id}, which is shared or cached")
            self._free_block_ids.appendleft(block_id)
        req.num_tokens = num_tokens

    def _take_block(self) -> int:
        # Callers have checked num_free_blocks, so one of the two sources is non-empty.
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._evictable_block_ids.popitem(last=False)
            self._drop_hash(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self._block_id_to_hash.pop(block_id)
        del self._hash_to_block_id[block_hash]
        if self._changes is not None:
            self._changes[block_hash] = False

    # ---- prefix cache -----------------------------------------------------------------------

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register every full block within the first num_computed_tokens tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        req = self._requests[request_id]
        if num_computed_tokens > req.num_tokens or num_computed_tokens > len(token_ids):
            raise ValueError(
                f"request {request_id!r}: {num_computed_tokens} computed tokens exceed its "
                f"{req.num_tokens} slots or {len(token_ids)} known tokens"
            )
        for i in range(req.num_hashed_blocks, num_computed_tokens // self.block_size):
            start = i * self.block_size
            block_hash = hash_block(req.last_hash, token_ids[start:start + self.block_size])
            block_id = req.block_ids[i]
            # Register only if neither side is taken: a block from a cache hit
            # already carries this hash, and a duplicate of another block's content stays
            # unregistered so the map remains one-to-one.
            if block_hash not in self._hash_to_block_id and block_id not in self._block_id_to_hash:
                self._hash_to_block_id[block_hash] = block_id
                self._block_id_to_hash[block_id] = block_hash
                if self._changes is not None:
                    self._changes[block_hash] = True
            req.num_hashed_blocks = i + 1
            req.last_hash = block_hash

    def track_cache_changes(self) -> None:
        """Start recording registered and dropped hashes for drain_cache_changes (idempotent)."""
        if self._changes is None:
            self._changes = {}

    def drain_cache_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) hashes since the last drain, each hash once in its final state; clears them.
        A hash registered and dropped within one interval is removed, dropped and re-registered is stored."""
        if not self._changes:
            return [], []
        changes, self._changes = self._changes, {}
        stored = [h for h, cached in changes.items() if cached]
        removed = [h for h, cached in changes.items() if not cached]
        return stored, removed

    def cached_hashes(self) -> list[bytes]:
        """Every hash registered in the prefix cache now, held by a request or evictable."""
        return list(self._hash_to_block_id)

    # ---- release ----------------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release the request's blocks and forget it; unknown ids are a no-op."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        # Reverse order: a chain's tail enters the LRU first and so is evicted before its head,
        # which keeps the surviving cached prefix usable.
        for block_id in reversed(req.block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            if block_id in self._block_id_to_hash:
                self._evictable_block_ids[block_id] = None
            else:
                self._free_block_ids.append(block_id)

    def evict(self, max_blocks: int | None = None) -> int:
        """Move up to max_blocks (all if None) unreferenced cached blocks, LRU first, to the free list."""
        num_evicted = 0
        while self._evictable_block_ids and (max_blocks is None or num_evicted < max_blocks):
            block_id, _ = self._evictable_block_ids.popitem(last=False)
            self._drop_hash(block_id)
            self._free_block_ids.append(block_id)
            num_evicted += 1
        return num_evicted

    # ---- debugging --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless the pool, refcounts, tables and cache maps agree."""
        free_ids, evictable_ids = list(self._free_block_ids), list(self._evictable_block_ids)
        assert len(free_ids) == len(set(free_ids)), f"free list holds duplicates: {free_ids}"
        holders = [0] * self.num_blocks
        for request_id, req in self._requests.items():
            assert len(req.block_ids) == len(set(req.block_ids)), (
                f"request {request_id!r} holds a block twice: {req.block_ids}")
            assert len(req.block_ids) == _cdiv(req.num_tokens, self.block_size), (
                f"request {request_id!r}: {len(req.block_ids)} blocks for {req.num_tokens} tokens")
            assert req.num_hashed_blocks <= req.num_tokens // self.block_size, (
                f"request {request_id!r} hashed {req.num_hashed_blocks} blocks past its full ones")
            for block_id in req.block_ids:
                holders[block_id] += 1
        assert holders == self._ref_counts, f"refcounts {self._ref_counts} != table holders {holders}"

        referenced = {b for b in range(self.num_blocks) if holders[b] > 0}
        free, evictable = set(free_ids), set(evictable_ids)
        assert not (free & evictable), f"blocks both free and evictable: {sorted(free & evictable)}"
        assert not (free & referenced), f"blocks both free and referenced: {sorted(free & referenced)}"
        assert not (evictable & referenced), f"evictable blocks are referenced: {sorted(evictable & referenced)}"
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, (
            f"{len(free)} free + {len(evictable)} evictable + {len(referenced)} referenced "
            f"!= {self.num_blocks} blocks")

        assert len(self._hash_to_block_id) == len(self._block_id_to_hash) and all(
            self._block_id_to_hash.get(b) == h for h, b in self._hash_to_block_id.items()
        ), "hash->block and block->hash maps are not mutual inverses"
        assert all(b in self._block_id_to_hash for b in evictable), "an evictable block has no hash"
        assert not (free & self._block_id_to_hash.keys()), "a block on the free list still has a hash"
        assert all((h in self._hash_to_block_id) == cached for h, cached in (self._changes or {}).items()), (
            "a tracked change disagrees with the prefix cache")
