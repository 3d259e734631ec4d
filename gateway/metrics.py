"""Prometheus metrics of the gateway, names modelled on vLLM's (`inference_` instead of `vllm:`).

Everything is observed in the gateway from its own clock or from durations a worker
reported; worker counters arrive cumulative per incarnation in heartbeats and are turned
into monotonic Prometheus counters here. One registry per Metrics object, so tests can
run several gateways in one process.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase

from gateway.listen import metrics_taken
from protos import worker_pb2

# Sub-100 ms resolution for per-token latencies, seconds to minutes for whole requests.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1,
                     0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
MEMORY_LEVELS = {"OK": 0, "HIGH": 1, "CRITICAL": 2}
_WORKER_COUNTERS = {  # heartbeat field -> metric attribute
    "num_prefix_query_tokens": "prefix_cache_queries",
    "num_prefix_hit_tokens": "prefix_cache_hits",
    "num_preemptions": "preemptions",
    "num_oom_recoveries": "oom_recoveries",
    "num_spec_drafts": "spec_drafts",
    "num_spec_draft_tokens": "spec_draft_tokens",
    "num_spec_accepted_tokens": "spec_accepted_tokens",
}


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        w, b = ["worker"], ["bucket"]
        self.requests_running = Gauge("inference_num_requests_running", "Requests running on a worker.", w,
                                      registry=r)
        self.requests_waiting = Gauge("inference_num_requests_waiting", "Requests waiting on a worker.", w,
                                      registry=r)
        self.requests_queued = Gauge("inference_num_requests_queued", "Requests in the gateway queue.", b,
                                     registry=r)
        self.kv_usage = Gauge("inference_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", w,
                              registry=r)
        self.worker_up = Gauge("inference_worker_up", "1 while the worker's heartbeats are fresh.", w, registry=r)
        self.worker_ready = Gauge("inference_worker_ready", "1 while the worker is ready for work.", w, registry=r)
        self.memory_bytes = Gauge("inference_worker_memory_bytes", "Worker memory by kind.", ["worker", "kind"],
                                  registry=r)
        self.memory_level = Gauge("inference_worker_memory_level", "Watchdog level: 0 OK, 1 HIGH, 2 CRITICAL.", w,
                                  registry=r)
        self.utilization = Gauge("inference_worker_utilization_percent", "GPU (NVML) or process CPU percent.", w,
                                 registry=r)
        self.prefix_cache_queries = Counter("inference_prefix_cache_queries", "Prompt tokens looked up in the "
                                            "prefix cache.", w, registry=r)
        self.prefix_cache_hits = Counter("inference_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                         w, registry=r)
        self.preemptions = Counter("inference_num_preemptions", "Requests preempted (recompute).", w, registry=r)
        self.oom_recoveries = Counter("inference_oom_recoveries", "Out-of-memory errors survived in a forward.", w,
                                      registry=r)
        # Speculative decoding by prompt lookup (vLLM's spec_decode counters); acceptance rate =
        # accepted / draft tokens, tokens per verified draft = 1 + accepted / drafts.
        self.spec_drafts = Counter("inference_spec_decode_num_drafts", "Drafts verified (decode steps of a "
                                   "request that proposed tokens).", w, registry=r)
        self.spec_draft_tokens = Counter("inference_spec_decode_num_draft_tokens", "Draft tokens verified.", w,
                                         registry=r)
        self.spec_accepted_tokens = Counter("inference_spec_decode_num_accepted_tokens", "Draft tokens that "
                                            "sampling confirmed (taken without a step of their own).", w,
                                            registry=r)
        self.worker_restarts = Counter("inference_worker_restarts", "New incarnations of a worker.", w, registry=r)
        self.routing = Counter("inference_routing_decisions", "Requests dispatched, by how their worker was "
                               "chosen: cache_hit (the longest cached prefix), balanced (the worker with the "
                               "longest cached prefix lost on load), sticky (the session's worker), spread (the "
                               "most room).",
                               ["outcome"], registry=r)
        self.predicted_cached_tokens = Counter("inference_routing_predicted_cached_tokens", "Prompt tokens the "
                                               "prefix index expected the chosen worker to find cached.", w,
                                               registry=r)
        self.reported_cached_tokens = Counter("inference_routing_reported_cached_tokens", "Prompt tokens the worker "
                                              "reported it found cached, for the same requests.", w, registry=r)
        self.workers_refused = Counter("inference_workers_refused", "Worker incarnations refused, by reason "
                                       "(model: it serves another model than the gateway).", ["reason"],
                                       registry=r)
        self.kv_snapshots = Counter("inference_kv_snapshot_requests", "KV-cache snapshots asked of a worker (its "
                                    "events were lost or out of order).", w, registry=r)
        self.prompt_tokens = Counter("inference_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("inference_generation_tokens", "Generated tokens streamed.", registry=r)
        self.request_success = Counter("inference_request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_status = Counter("inference_request_status", "Finished RPCs by gRPC status.", ["code"],
                                      registry=r)
        self.rejections = Counter("inference_request_rejections", "Requests refused before queueing, by reason.",
                                  ["reason"], registry=r)
        self.resumptions = Counter("inference_request_resumptions", "Requests resumed on another worker.",
                                   registry=r)
        self.http_connections_refused = Counter("inference_http_connections_refused", "HTTP connections "
                                                "answered 503 and closed as they opened: gateway.max_connections "
                                                "were open.", registry=r)

        def histogram(name: str, doc: str, labels=b) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS_S, registry=r)

        self.ttft = histogram("inference_time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inference_inter_token_latency_seconds", "Between streamed tokens.")
        self.e2e = histogram("inference_e2e_request_latency_seconds", "Arrival to the last message.")
        self.queue_time = histogram("inference_request_queue_time_seconds", "Time in the gateway queue.")
        self.prefill_time = histogram("inference_request_prefill_time_seconds", "Worker: first step to first token.")
        self.decode_time = histogram("inference_request_decode_time_seconds", "First token to the last.")
        self.loop_lag = histogram("inference_gateway_event_loop_lag_seconds", "How late the gateway's event loop "
                                  "runs a short periodic timer: what a stream or heartbeat waits for it.", labels=())
        self._last_counts: dict[tuple[str, str], tuple[str, int]] = {}

    def count_indexed_blocks(self, worker_ids: Callable[[], Iterable[str]], num_blocks: Callable[[str], int]) -> None:
        """`inference_prefix_index_blocks{worker}`, read from the prefix index at each scrape, so a
        worker whose blocks the index forgot (dead, restarted) reads 0 at once."""
        self.registry.register(_IndexedBlocks(worker_ids, num_blocks))

    def serve(self, port: int, host: str = "0.0.0.0", read_timeout_s: float = 20.0) -> None:
        """/metrics on host:port, a thread per connection (prometheus_client's server), each ended
        once its client is idle for `read_timeout_s`, so idle connections cannot pile threads up."""
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise metrics_taken(host, port, e) from None
        server.RequestHandlerClass = type("TimedMetricsHandler", (_TimedHandler, server.RequestHandlerClass),
                                          {"timeout": read_timeout_s})

    # ---- workers ---------------------------------------------------------------------------------
    def on_heartbeat(self, worker_id: str, incarnation: str, hb: worker_pb2.Heartbeat) -> None:
        self.requests_running.labels(worker_id).set(hb.num_running)
        self.requests_waiting.labels(worker_id).set(hb.num_waiting)
        if hb.kv_blocks_total:
            self.kv_usage.labels(worker_id).set(1 - hb.kv_blocks_free / hb.kv_blocks_total)
        for kind in ("allocated", "reserved", "peak", "resident"):
            self.memory_bytes.labels(worker_id, kind).set(getattr(hb, f"memory_{kind}_bytes"))
        self.memory_bytes.labels(worker_id, "used").set(hb.memory_used_bytes)
        self.memory_level.labels(worker_id).set(MEMORY_LEVELS.get(hb.memory_level, 0))
        self.utilization.labels(worker_id).set(hb.utilization_percent)
        for field, attr in _WORKER_COUNTERS.items():
            self._add_cumulative(getattr(self, attr), worker_id, incarnation, field, getattr(hb, field))

    def _add_cumulative(self, counter: Counter, worker_id: str, incarnation: str, field: str, value: int) -> None:
        last_incarnation, last = self._last_counts.get((worker_id, field), (incarnation, 0))
        delta = value if last_incarnation != incarnation else value - last
        if delta > 0:
            counter.labels(worker_id).inc(delta)
        self._last_counts[(worker_id, field)] = (incarnation, value)

    def forget_worker(self, worker_id: str) -> None:
        """A worker that left: its series go, so /metrics lists the live set."""
        for metric in [m for m in vars(self).values() if isinstance(m, MetricWrapperBase)]:
            names = getattr(metric, "_labelnames", ())
            if "worker" not in names:
                continue
            position = names.index("worker")
            for labels in [k for k in list(getattr(metric, "_metrics", {})) if k[position] == worker_id]:
                metric.remove(*labels)
        self._last_counts = {k: v for k, v in self._last_counts.items() if k[0] != worker_id}

    def on_cache_prediction(self, worker_id: str, predicted: int, reported: int) -> None:
        self.predicted_cached_tokens.labels(worker_id).inc(predicted)
        self.reported_cached_tokens.labels(worker_id).inc(reported)

    def on_liveness(self, worker_id: str, alive: bool, ready: bool) -> None:
        self.worker_up.labels(worker_id).set(int(alive))
        self.worker_ready.labels(worker_id).set(int(ready))


class _IndexedBlocks:
    """A collector: the prefix index's blocks per worker, as the index holds them when scraped."""

    def __init__(self, worker_ids: Callable[[], Iterable[str]], num_blocks: Callable[[str], int]):
        self._worker_ids, self._num_blocks = worker_ids, num_blocks

    def collect(self):
        family = GaugeMetricFamily("inference_prefix_index_blocks", "Prefix-cache blocks the gateway's index holds "
                                   "for the worker.", labels=["worker"])
        for worker_id in self._worker_ids():
            family.add_metric([worker_id], self._num_blocks(worker_id))
        yield family


class _TimedHandler:
    """Mixed into prometheus_client's request handler: a read past its `timeout` ends the connection
    quietly (the stdlib server would print a traceback for it)."""

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:
            pass
