"""The gateway's prefix index: exactly which prompt prefixes each worker's prefix cache holds.

Workers report the blocks their block manager registers and evicts (`KvEvents`, by the chained
block hashes of shared/block_hash.py), numbered per incarnation. The index keeps, for every hash
some worker caches, the set of workers that hold it, so its memory is the union of the workers'
cached blocks, and a lookup walks the prompt's hashes once: O(blocks in the prompt). The prompts
routed (`note_chain`) also say where chains branch: a cached block that two prompts continue
differently is a shared prefix (a system prompt), not one conversation's history.

A report that arrives out of turn (a gap in the numbers), or one a heartbeat says was sent and
that has not arrived by the next heartbeat, means the index lost track of that worker: it asks
for a snapshot (`needs_snapshot`) and replaces the worker's set with it. A new incarnation, or a
dead worker, starts from nothing. Pure Python, no torch.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from protos import worker_pb2

log = logging.getLogger(__name__)
SNAPSHOT_RETRY_S = 1.0  # a snapshot asked for and not received by then is asked for again
MAX_CHILDREN = 2  # continuations remembered per block: enough to tell a branch from a chain


@dataclass
class _WorkerCache:
    hashes: set[bytes] = field(default_factory=set)
    block_size: int = 0
    applied_seq: int = 0  # the last report applied (or the snapshot's seq)
    claimed_seq: int = 0  # the seq the previous heartbeat said had been sent
    heard_heartbeat: bool = False
    lost: bool = False  # a report went missing: a snapshot is due
    snapshot_asked_s: float = -math.inf


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}  # block hash -> workers caching it
        # cached block -> the next blocks of the prompts routed through it (at most MAX_CHILDREN);
        # an entry lives as long as some worker caches its block, so memory stays the union's.
        self._children: dict[bytes, set[bytes]] = {}
        self._workers: dict[str, _WorkerCache] = {}
        self.num_snapshots = 0  # snapshots applied (the dispatcher counts them in metrics)

    # ---- what the workers report ----------------------------------------------------------------
    def on_events(self, worker_id: str, events: worker_pb2.KvEvents) -> None:
        cache = self._workers.setdefault(worker_id, _WorkerCache())
        if events.snapshot:
            self._replace(worker_id, cache, set(events.stored))
            cache.applied_seq, cache.lost, cache.snapshot_asked_s = events.seq, False, -math.inf
            cache.block_size = events.block_size or cache.block_size
            self.num_snapshots += 1
            return
        if events.seq <= cache.applied_seq:
            return  # already covered (by a snapshot, or a repeat)
        if events.seq != cache.applied_seq + 1:
            log.warning("%s: KV events %d arrived after %d; asking for a snapshot", worker_id, events.seq,
                        cache.applied_seq)
            cache.lost = True
        # Applied even after a gap: what it says is true now, and the snapshot corrects the rest.
        cache.applied_seq = events.seq
        cache.block_size = events.block_size or cache.block_size
        for block_hash in events.removed:
            if block_hash in cache.hashes:
                cache.hashes.discard(block_hash)
                self._drop_holder(block_hash, worker_id)
        for block_hash in events.stored:
            if block_hash not in cache.hashes:
                cache.hashes.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(worker_id)

    def on_heartbeat(self, worker_id: str, kv_events_seq: int) -> None:
        """A report the previous heartbeat said was sent and that is still missing was lost (the
        reports and heartbeats travel on separate sockets, so one heartbeat interval of slack)."""
        cache = self._workers.setdefault(worker_id, _WorkerCache())
        if not cache.heard_heartbeat and kv_events_seq > cache.applied_seq:
            cache.lost = True  # a worker this index has never followed (the gateway restarted)
        elif cache.applied_seq < cache.claimed_seq:
            cache.lost = True
        cache.heard_heartbeat = True
        cache.claimed_seq = kv_events_seq

    def needs_snapshot(self, worker_id: str, now_s: float) -> bool:
        """True when a snapshot should be asked for now (and notes that it was)."""
        cache = self._workers.get(worker_id)
        if cache is None or not cache.lost or now_s - cache.snapshot_asked_s < SNAPSHOT_RETRY_S:
            return False
        cache.snapshot_asked_s = now_s
        return True

    def forget(self, worker_id: str) -> None:
        """The worker died or restarted: nothing it cached is there any more."""
        cache = self._workers.pop(worker_id, None)
        if cache is not None:
            self._replace(worker_id, cache, set())

    # ---- lookups --------------------------------------------------------------------------------
    def block_size(self, worker_id: str) -> int:
        cache = self._workers.get(worker_id)
        return cache.block_size if cache is not None else 0

    def num_blocks(self, worker_id: str) -> int:
        cache = self._workers.get(worker_id)
        return len(cache.hashes) if cache is not None else 0

    def match(self, hashes: list[bytes], worker_ids: list[str]) -> dict[str, int]:
        """For each of `worker_ids`, how many leading blocks of the chain `hashes` it caches."""
        matched = dict.fromkeys(worker_ids, 0)
        holding = set(worker_ids)
        for i, block_hash in enumerate(hashes):
            holding &= self._holders.get(block_hash, set())
            if not holding:
                break
            for worker_id in holding:
                matched[worker_id] = i + 1
        return matched

    def note_chain(self, hashes: list[bytes]) -> None:
        """A prompt with these chained hashes was routed: each cached block of it is continued by the next."""
        for parent, child in zip(hashes, hashes[1:]):
            if parent in self._holders:
                children = self._children.setdefault(parent, set())
                if len(children) < MAX_CHILDREN:
                    children.add(child)

    def is_shared(self, hashes: list[bytes], num_blocks: int) -> bool:
        """Whether the first `num_blocks` of the chain `hashes` end where another routed prompt went on
        differently: a prefix several conversations share, not the history of this one."""
        if num_blocks <= 0:
            return False
        own_next = hashes[num_blocks] if num_blocks < len(hashes) else None
        return any(child != own_next for child in self._children.get(hashes[num_blocks - 1], ()))

    def __len__(self) -> int:
        """Distinct blocks cached across the workers."""
        return len(self._holders)

    # ---- internals -----------------------------------------------------------------------------
    def _replace(self, worker_id: str, cache: _WorkerCache, hashes: set[bytes]) -> None:
        for block_hash in cache.hashes - hashes:
            self._drop_holder(block_hash, worker_id)
        for block_hash in hashes - cache.hashes:
            self._holders.setdefault(block_hash, set()).add(worker_id)
        cache.hashes = hashes

    def _drop_holder(self, block_hash: bytes, worker_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[block_hash]
                self._children.pop(block_hash, None)
