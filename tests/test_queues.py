"""Length-bucketed priority queues: ordering, aging, bounds, expiry, FIFO mode. Pure Python, exact."""
from __future__ import annotations

import math

import pytest

from gateway.queues import LengthBucketedQueue, QueuedItem, QueueFullError


def make_queue(**overrides) -> LengthBucketedQueue:
    options = dict(bucket_bounds=(128, 512), aging_s=10.0, max_requests=100, max_tokens=10_000)
    options.update(overrides)
    return LengthBucketedQueue(**options)


def item(request_id, num_tokens=10, priority=0, arrival_s=0.0, **kw) -> QueuedItem:
    return QueuedItem(request_id=request_id, num_tokens=num_tokens, priority=priority, arrival_s=arrival_s, **kw)


def ids(items):
    return [i.request_id for i in items]


def test_prompt_length_picks_the_bucket():
    q = make_queue()
    assert [q.bucket_of(n) for n in (1, 128, 129, 512, 513, 100_000)] == [0, 0, 1, 1, 2, 2]
    for i, n in enumerate((5, 200, 600, 7)):
        q.push(item(f"r{i}", num_tokens=n))
    assert q.bucket_sizes() == [2, 1, 1] and q.num_tokens == 812


def test_within_a_bucket_priority_then_deadline_then_arrival():
    q = make_queue()
    q.push(item("late-low", priority=5))
    q.push(item("no-deadline", priority=0))
    q.push(item("deadline-later", priority=0, deadline_s=20.0))
    q.push(item("deadline-soon", priority=0, deadline_s=10.0))
    q.push(item("urgent", priority=-1))
    assert ids(q.pop_batch(now_s=0.0, max_items=10)) == ["urgent", "deadline-soon", "deadline-later",
                                                        "no-deadline", "late-low"]


def test_equal_timeouts_keep_arrival_order_whatever_the_wire_rounding():
    """gRPC carries a timeout with a few significant digits, so ten "60 s" requests 30 ms apart
    arrive with deadlines jittered by up to 0.1 s: they are still served in arrival order, and a
    really shorter timeout still goes first."""
    q = make_queue()
    jitter = [0.0, -0.1, 0.05, -0.08, 0.0, -0.03, 0.09, -0.1, 0.02, -0.06]
    for i, j in enumerate(jitter):
        arrival = 0.03 * i
        q.push(item(f"r{i}", arrival_s=arrival, deadline_s=arrival + 60.0 + j))
    q.push(item("tight", arrival_s=0.5, deadline_s=0.5 + 2.0))
    assert ids(q.pop_batch(now_s=0.5, max_items=20)) == ["tight"] + [f"r{i}" for i in range(10)]


def test_a_batch_comes_from_the_bucket_with_the_best_head():
    q = make_queue()
    q.push(item("short-bulk", num_tokens=10, priority=5))
    q.push(item("long-urgent", num_tokens=300, priority=0))
    q.push(item("long-bulk", num_tokens=300, priority=5))
    assert ids(q.pop_batch(0.0, 10)) == ["long-urgent", "long-bulk"]
    assert ids(q.pop_batch(0.0, 10)) == ["short-bulk"]
    assert len(q) == 0 and q.num_tokens == 0


def test_aging_stops_starvation():
    q = make_queue(aging_s=1.0)
    q.push(item("old-bulk", priority=3, arrival_s=0.0))
    q.push(item("new-urgent", priority=0, arrival_s=9.0))
    # At t=2 the bulk request has aged 2 levels (3 -> 1): the urgent one still wins.
    assert ids(q.pop_batch(2.0, 1)) == ["new-urgent"]
    q.push(item("newer-urgent", priority=0, arrival_s=9.0))
    # At t=4 it has aged 4 levels (3 -> -1) and goes first.
    assert ids(q.pop_batch(4.0, 1)) == ["old-bulk"]


def test_bounds_in_requests_and_tokens():
    q = make_queue(max_requests=2, max_tokens=100)
    q.push(item("a", num_tokens=60))
    with pytest.raises(QueueFullError, match="prompt tokens"):
        q.push(item("b", num_tokens=41))
    q.push(item("b", num_tokens=40))
    with pytest.raises(QueueFullError, match="maximum of 2 requests"):
        q.push(item("c", num_tokens=1))
    # A resumed request goes in front and past the bounds: it was admitted once already.
    q.push(item("resumed", num_tokens=500, priority=9, arrival_s=0.0), front=True)
    assert len(q) == 3 and q.num_tokens == 600 and "resumed" in q


def test_front_sorts_before_equal_work():
    q = make_queue()
    q.push(item("queued", priority=0))
    q.push(item("resumed", priority=0), front=True)
    assert ids(q.pop_batch(0.0, 2)) == ["resumed", "queued"]


def test_expiry_by_deadline_and_by_queue_time_limit():
    q = make_queue()
    q.push(item("deadline", deadline_s=5.0))
    q.push(item("waited", arrival_s=1.0, max_wait_s=2.0))
    q.push(item("forever"))
    assert q.next_expiry() == 3.0
    assert ids(q.pop_expired(2.9)) == []
    assert ids(q.pop_expired(3.0)) == ["waited"]
    assert ids(q.pop_expired(6.0)) == ["deadline"]
    assert len(q) == 1 and q.next_expiry() == math.inf


def test_fits_stops_at_the_head_of_line():
    q = make_queue()
    for i, n in enumerate((10, 90, 5)):
        q.push(item(f"r{i}", num_tokens=n))
    budget = [50]

    def fits(it):
        if it.num_tokens > budget[0]:
            return False
        budget[0] -= it.num_tokens
        return True

    assert ids(q.pop_batch(0.0, 10, fits)) == ["r0"]  # r1 does not fit; r2 may not overtake it
    assert len(q) == 2


def test_remove_and_duplicates():
    q = make_queue()
    q.push(item("a"))
    with pytest.raises(ValueError, match="already queued"):
        q.push(item("a"))
    assert q.remove("a").request_id == "a" and q.remove("a") is None and len(q) == 0


def test_fifo_mode_ignores_buckets_and_priorities():
    q = make_queue(fifo=True, aging_s=1.0)
    q.push(item("first-bulk", num_tokens=600, priority=10))
    q.push(item("second-urgent", num_tokens=5, priority=-5))
    assert q.bucket_sizes() == [2, 0, 0]
    assert ids(q.pop_batch(0.0, 10)) == ["first-bulk", "second-urgent"]
