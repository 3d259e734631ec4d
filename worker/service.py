"""The worker process's loop: take commands off the wire, act on memory, step the engine, send deltas.

Aborts and new work are applied between steps, so an abort takes effect right after the
step in flight. On CUDA every step runs on the worker's own stream. The loop owns the
engine; the heartbeat and watchdog threads only read. Memory (DESIGN.md section 4): the
watchdog reports a level, this loop decides what it calls for, the scheduler and engine act.
A fatal error tells the gateway (WorkerExit) and exits non-zero, so the supervisor restarts us;
so does a model that fails to load, and one that never will (a checkpoint this engine refuses or
cannot read, settings it refuses for this model) exits EXIT_DO_NOT_RESTART (worker/__main__.py),
which its supervisor does not restart.

KV events: after each step (before its outputs) the loop sends the prefix-cache blocks registered
and dropped since the last report (KvEvents, seq 1, 2, ... per incarnation), and a full snapshot when the
gateway asks (KvSnapshotRequest). The heartbeat carries the last seq sent, published only after
the send, so it never reports a seq not yet sent (heartbeats travel on their own socket, so one
can still overtake the report it counts).
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import time
from pathlib import Path
from typing import Callable

import torch

from protos import worker_pb2
from shared.config import ClusterConfig
from shared.curve import WORKER, transport_keys
from shared.engine_config import EngineConfig
from shared.ipc import WorkerSocket, new_incarnation
from shared.model_fingerprint import model_fingerprint
from shared.sampling_params import SamplingParams
from shared.startup_objects import freeze_startup_objects
from shared.wire import logprobs_to_wire, prompt_logprobs_to_wire, sampling_from_wire
from worker.engine import Engine, RequestDelta
from worker.memory import MemoryReader, MemoryReading
from worker.scheduler import RequestRejectedError
from worker.transport import HeartbeatThread, LoadSnapshot, LoopProgress, StaticInfo
from worker.watchdog import MemoryLevel, MemoryStatus, Watchdog

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.05
EXIT_LINGER_MS = 1000  # how long a WorkerExit may take to leave before the process ends
_PROBE_PREFIX = "\x00probe-"  # ids the gateway can never send (it rejects control characters)


def engine_config(config: ClusterConfig) -> EngineConfig:
    """The engine's settings of a cluster's worker: the `[worker]` section as it is, with the
    thread count the cluster gives each worker."""
    return config.worker.engine_config(num_threads=config.worker_threads())


def say_goodbye(socket: WorkerSocket, reason: str, stopping: bool = False, wait: bool = True) -> None:
    """Tell the gateway this process is exiting and why (WorkerExit), then close the socket,
    leaving the frame EXIT_LINGER_MS to go (honoured when the process ends the ZeroMQ context:
    worker/__main__.py). `wait`: for a connection, as WorkerSocket.send."""
    socket.send(worker_pb2.Envelope(exit=worker_pb2.WorkerExit(reason=reason, stopping=stopping)), wait=wait)
    socket.close(linger_ms=EXIT_LINGER_MS)


class WorkerService:
    def __init__(self, config: ClusterConfig, worker_id: str, engine: Engine | None = None,
                 read_memory: Callable[[bool], MemoryReading] | None = None):
        """`engine` and `read_memory` are injectable for tests (a fake reading drives the levels)."""
        # Before the model loads: a worker that may not connect (plain tcp:// refused, keys that
        # do not load) says so at once. Both sockets hold the same keys.
        keys = transport_keys(config, WORKER)
        self.config = config
        self.worker_id = worker_id
        self.incarnation = new_incarnation()
        endpoint = config.worker_endpoint
        try:
            self.engine = engine or Engine.from_model_dir(config.model_dir, engine_config(config))
        except Exception as e:
            # On a socket of its own, unrouted (the gateway reads the id from the frame): the routed
            # socket comes only after the load, so that meanwhile the gateway's sends to this id
            # fail at once, as after a crash, rather than wait here unread.
            say_goodbye(WorkerSocket(endpoint, worker_id, self.incarnation, routed=False, keys=keys),
                        f"cannot load the model in {config.model_dir}: {type(e).__name__}: {e}")
            raise
        self.socket = WorkerSocket(endpoint, worker_id, self.incarnation, keys=keys)
        self.engine.track_kv_events()
        self._kv_seq = 0  # the last KvEvents seq sent by this incarnation
        self.device = self.engine.device
        # The worker's own stream: its kernels never queue behind another context's default stream.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        w = config.worker
        self.memory_reader = MemoryReader(self.device)
        self.watchdog = Watchdog(read_memory or self.memory_reader, w.memory_limit_bytes, w.memory_high_fraction,
                                 w.memory_critical_fraction, w.memory_hysteresis_fraction, w.memory_poll_interval_s)
        self.progress = LoopProgress()
        self.heartbeat = HeartbeatThread(endpoint, worker_id, self.incarnation, w.heartbeat_interval_s,
                                         StaticInfo(max_num_seqs=w.max_num_seqs, max_queued=w.max_queued,
                                                    block_size=self.engine.config.block_size,
                                                    max_model_len=self.engine.max_model_len,
                                                    vocab_size=self.engine.model_config.vocab_size,
                                                    device=str(self.device),
                                                    model_fingerprint=model_fingerprint(config.model_dir),
                                                    model_name=Path(config.model_dir).name),
                                         self.progress, lambda: self.watchdog.status, w.hung_after_s, keys=keys)
        self._probes: dict[str, tuple[int, float, bool]] = {}  # request id -> (probe id, started, report?)
        self._probe_ids = 0
        self._stopping = False
        self._loaded = False  # model loaded and warmed up
        self._level = MemoryLevel.OK  # as last acted on, to log changes once
        self._last_empty_cache_s = float("-inf")

    # ---- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (0) or a fatal error (1, after telling the gateway)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # `kill -USR1 <pid>` writes every thread's stack to stderr (our log): a stuck worker can
        # be diagnosed without a debugger, and faulthandler does it even while the GIL is held.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        self._publish()
        self.heartbeat.start()
        self.watchdog.start()
        reason = None
        try:
            self._warm_up()
            self._loaded = True
            frozen = freeze_startup_objects()
            log.info("%s ready (incarnation %s) on %s; %d startup objects frozen out of garbage collection",
                     self.worker_id, self.incarnation, self.device, frozen)
            while not self._stopping:
                self.run_once()
            self._publish()  # the last heartbeat says draining
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            log.exception("%s: fatal error, exiting", self.worker_id)
        finally:
            self.watchdog.stop()
            # Heartbeats stop before the exit message, so none can make the gateway think us alive after it.
            self.heartbeat.stop(send_last=reason is None)
            self.heartbeat.join(timeout=2)
            # A stop leaves the requests still here unfinished too: the gateway resumes them at once.
            # Where the last heartbeat found no gateway (all of a cluster stopped at once), a stop's
            # word would only wait out the send timeout; a fatal error's reason is worth the wait.
            say_goodbye(self.socket, reason or "stopped on a signal", stopping=reason is None,
                        wait=self.heartbeat.delivered or reason is not None)
        return 0 if reason is None else 1

    def _on_signal(self, signum, _frame) -> None:
        log.info("%s: signal %d, stopping", self.worker_id, signum)
        self._stopping = True

    def _warm_up(self) -> None:
        """One real one-token generation, so the first client request pays no first-call costs."""
        self.engine.generate([[0]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)

    def is_ready(self) -> bool:
        return self._loaded and not self._stopping and self.watchdog.status.level < MemoryLevel.CRITICAL

    # ---- one iteration -----------------------------------------------------------------------
    def run_once(self) -> None:
        engine = self.engine
        timeout = 0.0 if engine.has_unfinished_requests() else IDLE_POLL_S
        for envelope in self.socket.recv_all(timeout):
            self._handle(envelope)
        self._check_memory()
        if engine.has_unfinished_requests():
            self.progress.expect_step()
            started = time.perf_counter()
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                outputs = engine.step()
            if self.stream is not None:
                self.stream.synchronize()  # the sampled ids are read on the host right after
            # Before the outputs: a reply's blocks are in the gateway's index before the client
            # can send the conversation's next turn.
            self._send_kv_events()
            self._emit(outputs, (time.perf_counter() - started) * 1e3)
        # Memory relief evicts between steps too; before _publish, so no heartbeat names an unsent seq.
        self._send_kv_events()
        self.progress.record(engine.has_unfinished_requests())
        self._publish()

    # ---- memory: the loop decides, the scheduler and engine act ------------------------------
    def _check_memory(self) -> None:
        status = self.watchdog.update(self.engine.kv_pool_usage())
        if status.level >= MemoryLevel.HIGH:
            status = self._relieve(status.level)
            self._maybe_empty_cache(status)
            status = self.watchdog.status
        if status.level != self._level:
            log_fn = log.info if status.level < self._level else log.warning
            log_fn("%s: %s", self.worker_id, self.watchdog.describe())
            self._level = status.level
        # Running requests go on; waiting ones wait (one is let in when nothing runs).
        self.engine.set_admission(paused=status.level >= MemoryLevel.HIGH)

    def _relieve(self, level: MemoryLevel) -> MemoryStatus:
        """Free KV blocks until the reading would leave `level`: unreferenced prefix-cache blocks
        first (cheap), then at CRITICAL the lowest-priority running requests (recompute later)."""
        engine, watchdog = self.engine, self.watchdog
        while (excess := watchdog.excess_blocks(level)) > 0:
            if engine.evict_prefix_cache(excess) == 0:
                if level < MemoryLevel.CRITICAL:
                    break
                victim = engine.preempt_lowest()
                if victim is None:
                    break
                log.warning("%s: memory CRITICAL, preempted %r (priority %d)", self.worker_id, victim.request_id,
                            victim.priority)
            watchdog.update_kv(engine.kv_pool_usage())
        return watchdog.status

    def _maybe_empty_cache(self, status: MemoryStatus) -> None:
        """Hand the allocator's cached blocks back when fragmentation is large: between steps and at
        most once per poll interval, since the allocations that follow pay for it."""
        w, now = self.config.worker, time.monotonic()
        threshold = w.empty_cache_fragmentation_bytes
        if (not threshold or status.reading.fragmentation_bytes < threshold
                or now - self._last_empty_cache_s < w.memory_poll_interval_s):
            return
        self._last_empty_cache_s = now
        self.engine.empty_device_cache()
        self.watchdog.update(self.engine.kv_pool_usage())

    # ---- commands ----------------------------------------------------------------------------
    def _handle(self, envelope: worker_pb2.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        if kind == "submit":
            rejected = [self._submit(r) for r in envelope.submit.requests]
            rejected = [d for d in rejected if d is not None]
            if rejected:
                self.socket.send(worker_pb2.Envelope(outputs=worker_pb2.StepOutputs(deltas=rejected)))
        elif kind == "abort":
            for request_id in envelope.abort.request_ids:
                self.engine.abort(request_id)
        elif kind == "probe":
            self._probe(envelope.probe)
        elif kind == "kv_snapshot_request":
            self._send_kv_snapshot()
        else:
            log.warning("%s: ignoring a %s message", self.worker_id, kind)

    def _submit(self, wire: worker_pb2.WireRequest) -> worker_pb2.TokenDelta | None:
        try:
            params = sampling_from_wire(wire.sampling)
            self.engine.add_request(wire.request_id, list(wire.prompt_token_ids), params, priority=wire.priority,
                                    output_token_ids=list(wire.output_token_ids))
        except (RequestRejectedError, ValueError) as e:
            return worker_pb2.TokenDelta(request_id=wire.request_id, finished=True, finish_reason="error",
                                         error=str(e), num_prompt_tokens=len(wire.prompt_token_ids))
        return None

    def _probe(self, probe: worker_pb2.Probe) -> None:
        started = time.perf_counter()
        if not probe.deep:
            report = self.memory_report() if probe.memory_report else ""
            self._reply_probe(probe.probe_id, started, ok=self.is_ready(), memory_report=report)
            return
        self._probe_ids += 1
        request_id = f"{_PROBE_PREFIX}{self._probe_ids}"
        self._probes[request_id] = (probe.probe_id, started, probe.memory_report)
        self.engine.add_request(request_id, [0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                priority=-(2**31))

    def memory_report(self) -> str:
        """The watchdog's view, the allocator's full report (CUDA) or the resident set (CPU), and
        the KV pool's layout."""
        self.watchdog.update(self.engine.kv_pool_usage(), detailed=True)
        return "\n".join([self.watchdog.describe(), self.memory_reader.report(), self.engine.describe_kv_pool()])

    def _reply_probe(self, probe_id: int, started: float, ok: bool, error: str = "", memory_report: str = "") -> None:
        self.socket.send(worker_pb2.Envelope(probe_reply=worker_pb2.ProbeReply(
            probe_id=probe_id, ok=ok, error=error, latency_ms=(time.perf_counter() - started) * 1e3,
            memory_report=memory_report)))

    # ---- outputs -----------------------------------------------------------------------------
    def _emit(self, outputs: list[RequestDelta], step_ms: float) -> None:
        deltas = []
        for out in outputs:
            if out.request_id in self._probes:
                if out.finished:
                    probe_id, started, report = self._probes.pop(out.request_id)
                    self._reply_probe(probe_id, started, ok=out.finish_reason == "length", error=out.error or "",
                                      memory_report=self.memory_report() if report else "")
                continue
            delta = worker_pb2.TokenDelta(
                request_id=out.request_id, new_token_ids=out.new_token_ids, finished=out.finished,
                finish_reason=out.finish_reason or "", error=out.error or "",
                num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                worker_queue_ms=out.worker_queue_ms, prefill_ms=out.prefill_ms,
                num_draft_tokens=out.num_draft_tokens, num_accepted_draft_tokens=out.num_accepted_draft_tokens,
                num_preemptions=out.num_preemptions, peak_kv_blocks=out.peak_kv_blocks)
            if out.new_logprobs:
                delta.logprobs.extend(logprobs_to_wire(out.new_logprobs, out.new_top_logprobs))
            if out.prompt_logprobs:
                delta.prompt_logprobs.extend(prompt_logprobs_to_wire(out.prompt_logprobs))
            deltas.append(delta)
        if deltas:
            self.socket.send(worker_pb2.Envelope(outputs=worker_pb2.StepOutputs(deltas=deltas, step_ms=step_ms)))

    # ---- KV events: what the prefix cache holds, for the gateway's routing ------------------
    def _send_kv_events(self) -> None:
        """One report of the blocks registered and dropped since the last, if there were any."""
        stored, removed = self.engine.drain_kv_events()
        if stored or removed:
            self._send_kv(stored=stored, removed=removed)

    def _send_kv_snapshot(self) -> None:
        """Every cached block; the changes not yet reported are in it, so they are dropped."""
        self.engine.drain_kv_events()
        self._send_kv(snapshot=True, stored=self.engine.cached_block_hashes())

    def _send_kv(self, **fields) -> None:
        # The seq advances even when the send is dropped: the gap tells the gateway to ask for a snapshot.
        self._kv_seq += 1
        self.socket.send(worker_pb2.Envelope(kv_events=worker_pb2.KvEvents(
            seq=self._kv_seq, block_size=self.engine.config.block_size, **fields)))

    def _publish(self) -> None:
        stats = self.engine.stats()
        self.heartbeat.snapshot = LoadSnapshot(
            is_loaded=self._loaded, is_draining=self._stopping, num_running=stats.num_running,
            num_waiting=stats.num_waiting, kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_free=stats.kv_blocks_free, kv_blocks_cached=stats.kv_blocks_cached,
            num_prefix_query_tokens=stats.num_prefix_query_tokens, num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
            num_preemptions=stats.num_preemptions, num_steps=stats.num_steps,
            num_oom_recoveries=stats.num_oom_recoveries, num_spec_drafts=stats.num_spec_drafts,
            num_spec_draft_tokens=stats.num_spec_draft_tokens,
            num_spec_accepted_tokens=stats.num_spec_accepted_tokens, kv_events_seq=self._kv_seq)
