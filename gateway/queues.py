"""Length-bucketed priority queues: the gateway's global order of waiting requests.

A prompt's length in tokens picks its bucket. Within a bucket, requests are ordered by
(effective priority, deadline, arrival). The effective priority improves by one level for every
`aging_s` a request has waited, so a long-bucket or low-priority request cannot starve. A
deadline is compared by its timeout to two significant digits: a client's "60 s" reaches the
gateway as 59.9-60.0 s (gRPC keeps a few digits on the wire), and equal timeouts keep arrival
order. The queue is bounded in requests and in prompt tokens. Pure Python, no I/O: the
dispatcher decides when to pop, and times come in as arguments.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, TypeVar

T = TypeVar("T")


class QueueFullError(Exception):
    """The queue is at its request or token bound; the message says which."""


@dataclass
class QueuedItem(Generic[T]):
    request_id: str
    num_tokens: int  # prompt tokens: picks the bucket, counts against the token bound
    priority: int  # lower is served first
    arrival_s: float
    deadline_s: float | None = None  # the client's deadline: expired items never reach a worker
    max_wait_s: float | None = None  # the queue-time limit of its priority class
    payload: T | None = None
    seq: int = 0  # arrival order, assigned by the queue

    def expires_at(self) -> float:
        limits = [t for t in (self.deadline_s,
                              None if self.max_wait_s is None else self.arrival_s + self.max_wait_s) if t is not None]
        return min(limits) if limits else math.inf

    def sort_key(self, now_s: float, aging_s: float) -> tuple:
        boost = math.floor(max(0.0, now_s - self.arrival_s) / aging_s)
        deadline = math.inf if self.deadline_s is None else self.arrival_s + _two_digits(self.deadline_s - self.arrival_s)
        return (self.priority - boost, deadline, self.seq)


def _two_digits(seconds: float) -> float:
    """A timeout rounded to two significant digits (59.93 -> 60, 2.449 -> 2.4)."""
    if not seconds > 0 or math.isinf(seconds):
        return seconds
    step = 10.0 ** (math.floor(math.log10(seconds)) - 1)
    return round(seconds / step) * step


@dataclass
class LengthBucketedQueue(Generic[T]):
    bucket_bounds: tuple[int, ...]  # upper bounds (inclusive); one more bucket holds the rest
    aging_s: float
    max_requests: int
    max_tokens: int
    fifo: bool = False  # one queue in arrival order: no buckets, priorities and aging ignored
    _buckets: list[list[QueuedItem[T]]] = field(init=False)
    _by_id: dict[str, tuple[int, QueuedItem[T]]] = field(init=False, default_factory=dict)
    _num_tokens: int = field(init=False, default=0)
    _seq: Iterable[int] = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._buckets = [[] for _ in range(len(self.bucket_bounds) + 1)]

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def bucket_of(self, num_tokens: int) -> int:
        return 0 if self.fifo else bisect.bisect_left(self.bucket_bounds, num_tokens)

    def _key(self, item: QueuedItem[T], now_s: float) -> tuple:
        return (item.seq,) if self.fifo else item.sort_key(now_s, self.aging_s)

    def bucket_sizes(self) -> list[int]:
        return [len(b) for b in self._buckets]

    def push(self, item: QueuedItem[T], front: bool = False) -> None:
        """Queue an item; QueueFullError past a bound. `front` (a resumed request) skips the bounds
        and keeps its original arrival, so it sorts ahead of newer work."""
        if item.request_id in self._by_id:
            raise ValueError(f"request {item.request_id!r} is already queued")
        if not front:
            if len(self._by_id) >= self.max_requests:
                raise QueueFullError(f"the queue holds its maximum of {self.max_requests} requests")
            if self._num_tokens + item.num_tokens > self.max_tokens:
                raise QueueFullError(f"the queue holds {self._num_tokens} prompt tokens; {item.num_tokens} more "
                                     f"would pass its maximum of {self.max_tokens}")
        item.seq = -next(self._seq) if front else next(self._seq)
        bucket = self.bucket_of(item.num_tokens)
        self._buckets[bucket].append(item)
        self._by_id[item.request_id] = (bucket, item)
        self._num_tokens += item.num_tokens

    def remove(self, request_id: str) -> QueuedItem[T] | None:
        entry = self._by_id.pop(request_id, None)
        if entry is None:
            return None
        bucket, item = entry
        self._buckets[bucket].remove(item)
        self._num_tokens -= item.num_tokens
        return item

    def pop_expired(self, now_s: float) -> list[QueuedItem[T]]:
        expired = [item for _, item in self._by_id.values() if item.expires_at() <= now_s]
        for item in expired:
            self.remove(item.request_id)
        return expired

    def next_expiry(self) -> float:
        return min((item.expires_at() for _, item in self._by_id.values()), default=math.inf)

    def head(self, now_s: float) -> QueuedItem[T] | None:
        """The item pop_batch would take first, left in the queue."""
        if not self._by_id:
            return None
        return min((item for b in self._buckets for item in b), key=lambda item: self._key(item, now_s))

    def pop_batch(self, now_s: float, max_items: int, fits: Callable[[QueuedItem[T]], bool] = lambda _: True
                  ) -> list[QueuedItem[T]]:
        """Up to max_items from the one bucket whose head comes first overall, in order.

        Stops at the first item `fits` refuses (head-of-line), so a large request is never
        overtaken indefinitely by smaller ones of lower priority."""
        if max_items <= 0 or not self._by_id:
            return []
        heads = [(min(self._key(item, now_s) for item in b), i) for i, b in enumerate(self._buckets) if b]
        _, bucket = min(heads)
        ordered = sorted(self._buckets[bucket], key=lambda item: self._key(item, now_s))
        batch = []
        for item in ordered[:max_items]:
            if not fits(item):
                break
            batch.append(item)
        for item in batch:
            self.remove(item.request_id)
        return batch
