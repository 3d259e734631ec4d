"""Who used the CPU during a measured phase: this process, the cluster's processes, and everyone else.

bench/contention.py charges every other process as foreign load; a cluster benchmark starts its
own gateway and workers, whose CPU is part of the system under test. This splits the machine's
busy time into ours (this process + the named cluster processes) and foreign, so a phase timed
under a neighbour's load is flagged, and per-process CPU per output token shows where the
cluster spends its cycles.
"""

from __future__ import annotations

import os

import time
from contextlib import contextmanager
from typing import Callable

import psutil


def _busy(t) -> float:
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def _own_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


@contextmanager
def cpu_accounting(record: dict, cluster_cpu: Callable[[], dict[str, float]] | None = None):
    """Fills record with wall_s, this process's CPU seconds, each cluster process's CPU seconds and the
    foreign share: other processes' busy time / (wall x cores)."""
    cluster_cpu = cluster_cpu or (lambda: {})
    sys0, own0, cl0, t0 = psutil.cpu_times(), _own_cpu(), cluster_cpu(), time.perf_counter()
    try:
        yield record
    finally:
        sys1, own1, cl1, wall = psutil.cpu_times(), _own_cpu(), cluster_cpu(), time.perf_counter() - t0
        cluster = {k: cl1.get(k, 0.0) - cl0.get(k, 0.0) for k in cl1}
        own = own1 - own0
        foreign = _busy(sys1) - _busy(sys0) - own - sum(cluster.values())
        cores = psutil.cpu_count() or 1
        record.update(wall_s=wall, client_cpu_s=own, cluster_cpu_s=cluster,
                      foreign_share=max(0.0, foreign) / (wall * cores) if wall > 0 else 0.0)


@contextmanager
def pinned_to(cores: list[int] | None):
    """This thread (and threads it starts) on `cores` for the block (nothing when None or empty); the
    mask is restored after, so processes started later inherit every core."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
