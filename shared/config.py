"""The cluster's configuration: frozen, validated dataclasses loaded from TOML.

Every value can be overridden on the command line with a flag named after it
(`--gateway.port 50052`, `--queues.bucket_bounds "[64, 256]"`, `--model_dir ...`);
`add_config_flags` and `load_config` implement that once for every process. Stdlib only.
"""
from __future__ import annotations

import argparse
import os
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shared.engine_config import ConfigError, EngineConfig
from shared.engine_config import check as _check
from shared.config_values import convert, parse_literal
from shared.gateway_config import GatewayConfig

__all__ = ["ClusterConfig", "ConfigError", "DispatchConfig", "EngineConfig", "GatewayConfig", "QueueConfig",
           "WorkerConfig", "add_config_flags", "build_section", "config_from_args", "load_config", "usable_cores"]


@dataclass(frozen=True)
class QueueConfig:
    bucket_bounds: tuple[int, ...] = (128, 512, 2048)  # prompt-token upper bounds; one more bucket above
    max_queued_requests: int = 512
    max_queued_tokens: int = 1 << 20  # prompt tokens across every queued request
    aging_s: float = 5.0  # every aging_s in the queue counts as one priority level better
    # (priority_at_most, max_wait_s) pairs: a request of priority p gets the first pair with p <= bound.
    # A request still queued after max_wait_s fails with DEADLINE_EXCEEDED. Empty: no limit.
    max_queue_wait_s: tuple[tuple[int, float], ...] = ()
    # Dispatch passes at most once per window (gateway/dispatch_window.py): a request that finds
    # the dispatcher quiet for a window leaves at once; those arriving within a window of the last
    # pass wait out its rest and leave together.
    batch_window_ms: float = 2.0
    max_batch_size: int = 16
    retry_after_ms: int = 1000  # the hint sent with RESOURCE_EXHAUSTED
    # "priority": length buckets x (priority, deadline, arrival); "fifo": one queue in arrival
    # order, priorities ignored (the baseline the benchmark compares against).
    policy: str = "priority"

    def validate(self) -> None:
        _check(self.policy in ("priority", "fifo"), "queues.policy", self.policy, '"priority" or "fifo"')
        bounds = self.bucket_bounds
        _check(all(b >= 1 for b in bounds) and list(bounds) == sorted(set(bounds)), "queues.bucket_bounds",
               bounds, "strictly increasing positive token counts")
        _check(self.max_queued_requests >= 1, "queues.max_queued_requests", self.max_queued_requests, ">= 1")
        _check(self.max_queued_tokens >= 1, "queues.max_queued_tokens", self.max_queued_tokens, ">= 1")
        _check(self.aging_s > 0, "queues.aging_s", self.aging_s, "> 0")
        _check(all(len(p) == 2 and p[1] > 0 for p in self.max_queue_wait_s), "queues.max_queue_wait_s",
               self.max_queue_wait_s, "a list of [priority_at_most, seconds > 0] pairs")
        _check(self.batch_window_ms >= 0, "queues.batch_window_ms", self.batch_window_ms, ">= 0")
        _check(self.max_batch_size >= 1, "queues.max_batch_size", self.max_batch_size, ">= 1")
        _check(self.retry_after_ms >= 0, "queues.retry_after_ms", self.retry_after_ms, ">= 0")

    def max_wait_for(self, priority: int) -> float | None:
        for bound, wait_s in sorted(self.max_queue_wait_s):
            if priority <= bound:
                return float(wait_s)
        return None


