"""`python -m bench.fake_worker --worker-id worker-0 --config FILE --step-ms 20 --trace OUT.json`: a model-free worker.

It speaks the real wire (shared/ipc.py sockets, worker_pb2 envelopes and heartbeats) but runs no
model: every `step_ms` it gives each running request one token, in one StepOutputs envelope,
and notes when it sent it. With the real gateway in front and the load generator behind, the
gap between that send time and the client's receipt is exactly what the cluster path (ZeroMQ
hop, gateway, gRPC stream, client) adds per token, with no model competing for the CPU.
Both processes read CLOCK_MONOTONIC (time.perf_counter on Linux), so the times compare directly.
On SIGTERM it writes the trace {request_id: [send time of each step that gave it tokens]}.
It depends only on the wire contract, not on the worker's internals, which change independently.

`--worker-id` given several times runs that many workers in this one process (bench/gateway_ceiling.py:
128 workers on 2 cores): each is still its own ZeroMQ peer, with its own socket, identity, incarnation,
heartbeats, requests and cache; they only share the process, its ZeroMQ I/O thread and one poll
loop, and one trace file (request ids are the gateway's, unique across workers).

Prefix cache (bench/fake_prefix_cache.py, `--cache-blocks` in a pool of that many blocks): each
request reuses the cached full blocks of its prompt, reports them as num_cached_tokens, registers
its prompt's blocks once prefilled and its generated tokens' when it finishes, and the worker
reports what changed (KvEvents, seq 1, 2, ... before the heartbeat that counts them) and answers
KvSnapshotRequest, as a real worker does. `--prefill-us-per-token F` > 0 simulates prefill: the
worker prefills one request at a time, F per uncached prompt token, and a request's first token
comes at max(one step, its prefill's end); 0 (the default) gives it its first token at the next step.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from bench.fake_prefix_cache import FakePrefixCache
from protos import worker_pb2
from shared.config import add_config_flags, config_from_args
from shared.ipc import connect_worker_socket, new_incarnation
from shared.model_fingerprint import model_fingerprint

FAKE_KV_BLOCKS = 100_000  # the default pool: large enough that nothing is ever evicted
TOKEN_ID = 100  # any ordinary id: the gateway detokenizes it like a real one
IDLE_POLL_S = 0.02


@dataclass
class _Running:
    token_ids: list[int]  # prompt, then every token generated (those streamed before a resume included)
    num_left: int
    num_prompt_tokens: int
    num_cached_tokens: int
    ready_s: float | None  # prefilling until then; None: in the step cadence
    is_prefilled: bool = False


class FakeWorker:
    def __init__(self, config, worker_id: str, step_s: float, trace_path: Path, cache_blocks: int = FAKE_KV_BLOCKS,
                 prefill_s_per_token: float = 0.0):
        self.step_s = step_s
        self.trace_path = trace_path
        self.worker = config.worker
        # It detokenizes nothing, but the gateway's tokenizer must match what it "serves": the config's model.
        self.model_name, self.model_fingerprint = Path(config.model_dir).name, model_fingerprint(config.model_dir)
        self.socket = connect_worker_socket(config, worker_id, new_incarnation())  # with the keys the policy gives it
        self.cache = FakePrefixCache(cache_blocks, config.worker.block_size)
        self.prefill_s_per_token = prefill_s_per_token
        self.prefill_free_s = 0.0  # when the simulated prefill of the requests admitted so far ends
        self.kv_seq = 0  # the last KvEvents seq sent
        self.next_heartbeat = 0.0
        self.next_step = 0.0  # when the next step is due (the loop sets it on start)
        self.running: dict[str, _Running] = {}
        self.trace: dict[str, list[float]] = {}
        self.stopping = False

    def _heartbeat(self) -> None:
        """Sent from the loop itself: it never blocks for longer than a step, unlike a real model."""
        now = time.perf_counter()
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + self.worker.heartbeat_interval_s
        w, c = self.worker, self.cache
        self.socket.send(worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(
            ready=True, num_running=len(self.running), max_num_seqs=w.max_num_seqs, max_queued=w.max_queued,
            kv_blocks_total=c.num_blocks, kv_blocks_free=c.num_free_blocks, kv_blocks_cached=c.num_evictable_blocks,
            block_size=w.block_size, max_model_len=1 << 20, vocab_size=1 << 20, memory_level="OK", device="fake",
            num_prefix_query_tokens=c.num_prefix_query_tokens, num_prefix_hit_tokens=c.num_prefix_hit_tokens,
            kv_events_seq=self.kv_seq, model_fingerprint=self.model_fingerprint, model_name=self.model_name)))

    def _handle(self, envelope: worker_pb2.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        if kind == "submit":
            now = time.perf_counter()
            for r in envelope.submit.requests:
                self._admit(r, now)
        elif kind == "abort":
            for request_id in envelope.abort.request_ids:
                if self.running.pop(request_id, None) is not None:
                    self.cache.release(request_id)
        elif kind == "kv_snapshot_request":
            self._send_kv(snapshot=True, stored=self.cache.snapshot())

    def _admit(self, r: worker_pb2.WireRequest, now: float) -> None:
        if r.request_id in self.running:  # a repeat of a request still running here: start it over
            self.running.pop(r.request_id)
            self.cache.release(r.request_id)
        token_ids = [*r.prompt_token_ids, *r.output_token_ids]
        cached = self.cache.admit(r.request_id, token_ids)
        ready_s = None
        if self.prefill_s_per_token > 0:
            # One prefill at a time, as one model would run them: this one starts when the last ends.
            self.prefill_free_s = max(now, self.prefill_free_s) + (len(token_ids) - cached) * self.prefill_s_per_token
            ready_s = max(now + self.step_s, self.prefill_free_s)
        self.running[r.request_id] = _Running(token_ids, r.sampling.max_tokens - len(r.output_token_ids),
                                              len(r.prompt_token_ids), cached, ready_s)

    def _give_token(self, request_id: str, entry: _Running) -> worker_pb2.TokenDelta:
        if not entry.is_prefilled:  # the prompt's KV is computed: its full blocks are cacheable now
            self.cache.register(request_id, entry.token_ids)
            entry.is_prefilled = True
        entry.token_ids.append(TOKEN_ID)
        entry.num_left -= 1
        finished = entry.num_left <= 0
        if finished:
            # Every token but the last sampled one has its KV computed.
            self.cache.register(request_id, entry.token_ids[:-1])
            self.cache.release(request_id)
            del self.running[request_id]
        else:
            self.cache.grow(request_id, len(entry.token_ids))
        return worker_pb2.TokenDelta(request_id=request_id, new_token_ids=[TOKEN_ID], finished=finished,
                                     finish_reason="length" if finished else "",
                                     num_prompt_tokens=entry.num_prompt_tokens,
                                     num_cached_tokens=entry.num_cached_tokens)

    def _send(self, deltas: list[worker_pb2.TokenDelta]) -> None:
        if not deltas:
            return
        sent = time.perf_counter()
        self.socket.send(worker_pb2.Envelope(outputs=worker_pb2.StepOutputs(deltas=deltas, step_ms=self.step_s * 1e3)))
        for d in deltas:
            self.trace.setdefault(d.request_id, []).append(sent)

    def _send_kv_events(self) -> None:
        stored, removed = self.cache.drain_events()
        if stored or removed:
            self._send_kv(stored=stored, removed=removed)

    def _send_kv(self, **fields) -> None:
        self.kv_seq += 1
        self.socket.send(worker_pb2.Envelope(kv_events=worker_pb2.KvEvents(
            seq=self.kv_seq, block_size=self.cache.block_size, **fields)))

    def _wake_s(self, now: float, next_step: float) -> float:
        stepping = any(e.ready_s is None for e in self.running.values())
        due = [e.ready_s for e in self.running.values() if e.ready_s is not None]
        return min([next_step if stepping else now + IDLE_POLL_S, *due])

    def wake_s(self, now: float) -> float:
        """When this worker next has something to do (a step, a prefill's end, an idle poll)."""
        return self._wake_s(now, self.next_step)

    def tick(self, envelopes: list[worker_pb2.Envelope]) -> None:
        """One pass of the loop: act on what arrived, then step if due, and report."""
        for envelope in envelopes:
            self._handle(envelope)
        now = time.perf_counter()
        stepping = [rid for rid, e in self.running.items() if e.ready_s is None]
        deltas = []
        if stepping and now >= self.next_step:
            deltas = [self._give_token(rid, self.running[rid]) for rid in stepping]
            # Fixed cadence like a model whose step always takes step_s.
            self.next_step = max(self.next_step + self.step_s, now)
        elif not stepping:
            self.next_step = now + self.step_s  # a new request's first token comes one step after it lands
        for rid, e in list(self.running.items()):
            if e.ready_s is not None and now >= e.ready_s:  # prefill done: its first token, at once
                e.ready_s = None
                deltas.append(self._give_token(rid, e))
        self._send(deltas)
        self._send_kv_events()  # before the heartbeat that counts them
        self._heartbeat()

    def run(self) -> int:
        return serve([self], self.trace_path)

    def _stop(self, *_):
        self.stopping = True


def serve(workers: list[FakeWorker], trace_path: Path) -> int:
    """Run `workers` in one loop until SIGTERM: each wakes when it is due or its socket has frames."""
    def stop(*_):
        for w in workers:
            w._stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    poller = zmq.Poller()
    by_socket = {}
    start = time.perf_counter()
    for i, w in enumerate(workers):
        w.next_step = start
        # Heartbeats spread over one interval, as independent workers' would be (the first at once).
        w.next_heartbeat = start + i * w.worker.heartbeat_interval_s / len(workers)
        poller.register(w.socket.socket, zmq.POLLIN)
        by_socket[w.socket.socket] = w
    try:
        while not workers[0].stopping:
            now = time.perf_counter()
            wakes = [w.wake_s(now) for w in workers]
            # Rounded up to whole ms (ZeroMQ's unit): a step a fraction of a ms late, never a spin.
            readable = {by_socket[s] for s, _ in poller.poll(math.ceil(max(0.0, min(wakes) - now) * 1e3))}
            now = time.perf_counter()
            for w, wake in zip(workers, wakes):
                if w.stopping:
                    break
                if w in readable or wake <= now:
                    w.tick(w.socket.recv_all(0.0) if w in readable else [])
    finally:
        trace = {}
        for w in workers:
            trace.update(w.trace)
            w.socket.close()
        trace_path.write_text(json.dumps(trace))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fake_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker-id", required=True, action="append",
                   help="this worker's id; given N times, N workers in this process")
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--cache-blocks", type=int, default=FAKE_KV_BLOCKS, help="KV pool (and prefix cache) in blocks")
    p.add_argument("--prefill-us-per-token", type=float, default=0.0,
                   help="simulated prefill time per uncached prompt token (0: none)")
    add_config_flags(p)
    args = p.parse_args(argv)
    config = config_from_args(args)
    return serve([FakeWorker(config, worker_id, args.step_ms / 1e3, args.trace, args.cache_blocks,
                             args.prefill_us_per_token / 1e6) for worker_id in args.worker_id], args.trace)


if __name__ == "__main__":
    sys.exit(main())
