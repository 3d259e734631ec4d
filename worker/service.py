"""The worker process's loop: take commands off the wire, step the engine, send the deltas.

Aborts and new work are applied between steps, so an abort takes effect right after the
step in flight. On CUDA every step runs on the worker's own stream. The loop owns the
engine; the heartbeat thread only reads the snapshot the loop publishes.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import time

import torch

from protos import worker_pb2
from shared.config import ClusterConfig
from shared.ipc import WorkerSocket, new_incarnation
from shared.wire import sampling_from_wire
from worker.engine import Engine, RequestOutput
from worker.memory import read_memory
from worker.scheduler import RequestRejectedError
from worker.transport import HeartbeatThread, LoadSnapshot, StaticInfo

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.05
_PROBE_PREFIX = "\x00probe-"  # ids the gateway can never send (it rejects control characters)


def engine_overrides(config: ClusterConfig) -> dict:
    w = config.worker
    return dict(device=w.device, dtype=w.dtype or None, block_size=w.block_size,
                num_kv_blocks=w.num_kv_blocks or None, kv_cache_bytes=w.kv_cache_bytes,
                gpu_memory_utilization=w.gpu_memory_utilization, max_num_seqs=w.max_num_seqs,
                max_num_batched_tokens=w.max_num_batched_tokens, max_model_len=w.max_model_len or None,
                max_prefill_chunk_tokens=w.max_prefill_chunk_tokens or None,
                enable_prefix_caching=w.enable_prefix_caching, num_threads=config.worker_threads())


class WorkerService:
    def __init__(self, config: ClusterConfig, worker_id: str, engine: Engine | None = None):
        self.config = config
        self.worker_id = worker_id
        self.engine = engine or Engine.from_model_dir(config.model_dir, **engine_overrides(config))
        self.device = self.engine.device
        # The worker's own stream: its kernels never queue behind another context's default stream.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.incarnation = new_incarnation()
        endpoint = config.worker_endpoint
        self.socket = WorkerSocket(endpoint, worker_id, self.incarnation)
        self.heartbeat = HeartbeatThread(endpoint, worker_id, self.incarnation, config.worker.heartbeat_interval_s,
                                         StaticInfo(max_num_seqs=config.worker.max_num_seqs,
                                                    max_queued=config.worker.max_queued,
                                                    block_size=self.engine.config.block_size,
                                                    max_model_len=self.engine.max_model_len,
                                                    vocab_size=self.engine.model_config.vocab_size,
                                                    device=str(self.device)))
        self._probes: dict[str, tuple[int, float]] = {}
        self._probe_ids = 0
        self._stopping = False
        self._ready = False

    # ---- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._publish()
        self.heartbeat.start()
        self._warm_up()
        self._ready = True
        log.info("%s ready (incarnation %s) on %s", self.worker_id, self.incarnation, self.device)
        try:
            while not self._stopping:
                self.run_once()
        finally:
            self.heartbeat.stop()
            self.heartbeat.join(timeout=2)
            self.socket.close()
        return 0

    def _on_signal(self, signum, _frame) -> None:
        log.info("%s: signal %d, stopping", self.worker_id, signum)
        self._stopping = True

    def _warm_up(self) -> None:
        """One real one-token generation, so the first client request pays no first-call costs."""
        from shared.sampling_params import SamplingParams
        self.engine.generate([[0]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)

    # ---- one iteration -----------------------------------------------------------------------
    def run_once(self) -> None:
        timeout = 0.0 if self.engine.has_unfinished_requests() else IDLE_POLL_S
        for envelope in self.socket.recv_all(timeout):
            self._handle(envelope)
        if self.engine.has_unfinished_requests():
            started = time.perf_counter()
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                outputs = self.engine.step()
            if self.stream is not None:
                self.stream.synchronize()  # the sampled ids are read on the host right after
            self._emit(outputs, (time.perf_counter() - started) * 1e3)
        self._publish()

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
        if not probe.deep:
            self._reply_probe(probe.probe_id, time.perf_counter(), ok=self._ready)
            return
        from shared.sampling_params import SamplingParams
        self._probe_ids += 1
        request_id = f"{_PROBE_PREFIX}{self._probe_ids}"
        self._probes[request_id] = (probe.probe_id, time.perf_counter())
        self.engine.add_request(request_id, [0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                priority=-(2**31))

    def _reply_probe(self, probe_id: int, started: float, ok: bool, error: str = "") -> None:
        self.socket.send(worker_pb2.Envelope(probe_reply=worker_pb2.ProbeReply(
            probe_id=probe_id, ok=ok, error=error, latency_ms=(time.perf_counter() - started) * 1e3)))

    def _emit(self, outputs: list[RequestOutput], step_ms: float) -> None:
        deltas = []
        for out in outputs:
            if out.request_id in self._probes:
                if out.finished:
                    probe_id, started = self._probes.pop(out.request_id)
                    self._reply_probe(probe_id, started, ok=out.finish_reason == "length", error=out.error or "")
                continue
            deltas.append(worker_pb2.TokenDelta(
                request_id=out.request_id, new_token_ids=out.new_token_ids, finished=out.finished,
                finish_reason=out.finish_reason or "", error=out.error or "",
                num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens))
        if deltas:
            self.socket.send(worker_pb2.Envelope(outputs=worker_pb2.StepOutputs(deltas=deltas, step_ms=step_ms)))

    def _publish(self) -> None:
        engine = self.engine
        blocks = engine.block_manager
        memory = read_memory(self.device, self.config.worker.memory_limit_bytes)
        self.heartbeat.snapshot = LoadSnapshot(
            ready=self._ready and not self._stopping, num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting), kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free_blocks, kv_blocks_cached=blocks.num_evictable_blocks,
            memory_used_bytes=memory.used_bytes, memory_limit_bytes=memory.limit_bytes, memory_level=memory.level)
