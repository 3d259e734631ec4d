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

__all__ = ["ClusterConfig", "ConfigError", "DispatchConfig", "EngineConfig", "GatewayConfig", "QueueConfig",
           "WorkerConfig", "add_config_flags", "build_section", "config_from_args", "load_config", "usable_cores"]


@dataclass(frozen=True)
class GatewayConfig:
    # Loopback by default: a gateway reachable from other hosts must say who may call it
    # (api_keys_file / INFERENCE_API_KEY) or that anyone may (allow_unauthenticated).
    host: str = "127.0.0.1"
    port: int = 50051
    worker_endpoint: str = ""  # "" = ipc://<run_dir>/gateway.ipc; tcp://host:port by config
    heartbeat_timeout_s: float = 1.0  # no heartbeat for this long: the worker is dead
    drain_grace_s: float = 30.0  # SIGTERM: how long in-flight streams may run on
    default_max_tokens: int = 64  # a prompt's (gRPC, /v1/completions) that sets none
    # A chat's (messages: gRPC, /v1/chat/completions) that sets none; 0 = as many as fit, the rest
    # of the model's context within the largest live worker's KV pool (OpenAI's and vLLM's default).
    chat_default_max_tokens: int = 0
    request_timeout_s: float = 0.0  # 0 = only the client's own deadline applies
    max_concurrent_streams: int = 1024
    metrics_port: int = 8000  # Prometheus /metrics over HTTP; 0 = off
    metrics_host: str = "127.0.0.1"
    probe_timeout_s: float = 10.0  # ProbeWorker: how long to wait for the worker's reply
    # Tokens per GenerateResponse (as vLLM's and SGLang's --stream-interval): 1 streams every token
    # as it comes; N > 1 holds a stream's tokens until N are ready, the request ends, or
    # stream_hold_ms passes. The first token always leaves at once. Larger N trades streaming
    # granularity for host CPU: gRPC's cost is per message, on the gateway and on the client.
    stream_interval: int = 1
    stream_hold_ms: float = 50.0
    # Request size bounds, checked before any tokenizing or rendering: every size a client picks
    # is bounded before work is done on it. gRPC's message limit follows them (gateway/listen.py
    # max_request_bytes: 4 bytes a character they count, plus framing; about 17 MB by default).
    max_prompt_chars: int = 4 << 20
    max_chat_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string; a stream holds back at most this much text
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024  # logit_bias entries
    max_schema_bytes: int = 64 << 10  # a structured-output constraint's text (schema, regex, grammar, choices)
    # Threads that tokenize large prompts and render chat templates off the event loop.
    tokenizer_threads: int = 2
    # A stream whose worker died waits this long (never past its deadline) for a live worker
    # before it fails UNAVAILABLE: a restarted worker is often back within seconds. Not while the
    # gateway drains and every worker said it was stopping: none is coming back.
    resume_grace_s: float = 5.0
    # `python -m gateway --supervise`: first delay before restarting a gateway that exited, doubled
    # per quick crash up to worker.max_restart_backoff_s. A gateway loads no model, so it restarts
    # sooner than a worker: clients are refused for as long as it is down.
    restart_backoff_s: float = 0.1
    # The OpenAI-compatible HTTP API (gateway/http_api.py) on `host`; 0 turns it off.
    http_port: int = 8080
    # Let several gateway processes on this host share `port` and `http_port` (SO_REUSEPORT): the
    # kernel spreads new connections over them, not requests (docs/deployment.md). Each keeps its
    # own metrics_port and worker_endpoint, which must differ. Off: a taken port fails the start.
    reuse_port: bool = False
    served_model_name: str = ""  # the `model` clients name; "" = the model folder's name
    # How tool_choice "auto" reads calls out of the model's text (gateway/tool_parsers.py): "auto" =
    # the format the chat template teaches; "hermes", "llama3_json"; "none" = refuse "auto".
    tool_call_parser: str = "auto"
    max_body_bytes: int = 16 << 20  # an HTTP body beyond this is refused 413 before it is parsed
    # An HTTP body's JSON is parsed on the event loop, at a cost per value (each token id, each
    # logit_bias entry): a body of more values is refused 413 before it is parsed.
    max_body_values: int = 1 << 20
    # An HTTP request's head (request line and headers) at most this long (431), and arriving
    # within read_timeout_s, as must each chunk of its body (408 / the connection closed); a gRPC
    # connection's handshake and a metrics scrape's request get as long.
    max_header_bytes: int = 64 << 10
    read_timeout_s: float = 20.0
    # Connections open at once on each public port (gRPC, HTTP): one more is closed at once (HTTP:
    # answered 503 first), so a flood of connections cannot take the file descriptors every stream
    # and worker socket needs. The gateway raises its open-files limit to fit, up to the hard limit.
    max_connections: int = 4096
    # Browser pages of these origins may call the HTTP API (CORS; "*" = any); () = none. A
    # preflight is answered before the key check, which still holds for the call itself.
    cors_allow_origins: tuple[str, ...] = ()
    max_n: int = 16  # choices per request (`n`)
    max_prompts: int = 256  # prompts per /v1/completions request (a list of prompts)
    # Who may call (gateway/auth.py, docs/security.md): one key per line with its name, role and
    # limits; or the INFERENCE_API_KEY environment variable for a single (admin) key. No keys:
    # anyone who can reach the ports may call, which a non-loopback host refuses unless
    # allow_unauthenticated.
    api_keys_file: str = ""
    allow_unauthenticated: bool = False
    # TLS for gRPC and HTTP: both files (PEM) turn it on; a client CA also requires clients to
    # present a certificate it signed.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Who may join as a worker (shared/curve.py): ZeroMQ CURVE keys in zmq.auth's format
    # (tools/curve_keys.py writes them); "" = the cluster's own pair in <run_dir>/keys, made at
    # first start. Plain tcp:// without keys is refused unless allow_insecure_tcp.
    curve_keys_dir: str = ""
    allow_insecure_tcp: bool = False
    # A worker that joined by itself (not one of the num_workers this cluster launches) and has
    # been dead this long leaves the worker table, the status RPC, health and metrics.
    forget_worker_after_s: float = 30.0

    def validate(self) -> None:
        _check(0 <= self.port < 65536, "gateway.port", self.port, "in [0, 65535]")
        _check(0 <= self.http_port < 65536, "gateway.http_port", self.http_port, "in [0, 65535]")
        for name in ("max_body_bytes", "max_n", "max_prompts", "max_body_values", "max_header_bytes",
                     "max_connections", "max_prompt_chars", "max_chat_messages", "max_stop_chars",
                     "tokenizer_threads", "max_schema_bytes", "default_max_tokens", "stream_interval",
                     "max_concurrent_streams"):
            _check(getattr(self, name) >= 1, f"gateway.{name}", getattr(self, name), ">= 1")
        for name in ("read_timeout_s", "restart_backoff_s", "heartbeat_timeout_s", "probe_timeout_s",
                     "stream_hold_ms"):
            _check(getattr(self, name) > 0, f"gateway.{name}", getattr(self, name), "> 0")
        for name in ("max_stop_strings", "max_stop_token_ids", "max_logit_bias", "resume_grace_s", "drain_grace_s",
                     "request_timeout_s"):
            _check(getattr(self, name) >= 0, f"gateway.{name}", getattr(self, name), ">= 0")
        _check(self.forget_worker_after_s >= self.heartbeat_timeout_s, "gateway.forget_worker_after_s",
               self.forget_worker_after_s, ">= gateway.heartbeat_timeout_s")
        _check(self.tool_call_parser in ("auto", "none", "hermes", "llama3_json"), "gateway.tool_call_parser",
               self.tool_call_parser, "one of auto, none, hermes, llama3_json")
        _check(self.chat_default_max_tokens >= 0, "gateway.chat_default_max_tokens", self.chat_default_max_tokens,
               ">= 0 (0 = the rest of the context)")
        _check(0 <= self.metrics_port < 65536, "gateway.metrics_port", self.metrics_port, "in [0, 65535]")
        _check(bool(self.tls_cert_file) == bool(self.tls_key_file), "gateway.tls_cert_file", self.tls_cert_file,
               "set together with gateway.tls_key_file")
        _check(not self.tls_client_ca_file or bool(self.tls_cert_file), "gateway.tls_client_ca_file",
               self.tls_client_ca_file, "used with gateway.tls_cert_file and tls_key_file")


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
