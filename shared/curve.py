"""Who may join as a worker: ZeroMQ CURVE keys in zmq.auth's certificate format, and which
endpoint uses which keys (`transport_keys`, the one policy the gateway and the workers share).

A keys dir holds `gateway.key` / `gateway.key_secret` (the gateway's pair) and `worker.key` /
`worker.key_secret` (a worker's pair). The gateway admits the public key of every `*.key` file in
its dir other than its own. The cluster's own dir, `<run_dir>/keys`, is made on first use by
whichever process comes first. No sockets here: shared/ipc.py sets these keys on them.
"""
from __future__ import annotations

import ipaddress
import logging
import math
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from shared.engine_config import ConfigError  # a stdlib-only module: the project's config error

log = logging.getLogger(__name__)

GATEWAY = "gateway"
WORKER = "worker"
ROLES = (GATEWAY, WORKER)
CLUSTER_KEYS_DIRNAME = "keys"  # <run_dir>/keys
ZAP_DOMAIN = "inference-workers"
# An unknown client key re-reads the gateway's dir (a key file added since is admitted), at
# most this often, so a peer retrying with random keys cannot keep the gateway reading files.
RELOAD_INTERVAL_S = 1.0
# Each refused key (or kind of failed handshake) is logged at most once per interval.
REFUSAL_LOG_INTERVAL_S = 10.0
_MAX_TRACKED_REFUSALS = 1024


def public_file(keys_dir: Path, name: str) -> Path:
    return Path(keys_dir) / f"{name}.key"


def secret_file(keys_dir: Path, name: str) -> Path:
    return Path(keys_dir) / f"{name}.key_secret"


def key_files(keys_dir: Path) -> list[Path]:
    """The four files `write_keys` makes, in a stable order."""
    return [f for name in ROLES for f in (public_file(keys_dir, name), secret_file(keys_dir, name))]


# ---- making keys ------------------------------------------------------------------------------------
def _write_pairs(keys_dir: Path) -> None:
    """A fresh gateway pair and worker pair in `keys_dir`; secret files 0600."""
    for name in ROLES:
        public, secret = zmq.auth.create_certificates(keys_dir, name)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)


def create_keys_dir(path: Path) -> Path:
    """Make `path` (mode 0700) holding a fresh gateway pair and worker pair, atomically.

    The keys are written into a private temporary dir beside `path` that is then renamed into
    place, so no process ever sees a partial dir. When another process made `path` first, its
    keys win and ours are dropped: every process of the cluster ends up with the same keys."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))  # mkdtemp: mode 0700
    try:
        _write_pairs(tmp)
        try:
            os.rename(tmp, path)  # atomic; refused when a non-empty `path` exists
        except OSError:
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename won
    return path


def write_keys(keys_dir: Path, force: bool = False) -> list[Path]:
    """`python -m tools.curve_keys DIR`: the four key files in DIR (made 0700 if missing).
    Refuses to replace existing files unless `force`. Returns the files written."""
    keys_dir = Path(keys_dir)
    existing = [f for f in key_files(keys_dir) if f.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(map(str, existing))} already exist; pass --force to replace "
                              f"them (every worker then needs the new keys)")
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".curve-keys-", dir=keys_dir))
    try:
        _write_pairs(tmp)
        for f in key_files(keys_dir):
            os.replace(tmp / f.name, f)  # each file appears whole
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return key_files(keys_dir)


def _configured_dir(config, role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return config.gateway.curve_keys_dir if role == GATEWAY else config.worker.curve_keys_dir


def cluster_keys_dir(config, role: str) -> Path:
    """The keys dir of the gateway (role GATEWAY) or a worker (WORKER): `<role>.curve_keys_dir`,
    which must exist (tools/curve_keys.py writes one), or else the cluster's own `<run_dir>/keys`,
    made on first use."""
    configured = _configured_dir(config, role)
    if configured:
        path = Path(configured).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(f"{role}.curve_keys_dir: {path} is not a folder; write keys into it with "
                              f"`python -m tools.curve_keys {path}`")
        return path
    path = Path(config.run_dir).resolve() / CLUSTER_KEYS_DIRNAME
    if not path.is_dir():
        create_keys_dir(path)
    return path


# ---- loading keys -----------------------------------------------------------------------------------
def _warn_if_exposed(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("%s is readable by other users (mode %04o); a secret key file should be 0600", path, mode)


def _load(path: Path, role: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{role} CURVE keys: cannot load {path} ({e}); write keys with "
                          f"`python -m tools.curve_keys {path.parent}`") from None
    if need_secret:
        if not secret:
            raise ConfigError(f"{role} CURVE keys: {path} holds no secret key")
        _warn_if_exposed(path)
    return public, secret


@dataclass(frozen=True)
class ClientKeys:
    """A worker's side of the handshake: its own pair and the gateway's public key (z85)."""
    public: bytes
    secret: bytes  # never logged, never in a repr
    server_public: bytes
    keys_dir: Path

    def __repr__(self) -> str:
        return f"ClientKeys(public={self.public.decode()}, server_public={self.server_public.decode()})"


@dataclass(frozen=True, eq=False)
class ServerKeys:
    """The gateway's side: its pair, and the workers it admits."""
    public: bytes
    secret: bytes
    allowed: "AllowedKeys"
    keys_dir: Path

    def __repr__(self) -> str:
        return f"ServerKeys(public={self.public.decode()}, keys_dir={self.keys_dir})"


