"""CURVE on the sockets (shared/ipc.py): who gets a frame through, and the rogue worker of issue 22 against a
real cluster. The gateway's ZAP handler runs on its event loop, so worker sockets send from a thread."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from cluster_harness import ROOT, Cluster, free_port, generate
from curve_harness import config_for, mode_of, short_temp_dir
from protos import worker_pb2
from shared.curve import (GATEWAY, WORKER, cluster_keys_dir, load_client_keys, load_server_keys, public_file,
                          secret_file, write_keys)
from shared.ipc import AUTH_RETRY_S, GatewaySocket, WorkerSocket, bind_gateway_socket, encode

HEARTBEAT = worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(ready=True, max_num_seqs=64, kv_blocks_total=1000,
                                                               kv_blocks_free=1000, block_size=16))


@pytest.fixture
def short_dir():
    yield from short_temp_dir()


# ---- sockets ------------------------------------------------------------------------------------------
async def deliver(gateway: GatewaySocket, worker: WorkerSocket, envelope, timeout_s: float = 10.0):
    """Send from `worker` (in a thread) until the gateway receives a frame; that frame."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.to_thread(worker.send, envelope)
        try:
            return await asyncio.wait_for(gateway.recv(), 0.2)
        except asyncio.TimeoutError:
            continue
    raise AssertionError(f"no frame from {worker.worker_id} within {timeout_s} s")


async def assert_never_delivered(gateway: GatewaySocket, send, duration_s: float = 2.0) -> None:
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        await asyncio.to_thread(send)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(gateway.recv(), 0.2)


