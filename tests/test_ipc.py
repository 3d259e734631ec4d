"""The ZeroMQ wrapper end to end, over tcp:// and ipc://: routing by worker id, the
anonymous heartbeat socket, and a worker that never blocks on a missing gateway."""
from __future__ import annotations

import asyncio
import tempfile
import time

import pytest

from cluster_harness import free_port
from protos import worker_pb2
from shared.ipc import WORKER_SEND_TIMEOUT_MS, GatewaySocket, WorkerSocket


def _endpoints():
    return [f"tcp://127.0.0.1:{free_port()}", f"ipc://{tempfile.mkdtemp(prefix='ic-')}/gw.ipc"]


@pytest.mark.parametrize("endpoint", _endpoints(), ids=["tcp", "ipc"])
def test_gateway_and_worker_talk_both_ways(endpoint):
    async def scenario():
        gateway = GatewaySocket(endpoint)
        worker = WorkerSocket(endpoint, "worker-7", "inc-1")
        heartbeat = WorkerSocket(endpoint, "worker-7", "inc-1", routed=False)
        try:
            assert heartbeat.send(worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(ready=True)))
            got = await asyncio.wait_for(gateway.recv(), 5)
            assert (got.worker_id, got.incarnation, got.heartbeat.ready) == ("worker-7", "inc-1", True)
            # The gateway addresses the worker's routed socket by its id.
            abort = worker_pb2.Envelope(abort=worker_pb2.AbortRequests(request_ids=["a"]))
            deadline = time.monotonic() + 5
            while not await gateway.send("worker-7", abort):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            [frame] = await asyncio.to_thread(worker.recv_all, 5.0)
            assert list(frame.abort.request_ids) == ["a"]
            assert not await gateway.send("worker-unknown", abort)  # not connected: reported, not dropped
        finally:
            for s in (worker, heartbeat, gateway):
                s.close()

    asyncio.run(scenario())


def test_a_worker_does_not_block_when_no_gateway_listens():
    worker = WorkerSocket(f"tcp://127.0.0.1:{free_port()}", "worker-0", "inc")
    started = time.monotonic()
    assert worker.send(worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat())) is False
    assert time.monotonic() - started < 5
    assert worker.recv_all(0.01) == []
    worker.close()


def test_a_frame_sent_without_waiting_is_dropped_at_once_when_no_gateway_listens():
    # Heartbeats and a stopping worker's last word: one that waited out the send timeout for a
    # gateway that is gone held up every stop of a cluster stopped all at once by seconds.
    worker = WorkerSocket(f"tcp://127.0.0.1:{free_port()}", "worker-0", "inc")
    started = time.monotonic()
    assert worker.send(worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat()), wait=False) is False
    assert time.monotonic() - started < WORKER_SEND_TIMEOUT_MS / 1000 / 2
    worker.close()


def test_a_backlog_of_frames_leaves_the_event_loop_a_turn_per_batch():
    """Awaiting a frame already queued does not yield: a gateway behind its workers' output read it alone
    until the backlog drained, and deadlines, cancellations and new requests waited (seconds, on a loaded
    host)."""
    async def scenario():
        endpoint = f"ipc://{tempfile.mkdtemp(prefix='ic-')}/gw.ipc"
        gateway = GatewaySocket(endpoint)
        worker = WorkerSocket(endpoint, "worker-0", "inc", routed=False)
        turns = 0

        async def another_task():
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        try:
            for _ in range(640):
                assert worker.send(worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(ready=True)))
            await asyncio.sleep(0.5)  # all of them queued on the gateway's side
            task = asyncio.ensure_future(another_task())
            await asyncio.sleep(0)
            before, received, batches = turns, 0, 0
            while received < 640:  # awaited as the dispatcher awaits it (a wait_for's task would yield itself)
                received += len(await gateway.recv_frames(64))
                batches += 1
            task.cancel()
            assert batches >= 10 and turns - before >= batches - 1, (batches, turns - before)
        finally:
            worker.close()
            gateway.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