def load_client_keys(keys_dir: Path) -> ClientKeys:
    keys_dir = Path(keys_dir)
    public, secret = _load(secret_file(keys_dir, WORKER), WORKER, need_secret=True)
    server_public, _ = _load(public_file(keys_dir, GATEWAY), WORKER, need_secret=False)
    return ClientKeys(public, secret, server_public, keys_dir)


def load_server_keys(keys_dir: Path) -> ServerKeys:
    keys_dir = Path(keys_dir)
    public, secret = _load(secret_file(keys_dir, GATEWAY), GATEWAY, need_secret=True)
    allowed = AllowedKeys(keys_dir)
    if not allowed.keys:
        log.warning("no worker public keys (*.key) in %s: no worker can join until one is added", keys_dir)
    return ServerKeys(public, secret, allowed, keys_dir)


# ---- admitting workers --------------------------------------------------------------------------------
class RefusalLog:
    """Warnings about refused handshakes, at most one per `interval_s` per key, with the count of
    those held back: a peer retrying in a loop cannot flood the log."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log):
        self._interval_s = interval_s
        self._clock = clock
        self._log = logger
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (last logged, held back since)

    def warn(self, key: str, message: str, *args) -> bool:
        """Log `message % args` unless `key` was logged within the interval. True if logged."""
        now = self._clock()
        last_s, held_back = self._seen.get(key, (-math.inf, 0))
        if now - last_s < self._interval_s:
            self._seen[key] = (last_s, held_back + 1)
            return False
        if len(self._seen) >= _MAX_TRACKED_REFUSALS:
            self._seen.clear()  # bounded memory against a peer that never repeats a key
        self._seen[key] = (now, 0)
        if held_back:
            message, args = message + " (%d more since)", (*args, held_back)
        self._log.warning(message, *args)
        return True


class AllowedKeys:
    """The gateway's allowed set: the public keys of the `*.key` files in its keys dir other
    than gateway.key. zmq.auth calls `callback(domain, key)` for every CURVE handshake. The dir
    is re-read when its mtime changed (a key file added, removed or renamed: admitted, or
    refused from the next handshake on, without a restart), and for a key not in the set at most
    once per `reload_interval_s` (a file rewritten in place)."""

    def __init__(self, keys_dir: Path, reload_interval_s: float = RELOAD_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, refusals: RefusalLog | None = None):
        self.keys_dir = Path(keys_dir)
        self._reload_interval_s = reload_interval_s
        self._clock = clock
        self._refusals = refusals or RefusalLog(clock=clock)
        self._bad_files: dict[Path, float] = {}  # file -> the mtime whose parse error was logged
        self._keys: frozenset[bytes] = frozenset()
        self._read_s = -math.inf
        self._dir_mtime_ns = -1
        self.num_reloads = 0
        self.peer_address = ""  # of the handshake in hand, set by the authenticator
        self.reload()

    @property
    def keys(self) -> frozenset[bytes]:
        return self._keys

    def _dir_mtime(self) -> int:
        try:
            return self.keys_dir.stat().st_mtime_ns
        except OSError:
            return -1

    def reload(self) -> None:
        self._dir_mtime_ns = self._dir_mtime()  # before reading: a change meanwhile reads again
        keys = set()
        own = public_file(self.keys_dir, GATEWAY)
        for path in sorted(self.keys_dir.glob("*.key")):
            if path == own:
                continue
            try:
                keys.add(zmq.auth.load_certificate(path)[0])
            except (OSError, ValueError) as e:
                mtime = path.stat().st_mtime if path.exists() else 0.0
                if self._bad_files.get(path) != mtime:
                    self._bad_files[path] = mtime
                    log.warning("ignoring %s: not a public key certificate (%s)", path, e)
        self._keys = frozenset(keys)
        self._read_s = self._clock()
        self.num_reloads += 1

    def is_allowed(self, public_z85: bytes) -> bool:
        if self._dir_mtime() != self._dir_mtime_ns:
            self.reload()
        elif public_z85 not in self._keys and self._clock() - self._read_s >= self._reload_interval_s:
            self.reload()
        return public_z85 in self._keys

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials-provider hook: `key` is the client's public key in z85."""
        if self.is_allowed(key):
            return True
        z85 = key.decode("ascii", "replace")
        self._refusals.warn(z85, "refused a worker's CURVE handshake from %s: public key %s is not among the "
                                 "worker keys in %s", self.peer_address or "?", z85, self.keys_dir)
        return False