async def wait_for_log(caplog, predicate, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for record in caplog.records:
            if predicate(record.getMessage()):
                return record.getMessage()
        await asyncio.sleep(0.05)
    raise AssertionError(f"no such log line in {[r.getMessage() for r in caplog.records]}")


def raw_dealer(endpoint: str, routing_id: bytes, keys: tuple[bytes, bytes, bytes] | None = None) -> zmq.Socket:
    """A DEALER as anyone could write it: `keys` = (public, secret, server public) or no CURVE at all."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    sock.connect(endpoint)
    return sock


def try_send(sock: zmq.Socket, frame: bytes) -> None:
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:  # no connection to queue on: what a refused peer mostly sees
        pass


def _endpoint(kind: str, run_dir: Path) -> str:
    return f"tcp://127.0.0.1:{free_port()}" if kind == "tcp" else f"ipc://{run_dir}/gw.ipc"


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_a_worker_with_the_keys_talks_both_ways(kind, short_dir):
    write_keys(short_dir / "k")
    endpoint = _endpoint(kind, short_dir)

    async def scenario():
        gateway = GatewaySocket(endpoint, keys=load_server_keys(short_dir / "k"))
        worker = WorkerSocket(endpoint, "worker-7", "inc-1", keys=load_client_keys(short_dir / "k"))
        heartbeat = WorkerSocket(endpoint, "worker-7", "inc-1", routed=False, keys=load_client_keys(short_dir / "k"))
        try:
            got = await deliver(gateway, heartbeat, worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(ready=True)))
            assert (got.worker_id, got.incarnation, got.heartbeat.ready) == ("worker-7", "inc-1", True)
            abort = worker_pb2.Envelope(abort=worker_pb2.AbortRequests(request_ids=["a"]))
            deadline = time.monotonic() + 10
            while not await gateway.send("worker-7", abort):  # until the routed socket's handshake is done
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            [frame] = await asyncio.to_thread(worker.recv_all, 5.0)
            assert list(frame.abort.request_ids) == ["a"]
            got = await deliver(gateway, worker, worker_pb2.Envelope(exit=worker_pb2.WorkerExit(reason="r")))
            assert got.exit.reason == "r"
        finally:
            for s in (worker, heartbeat, gateway):
                s.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_a_wrong_key_pair_or_no_curve_never_delivers_a_frame(kind, short_dir, caplog):
    write_keys(short_dir / "k")
    endpoint = _endpoint(kind, short_dir)
    server_keys = load_server_keys(short_dir / "k")
    wrong_public, wrong_secret = zmq.curve_keypair()
    caplog.set_level(logging.WARNING)

    async def scenario():
        gateway = GatewaySocket(endpoint, keys=server_keys)
        # Both rogues hold the gateway's public key (it is public); one has its own pair, one no CURVE.
        wrong = raw_dealer(endpoint, b"rogue-1", (wrong_public, wrong_secret, server_keys.public))
        plain = raw_dealer(endpoint, b"rogue-2")
        ours = WorkerSocket(endpoint, "worker-0", "inc", keys=load_client_keys(short_dir / "k"))
        try:
            frame = encode(HEARTBEAT)
            for rogue in (wrong, plain):
                await assert_never_delivered(gateway, lambda r=rogue: try_send(r, frame), duration_s=1.5)
            message = await wait_for_log(caplog, lambda m: wrong_public.decode() in m)
            assert "refused a worker's CURVE handshake" in message
            await wait_for_log(caplog, lambda m: m.startswith(f"refused a connection to {endpoint}: ") and (
                "ZMTP_MECHANISM_MISMATCH" in m or "closed mid-handshake" in m))
            # The gateway still serves its own workers.
            assert (await deliver(gateway, ours, HEARTBEAT)).worker_id == "worker-0"
        finally:
            for s in (wrong, plain, ours, gateway):
                s.close()

    asyncio.run(scenario())
    text = "\n".join(r.getMessage() for r in caplog.records)
    for secret in (wrong_secret, server_keys.secret, load_client_keys(short_dir / "k").secret):
        assert secret.decode() not in text  # a secret is never logged


def test_a_worker_holding_another_gateway_key_is_refused(short_dir, caplog):
    write_keys(short_dir / "k")
    write_keys(short_dir / "other")
    endpoint = _endpoint("ipc", short_dir)
    caplog.set_level(logging.WARNING)

    async def scenario():
        gateway = GatewaySocket(endpoint, keys=load_server_keys(short_dir / "k"))
        stranger = WorkerSocket(endpoint, "worker-0", "inc", keys=load_client_keys(short_dir / "other"))
        try:
            await assert_never_delivered(gateway, lambda: stranger.send(HEARTBEAT), duration_s=2.0)
            await wait_for_log(caplog, lambda m: m.startswith("refused a connection to") and endpoint in m)
            # The worker says so too, naming its key and where it read it.
            message = await wait_for_log(caplog, lambda m: "refused this worker" in m)
            assert stranger.keys.public.decode() in message and str(short_dir / "other") in message
            assert "gateway.key other than the gateway's public key" in message
            # It waits for its own backoff before the next handshake, not ZeroMQ's 100 ms retry: the
            # backoff has grown (whether a wait is running when this looks depends on the host's speed).
            assert stranger._retry_s > AUTH_RETRY_S
        finally:
            stranger.close()
            gateway.close()

    asyncio.run(scenario())


def test_a_worker_key_added_later_is_admitted_without_a_new_gateway_socket(short_dir, caplog):
    gateway_dir, worker_dir = short_dir / "g", short_dir / "w"
    write_keys(worker_dir)
    gateway_dir.mkdir(mode=0o700)
    for f in (public_file(worker_dir, GATEWAY), secret_file(worker_dir, GATEWAY)):
        shutil.copy2(f, gateway_dir / f.name)  # the gateway's pair only: no worker admitted yet
    endpoint = _endpoint("ipc", short_dir)
    worker_keys = load_client_keys(worker_dir)
    caplog.set_level(logging.WARNING)

    async def scenario():
        gateway = GatewaySocket(endpoint, keys=load_server_keys(gateway_dir))
        worker = WorkerSocket(endpoint, "worker-0", "inc", keys=worker_keys)
        try:
            await assert_never_delivered(gateway, lambda: worker.send(HEARTBEAT), duration_s=1.5)
            await wait_for_log(caplog, lambda m: worker_keys.public.decode() in m and "refused" in m)
            reloads = gateway.keys.allowed.num_reloads
            shutil.copy2(public_file(worker_dir, WORKER), gateway_dir / "worker-0.key")
            # The same worker socket retries (its refused connection is final in ZeroMQ) and gets in.
            got = await deliver(gateway, worker, HEARTBEAT, timeout_s=15.0)
            assert got.worker_id == "worker-0"
            assert gateway.keys.allowed.num_reloads > reloads
            assert worker_keys.public in gateway.keys.allowed.keys
        finally:
            worker.close()
            gateway.close()

    asyncio.run(scenario())


def test_the_ipc_socket_is_0600_in_a_0700_folder(short_dir):
    run_dir = short_dir / "run"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)  # as a umask of 022 would leave it
    config = config_for(run_dir)

    async def scenario():
        gateway = bind_gateway_socket(config)
        try:
            path = Path(config.worker_endpoint[len("ipc://"):])
            assert stat.S_ISSOCK(path.lstat().st_mode) and mode_of(path) == 0o600
            assert mode_of(run_dir) == 0o700
            assert gateway.keys is not None  # ipc:// is CURVE by default
        finally:
            gateway.close()
        assert not path.exists()

    asyncio.run(scenario())


def test_a_gateway_socket_that_fails_to_start_leaves_another_gateways_socket_alone(short_dir):
    endpoint = _endpoint("ipc", short_dir)
    keys = load_server_keys(cluster_keys_dir(config_for(short_dir), GATEWAY))

    async def scenario():
        first = GatewaySocket(endpoint)
        try:
            # CURVE needs a running event loop (the ZAP handler is a task of it): a thread has none.
            with pytest.raises(RuntimeError):
                await asyncio.to_thread(GatewaySocket, endpoint, None, keys)
            assert Path(endpoint[len("ipc://"):]).exists()
        finally:
            first.close()

    asyncio.run(scenario())


# ---- the rogue worker of issue 22, against a real cluster ------------------------------------------
ROGUE = r"""
import json, sys, time
import zmq
from protos import worker_pb2
from shared.ipc import encode
endpoint, routing_id, mode, duration_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
public = b""
if mode == "wrong-key":
    public, secret = zmq.curve_keypair()
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, sys.argv[5].encode()
sock.connect(endpoint)
beat = worker_pb2.Envelope(worker_id=routing_id, incarnation="rogue", heartbeat=worker_pb2.Heartbeat(
    ready=True, max_num_seqs=64, max_queued=64, kv_blocks_total=10000, kv_blocks_free=10000, block_size=16,
    max_model_len=4096, vocab_size=320, memory_level="OK", device="cpu"))
print(json.dumps({"public": public.decode()}), flush=True)
received, end = [], time.monotonic() + duration_s
while time.monotonic() < end:
    try:
        sock.send(encode(beat), zmq.NOBLOCK)
    except zmq.Again:
        pass
    if sock.poll(100):
        received.append(worker_pb2.Envelope.FromString(sock.recv()).WhichOneof("body"))
print(json.dumps({"received": received}), flush=True)
"""


@pytest.mark.timeout(300)
def test_a_rogue_worker_never_joins_a_cluster_nor_gets_a_request(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=1) as cluster:
        endpoint = f"ipc://{cluster.run_dir}/gateway.ipc"
        gateway_public = zmq.auth.load_certificate(public_file(cluster.run_dir / "keys", GATEWAY))[0].decode()
        rogues = [subprocess.Popen([sys.executable, "-c", ROGUE, endpoint, rogue_id, mode, "8", gateway_public],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for rogue_id, mode in (("rogue-1", "plain"), ("rogue-2", "wrong-key"))]
        try:
            started = time.monotonic()
            served = 0
            while time.monotonic() - started < 7:  # the rogues heartbeat for 8 s; requests go on meanwhile
                ids, _text, last = generate(cluster.stub, prompt_token_ids=[5, 6, 7, 8 + served % 300],
                                            sampling={"max_tokens": 8, "temperature": 0.0})
                assert len(ids) == 8 and last.worker_id == "worker-0"
                served += 1
                assert [w.worker_id for w in cluster.status().workers] == ["worker-0"]
                time.sleep(0.1)
            assert served >= 3
            outputs = []
            for proc in rogues:
                out, err = proc.communicate(timeout=30)
                assert proc.returncode == 0, err
                outputs.append([json.loads(line) for line in out.splitlines()])
        finally:
            for proc in rogues:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for lines in outputs:
            assert lines[-1] == {"received": []}  # no SubmitBatch, no probe, nothing
        assert [w.worker_id for w in cluster.status().workers] == ["worker-0"]
        wrong_public = outputs[1][0]["public"]
        log_text = (cluster.run_dir / "gateway.log").read_text(errors="replace")
        assert f"public key {wrong_public} is not among the worker keys" in log_text
        # The plain one: a mechanism mismatch, or a hang-up mid-handshake when it noticed first.
        assert f"refused a connection to {endpoint}: protocol error ZMTP_MECHANISM_MISMATCH" in log_text or \
            f"refused a connection to {endpoint}: the connection closed mid-handshake" in log_text
        assert "rogue" not in log_text  # no frame of theirs was ever read
        # The run dir, its keys and its socket are the owner's only.
        assert mode_of(cluster.run_dir) == 0o700 and mode_of(cluster.run_dir / "keys") == 0o700
        assert mode_of(cluster.run_dir / "gateway.ipc") == 0o600
