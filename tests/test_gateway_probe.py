"""ProbeWorker through the real gateway: an unknown worker is NOT_FOUND naming the known ones, and
one that never answers (the fake worker does not answer probes) is UNAVAILABLE within
`gateway.probe_timeout_s`, saying so."""
from __future__ import annotations

import time

import grpc
import pytest

from gateway_fake_cluster import FakeCluster
from protos import inference_pb2

pytestmark = pytest.mark.timeout(120)


def test_a_probe_unanswered_names_its_timeout_and_an_unknown_worker_is_not_found(served_checkpoint):
    with FakeCluster(served_checkpoint, step_ms=5, sections={"gateway": {"probe_timeout_s": 0.3}}) as cluster:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            cluster.stub.ProbeWorker(inference_pb2.ProbeWorkerRequest(worker_id="worker-0"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details() == "worker-0 did not answer the probe: no answer within gateway.probe_timeout_s = 0.3 s"
        assert time.monotonic() - started < 5
        with pytest.raises(grpc.RpcError) as e:
            cluster.stub.ProbeWorker(inference_pb2.ProbeWorkerRequest(worker_id="worker-9"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "worker-0" in e.value.details()
