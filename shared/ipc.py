"""ZeroMQ, wrapped once: the envelope codec and the two socket roles of the wire.

The gateway binds one ROUTER socket; each worker connects a DEALER whose routing id is its
worker id (so the gateway can address it), and a worker's heartbeat thread connects a second,
anonymous DEALER (sockets are not thread-safe). Every frame is one `worker_pb2.Envelope`;
nothing is ever pickled. No torch and no grpc here.

A gateway restart needs nothing from the workers: their DEALERs reconnect on their own
(ZeroMQ retries every 100 ms) once the new gateway binds, and their next heartbeats register
them with it. What a gateway killed without closing leaves behind is its socket file, which
`remove_stale_ipc_socket` clears before the next bind.

Who may join (shared/curve.py, docs/security.md): with keys, the ROUTER is a CURVE server whose
ZAP handler admits only the allowed worker keys, and each DEALER a CURVE client holding the
gateway's public key; a refused handshake never delivers a frame, and both sides log it. An
ipc:// socket also sits in a 0700 folder and is itself 0600.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
import time
import uuid
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protos import worker_pb2
from shared.curve import (GATEWAY, WORKER, ZAP_DOMAIN, ClientKeys, RefusalLog, ServerKeys,
                          describe_handshake_failure, start_authenticator, transport_keys)

log = logging.getLogger(__name__)

WIRE_VERSION = 4  # 3: prefix-cache KV events; 4: prompt log-probabilities
# Unix socket paths are limited to about 107 bytes; ZeroMQ fails obscurely past that.
_MAX_IPC_PATH = 100
# A worker never blocks for long on a gateway that is gone: what it would have sent is moot,
# and a blocked send would keep it from noticing SIGTERM.
WORKER_SEND_TIMEOUT_MS = 1000
# Most frames the gateway takes per wake of its loop: enough to amortise the wake over a fleet's
# burst, few enough that the other tasks (dispatch, streams) get the loop back soon.
RECV_BATCH_FRAMES = 64
# A refused CURVE handshake is final for that connection in ZeroMQ, so a worker retries it
# itself: first after this long, doubling up to the max (its key may be added meanwhile).
AUTH_RETRY_S = 1.0
MAX_AUTH_RETRY_S = 30.0
_MONITOR_CHECK_S = 0.2  # how often a worker's sockets look at their handshake events
_GATEWAY_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_WORKER_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)


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
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    elif not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint must start with ipc:// or tcp://, got {endpoint!r}")
    return endpoint


def make_private_dir(path: Path) -> None:
    """The ipc socket's folder, entered by its owner only: made 0700, or tightened to 0700 when
    it exists and this user owns it (a folder such as /tmp that others own is left as it is;
    the socket file's own 0600 still keeps them out)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
        log.info("making %s private (mode %04o -> 0700): it holds the gateway's worker socket", path,
                 stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)


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
    """The gateway's ROUTER: receives every worker's frames, sends to a worker by id.

    With `keys` it is a CURVE server: a ZAP handler on the running event loop admits the keys of
    `keys.allowed`, and refused handshakes are logged (so it must be made inside the loop). The
    socket then has a context of its own, since a context has one ZAP handler."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context | None = None, keys: ServerKeys | None = None):
        self._own_context = keys is not None and context is None
        self._context = zmq.asyncio.Context() if self._own_context else (context or zmq.asyncio.Context.instance())
        self._auth = None
        self._monitor_task: asyncio.Task | None = None
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A restarted worker reconnects with the same id: let it take the id over at once.
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Sending to a worker that is not connected raises instead of dropping silently.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.endpoint = check_endpoint(endpoint)
        self.keys = keys
        self._is_bound = False
        try:
            if keys is not None:
                self._start_curve(keys)
            if (path := ipc_path(endpoint)) is not None:
                make_private_dir(path.parent)
            self.socket.bind(endpoint)
            self._is_bound = True
            if path is not None:
                os.chmod(path, 0o600)  # the folder is private already, so no one got in meanwhile
        except BaseException:
            self.close()
            raise

    def _start_curve(self, keys: ServerKeys) -> None:
        asyncio.get_running_loop()  # the ZAP handler and the refusal log are tasks of this loop
        self._auth = start_authenticator(self._context, keys.allowed)
        self.socket.curve_server = True
        self.socket.curve_secretkey = keys.secret
        self.socket.curve_publickey = keys.public
        self.socket.zap_domain = ZAP_DOMAIN.encode()
        # No ZAP handler must mean no admission, never "anyone".
        self.socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        monitor = self.socket.get_monitor_socket(_GATEWAY_EVENTS)
        self._monitor_task = asyncio.create_task(self._log_failed_handshakes(monitor), name="curve-refusals")

    async def _log_failed_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        """Handshakes that never reach the ZAP handler (no CURVE, a wrong gateway key); refused
        keys are logged by the handler itself (shared/curve.py), with the key."""
        refusals = RefusalLog(logger=log)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                # A peer without CURVE shows as a mechanism mismatch or, when it hangs up first, as a
                # connection closed mid-handshake (as a bare port probe does too).
                reason = describe_handshake_failure(event["event"], event["value"])
                refusals.warn(reason, "refused a connection to %s: %s", self.endpoint, reason)
        finally:
            monitor.close(linger=0)

    async def recv(self) -> worker_pb2.Envelope:
        _identity, frame = await self.socket.recv_multipart()
        return decode(frame)

    async def recv_frames(self, limit: int = RECV_BATCH_FRAMES) -> list[bytes]:
        """The frames waiting now, up to `limit`, waiting for the first: one wake of the event
        loop per batch rather than per frame (a fleet's outputs arrive faster than the loop turns).
        Undecoded, so that one bad frame costs only itself (`decode` each)."""
        # Awaiting a frame that is already queued does not yield to the event loop: behind a backlog the
        # reader would run alone until it was drained, every other task (deadlines, cancellations, new
        # requests, the HTTP server) waiting on it. One turn of the loop per batch, whatever is queued.
        await asyncio.sleep(0)
        frames = [(await self.socket.recv_multipart())[1]]
        while len(frames) < limit:
            try:
                frames.append((await self.socket.recv_multipart(flags=zmq.NOBLOCK))[1])  # done at once, or Again
            except zmq.Again:
                break
        return frames

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
        if self._monitor_task is not None:
            try:
                self._monitor_task.cancel()
            except RuntimeError:  # its loop is closed: the task went with it
                pass
            self.socket.disable_monitor()
        self.socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_context:
            self._context.destroy(linger=0)
        if self._is_bound and (path := ipc_path(self.endpoint)) is not None:
            path.unlink(missing_ok=True)


class WorkerSocket:
    """One DEALER connected to the gateway; blocking API for the worker's threads.

    With `keys` it is a CURVE client. A refused handshake is final for a ZeroMQ connection, so
    this socket watches its handshake events (at most every _MONITOR_CHECK_S, from send and
    recv_all) and reconnects after a backoff: a key added to the gateway's dir later gets in."""

    def __init__(self, endpoint: str, worker_id: str, incarnation: str, routed: bool = True,
                 context: zmq.Context | None = None, keys: ClientKeys | None = None):
        self._context = context or zmq.Context.instance()
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, WORKER_SEND_TIMEOUT_MS)
        # Queue only on a live connection: heartbeats and deltas kept for a gateway that is not
        # there would reach its successor stale.
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        if routed:
            self.socket.setsockopt(zmq.ROUTING_ID, worker_id.encode())
        self.keys = keys
        self._monitor: zmq.Socket | None = None
        self._next_check_s = 0.0
        self._retry_at_s: float | None = None
        self._retry_s = AUTH_RETRY_S
        self._refusals = RefusalLog(logger=log)
        if keys is not None:
            self.socket.curve_publickey = keys.public
            self.socket.curve_secretkey = keys.secret
            self.socket.curve_serverkey = keys.server_public
            self._monitor = self.socket.get_monitor_socket(_WORKER_EVENTS)
        self.endpoint = check_endpoint(endpoint)
        self.socket.connect(endpoint)
        self.worker_id = worker_id
        self.incarnation = incarnation

    def send(self, envelope: worker_pb2.Envelope, wait: bool = True) -> bool:
        """False when the gateway is unreachable and the frame was dropped. `wait`: for a connection
        (or room in its queue) up to WORKER_SEND_TIMEOUT_MS; without it a frame no connection takes
        now is dropped at once."""
        self._watch_handshakes()
        envelope.worker_id = self.worker_id
        envelope.incarnation = self.incarnation
        try:
            self.socket.send(encode(envelope), flags=0 if wait else zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv_all(self, timeout_s: float) -> list[worker_pb2.Envelope]:
        """Every frame waiting now, waiting up to timeout_s for the first."""
        self._watch_handshakes()
        frames = []
        if self.socket.poll(int(timeout_s * 1000)):
            while True:
                try:
                    frames.append(decode(self.socket.recv(flags=zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return frames

    def _watch_handshakes(self) -> None:
        if self._monitor is None:
            return
        now = time.monotonic()
        if now < self._next_check_s:
            return
        self._next_check_s = now + _MONITOR_CHECK_S
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._retry_s > AUTH_RETRY_S:
                    log.info("the gateway at %s accepted this worker's CURVE key", self.endpoint)
                self._retry_at_s, self._retry_s = None, AUTH_RETRY_S
                continue
            reason = describe_handshake_failure(kind, event["value"], worker_side=True)
            # A refused key is final for a ZeroMQ connection; a handshake the gateway cut (what a
            # wrong gateway.key looks like from here) ZeroMQ would retry every 100 ms for ever.
            # Both wait for our own backoff instead.
            if self._retry_at_s is None:
                self.socket.disconnect(self.endpoint)
                self._retry_at_s = now + self._retry_s
                self._retry_s = min(2 * self._retry_s, MAX_AUTH_RETRY_S)
            self._refusals.warn(reason, "the gateway at %s refused this worker (its CURVE public key %s; the gateway's "
                                "public key and this worker's pair read from %s): %s", self.endpoint,
                                self.keys.public.decode(), self.keys.keys_dir, reason)
        if self._retry_at_s is not None and now >= self._retry_at_s:
            self._retry_at_s = None
            self.socket.connect(self.endpoint)

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long frames already sent may still take to leave (a last word, such
        as WorkerExit, is worth the wait; a stale heartbeat is not)."""
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
        self.socket.close(linger=linger_ms)


def bind_gateway_socket(config) -> GatewaySocket:
    """The gateway's socket on `config.worker_endpoint`, with the keys the policy gives it
    (shared/curve.py transport_keys; raises ConfigError for plain tcp:// that is not allowed)."""
    return GatewaySocket(config.worker_endpoint, keys=transport_keys(config, GATEWAY))


def connect_worker_socket(config, worker_id: str, incarnation: str, routed: bool = True) -> WorkerSocket:
    """A worker's socket to `config.worker_endpoint`, with the keys the policy gives it."""
    return WorkerSocket(config.worker_endpoint, worker_id, incarnation, routed=routed,
                        keys=transport_keys(config, WORKER))
