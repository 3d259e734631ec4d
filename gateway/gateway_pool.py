"""Client-side balancing of requests over several gateways that share nothing: one channel per
gateway address, a gateway picked per request, and one retry elsewhere for a request a gateway
refused UNAVAILABLE before sending anything. Imports only gRPC and the public protos.

Each gateway owns its workers, queues and prefix index (docs/deployment.md, "Several gateways"),
so the choice is made per request, never per connection:

- A request with a `session_id` goes to the gateway that rendezvous (highest-random-weight)
  hashing ranks first for that id among the gateways believed healthy, so a conversation's turns
  keep reaching the gateway whose worker caches its history. Adding or removing a gateway moves
  only the sessions that rank it first.
- Any other request goes to the gateway with the fewest of this pool's requests in flight; ties
  take turns (round-robin).
- A call that fails UNAVAILABLE before its first response message marks its gateway unhealthy for
  `unhealthy_s` and is retried once on the next gateway, within the same deadline. A stream that
  has delivered tokens is never retried: the client has seen part of an answer.

`GatewayPool` is the blocking API (gateway/client.py uses it), `AsyncGatewayPool` the grpc.aio
one; the policy is `GatewaySelector`, shared by both and free of I/O.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import grpc

from protos import inference_pb2, inference_pb2_grpc

# Long enough that a gateway that is down costs one failed connect per interval, not one per
# request; short enough that a restarted gateway (its supervisor restarts it within seconds)
# gets its sessions back soon.
UNHEALTHY_S = 2.0
MAX_ATTEMPTS = 2  # the first gateway, then one other


def parse_addresses(addresses: str | Sequence[str]) -> list[str]:
    """`"host:port,host:port"` (or a list of them) as a list; ValueError naming a bad entry."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    parsed = [item.strip() for item in items]
    if not parsed or parsed == [""]:
        raise ValueError("no gateway address given: expected host:port[,host:port...]")
    for address in parsed:
        _check_address(address)
    duplicates = sorted({a for a in parsed if parsed.count(a) > 1})
    if duplicates:
        raise ValueError(f"gateway addresses given more than once: {duplicates}")
    return parsed


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if (not host or any(c.isspace() for c in address) or not port.isdigit() or not 0 < int(port) < 65536
            or (":" in host and not bracketed)):
        raise ValueError(f"gateway address {address!r} is not host:port (e.g. 127.0.0.1:50051 or [::1]:50051)")


