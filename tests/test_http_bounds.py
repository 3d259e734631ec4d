"""The HTTP port's bounds on reading a request, on the real gateway in front of model-free workers:
a head too long (431) or too slow (408), a body that pauses too long (cut off), a body of too many
JSON values (413, before it is parsed on the event loop), and a client within them served as ever;
the same timeout on a gRPC connection's handshake and a metrics connection. Also the value count
itself against JSON documents of every shape."""
from __future__ import annotations

import json
import socket
import time

import httpx2 as httpx
import pytest
from hypothesis import given, settings, strategies as st

from bench.cluster_process import free_port
from gateway.http_body_limit import _count_values_of, values_outside_strings
from gateway_fake_cluster import FakeCluster

pytestmark = pytest.mark.timeout(300)
MODEL = "llama"
MAX_VALUES = 1000
MAX_HEADER = 8192
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    bounds = {"max_body_values": MAX_VALUES, "max_header_bytes": MAX_HEADER, "read_timeout_s": READ_TIMEOUT_S}
    with FakeCluster(served_checkpoint, step_ms=5, sections={"gateway": {"http_port": free_port(), **bounds}}) as c:
        yield c


@pytest.fixture
def http(cluster):
    """A client of its own per test: a connection another test's bounds closed is not reused."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}", timeout=30)
    yield client
    client.close()


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def raw(cluster, data: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=10)
    conn.sendall(data)
    return conn


def answer(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := conn.recv(65536):
        received += chunk
    return received


def test_a_body_of_too_many_json_values_is_413_before_it_is_parsed(http, cluster):
    r = http.post("/v1/completions", json=completion(prompt=[5] * MAX_VALUES), headers={"x-request-id": "many"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    assert "gateway.max_body_values" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json=completion(logit_bias={str(i): 1 for i in range(MAX_VALUES)}))
    assert r.status_code == 413 and "max_body_values" in r.json()["error"]["message"]
    # In UTF-16 (which the JSON parser takes too) an escaped quote is not the bytes the count skips.
    body = json.dumps(completion(prompt='"\u0122', stop_token_ids=[5] * MAX_VALUES), ensure_ascii=False)
    r = http.post("/v1/completions", content=body.encode("utf-16"), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max_body_values" in r.json()["error"]["message"]
    # Commas inside strings are not values: a long text of them is parsed and served.
    r = http.post("/v1/completions", json=completion(prompt='a, "b", \\' * 200 + "," * MAX_VALUES))
    assert r.status_code == 200, r.text
    assert http.post("/v1/completions", json=completion(prompt=[5] * (MAX_VALUES - 20))).status_code == 200
    [line] = [json.loads(line[line.index("{"):]) for line in cluster.logs("gateway").splitlines()
              if '"event":"request"' in line and '"many"' in line]
    assert line["status_code"] == "RESOURCE_EXHAUSTED" and "max_body_values" in line["error"]


def test_a_head_too_long_is_431_and_a_head_too_slow_408(http, cluster):
    conn = raw(cluster, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * MAX_HEADER)
    status_line = answer(conn).split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 431"), status_line
    started = time.monotonic()
    conn = raw(cluster, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")  # the head's end never comes
    reply = answer(conn)
    assert reply.startswith(b"HTTP/1.1 408") and b"gateway.read_timeout_s" in reply, reply
    assert time.monotonic() - started < 10 * READ_TIMEOUT_S
    idle = raw(cluster, b"")  # opens and sends nothing
    assert answer(idle).startswith(b"HTTP/1.1 408")
    assert http.get("/v1/models").status_code == 200


def test_a_body_that_pauses_too_long_is_cut_off_and_one_that_keeps_coming_is_served(http, cluster):
    body = json.dumps(completion()).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    conn = raw(cluster, head + body[:10])  # the rest never comes
    assert answer(conn) == b""  # closed without a word: a response may not begin mid-body
    conn = raw(cluster, head)
    for i in range(len(body)):  # a slow client, but never pausing for the timeout
        conn.sendall(body[i:i + 1])
        time.sleep(READ_TIMEOUT_S / 20)
    assert answer_status(conn) == 200


def answer_status(conn: socket.socket) -> int:
    received = b""
    while b"\r\n" not in received:
        received += conn.recv(65536)
    conn.close()
    return int(received.split(b" ", 2)[1])


def test_a_pipelined_request_waits_for_the_answer_before_it_without_its_clock_running(cluster):
    """uvicorn reads a pipelined request only once the answer before it is out: the wait is the
    server's, and neither request may be cut off for it."""
    long_body = json.dumps(completion(max_tokens=600, ignore_eos=True)).encode()
    short_body = json.dumps(completion()).encode()

    def post(body: bytes) -> bytes:
        return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body))

    started = time.monotonic()
    conn = raw(cluster, post(long_body) + post(short_body)[:-4])
    time.sleep(0.1)
    conn.sendall(post(short_body)[-4:] + b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    received = answer(conn)
    assert time.monotonic() - started > 2 * READ_TIMEOUT_S  # the first answer outlasted the timeout
    assert received.count(b"HTTP/1.1 200") == 3, received[:300]


def test_bytes_that_begin_no_request_do_not_hold_a_connection_open(cluster):
    with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=30) as conn:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        with pytest.raises(OSError):  # the server closes it, and a later send or read fails
            while time.monotonic() - started < 10 * READ_TIMEOUT_S:
                conn.sendall(b"\r\n")  # llhttp skips a CRLF between requests
                time.sleep(READ_TIMEOUT_S / 4)
                if conn.recv(65536, socket.MSG_DONTWAIT) == b"":
                    raise ConnectionResetError
        assert time.monotonic() - started < 10 * READ_TIMEOUT_S


def test_requests_after_another_on_a_kept_alive_connection_have_the_same_bounds(cluster):
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}", timeout=30) as client:
        for _ in range(3):
            time.sleep(1.5 * READ_TIMEOUT_S)  # idle between requests: the keep-alive timeout's, not ours
            assert client.post("/v1/completions", json=completion()).status_code == 200
        r = client.get("/v1/models", headers={"x-padding": "a" * MAX_HEADER})
        assert r.status_code == 431


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from(',"\\:[]{} ab\u00e9')),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
                        st.text(alphabet=st.sampled_from(',"\\ab')), inner, max_size=5), max_leaves=30)


def commas(doc) -> int:
    if isinstance(doc, list):
        return max(len(doc) - 1, 0) + sum(commas(d) for d in doc)
    if isinstance(doc, dict):
        return max(len(doc) - 1, 0) + sum(commas(d) for d in doc.values())
    return 0


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans(), st.integers(1, 16), st.sampled_from(["utf-8", "utf-16", "utf-16-le", "utf-32-be"]))
def test_values_are_counted_outside_strings(doc, ascii_only, chunk_bytes, encoding):
    """Chunks of a few bytes: strings and escapes across a chunk's end, as megabyte chunks meet them;
    and every encoding the JSON parser detects."""
    text = json.dumps(doc, ensure_ascii=ascii_only)
    assert values_outside_strings(text.encode(), chunk_bytes) == 1 + commas(doc)
    assert _count_values_of(text.encode(encoding)) == 1 + commas(doc)


def test_a_grpc_connection_that_never_handshakes_and_an_idle_metrics_connection_are_closed(cluster):
    for port in (cluster.port, cluster.metrics_port):
        started = time.monotonic()
        conn = socket.create_connection(("127.0.0.1", port), timeout=30)
        answer(conn)  # until the server closes it: gRPC's default waits 120 s, a metrics thread for ever
        assert time.monotonic() - started < 10 * READ_TIMEOUT_S, port
