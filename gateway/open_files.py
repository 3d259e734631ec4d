"""The gateway's open-files limit, fitted to the connections its public ports may hold.

Every connection is a file descriptor, as is each worker socket and file the gateway opens. A soft
limit below what `gateway.max_connections` on each port needs would let a flood of connections
exhaust the descriptors before the connection cap refuses any, so the soft limit is raised to fit,
up to the hard limit (an unprivileged process may do so); where even the hard limit is lower, a
warning names both settings to change.
"""
from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)
# Beyond the public connections: worker and metrics sockets, the tokenizer's and logs' files.
RESERVED_FILES = 1024


def fit_open_files(max_connections: int, num_ports: int) -> int:
    """Raise the soft RLIMIT_NOFILE to fit `num_ports` ports of `max_connections` each (up to the
    hard limit); the soft limit now in force."""
    needed = num_ports * max_connections + RESERVED_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < needed:
        log.warning("open files are limited to %d (the hard limit), below the %d that %d port(s) of "
                    "gateway.max_connections = %d need: raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower "
                    "gateway.max_connections", soft, needed, num_ports, max_connections)
    return soft
