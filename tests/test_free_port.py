"""bench.cluster_process.free_port: the loopback ports the cluster tests bind their servers to."""
from __future__ import annotations

import socket

from bench.cluster_process import _ephemeral_range, free_port


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        if low >= 11000:  # room below the range: never a port the kernel hands out as a source
            assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned():
    held = []
    try:
        for _ in range(20):
            port = free_port()
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == len(held)
    finally:
        for s in held:
            s.close()
