"""Who may call the gateway: API keys, their roles and limits, and the principal a request runs as.

Keys come from `gateway.api_keys_file` (one per line: the key, then optional `name=`, `role=`
(`user` or `admin`), `rpm=` (requests per minute), `tpm=` (prompt + max_tokens per minute),
`streams=` (concurrent streams) and `priority_floor=` (the most urgent priority it may ask for))
or, for a single admin key, the INFERENCE_API_KEY environment variable. Clients present one as
`authorization: Bearer KEY` (gRPC metadata or the HTTP header). Only each key's SHA-256 digest
is kept; a presented key is found by its digest and confirmed with hmac.compare_digest, and
nothing but a key's name ever reaches a log line or a metric. With no keys configured every
caller is the anonymous admin, which `check_exposure` allows on loopback addresses only unless
`gateway.allow_unauthenticated` says otherwise.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import os
from dataclasses import dataclass
from pathlib import Path

from gateway.rate_limit import TokenBucket
from shared.config import ConfigError, GatewayConfig

ROLES = ("user", "admin")
MIN_KEY_CHARS = 16
ENV_KEY = "INFERENCE_API_KEY"
_FIELDS = {"name", "role", "rpm", "tpm", "streams", "priority_floor"}


@dataclass(frozen=True)
class KeySpec:
    name: str
    digest: bytes  # SHA-256 of the key
    role: str = "user"
    requests_per_minute: float = 0.0  # 0 = no limit
    tokens_per_minute: float = 0.0
    max_streams: int = 0
    priority_floor: int | None = None


class Principal:
    """One key's identity and the live state of its limits, shared by all its requests."""

    def __init__(self, spec: KeySpec, now_s: float = 0.0):
        self.spec = spec
        self.requests = TokenBucket(spec.requests_per_minute, now_s) if spec.requests_per_minute else None
        self.tokens = TokenBucket(spec.tokens_per_minute, now_s) if spec.tokens_per_minute else None
        self.num_streams = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_admin(self) -> bool:
        return self.spec.role == "admin"

    def priority(self, asked: int) -> int:
        """The priority a request runs at: what it asked for, but never more urgent than the floor."""
        floor = self.spec.priority_floor
        return asked if floor is None else max(asked, floor)


ANONYMOUS = Principal(KeySpec(name="", digest=b"", role="admin"))


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyStore:
    def __init__(self, specs: list[KeySpec], now_s: float = 0.0):
        self._by_digest = {spec.digest: Principal(spec, now_s) for spec in specs}

    @classmethod
    def from_config(cls, config: GatewayConfig, environ=os.environ, now_s: float = 0.0) -> "KeyStore":
        specs = parse_keys_file(Path(config.api_keys_file)) if config.api_keys_file else []
        if environ.get(ENV_KEY):
            key = environ[ENV_KEY].strip()
            _check_key(key, f"${ENV_KEY}")
            specs.append(KeySpec(name="env", digest=digest(key), role="admin"))
        if len({s.name for s in specs}) != len(specs) or len({s.digest for s in specs}) != len(specs):
            raise ConfigError("API keys and their names must be unique (a key file line repeats one, or "
                              f"${ENV_KEY} repeats a key of the file)")
        return cls(specs, now_s)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of an `authorization` header value; None for a missing or unknown key
        (ANONYMOUS when no keys are configured)."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        presented = digest(key.strip())
        principal = self._by_digest.get(presented)
        expected = principal.spec.digest if principal is not None else bytes(len(presented))
        return principal if hmac.compare_digest(expected, presented) and principal is not None else None


def retry_after_ms(wait_s: float) -> int | None:
    """A wait as a retry hint; None when waiting cannot help (math.inf)."""
    return None if math.isinf(wait_s) else max(1, math.ceil(wait_s * 1e3))


def check_exposure(config: GatewayConfig, keys: KeyStore) -> None:
    """Refuse to serve non-loopback addresses without keys, unless told anyone may call."""
    if keys.enabled or config.allow_unauthenticated or is_loopback(config.host):
        return
    raise ConfigError(
        f"gateway.host = {config.host!r} reaches beyond this machine and no API keys are set, so anyone who "
        f"can reach it could call it. Set keys (--gateway.api_keys_file FILE, or ${ENV_KEY}), bind loopback "
        f"(--gateway.host 127.0.0.1), or accept that anyone may call (--gateway.allow_unauthenticated true). "
        f"See docs/security.md.")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def parse_keys_file(path: Path) -> list[KeySpec]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"gateway.api_keys_file: cannot read {path}: {e.strerror}") from None
    specs = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}:{number}"
        key, fields = words[0], {}
        _check_key(key, where)
        for word in words[1:]:
            name, sep, value = word.partition("=")
            if not sep or name not in _FIELDS or not value:
                raise ConfigError(f"{where}: {word.split('=')[0]!r} is not one of {sorted(_FIELDS)} as name=value")
            fields[name] = value
        specs.append(_spec(key, fields, where, number))
    return specs


def _spec(key: str, fields: dict[str, str], where: str, number: int) -> KeySpec:
    role = fields.get("role", "user")
    if role not in ROLES:
        raise ConfigError(f"{where}: role must be one of {ROLES}, got {role!r}")
    try:
        spec = KeySpec(name=fields.get("name", f"key-{number}"), digest=digest(key), role=role,
                       requests_per_minute=float(fields.get("rpm", 0)), tokens_per_minute=float(fields.get("tpm", 0)),
                       max_streams=int(fields.get("streams", 0)),
                       priority_floor=int(fields["priority_floor"]) if "priority_floor" in fields else None)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if spec.max_streams < 0:
        raise ConfigError(f"{where}: streams must be >= 0, got {spec.max_streams}")
    # A bucket holds a minute's worth: under one request (or token) it could never let one through.
    for name, value in (("rpm", spec.requests_per_minute), ("tpm", spec.tokens_per_minute)):
        if not (value == 0 or (math.isfinite(value) and value >= 1)):
            raise ConfigError(f"{where}: {name} must be 0 (no limit) or a number >= 1, got {fields[name]!r}")
    return spec


def _check_key(key: str, where: str) -> None:
    # The message never repeats the key: it names where it came from.
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{where}: an API key must be at least {MIN_KEY_CHARS} characters "
                          f"(`python -c 'import secrets; print(secrets.token_urlsafe(32))'` makes one)")
