"""The gateway's listening ports: binding them alone or shared with SO_REUSEPORT
(`gateway.reuse_port`), and the error that names the address and the setting when one is taken;
and the largest request the gRPC port takes, which follows the request bounds.

Only the front doors (gRPC `gateway.port`, HTTP `gateway.http_port`) may be shared. The metrics
port and the worker endpoint belong to one gateway each: on a shared port a scrape would read
whichever gateway the kernel picked, and a worker would join one of them at random.
"""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the supervisor imports this module, and need not load gRPC to check a port
    import grpc

    from shared.config import GatewayConfig

# The backlog of the HTTP socket; gRPC sets its own.
HTTP_BACKLOG = 1024
# Of a GenerateRequest beyond the characters its bounds count: the framing of each chat message,
# stop string, stop token id and logit_bias entry (a few bytes of tags and lengths; 64 is ample),
# and of everything else (ids, sampling's numbers, the choices of a constraint).
_BYTES_PER_ITEM = 64
_BYTES_BESIDES = 256 << 10
# gRPC's own default, kept as the least: prompt_token_ids are bounded by no character count (an
# over-long list is refused, or truncated, by the gateway itself, not by gRPC).
_GRPC_DEFAULT_BYTES = 4 << 20


class ListenError(OSError):
    """A port the gateway must listen on could not be bound; the message names it and the fix."""


def grpc_server_options(reuse_port: bool, max_receive_bytes: int | None = None,
                        handshake_timeout_s: float | None = None,
                        max_connections: int | None = None) -> list[tuple[str, int]]:
    # gRPC sets SO_REUSEPORT on Linux unless told not to, which would let a second gateway
    # silently take half the connections of a port it was never meant to share.
    options = [("grpc.so_reuseport", int(reuse_port))]
    if max_receive_bytes is not None:
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    if handshake_timeout_s is not None:
        # A connection that never completes its handshake (TLS, HTTP/2's preface and settings) is
        # closed then, as an HTTP request's head must arrive in time (gateway.read_timeout_s).
        options.append(("grpc.server_handshake_timeout_ms", max(1, round(handshake_timeout_s * 1e3))))
    if max_connections is not None:  # one more is closed as it is accepted (gateway.max_connections)
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    return options


def max_request_bytes(g: GatewayConfig) -> int:
    """The largest GenerateRequest the gateway's bounds let through, in bytes: gRPC's own limit
    (4 MiB unless set) would otherwise refuse, with a RESOURCE_EXHAUSTED of its own, a prompt
    within `max_prompt_chars`. Every character the bounds count (a prompt, or a chat's contents and
    tools; the constraint; the stop strings) at UTF-8's longest, 4 bytes, plus the framing; never
    less than gRPC's default."""
    chars = g.max_prompt_chars + g.max_schema_bytes + g.max_stop_strings * g.max_stop_chars
    items = g.max_chat_messages + g.max_stop_strings + g.max_stop_token_ids + g.max_logit_bias
    needed = 4 * chars + _BYTES_PER_ITEM * items + _BYTES_BESIDES
    return min(max(needed, _GRPC_DEFAULT_BYTES), 2**31 - 1)  # gRPC's options are C ints


def _taken(address: str, what: str, setting: str, reuse_port: bool, reason: str) -> ListenError:
    if reuse_port:
        fix = ("with gateway.reuse_port a port is shared only with processes that set SO_REUSEPORT too and run "
               "as the same user")
    else:
        fix = ("stop what holds it, choose another port, or set gateway.reuse_port = true on every gateway that "
               "is to share it")
    return ListenError(f"cannot listen on {address} for {what} ({setting}): {reason}; {fix}")


def add_grpc_port(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None,
                  reuse_port: bool) -> int:
    """Bind `server` (made with `grpc_server_options(reuse_port)`) to host:port; the port bound."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:  # gRPC says only that the bind failed; its log line has the errno
        bound = 0
    if bound == 0:
        raise _taken(address, "gRPC", "gateway.port", reuse_port, "the address is in use or not one of this host")
    return bound


def listen_socket(host: str, port: int, reuse_port: bool, what: str = "HTTP",
                  setting: str = "gateway.http_port") -> socket.socket:
    """A listening TCP socket on host:port, with SO_REUSEPORT when `reuse_port`."""
    return _bound(host, port, reuse_port, what, setting, listen=True)


def check_can_listen(host: str, port: int, reuse_port: bool, what: str, setting: str) -> None:
    """Raise ListenError unless host:port could be bound as the gateway binds it (port 0 always can).
    A supervisor checks before its first start, so a taken port fails once instead of in a
    restart loop. It binds without listening: a listening socket would join a shared port's
    group, and a connection the kernel gave it in that instant would be reset."""
    if port:
        _bound(host, port, reuse_port, what, setting, listen=False).close()


def _bound(host: str, port: int, reuse_port: bool, what: str, setting: str, listen: bool) -> socket.socket:
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # that say they are TCP, and with Nagle on, an event waits behind the headers for the client's
    # delayed ACK: the first token of a kept-alive connection would be late by that timer.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart does not wait out TIME_WAIT
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(HTTP_BACKLOG)
    except OSError as e:
        sock.close()
        raise _taken(f"{host}:{port}", what, setting, reuse_port, e.strerror or str(e)) from None
    return sock


def metrics_taken(host: str, port: int, error: OSError) -> ListenError:
    """The error for a metrics port that could not be bound: never shared between gateways."""
    return ListenError(f"cannot listen on {host}:{port} for metrics (gateway.metrics_port): "
                       f"{error.strerror or error}; every gateway needs a metrics port of its own, even with "
                       f"gateway.reuse_port")
