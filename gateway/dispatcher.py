"""The dispatcher: queued requests out to workers in batches, worker deltas back to streams.

It owns the queue, the table of live requests and the ZeroMQ socket; requests are known here
and on the wire by their internal ids only (gateway/request_table.py). Batches come from one
length bucket, go to the worker the routing policy picks for them (gateway/routing.py: by default
the one whose prefix cache holds the longest prefix of the prompt, as the workers' KV events
report it to the prefix index), and never exceed what that worker said it can take. A batch
window's requests may split across workers. A worker that dies (silent heartbeats, or a new
incarnation) has its requests requeued at the front and resumed elsewhere from the tokens
already streamed; with no live worker left they wait up to `gateway.resume_grace_s` (never past
their deadlines) for one to come back, then end UNAVAILABLE; at once when the gateway drains
and every worker left stopping (the whole cluster shutting down: none is coming back).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable

import grpc

from gateway.dispatch_window import DispatchWindow
from gateway.loop_lag import LoopLag
from gateway.metrics import Metrics
from gateway.model_check import ModelCheck
from gateway.prefix_index import PrefixIndex
from gateway.queues import LengthBucketedQueue, QueuedItem
from gateway.request_table import DuplicateRequestError, RequestTable
from gateway.routing import Route, Router
from gateway.streams import RequestState
from gateway.worker_probes import WorkerProbes
from gateway.workers import WorkerHandle, WorkerRegistry
from protos import worker_pb2
from shared.config import ClusterConfig
from shared.ipc import GatewaySocket, WireError, bind_gateway_socket, decode

log = logging.getLogger(__name__)
MONITOR_INTERVAL_S = 0.05
LOOP_LAG_INTERVAL_S = 0.02


class Dispatcher:
    def __init__(self, config: ClusterConfig, on_workers_changed: Callable[[], None] = lambda: None,
                 metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        q = config.queues
        self.queue: LengthBucketedQueue[RequestState] = LengthBucketedQueue(
            q.bucket_bounds, q.aging_s, q.max_queued_requests, q.max_queued_tokens, fifo=q.policy == "fifo")
        # A stall of a quarter of the heartbeat timeout can delay reading heartbeats by no more than
        # the timeout leaves to spare beyond the heartbeat interval; a longer one restarts the count.
        self.loop_lag = LoopLag(LOOP_LAG_INTERVAL_S, config.gateway.heartbeat_timeout_s / 4,
                                self.metrics.loop_lag.observe)
        self.registry = WorkerRegistry(config.worker_ids, config.gateway.heartbeat_timeout_s,
                                       heard_since=self.loop_lag.heard_since)
        self.model_check = ModelCheck(config.model_dir)
        self.requests = RequestTable()  # every request not yet finished, by internal id
        self._no_live_worker_since_s: float | None = time.monotonic()
        self._draining = False
        self.socket: GatewaySocket | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._on_workers_changed = on_workers_changed
        self._liveness: dict[str, tuple[bool, bool]] = {}
        self.probes = WorkerProbes(lambda worker_id, envelope: self.socket.send(worker_id, envelope))
        self.prefix_index = PrefixIndex()
        self.router = Router(config.dispatch, self.prefix_index)
        self.metrics.count_indexed_blocks(lambda: list(self.registry.workers), self.prefix_index.num_blocks)
        # Label lookups cost more than the observation itself: resolve each bucket's once.
        self._itl_by_bucket = [self.metrics.itl.labels(str(b)) for b in range(len(q.bucket_bounds) + 1)]

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.socket = bind_gateway_socket(self.config)  # CURVE keys by shared/curve.py's policy
        self._tasks = [asyncio.create_task(coro, name=name) for name, coro in
                       (("recv", self._recv_loop()), ("dispatch", self._dispatch_loop()),
                        ("monitor", self._monitor_loop()), ("loop-lag", self.loop_lag.run()))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.socket is not None:
            self.socket.close()

    # ---- called by the servicer ------------------------------------------------------------------
    def submit(self, state: RequestState) -> None:
        """Queue a validated request; raises QueueFullError at the queue's bounds and
        DuplicateRequestError when a live request already has its client id."""
        if self.requests.is_live(state.request_id, state.owner):  # checked before the queue takes it
            raise DuplicateRequestError(state.request_id)
        item = QueuedItem(request_id=state.internal_id, num_tokens=len(state.prompt_ids), priority=state.priority,
                          arrival_s=state.arrival_s, deadline_s=state.deadline_s,
                          max_wait_s=self.config.queues.max_wait_for(state.priority), payload=state)
        self.queue.push(item)
        state.bucket = self.queue.bucket_of(item.num_tokens)
        self.requests.add(state)
        self._wake.set()

    def cancel(self, internal_id: str, reason: str = "abort") -> bool:
        """Stop a request wherever it is; its worker frees its blocks after the current step."""
        state = self.requests.pop(internal_id)
        if state is None:
            return False
        self.queue.remove(internal_id)
        if state.worker_id is not None:
            self.registry.release(state.worker_id, internal_id)
            self._send_abort(state.worker_id, [internal_id])
        state.finish(reason, time.monotonic())
        return True

    def cancel_by_client_id(self, request_id: str, owner: str = "") -> bool:
        """Abort the live request that the client (API key `owner`) calls `request_id`, if there is one."""
        state = self.requests.by_client(request_id, owner)
        return state is not None and self.cancel(state.internal_id)

    def begin_drain(self) -> None:
        """The gateway is stopping: once every worker has left stopping too, requests left with no
        live worker fail at once rather than wait out the resume grace."""
        self._draining = True
        self._check_liveness(time.monotonic())

    def _all_workers_stopped(self) -> bool:
        """The gateway drains and no worker is coming back (a crashed one would: it keeps the grace)."""
        return self._draining and self.registry.all_stopping()

    def has_live_worker(self) -> bool:
        return bool(self.registry.live(time.monotonic()))

    # ---- worker -> gateway ---------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            for frame in await self.socket.recv_frames():
                try:
                    envelope = decode(frame)
                except WireError as e:
                    log.warning("dropping a frame: %s", e)
                    continue
                # Each frame its own time: a batch's frames are handled one after another, and a
                # stream's inter-token gaps are measured between them.
                self._on_envelope(envelope, time.monotonic())

    def _on_envelope(self, envelope: worker_pb2.Envelope, now: float) -> None:
        if self.registry.has_exited(envelope) or not self._admits(envelope, now):
            return
        worker = self.registry.get(envelope.worker_id)
        incarnations = worker.num_incarnations
        lost = self.registry.on_message(envelope, now)
        if worker.num_incarnations > incarnations:
            self.prefix_index.forget(worker.worker_id)  # a new process caches nothing yet
            if incarnations > 0:
                self.metrics.worker_restarts.labels(worker.worker_id).inc()
        if lost:
            log.warning("%s restarted (incarnation %s); resuming %d requests", envelope.worker_id,
                        envelope.incarnation, len(lost))
            self._resume(lost, now)
        kind = envelope.WhichOneof("body")
        if kind == "outputs":
            self._on_outputs(envelope.worker_id, envelope.outputs, now)
        elif kind == "kv_events":
            self.prefix_index.on_events(envelope.worker_id, envelope.kv_events)
            self._ask_snapshot(envelope.worker_id, now)
        elif kind == "heartbeat":
            self.prefix_index.on_heartbeat(envelope.worker_id, envelope.heartbeat.kv_events_seq)
            self._ask_snapshot(envelope.worker_id, now)
            self.metrics.on_heartbeat(envelope.worker_id, envelope.incarnation, envelope.heartbeat)
            self._wake.set()  # capacity may have changed
            # Only this worker: a scan of every worker per heartbeat grows with the fleet's
            # square (the monitor loop reaps the others within MONITOR_INTERVAL_S).
            self.registry.note_heard(envelope.worker_id, now)
        elif kind == "probe_reply":
            self.probes.on_reply(envelope.probe_reply)
        elif kind == "exit":
            log.log(logging.INFO if envelope.exit.stopping else logging.ERROR, "%s is exiting: %s; resuming its %d "
                    "requests", envelope.worker_id, envelope.exit.reason, len(worker.assigned))
            lost = self.registry.mark_dead(envelope.worker_id, now, envelope.exit.reason, envelope.exit.stopping)
            self.prefix_index.forget(envelope.worker_id)
            self._resume(lost, now)
            self._check_liveness(now)

    def _admits(self, envelope: worker_pb2.Envelope, now: float) -> bool:
        """False for a frame of a worker serving another model; one just refused loses its work."""
        admitted, refused = self.model_check.admits(envelope)
        if refused:
            self.metrics.workers_refused.labels("model").inc()
            if envelope.worker_id in self.registry.workers:  # an earlier incarnation's requests resume elsewhere
                self._resume(self.registry.mark_dead(envelope.worker_id, now), now)
                self.prefix_index.forget(envelope.worker_id)
                self._check_liveness(now)
        return admitted

    def _on_outputs(self, worker_id: str, outputs: worker_pb2.StepOutputs, now: float) -> None:
        stale = []
        for delta in outputs.deltas:
            state = self.requests.get(delta.request_id)  # the wire carries internal ids
            if state is None or state.worker_id != worker_id:
                if not delta.finished:
                    stale.append(delta.request_id)  # cancelled, or moved on after a false death
                continue
            state.note_worker_report(delta)
            if state.predicted_cached_tokens is not None and (delta.new_token_ids or delta.finished):
                self.metrics.on_cache_prediction(worker_id, state.predicted_cached_tokens, delta.num_cached_tokens)
                state.predicted_cached_tokens = None
            if delta.new_token_ids:
                if state.last_token_s is not None:
                    self._itl_by_bucket[state.bucket].observe((now - state.last_token_s) / len(delta.new_token_ids))
                self.metrics.generation_tokens.inc(len(delta.new_token_ids))
                self.registry.note_tokens(worker_id, state.internal_id, len(delta.new_token_ids))
            stopped = state.on_delta(delta, now)
            if stopped:
                self._forget(state)
                self._send_abort(worker_id, [state.internal_id])
            elif delta.finished:
                self._forget(state)
                state.finish(delta.finish_reason or "stop", now, error=delta.error)
        if stale:
            self._send_abort(worker_id, stale)
        if any(d.finished for d in outputs.deltas):
            self.registry.release_reservations(worker_id)
            self._wake.set()

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.internal_id)
        if state.worker_id is not None:
            self.registry.release(state.worker_id, state.internal_id)

    # ---- gateway -> worker -------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        window = DispatchWindow(self.config.queues.batch_window_ms / 1e3)
        while True:
            await self._wake.wait()
            self._wake.clear()
            if (wait_s := window.wait_s(time.monotonic())) > 0:
                await asyncio.sleep(wait_s)
            window.passed(time.monotonic(), had_work=len(self.queue) > 0)
            await self._dispatch_ready()

    async def _dispatch_ready(self) -> None:
        max_batch = self.config.queues.max_batch_size
        while len(self.queue):
            now = time.monotonic()
            self._expire(now)
            takers = [w for w in self.registry.live(now) if w.can_take() and w.free_slots() > 0]
            self.router.begin_pass()
            head = self.queue.head(now)
            first = self._route(head, takers, {}, {}) if head is not None else None
            if first is None:
                return
            worker = first.worker
            # Tokens and blocks routed to `worker` in this pass, not yet in its load or reservations.
            taken, taken_blocks = {worker.worker_id: 0}, {worker.worker_id: 0}
            routes: dict[str, Route] = {}

            def fits(item: QueuedItem, worker=worker) -> bool:
                # Another worker's request waits for that worker's turn (head-of-line, as the queue keeps it).
                route = self._route(item, takers, taken, taken_blocks)
                if route is None or route.worker is not worker:
                    return False
                routes[item.request_id] = route
                self.router.note_routed(item.payload, worker)
                num_tokens = self._num_tokens(item.payload) + 1
                taken[worker.worker_id] += num_tokens
                taken_blocks[worker.worker_id] += worker.blocks_for(num_tokens)
                return True

            # Spread what is queued now over the workers that can take it, not one while another idles.
            fair_share = -(-len(self.queue) // max(1, len(takers)))
            batch = self.queue.pop_batch(now, min(max_batch, worker.free_slots(), fair_share), fits)
            if not batch:
                return
            states = [item.payload for item in batch]
            for item in batch:
                route = routes[item.request_id]
                self.metrics.routing.labels(route.outcome).inc()
                item.payload.predicted_cached_tokens = route.predicted_cached_tokens
            self.router.committed(states, worker)
            await self._send_batch(worker, states, now)

    def _route(self, item: QueuedItem, takers: list[WorkerHandle], taken: dict[str, int],
               taken_blocks: dict[str, int]) -> Route | None:
        """The policy's worker for `item` among the workers with room for it, counting the tokens
        and blocks already routed to them in this pass."""
        state = item.payload
        need = self._num_tokens(state) + 1
        # Only a worker whose whole pool holds everything the sequence may write: a smaller one
        # would refuse it (a heterogeneous fleet, or a pool smaller than the model's context).
        whole = len(state.prompt_ids) + state.params.max_tokens
        room = [w for w in takers if w.free_blocks() - taken_blocks.get(w.worker_id, 0) >= w.blocks_for(need)
                and w.pool_holds(whole)]
        return self.router.route(state, room, taken)

    @staticmethod
    def _num_tokens(state: RequestState) -> int:
        return len(state.prompt_ids) + len(state.output_ids)

    async def _send_batch(self, worker: WorkerHandle, states: list[RequestState], now: float) -> None:
        wire = []
        for state in states:
            state.worker_id = worker.worker_id
            state.dispatch_s = state.dispatch_s or now
            self.registry.assign(worker.worker_id, state.internal_id, self._num_tokens(state) + 1)
            wire.append(worker_pb2.WireRequest(
                request_id=state.internal_id, prompt_token_ids=state.prompt_ids, output_token_ids=state.output_ids,
                sampling=state.wire_sampling(), priority=0 if self.queue.fifo else state.priority))
        sent = await self.socket.send(worker.worker_id, worker_pb2.Envelope(
            submit=worker_pb2.SubmitBatch(requests=wire)))
        if not sent:
            log.warning("%s unreachable; requeueing %d requests", worker.worker_id, len(states))
            self.registry.mark_unreachable(worker.worker_id)
            self._resume({s.internal_id for s in states}, now)

    def _ask_snapshot(self, worker_id: str, now: float) -> None:
        if self.prefix_index.needs_snapshot(worker_id, now):
            self.metrics.kv_snapshots.labels(worker_id).inc()
            asyncio.ensure_future(self.socket.send(worker_id, worker_pb2.Envelope(
                kv_snapshot_request=worker_pb2.KvSnapshotRequest())))

    def _send_abort(self, worker_id: str, request_ids: list[str]) -> None:
        envelope = worker_pb2.Envelope(abort=worker_pb2.AbortRequests(request_ids=request_ids))
        asyncio.ensure_future(self.socket.send(worker_id, envelope))

    # ---- failures and time ----------------------------------------------------------------------
    def _resume(self, internal_ids: set[str], now: float) -> None:
        for internal_id in sorted(internal_ids):
            state = self.requests.get(internal_id)
            if state is None or state.is_finished:
                continue
            if state.worker_id is not None:
                self.registry.release(state.worker_id, internal_id)
                self._send_abort(state.worker_id, [internal_id])  # one only silent may still run it
            state.worker_id = None
            state.num_resumes += 1
            self.metrics.resumptions.inc()
            self.queue.push(QueuedItem(request_id=self.requests.renew_id(state), num_tokens=len(state.prompt_ids),
                                       priority=state.priority, arrival_s=state.arrival_s,
                                       deadline_s=state.deadline_s, payload=state), front=True)
        self._wake.set()

    def _expire(self, now: float) -> None:
        for item in self.queue.pop_expired(now):
            state = item.payload
            self.requests.pop(state.internal_id)
            waited = now - state.arrival_s
            why = ("its deadline passed" if item.deadline_s is not None and item.deadline_s <= now
                   else f"the queue-time limit of {item.max_wait_s:g} s for priority {state.priority} passed")
            state.fail(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"request {state.request_id} waited {waited:.2f} s in the queue and {why}", now)

    def _check_liveness(self, now: float) -> None:
        dead = self.registry.reap_dead(now)
        for worker_id, lost in dead.items():
            self.prefix_index.forget(worker_id)
            log.warning("%s missed heartbeats for %.1f s; resuming its %d requests elsewhere", worker_id,
                        self.config.gateway.heartbeat_timeout_s, len(lost))
            self._resume(lost, now)
        for worker_id in self.registry.forget_departed(now, self.config.gateway.forget_worker_after_s):
            log.info("%s left (silent for %.0f s); forgetting it", worker_id, self.config.gateway.forget_worker_after_s)
            self.prefix_index.forget(worker_id)
            self.metrics.forget_worker(worker_id)
        if self.registry.live(now):
            self._no_live_worker_since_s = None
        else:
            if self._no_live_worker_since_s is None:
                self._no_live_worker_since_s = now
            # A worker restarting (supervised) is often back within the grace; deadlines still
            # apply meanwhile (`_expire`).
            if len(self.queue) and (self._all_workers_stopped() or
                                    now - self._no_live_worker_since_s >= self.config.gateway.resume_grace_s):
                self._fail_all_queued(now)
        status = {w.worker_id: (self.registry.is_alive(w, now), self.registry.is_ready(w, now))
                  for w in self.registry.workers.values()}
        if status != self._liveness:
            self._liveness = status
            for worker_id, (alive, ready) in status.items():
                self.metrics.on_liveness(worker_id, alive, ready)
            self._on_workers_changed()

    def _fail_all_queued(self, now: float) -> None:
        why = ("the gateway is draining and every worker stopped" if self._all_workers_stopped() else
               f"none came back within gateway.resume_grace_s = {self.config.gateway.resume_grace_s:g} s")
        for item in self.queue.pop_expired(math.inf):
            self.requests.pop(item.request_id)
            item.payload.fail(grpc.StatusCode.UNAVAILABLE, f"no live worker is left to serve this request ({why})",
                              now)

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            now = time.monotonic()
            self._check_liveness(now)
            if len(self.queue):
                self._expire(now)
                self._wake.set()
            for bucket, size in enumerate(self.queue.bucket_sizes()):
                self.metrics.requests_queued.labels(str(bucket)).set(size)