DISPATCH_POLICIES = ("cache_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class DispatchConfig:
    """The `[dispatch]` section: which worker each request goes to (gateway/routing.py)."""
    # cache_aware: the worker where the request costs least, in prefill tokens: its tokens not in
    # that worker's prefix cache (the workers report their cached blocks, gateway/prefix_index.py)
    # plus a load term (below); least_loaded: the worker with the most room; round_robin: each
    # batch to the next worker in turn.
    policy: str = "cache_aware"
    # The load term: this many prefill tokens x (tokens the worker holds, queued or running, with
    # the request's) / (its KV cache in tokens). A request continuing a conversation cached on its
    # worker leaves it only when the load there outweighs the history it would recompute elsewhere.
    load_cost_tokens: float = 128.0
    # The same for a request that starts a conversation: its cached prefix is one other
    # conversations share (a system prompt) or it has none. Larger, so new conversations spread
    # over the workers (computing the shared prefix once on each) instead of all joining the ones
    # that hold it.
    new_conversation_load_cost_tokens: float = 1024.0
    # Requests that name a session (GenerateRequest.session_id, the OpenAI API's `user`) and whose
    # prefix no worker caches yet count the worker that served the session last as holding the
    # prompt (it is computing the conversation so far) while it is alive and has room.
    sticky_sessions: bool = True

    def validate(self) -> None:
        _check(self.policy in DISPATCH_POLICIES, "dispatch.policy", self.policy, " or ".join(DISPATCH_POLICIES))
        for name in ("load_cost_tokens", "new_conversation_load_cost_tokens"):
            _check(getattr(self, name) >= 0, f"dispatch.{name}", getattr(self, name), ">= 0")


# `worker.reserved_cores = -1` keeps a core for the gateway from this many usable cores up, where
# one is at most an eighth of the compute; below, sharing the cores costs the workers less than
# giving one up (docs/benchmarks.md, the HTTP API against llama-server).
RESERVE_FROM_CORES = 8


@dataclass(frozen=True)
class WorkerConfig(EngineConfig):
    """The `[worker]` section: the engine's settings (inherited, read by the engine as they are)
    plus the worker process's own: threads and cores, heartbeats, memory watchdog, restarts."""
    # Cores left to the gateway (and whatever else shares the host) when num_threads is 0: a
    # worker's OpenMP threads spin between parallel regions, and a gateway wake-up that
    # deschedules one stalls the whole region (docs/benchmarks.md). In a cluster, num_threads 0
    # means the host's cores less reserved_cores, split evenly between workers. -1: auto
    # (RESERVE_FROM_CORES).
    reserved_cores: int = -1
    # Where the host has the cores (reserved_cores + num_workers x threads), pin each worker to
    # its own cores and the gateway to the reserved ones (shared/cpu_affinity.py).
    pin_cores: bool = True
    max_queued: int = 8  # requests a worker holds waiting beyond max_num_seqs
    heartbeat_interval_s: float = 0.2
    memory_limit_bytes: int = 0  # 0 = the device's memory (CUDA) or the host's (CPU)
    restart_backoff_s: float = 0.5  # supervisor: first delay before a restart, doubled per quick crash
    max_restart_backoff_s: float = 10.0
    cuda_alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF for the model process
    # Large CPU tensors (the weights as the kernels hold them, the KV pools) on 2 MiB transparent
    # huge pages (torch's THP_MEM_ALLOC_ENABLE): a decode step streams every weight, and with 4 KiB
    # pages it takes a TLB miss every 4 KiB of it. Nothing changes where the host's THP is off.
    cpu_huge_pages: bool = True
    # The memory watchdog (worker/watchdog.py): levels as fractions of memory_limit_bytes. A level
    # is entered at its fraction and left below (fraction - memory_hysteresis_fraction).
    memory_high_fraction: float = 0.85  # HIGH: admit nothing new, evict prefix-cache blocks
    memory_critical_fraction: float = 0.95  # CRITICAL: also preempt lowest-priority requests; not ready
    memory_hysteresis_fraction: float = 0.05
    memory_poll_interval_s: float = 1.0  # timer reads (with utilisation), besides one read per step
    # CUDA, at HIGH or above: release the allocator's cached blocks (empty_cache) when
    # reserved - allocated exceeds this; at most once per memory_poll_interval_s. 0 = never.
    empty_cache_fragmentation_bytes: int = 1 << 30
    hung_after_s: float = 10.0  # has work but no step completed for this long: not ready
    # This worker's CURVE keys (gateway.key, worker.key, worker.key_secret); "" = the cluster's
    # own in <run_dir>/keys (see gateway.curve_keys_dir).
    curve_keys_dir: str = ""

    def validate(self) -> None:
        super().validate()
        for name in ("max_queued", "memory_limit_bytes", "empty_cache_fragmentation_bytes"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        _check(self.reserved_cores >= -1, "reserved_cores", self.reserved_cores, ">= 0, or -1 (auto)")
        _check(0 < self.memory_high_fraction < self.memory_critical_fraction <= 1, "memory_high_fraction",
               self.memory_high_fraction, "in (0, memory_critical_fraction), with memory_critical_fraction <= 1")
        _check(0 <= self.memory_hysteresis_fraction < self.memory_high_fraction,
               "memory_hysteresis_fraction", self.memory_hysteresis_fraction, "in [0, memory_high_fraction)")
        for name in ("memory_poll_interval_s", "hung_after_s", "heartbeat_interval_s"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "> 0")
        _check(0 < self.restart_backoff_s <= self.max_restart_backoff_s, "restart_backoff_s",
               self.restart_backoff_s, "in (0, max_restart_backoff_s]")

    def engine_config(self, num_threads: int) -> EngineConfig:
        """The engine's part of this section, with the thread count the cluster chose."""
        values = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        return EngineConfig(**{**values, "num_threads": num_threads})


@dataclass(frozen=True)
class ClusterConfig:
    model_dir: str = "models/default"
    # Workers this cluster launches (honcho start, ClusterProcess): worker-0 .. worker-{n-1}. More
    # may join over the network (`python -m worker.supervisor --connect ...`); 0 = none local.
    num_workers: int = 2
    run_dir: str = ".run"  # ipc:// sockets live here
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    queues: QueueConfig = field(default_factory=QueueConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def validate(self) -> None:
        _check(self.num_workers >= 0, "num_workers", self.num_workers, ">= 0")
        _check(bool(self.model_dir), "model_dir", self.model_dir, "a model folder")
        self.gateway.validate()
        # A worker must heartbeat well within the gateway's timeout, or it reads dead between beats.
        _check(2 * self.worker.heartbeat_interval_s <= self.gateway.heartbeat_timeout_s, "worker.heartbeat_interval_s",
               self.worker.heartbeat_interval_s,
               f"at most half of gateway.heartbeat_timeout_s ({self.gateway.heartbeat_timeout_s:g})")
        self.queues.validate()
        self.dispatch.validate()

    @property
    def worker_ids(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.num_workers)]

    @property
    def worker_endpoint(self) -> str:
        return self.gateway.worker_endpoint or f"ipc://{Path(self.run_dir).resolve()}/gateway.ipc"

    def reserved_cores(self) -> int:
        """Cores kept from the workers' threads: `worker.reserved_cores`, or where that is -1 (auto)
        one on a host with RESERVE_FROM_CORES usable cores or more and none below."""
        if self.worker.reserved_cores >= 0:
            return self.worker.reserved_cores
        return 1 if len(usable_cores()) >= RESERVE_FROM_CORES else 0

    def worker_threads(self) -> int:
        """torch threads per worker: `worker.num_threads`, or the cores this process may run on,
        less the reserved cores, split evenly between the workers (at least one each)."""
        if self.worker.num_threads:
            return self.worker.num_threads
        return max(1, (len(usable_cores()) - self.reserved_cores()) // max(1, self.num_workers))


def usable_cores() -> list[int]:
    """The cores this process may run on, in order: its affinity mask where the platform has
    one (a container or `taskset` may allow fewer cores than the host has)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


# ---- loading and overriding ---------------------------------------------------------------
_SECTIONS = {"gateway": GatewayConfig, "queues": QueueConfig, "dispatch": DispatchConfig, "worker": WorkerConfig}


def _flag_names() -> list[str]:
    names = [f.name for f in fields(ClusterConfig) if f.name not in _SECTIONS]
    for section, cls in _SECTIONS.items():
        names += [f"{section}.{f.name}" for f in fields(cls)]
    return names


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` plus one `--<name>` flag per config value (dotted for sections)."""
    parser.add_argument("--config", type=Path, default=None, help="TOML config file")
    group = parser.add_argument_group("config overrides (TOML literals; plain words are strings)")
    for name in _flag_names():
        spellings = sorted({f"--{name}", f"--{name.replace('_', '-')}"})
        group.add_argument(*spellings, dest=f"cfg:{name}", default=None, metavar="VALUE")


def load_config(path: Path | str | None = None, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Read TOML (if given), apply dotted-name overrides, convert types and validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
    for name, value in (overrides or {}).items():
        *section, key = name.split(".")
        target = data.setdefault(section[0], {}) if section else data
        target[key] = value
    config = _build(ClusterConfig, data, "")
    config.validate()
    return config


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    overrides = {k[4:]: parse_literal(v) for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
    return load_config(args.config, overrides)


def build_section(cls, values: dict[str, Any]):
    """One config class from a table of values, converted and checked as a TOML section is
    (`Engine.from_model_dir`'s overrides take this path)."""
    return _build(cls, values, "")


def _build(cls, data: dict[str, Any], prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a table, got {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown config keys {[prefix + u for u in unknown]}; known: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        if name in _SECTIONS and cls is ClusterConfig:
            values[name] = _build(_SECTIONS[name], value, f"{name}.")
        else:
            values[name] = convert(hints[name], value, prefix + name)
    try:
        return cls(**values)
    except ConfigError as e:  # a section that checks itself when built names keys without its prefix
        raise ConfigError(f"{prefix}{e}") from None