class _Authenticator(AsyncioAuthenticator):
    """zmq.auth's asyncio ZAP handler that also tells the credentials provider whom each request
    is from (the address frame: `ip` on tcp://, the peer's uid:gid:pid on ipc://)."""

    def __init__(self, context: zmq.Context, allowed: AllowedKeys):
        super().__init__(context)
        self._provider = allowed  # not `_allowed`: the base class keeps its address allow-list there

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._provider.peer_address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)


def start_authenticator(context: zmq.Context, allowed: AllowedKeys) -> AsyncioAuthenticator:
    """The ZAP handler of `context` (one per context), admitting `allowed` for ZAP_DOMAIN.
    Runs on the running asyncio loop."""
    auth = _Authenticator(context, allowed)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=allowed)
    return auth


_PROTOCOL_ERRORS = {int(getattr(zmq, n)): n[len("PROTOCOL_ERROR_"):]
                    for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")}
_PROTOCOL_HINTS = {
    "ZMTP_MECHANISM_MISMATCH": "the peer does not use CURVE",
    "ZMTP_CRYPTOGRAPHIC": "the CURVE keys do not match (a wrong gateway public key?)",
    "ZMTP_KEY_EXCHANGE": "the CURVE keys do not match (a wrong gateway public key?)",
}


def describe_handshake_failure(event: int, value: int, worker_side: bool = False) -> str:
    """A monitor event's reason, in words (`value` is a PROTOCOL_ERROR_* code or a ZAP status).
    `worker_side`: as a worker's socket saw it, where a handshake the gateway cuts most likely
    means a wrong gateway key (on the gateway's side the same event is mostly a port probe)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the CURVE key was refused (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        name = _PROTOCOL_ERRORS.get(int(value), str(int(value)))
        return f"protocol error {name}" + (f": {_PROTOCOL_HINTS[name]}" if name in _PROTOCOL_HINTS else "")
    reason = f"the connection closed mid-handshake (errno {int(value)})"
    if worker_side:
        reason += (": possibly the gateway could not read this worker's CURVE hello, which is what a gateway.key "
                   "other than the gateway's public key looks like (keys made again with --force while this "
                   "worker kept the old ones?), or the gateway stopped")
    return reason


# ---- the policy ---------------------------------------------------------------------------------------
def is_loopback(endpoint: str) -> bool:
    """Whether a tcp:// endpoint names a loopback address (reachable from this host only)."""
    if not endpoint.startswith("tcp://") or ";" in endpoint:
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, or a host name that may resolve anywhere


def transport_keys(config, role: str) -> ServerKeys | ClientKeys | None:
    """The CURVE keys of the gateway's socket (role GATEWAY) or a worker's (WORKER) on
    `config.worker_endpoint`; None means plain ZeroMQ.

    - ipc://, and tcp:// on a loopback address (reachable from this host only): always CURVE,
      with `<role>.curve_keys_dir` or else the cluster's own keys in `<run_dir>/keys`.
    - any other tcp://: CURVE with `<role>.curve_keys_dir`; without one it is refused
      (ConfigError), unless `gateway.allow_insecure_tcp`, which runs plain and logs a warning.
    """
    endpoint = config.worker_endpoint
    if endpoint.startswith("tcp://") and not is_loopback(endpoint) and not _configured_dir(config, role):
        if not config.gateway.allow_insecure_tcp:
            raise ConfigError(f"worker endpoint {endpoint} is reachable from other hosts and {role}.curve_keys_dir "
                              f"is not set: write keys with `python -m tools.curve_keys DIR` and set "
                              f"--gateway.curve_keys_dir / --worker.curve_keys_dir, or set "
                              f"gateway.allow_insecure_tcp = true to run it without authentication")
        log.warning("%s on %s WITHOUT authentication or encryption (gateway.allow_insecure_tcp): any "
                    "process that reaches it can %s", role, endpoint,
                    "join as a worker and receive prompts" if role == GATEWAY else "read this worker's traffic")
        return None
    keys_dir = cluster_keys_dir(config, role)
    return load_server_keys(keys_dir) if role == GATEWAY else load_client_keys(keys_dir)