def rendezvous_weight(address: str, session_id: str) -> int:
    """The session's weight for a gateway: the highest-weighted gateway takes the session."""
    digest = hashlib.blake2b(f"{address}\n{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class GatewaySelector:
    """Which gateway each request goes to, and what this pool knows of them: requests in flight
    and which gateways failed recently. Thread-safe; makes no calls itself."""

    def __init__(self, addresses: Sequence[str], unhealthy_s: float = UNHEALTHY_S,
                 clock: Callable[[], float] = time.monotonic):
        if unhealthy_s < 0:
            raise ValueError(f"unhealthy_s must be >= 0, got {unhealthy_s}")
        self.addresses = list(addresses)
        self.unhealthy_s = unhealthy_s
        self.clock = clock
        self._in_flight = dict.fromkeys(self.addresses, 0)
        self._unhealthy_until = dict.fromkeys(self.addresses, -math.inf)
        self._next = 0  # the index the round-robin between equally loaded gateways starts from
        self._lock = threading.Lock()

    def healthy(self) -> list[str]:
        now = self.clock()
        with self._lock:
            return [a for a in self.addresses if self._unhealthy_until[a] <= now]

    def in_flight(self, address: str) -> int:
        with self._lock:
            return self._in_flight[address]

    def acquire(self, session_id: str = "", exclude: Sequence[str] = ()) -> str | None:
        """Pick a gateway (not one of `exclude`) and count a request in flight on it; None when
        `exclude` leaves none."""
        now = self.clock()
        with self._lock:
            candidates = [a for a in self.addresses if a not in exclude]
            # Every gateway believed down: try one anyway rather than refuse without asking.
            candidates = [a for a in candidates if self._unhealthy_until[a] <= now] or candidates
            if not candidates:
                return None
            if session_id:
                chosen = max(candidates, key=lambda a: (rendezvous_weight(a, session_id), a))
            else:
                chosen = self._least_in_flight(candidates)
            self._in_flight[chosen] += 1
            return chosen

    def _least_in_flight(self, candidates: list[str]) -> str:
        fewest = min(self._in_flight[a] for a in candidates)
        n = len(self.addresses)
        for k in range(n):
            i = (self._next + k) % n
            if self.addresses[i] in candidates and self._in_flight[self.addresses[i]] == fewest:
                self._next = (i + 1) % n
                return self.addresses[i]
        raise AssertionError("a candidate has the fewest requests in flight")

    def release(self, address: str) -> None:
        with self._lock:
            self._in_flight[address] -= 1

    def mark_unavailable(self, address: str) -> None:
        with self._lock:
            self._unhealthy_until[address] = self.clock() + self.unhealthy_s


class _Attempts:
    """One request's tries: which gateway it is on, the deadline left, and whether a failure may
    be tried again on another gateway."""

    def __init__(self, selector: GatewaySelector, session_id: str, timeout_s: float | None):
        self.selector = selector
        self.session_id = session_id
        self.deadline_s = None if timeout_s is None else selector.clock() + timeout_s
        self.tried: list[str] = []

    def start(self) -> str:
        address = self.selector.acquire(self.session_id, exclude=self.tried)
        assert address is not None, "start() follows a may_retry() that found another gateway"
        self.tried.append(address)
        return address

    def timeout_s(self) -> float | None:
        return None if self.deadline_s is None else max(0.0, self.deadline_s - self.selector.clock())

    def finish(self) -> None:
        self.selector.release(self.tried[-1])

    def may_retry(self, error: grpc.RpcError, received: bool) -> bool:
        """After the current try failed with `error` (`received`: a response had arrived)."""
        if received or error.code() != grpc.StatusCode.UNAVAILABLE:
            return False  # a stream under way, or the gateway's own answer (a bound, a bad request)
        self.selector.mark_unavailable(self.tried[-1])
        has_time = self.deadline_s is None or self.timeout_s() > 0
        return len(self.tried) < min(MAX_ATTEMPTS, len(self.selector.addresses)) and has_time


class _Pool:
    default_channel: Callable = staticmethod(grpc.insecure_channel)

    def __init__(self, addresses: str | Sequence[str], open_channel: Callable | None = None,
                 unhealthy_s: float = UNHEALTHY_S, clock: Callable[[], float] = time.monotonic):
        """`addresses`: "host:port,..." or a list; `open_channel(address)` makes each gateway's
        channel (plaintext by default; TLS and channel options are the caller's choice)."""
        open_channel = open_channel or self.default_channel
        self.addresses = parse_addresses(addresses)
        self.selector = GatewaySelector(self.addresses, unhealthy_s, clock)
        self.channels = {a: open_channel(a) for a in self.addresses}
        self._stubs = {a: inference_pb2_grpc.InferenceServiceStub(c) for a, c in self.channels.items()}

    def stub(self, address: str) -> inference_pb2_grpc.InferenceServiceStub:
        """The stub of one gateway, for the RPCs that are about that gateway (status, probes)."""
        return self._stubs[address]

    def healthy(self) -> list[str]:
        return self.selector.healthy()


class GatewayPool(_Pool):
    """Blocking calls over several gateways: `for response in pool.generate(request): ...`."""

    def generate(self, request: inference_pb2.GenerateRequest, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = ()) -> Iterator[inference_pb2.GenerateResponse]:
        """The responses of one Generate; raises the grpc.RpcError of the last try. Closing the
        iterator early cancels the call."""
        attempts = _Attempts(self.selector, request.session_id, timeout)
        while True:
            call = self._stubs[attempts.start()].Generate(request, timeout=attempts.timeout_s(), metadata=metadata)
            received = False
            try:
                for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as e:
                if not attempts.may_retry(e, received):
                    raise
            finally:
                call.cancel()  # nothing once the call has ended; stops it if the caller stopped reading
                attempts.finish()

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()

    def __enter__(self) -> GatewayPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGatewayPool(_Pool):
    """The same over grpc.aio: `async for response in pool.generate(request): ...`. Leaving the
    loop early should close the generator (`contextlib.aclosing`), which cancels the call and
    ends its count in flight at once rather than when it is collected."""
    default_channel = staticmethod(grpc.aio.insecure_channel)

    async def generate(self, request: inference_pb2.GenerateRequest, timeout: float | None = None,
                       metadata: Sequence[tuple[str, str]] = ()) -> AsyncIterator[inference_pb2.GenerateResponse]:
        attempts = _Attempts(self.selector, request.session_id, timeout)
        while True:
            call = self._stubs[attempts.start()].Generate(request, timeout=attempts.timeout_s(), metadata=metadata)
            received = False
            try:
                async for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as e:  # grpc.aio.AioRpcError is one
                if not attempts.may_retry(e, received):
                    raise
            finally:
                call.cancel()
                attempts.finish()

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    async def __aenter__(self) -> AsyncGatewayPool:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
