"""The worker registry: the only writer of WorkerHandles (assign / release), and liveness that counts
only missed heartbeats, never a stall of the gateway's own event loop. Pure Python, exact times."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from gateway.loop_lag import LoopLag
from gateway.workers import WorkerHandle, WorkerRegistry
from protos import worker_pb2

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"
TIMEOUT_S = 1.0


def heartbeat(registry: WorkerRegistry, worker_id: str, now_s: float, **fields) -> set[str]:
    hb = worker_pb2.Heartbeat(**{"ready": True, "max_num_seqs": 4, "max_queued": 0, "kv_blocks_total": 100,
                                 "kv_blocks_free": 100, "block_size": 16, "memory_level": "OK", **fields})
    return registry.on_message(worker_pb2.Envelope(worker_id=worker_id, incarnation="i1", heartbeat=hb), now_s)


def test_assign_and_release_account_slots_and_blocks():
    registry = WorkerRegistry(["w0"], TIMEOUT_S)
    heartbeat(registry, "w0", 0.0)
    worker = registry.get("w0")
    registry.assign("w0", "g-1", 33)  # 3 blocks of 16
    registry.assign("w0", "g-2", 16)  # 1 block
    assert worker.assigned == {"g-1", "g-2"} and worker.free_slots() == 2 and worker.free_blocks() == 96
    registry.release("w0", "g-1")
    registry.release("w0", "g-1")  # twice is harmless: a cancel and a late finish may both say so
    assert worker.assigned == {"g-2"} and worker.free_slots() == 3
    registry.release_reservations("w0")
    assert worker.free_blocks() == 100
    registry.mark_unreachable("w0")
    assert not worker.can_take() and registry.pick(0.1, 1) is None
    heartbeat(registry, "w0", 0.2)
    assert registry.pick(0.2, 1) is worker


def test_a_worker_at_high_memory_takes_one_request_while_idle_and_none_while_busy():
    """An idle worker at HIGH has nothing to free and may stay there for good: it still gets one
    request at a time (its scheduler lets one in when nothing runs), never a batch."""
    registry = WorkerRegistry(["w0"], TIMEOUT_S)
    heartbeat(registry, "w0", 0.0, memory_level="HIGH")
    worker = registry.get("w0")
    assert worker.can_take() and worker.free_slots() == 1 and registry.pick(0.1, 16) is worker
    registry.assign("w0", "g-1", 16)
    assert not worker.can_take() and registry.pick(0.1, 16) is None
    registry.release("w0", "g-1")
    heartbeat(registry, "w0", 0.2, memory_level="HIGH", num_running=1)  # its heartbeat still shows it running
    assert not worker.can_take()
    heartbeat(registry, "w0", 0.3, memory_level="HIGH", num_waiting=1)
    assert not worker.can_take()
    heartbeat(registry, "w0", 0.4, memory_level="CRITICAL")
    assert not worker.can_take()
    heartbeat(registry, "w0", 0.5)
    assert worker.can_take() and worker.free_slots() == 4


def test_a_worker_that_said_it_exits_is_not_reaped_again_as_silent_and_its_late_frames_are_dropped():
    registry = WorkerRegistry(["w0"], TIMEOUT_S)
    heartbeat(registry, "w0", 0.0)
    registry.note_heard("w0", 0.0)
    registry.assign("w0", "g-1", 16)
    assert registry.mark_dead("w0", 0.1, "stopped on a signal", stopping=True) == {"g-1"}
    assert registry.reap_dead(0.2) == {}  # no second "missed heartbeats" for a worker that said goodbye
    worker = registry.get("w0")
    assert worker.stopping and worker.exit_reason == "stopped on a signal"
    late = worker_pb2.Envelope(worker_id="w0", incarnation="i1", heartbeat=worker_pb2.Heartbeat(ready=True))
    assert registry.has_exited(late)
    assert not registry.has_exited(worker_pb2.Envelope(worker_id="w0", incarnation="i2"))


def test_a_restart_loses_what_the_old_incarnation_held():
    registry = WorkerRegistry(["w0"], TIMEOUT_S)
    heartbeat(registry, "w0", 0.0)
    registry.assign("w0", "g-1", 4)
    hb = worker_pb2.Heartbeat(ready=True, max_num_seqs=4)
    lost = registry.on_message(worker_pb2.Envelope(worker_id="w0", incarnation="i2", heartbeat=hb), 0.1)
    assert lost == {"g-1"} and registry.get("w0").assigned == set()


def test_only_the_registry_writes_worker_handles():
    """No other gateway module assigns a WorkerHandle field or mutates its set of assigned requests."""
    handle_fields = {f.name for f in dataclasses.fields(WorkerHandle)}
    offences = []
    for path in sorted(GATEWAY.glob("*.py")):
        if path.name == "workers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in handle_fields - {"worker_id"}:
                    offences.append(f"{path.name}:{node.lineno} writes .{target.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("add", "discard", "remove", "clear", "update", "pop")
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "assigned"):
                offences.append(f"{path.name}:{node.lineno} calls .assigned.{node.func.attr}")
    assert offences == []


def test_silence_kills_a_worker_only_after_the_timeout():
    registry = WorkerRegistry(["w0"], TIMEOUT_S)
    heartbeat(registry, "w0", 0.0)
    assert registry.reap_dead(0.5) == {}
    registry.assign("w0", "g-1", 4)
    assert registry.reap_dead(1.01) == {"w0": {"g-1"}}
    assert registry.live(1.01) == []


def test_a_stalled_loop_does_not_read_as_dead_workers():
    lag = LoopLag(interval_s=0.02, stall_s=0.25)
    registry = WorkerRegistry(["w0", "w1"], TIMEOUT_S, heard_since=lag.heard_since)
    lag.tick(0.0, 0.0)
    heartbeat(registry, "w0", 0.0)
    heartbeat(registry, "w1", 0.0)
    registry.reap_dead(0.0)
    # The loop runs nothing from t=0 to t=3 (a large prompt tokenized on it, say): both workers'
    # heartbeats wait unread. Whatever runs first after the stall must not reap them.
    assert registry.reap_dead(3.0) == {} and len(registry.live(3.0)) == 2
    assert lag.tick(3.0, 0.02) > 2.9  # the lag task notices the stall ...
    heartbeat(registry, "w0", 3.001)  # ... and the backlog is read: w0 spoke, w1 did not
    assert registry.reap_dead(3.5) == {}  # silence counts from the end of the stall only
    for t in (3.5, 3.9):
        lag.tick(t, t)
        heartbeat(registry, "w0", t)
    assert registry.reap_dead(3.99) == {}
    assert registry.reap_dead(4.01) == {"w1": set()}  # a full timeout of silence after the stall
    assert [w.worker_id for w in registry.live(4.01)] == ["w0"]


def test_loop_lag_measures_how_late_the_timer_fires():
    seen = []
    lag = LoopLag(interval_s=0.02, stall_s=0.25, observe=seen.append)
    assert lag.tick(1.0, 1.0) == 0.0 and lag.tick(1.1, 1.02) == pytest.approx(0.08)
    assert lag.heard_since(1.1) == float("-inf")  # no stall yet
    assert lag.tick(2.0, 1.12) == pytest.approx(0.88) and lag.heard_since(2.1) == 2.0  # since the stall ended
    assert seen == pytest.approx([0.0, 0.08, 0.88]) and lag.max_lag_s == pytest.approx(0.88)
    assert lag.heard_since(2.5) == 2.5  # no tick for 0.5 s: the loop is late right now, nothing is judged
