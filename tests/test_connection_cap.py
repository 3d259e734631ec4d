"""gateway.max_connections on the real gateway in front of a model-free worker: an HTTP
connection past the cap is answered 503 and closed as it opens (counted, retried once one closes),
a gRPC connection past it is closed, and the connections within it are served as ever. Also the
open-files limit the gateway fits to the cap."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import grpc
import pytest

from bench.cluster_process import free_port
from gateway.open_files import RESERVED_FILES
from gateway_fake_cluster import FakeCluster, metric
from protos import inference_pb2, inference_pb2_grpc
from test_http_bounds import answer

pytestmark = pytest.mark.timeout(300)
CAP = 3


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with FakeCluster(served_checkpoint, step_ms=5,
                     sections={"gateway": {"http_port": free_port(), "max_connections": CAP}}) as c:
        yield c


def get_models(conn: socket.socket) -> bytes:
    """GET /v1/models on a kept-alive connection: the whole response, read by its content-length."""
    conn.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        received += conn.recv(65536)
    head, body = received.split(b"\r\n\r\n", 1)
    [length] = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")]
    while len(body) < length:
        body += conn.recv(65536)
    return received


def served_connection(cluster) -> socket.socket:
    """A kept-alive HTTP connection the gateway has answered once: one of its open connections."""
    conn = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=10)
    assert get_models(conn).startswith(b"HTTP/1.1 200"), "a connection within the cap is served"
    return conn


def test_an_http_connection_past_the_cap_is_503_and_closed_until_one_closes(cluster):
    before = metric(cluster.metrics(), "inference_http_connections_refused_total")
    held = [served_connection(cluster) for _ in range(CAP)]
    try:
        extra = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=10)
        refused = answer(extra)  # sent as it opens, before the client says anything; then closed
        extra.close()
        assert refused.startswith(b"HTTP/1.1 503 "), refused
        assert b"retry-after: 1" in refused.lower() and b"gateway.max_connections" in refused
        assert metric(cluster.metrics(), "inference_http_connections_refused_total") == before + 1
        # The held connections are served as before.
        assert get_models(held[0]).startswith(b"HTTP/1.1 200")
        held.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the server sees the close a moment later
            conn = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=10)
            conn.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            got = answer(conn)
            conn.close()
            if got.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert got.startswith(b"HTTP/1.1 200"), got
    finally:
        for conn in held:
            conn.close()
    assert "refused 1 HTTP connection(s)" in cluster.logs("gateway")


def test_a_grpc_connection_past_the_cap_is_closed_and_those_within_it_served(cluster):
    def channel() -> grpc.Channel:  # a connection of its own, not one shared with the other channels
        return grpc.insecure_channel(cluster.address, options=[("grpc.use_local_subchannel_pool", 1)])

    assert cluster.status().workers  # the cluster's own client holds one connection: room for CAP - 1 more
    held = [channel() for _ in range(CAP - 1)]
    try:
        for c in held:
            inference_pb2_grpc.InferenceServiceStub(c).GetClusterStatus(inference_pb2.GetClusterStatusRequest(),
                                                                        timeout=10)
        extra = channel()
        with pytest.raises(grpc.RpcError) as refused:
            inference_pb2_grpc.InferenceServiceStub(extra).GetClusterStatus(inference_pb2.GetClusterStatusRequest(),
                                                                            timeout=3)
        extra.close()
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert cluster.status().workers, "the connections within the cap are served"
    finally:
        for c in held:
            c.close()


FIT = """
import logging, resource
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from gateway.open_files import fit_open_files
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
print(fit_open_files(1000, 2), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1500))
print(fit_open_files(1000, 2), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def test_the_open_files_limit_is_raised_to_fit_the_cap_up_to_the_hard_limit():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 3024:
        pytest.skip(f"this host's hard open-files limit ({hard}) is below the test's 3024")
    # In a process of its own: the limits it lowers stay lowered.
    done = subprocess.run([sys.executable, "-c", FIT], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    needed = str(2 * 1000 + RESERVED_FILES)
    assert done.stdout.split() == [needed, needed, "1500", "1500"]
    assert "limited to 1500 (the hard limit)" in done.stderr and "gateway.max_connections" in done.stderr
