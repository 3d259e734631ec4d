"""ZeroMQ, wrapped once: the envelope codec and the two socket roles of the wire.

The gateway binds one ROUTER socket; each worker connects a DEALER whose routing id is its
worker id (so the gateway can address it), and a worker's heartbeat thread connects a second,
anonymous DEALER (sockets are not thread-safe). Every frame is one `worker_pb2.Envelope`;
nothing is ever pickled. No torch and no grpc here.

A gateway restart needs nothing from the workers: their DEALERs reconnect on their own
(ZeroMQ retries every 100 ms) once the new gateway binds, and their next heartbeats register
them with it. What a gateway killed without closing leaves behind is its socket file, which
`remove_stale_ipc_socket` clears before the next bind.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import uuid
from pathlib import Path

import zmq
import zmq.asyncio

from protos import worker_pb2

WIRE_VERSION = 3  # 3: prefix-cache KV events
# Unix socket paths are limited to about 107 bytes; ZeroMQ fails obscurely past that.
_MAX_IPC_PATH = 100
# A worker never blocks for long on a gateway that is gone: what it would have sent is moot,
# and a blocked send would keep it from noticing SIGTERM.
WORKER_SEND_TIMEOUT_MS = 1000


class WireError(ValueError):
    """A frame that is not a valid envelope of our wire version."""


def new_incarnation() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def encode(envelope: worker_pb2.Envelope) -> bytes:
    envelope.version = WIRE_VERSION
    return envelope.SerializeToString()


def decode(frame: bytes) -> worker_pb2.Envelope:
    envelope = worker_pb2.Envelope()
    try:
        envelope.ParseFromString(frame)
    except Exception as e:  # protobuf raises DecodeError, a Message error subclass
        raise WireError(f"undecodable frame of {len(frame)} bytes: {e}") from None
    if envelope.version != WIRE_VERSION:
        raise WireError(f"wire version {envelope.version} from {envelope.worker_id or '?'}; "
                        f"this process speaks {WIRE_VERSION}")
    if envelope.WhichOneof("body") is None:
        raise WireError(f"envelope from {envelope.worker_id or '?'} has no body")
    return envelope


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint; None for any other transport."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def check_endpoint(endpoint: str) -> str:
    if (path := ipc_path(endpoint)) is not None:
        if len(str(path)) > _MAX_IPC_PATH:
            raise ValueError(f"ipc endpoint path is {len(str(path))} bytes, over the {_MAX_IPC_PATH}-byte "
                             f"limit of unix sockets: {path}; use a shorter run_dir")
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint must start with ipc:// or tcp://, got {endpoint!r}")
    return endpoint


class EndpointInUseError(RuntimeError):
    """Another live process already listens at the gateway's ipc:// endpoint."""


def ipc_listener_alive(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket at `path` (False: none, or stale)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as e:
        # A full backlog still means someone listens.
        return isinstance(e, TimeoutError) or e.errno == errno.EAGAIN
    finally:
        probe.close()


def check_no_listener(endpoint: str) -> None:
    """Raise EndpointInUseError if a live gateway already listens at this ipc:// endpoint."""
    path = ipc_path(endpoint)
    if path is not None and ipc_listener_alive(path):
        raise EndpointInUseError(f"another gateway is already listening at {endpoint} (same run_dir); stop it "
                                 f"or choose another run_dir")


def remove_stale_ipc_socket(endpoint: str) -> bool:
    """Before binding: remove the socket file a gateway that died without closing (kill -9)
    left at an ipc:// endpoint. True if one was removed.

    ZeroMQ's bind would unlink any file there silently, live or not; a second gateway on the
    same run_dir would then take every worker's next connection away from the first. So a
    socket someone still listens on raises EndpointInUseError, and a file that is not a
    socket is left alone (ValueError) rather than deleted."""
    path = ipc_path(endpoint)
    if path is None:
        return False
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; the gateway would bind over it. Remove it or "
                         f"choose another run_dir")
    check_no_listener(endpoint)
    path.unlink(missing_ok=True)
    return True


class GatewaySocket:
    """The gateway's ROUTER: receives every worker's frames, sends to a worker by id."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context | None = None):
        self._context = context or zmq.asyncio.Context.instance()
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A restarted worker reconnects with the same id: let it take the id over at once.
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Sending to a worker that is not connected raises instead of dropping silently.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.bind(check_endpoint(endpoint))
        self.endpoint = endpoint

    async def recv(self) -> worker_pb2.Envelope:
        _identity, frame = await self.socket.recv_multipart()
        return decode(frame)

    async def send(self, worker_id: str, envelope: worker_pb2.Envelope) -> bool:
        """False when the worker is not connected (the caller treats it as gone)."""
        try:
            await self.socket.send_multipart([worker_id.encode(), encode(envelope)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def close(self) -> None:
        self.socket.close(linger=0)
        if (path := ipc_path(self.endpoint)) is not None:
            path.unlink(missing_ok=True)


class WorkerSocket:
    """One DEALER connected to the gateway; blocking API for the worker's threads."""

    def __init__(self, endpoint: str, worker_id: str, incarnation: str, routed: bool = True,
                 context: zmq.Context | None = None):
        self._context = context or zmq.Context.instance()
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, WORKER_SEND_TIMEOUT_MS)
        # Queue only on a live connection: heartbeats and deltas kept for a gateway that is not
        # there would reach its successor stale.
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        if routed:
            self.socket.setsockopt(zmq.ROUTING_ID, worker_id.encode())
        self.socket.connect(check_endpoint(endpoint))
        self.worker_id = worker_id
        self.incarnation = incarnation

    def send(self, envelope: worker_pb2.Envelope) -> bool:
        """False when the gateway is unreachable and the frame was dropped."""
        envelope.worker_id = self.worker_id
        envelope.incarnation = self.incarnation
        try:
            self.socket.send(encode(envelope))
            return True
        except zmq.Again:
            return False

    def recv_all(self, timeout_s: float) -> list[worker_pb2.Envelope]:
        """Every frame waiting now, waiting up to timeout_s for the first."""
        frames = []
        if self.socket.poll(int(timeout_s * 1000)):
            while True:
                try:
                    frames.append(decode(self.socket.recv(flags=zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return frames

    def close(self) -> None:
        self.socket.close(linger=0)
