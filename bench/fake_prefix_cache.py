"""The fake worker's prefix cache (bench/fake_worker.py): which chained block hashes it holds, no KV.

It keeps the real block manager's rules (worker/block_manager.py) without any block ids: a pool
of `num_blocks`, blocks a running request holds are pinned, cached blocks no request holds are
evicted least recently released first, and only when the pool needs room; a request reuses at
most the full blocks before its last token. It records which hashes it registered and evicted
since the last drain, each once in its end state, for the worker's KvEvents. Pure Python.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from shared.block_hash import chain_hashes


class FakePrefixCache:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._holders: dict[bytes, int] = {}  # cached blocks some running request holds -> how many hold it
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # cached blocks nobody holds; first = evicted first
        self._held: dict[str, list[bytes]] = {}  # request -> the cached blocks it holds, chain order
        self._slots: dict[str, int] = {}  # request -> the token slots it covers
        self._private: dict[str, int] = {}  # request -> its blocks not (yet) in the cache (partial, uncomputed)
        self._num_private = 0  # their sum
        self._changes: dict[bytes, bool] = {}  # hash -> cached at the end of the interval
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ---- pool state ---------------------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return len(self._holders) + self._num_private

    @property
    def num_free_blocks(self) -> int:
        """Free or evictable, as a real worker reports them (a fake may overcommit: then 0)."""
        return max(0, self.num_blocks - self.num_used_blocks)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._lru)

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._holders or block_hash in self._lru

    def cached_hashes(self) -> list[bytes]:
        return [*self._holders, *self._lru]

    # ---- a request's life ---------------------------------------------------------------------------
    def admit(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Start a request over `token_ids`: hold its leading cached blocks (only those before its
        last token, which the worker always computes) and return how many tokens they cover."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already admitted")
        usable = (len(token_ids) - 1) // self.block_size if token_ids else 0
        held: list[bytes] = []
        for block_hash in chain_hashes(token_ids[:usable * self.block_size], self.block_size):
            if not self.is_cached(block_hash):
                break
            self._hold(block_hash)
            held.append(block_hash)
        self._held[request_id] = held
        self.num_prefix_query_tokens += usable * self.block_size
        self.num_prefix_hit_tokens += len(held) * self.block_size
        self.grow(request_id, len(token_ids))
        return len(held) * self.block_size

    def grow(self, request_id: str, num_tokens: int) -> None:
        """The request now covers `num_tokens` slots; blocks beyond the cached ones are its own."""
        self._slots[request_id] = num_tokens
        private = max(0, -(-num_tokens // self.block_size) - len(self._held[request_id]))
        self._num_private += private - self._private.get(request_id, 0)
        self._private[request_id] = private
        self._evict()

    def register(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The full blocks of `token_ids` (whose KV the request computed) enter the cache, held by it."""
        held = self._held[request_id]
        for block_hash in chain_hashes(token_ids, self.block_size)[len(held):]:
            if not self.is_cached(block_hash):
                self._changes[block_hash] = True
                self._lru[block_hash] = None  # _hold moves it to the holders at once
            self._hold(block_hash)
            held.append(block_hash)
        self.grow(request_id, max(self._slots[request_id], len(token_ids)))

    def release(self, request_id: str) -> None:
        """The request ended (finished or aborted): its blocks stay cached, evictable now; unknown ids are a no-op."""
        for block_hash in self._held.pop(request_id, []):
            self._holders[block_hash] -= 1
            if self._holders[block_hash] == 0:
                del self._holders[block_hash]
                self._lru[block_hash] = None  # most recently released: evicted last
        self._num_private -= self._private.pop(request_id, 0)
        self._slots.pop(request_id, None)
        self._evict()

    # ---- what the worker reports --------------------------------------------------------------------
    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) since the last drain, each hash once in its end state; clears them."""
        changes, self._changes = self._changes, {}
        return [h for h, cached in changes.items() if cached], [h for h, cached in changes.items() if not cached]

    def snapshot(self) -> list[bytes]:
        """Every cached hash now; the changes not yet reported are in it, so they are dropped."""
        self._changes = {}
        return self.cached_hashes()

    # ---- internals ----------------------------------------------------------------------------------
    def _hold(self, block_hash: bytes) -> None:
        if block_hash in self._lru:
            del self._lru[block_hash]
            self._holders[block_hash] = 0
        self._holders[block_hash] += 1

    def _evict(self) -> None:
        while self._lru and self.num_used_blocks + len(self._lru) > self.num_blocks:
            block_hash, _ = self._lru.popitem(last=False)
            self._changes[block_hash] = False
