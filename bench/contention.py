"""Detects other processes competing for the CPU, before and during each measured phase, so that timings taken
under foreign load are flagged: on 2 cores one busy neighbour stalls every 2-thread OpenMP region."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

import psutil

# Share of the machine's CPU time used by other processes above which a phase's timing is flagged. A descheduled
# partner thread stalls every parallel region (docs/benchmarks.md), so even modest foreign load distorts results.
FOREIGN_LOAD_WARN = 0.10


def busy_other_processes(threshold_pct: float = 20.0, interval_s: float = 1.0) -> list[str]:
    """Other processes using at least threshold_pct of one core over interval_s, as short descriptions."""
    me = os.getpid()
    procs = [p for p in psutil.process_iter(["pid", "name"]) if p.info["pid"] != me]
    for p in procs:
        try:
            p.cpu_percent(None)  # first call only starts the measurement window
        except psutil.Error:
            pass
    time.sleep(interval_s)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
            if pct >= threshold_pct:
                cmd = " ".join(p.cmdline())[:80] or p.info["name"]
                busy.append(f"pid {p.info['pid']} {pct:.0f}% {cmd}")
        except psutil.Error:
            pass
    return busy


def _busy_seconds(t) -> float:
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


@contextmanager
def foreign_load(record: dict, key: str):
    """Stores in record[key] the share of all cores' time that processes other than this one used while the block
    ran: (system busy CPU time - our own CPU time) / (wall time x cores)."""
    me = psutil.Process()
    sys0, own0, t0 = psutil.cpu_times(), me.cpu_times(), time.perf_counter()
    try:
        yield
    finally:
        sys1, own1, wall = psutil.cpu_times(), me.cpu_times(), time.perf_counter() - t0
        own = (own1.user + own1.system) - (own0.user + own0.system)
        other = _busy_seconds(sys1) - _busy_seconds(sys0) - own
        record[key] = max(0.0, other) / (wall * (psutil.cpu_count() or 1)) if wall > 0 else 0.0


def wait_for_idle(max_wait_s: float) -> list[str]:
    """Wait (up to max_wait_s) until no other process is busy; returns whoever still is."""
    busy = busy_other_processes()
    deadline = time.monotonic() + max_wait_s
    while busy and time.monotonic() < deadline:
        print(f"[bench {time.strftime('%H:%M:%S')}] waiting for an idle CPU: {busy}", file=sys.stderr, flush=True)
        time.sleep(min(15.0, max(0.0, deadline - time.monotonic())))
        busy = busy_other_processes()
    return busy
