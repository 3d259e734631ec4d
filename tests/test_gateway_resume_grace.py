"""Resume grace: a stream whose only worker died waits up to `gateway.resume_grace_s`, never past its
deadline, for a worker to come back, and then goes on from the tokens it had; with none back in
time it ends UNAVAILABLE, saying so.

The real gateway serves one fake worker (20 ms a token) that the tests kill with SIGKILL and start
again, as a supervisor would.
"""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from gateway_fake_cluster import FakeCluster, request

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def patient(served_checkpoint):
    with FakeCluster(served_checkpoint, step_ms=20, sections={"gateway": {"resume_grace_s": 30.0}}) as c:
        yield c


class Stream:
    def __init__(self, cluster, request_id: str, timeout: float = 60.0, max_tokens: int = MAX_TOKENS):
        self.call = cluster.stub.Generate(request(request_id=request_id, sampling=dict(
            max_tokens=max_tokens, ignore_eos=True)), timeout=timeout)
        self.responses, self.error = [], None
        self.thread = threading.Thread(target=self._read)
        self.thread.start()
        deadline = time.monotonic() + 10
        while sum(len(r.token_ids) for r in self.responses) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)

    def _read(self):
        try:
            for response in self.call:
                self.responses.append(response)
        except grpc.RpcError as e:
            self.error = e

    def join(self) -> "Stream":
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the stream hung"
        return self


def kill_and_wait_dead(cluster) -> float:
    cluster.kill_worker("worker-0")
    deadline = time.monotonic() + 10
    while cluster.status().workers[0].alive:
        assert time.monotonic() < deadline, "the gateway never noticed the worker died"
        time.sleep(0.02)
    return time.monotonic()


def test_a_stream_waits_for_its_worker_to_come_back(patient):
    stream = Stream(patient, "grace-resumed")
    kill_and_wait_dead(patient)
    time.sleep(1.0)  # dead and gone for a while: the old gateway failed the stream at once
    assert stream.error is None and stream.thread.is_alive()
    patient.restart_worker("worker-0")
    stream.join()
    assert stream.error is None, stream.error
    tokens = [t for r in stream.responses for t in r.token_ids]
    assert len(tokens) == MAX_TOKENS and stream.responses[-1].usage.completion_tokens == MAX_TOKENS
    record = [r for r in patient.request_records() if r["request_id"] == "grace-resumed"][-1]
    assert record["status_code"] == "OK" and record["resumptions"] == 1


def test_the_deadline_bounds_the_wait(patient):
    patient.wait_ready(30)
    stream = Stream(patient, "grace-deadline", timeout=3.0)
    started = time.monotonic()
    kill_and_wait_dead(patient)
    stream.join()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 10  # the client's 3 s, not the 30 s grace
    patient.restart_worker("worker-0")
    patient.wait_ready(30)


def test_no_worker_back_within_the_grace_is_unavailable(served_checkpoint):
    with FakeCluster(served_checkpoint, step_ms=20, sections={"gateway": {"resume_grace_s": 0.5}}) as cluster:
        stream = Stream(cluster, "grace-over")
        dead_at = kill_and_wait_dead(cluster)
        stream.join()
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "gateway.resume_grace_s = 0.5 s" in stream.error.details(), stream.error.details()
        assert time.monotonic() - dead_at < 10


def test_a_draining_gateway_keeps_the_grace_for_a_worker_that_crashed(served_checkpoint):
    """Only the gateway drains (it is being restarted): its worker crashing meanwhile is not the
    cluster stopping (that worker never said it was stopping), so the stream still waits for the
    worker's supervisor to bring it back, and the gateway exits 0 once the stream is done."""
    with FakeCluster(served_checkpoint, step_ms=20, sections={"gateway": {"resume_grace_s": 30.0}}) as cluster:
        stream = Stream(cluster, "grace-draining", max_tokens=4 * MAX_TOKENS)
        gateway = cluster.procs["gateway"]
        gateway.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not cluster.status().draining:
            assert time.monotonic() < deadline, "the gateway never began draining"
            time.sleep(0.005)
        kill_and_wait_dead(cluster)
        time.sleep(1.0)
        assert stream.error is None and stream.thread.is_alive()
        cluster.restart_worker("worker-0")
        stream.join()
        assert stream.error is None, stream.error
        assert sum(len(r.token_ids) for r in stream.responses) == 4 * MAX_TOKENS
        assert gateway.wait(timeout=30) == 0
