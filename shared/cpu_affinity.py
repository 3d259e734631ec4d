"""Which cores each process of the cluster runs on: a plan from the config, and pinning to it.

On the CPU a worker's torch threads are the model's compute. When the gateway (or another
worker) wakes on a core one of them holds, that thread is descheduled and its whole parallel
region waits. So where the host has the cores for it, worker i runs on its own
`worker_threads()` cores and the gateway on the `reserved_cores` left over; with fewer cores
(two workers on two cores, say) nothing is pinned and the OS shares them out as before.
"""
from __future__ import annotations

import os

from shared.config import ClusterConfig, usable_cores

GATEWAY = "gateway"


def plan_cores(config: ClusterConfig, cores: list[int] | None = None) -> dict[str, list[int]] | None:
    """{worker id or "gateway": its cores}, or None where the config or the host leaves the
    processes unpinned (`worker.pin_cores` off, no reserved core, or too few cores)."""
    cores = usable_cores() if cores is None else cores
    reserved, threads = config.reserved_cores(), config.worker_threads()
    if (not config.worker.pin_cores or not hasattr(os, "sched_setaffinity") or reserved <= 0
            or len(cores) < reserved + config.num_workers * threads):
        return None
    plan = {worker_id: cores[i * threads:(i + 1) * threads] for i, worker_id in enumerate(config.worker_ids)}
    plan[GATEWAY] = cores[-reserved:]
    return plan


def pin_process(name: str, config: ClusterConfig) -> list[int] | None:
    """Pin this process (and the threads it starts from now on) to its planned cores; the
    cores, or None where it stays unpinned. Call before torch starts its threads."""
    plan = plan_cores(config)
    cores = plan.get(name) if plan else None
    if cores:
        os.sched_setaffinity(0, cores)
    return cores
