"""`python -m bench.fake_worker --worker-id worker-0 --config FILE --step-ms 20 --trace OUT.json`: a model-free worker.

It speaks the real wire (shared/ipc.py sockets, worker_pb2 envelopes and heartbeats) but runs no
model: every `step_ms` it gives each running request one token, in one StepOutputs envelope,
and notes when it sent it. With the real gateway in front and the load generator behind, the
gap between that send time and the client's receipt is exactly what the cluster path (ZeroMQ
hop, gateway, gRPC stream, client) adds per token, with no model competing for the CPU.
Both processes read CLOCK_MONOTONIC (time.perf_counter on Linux), so the times compare directly.
On SIGTERM it writes the trace {request_id: [send time of each step that gave it tokens]}.
It depends only on the wire contract, not on the worker's internals, which change independently.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from protos import worker_pb2
from shared.config import add_config_flags, config_from_args
from shared.ipc import WorkerSocket, new_incarnation

FAKE_KV_BLOCKS = 100_000
TOKEN_ID = 100  # any ordinary id: the gateway detokenizes it like a real one


class FakeWorker:
    def __init__(self, config, worker_id: str, step_s: float, trace_path: Path):
        self.step_s = step_s
        self.trace_path = trace_path
        self.worker = config.worker
        self.socket = WorkerSocket(config.worker_endpoint, worker_id, new_incarnation())
        self.next_heartbeat = 0.0
        self.running: dict[str, list[int]] = {}  # request id -> [tokens left, prompt tokens]
        self.trace: dict[str, list[float]] = {}
        self.stopping = False

    def _heartbeat(self) -> None:
        """Sent from the loop itself: it never blocks for longer than a step, unlike a real model."""
        now = time.perf_counter()
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + self.worker.heartbeat_interval_s
        w = self.worker
        self.socket.send(worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(
            ready=True, num_running=len(self.running), max_num_seqs=w.max_num_seqs, max_queued=w.max_queued,
            kv_blocks_total=FAKE_KV_BLOCKS, kv_blocks_free=FAKE_KV_BLOCKS, block_size=w.block_size,
            max_model_len=1 << 20, vocab_size=1 << 20, memory_level="OK", device="fake")))

    def _handle(self, envelope: worker_pb2.Envelope) -> None:
        kind = envelope.WhichOneof("body")
        if kind == "submit":
            for r in envelope.submit.requests:
                left = r.sampling.max_tokens - len(r.output_token_ids)
                self.running[r.request_id] = [left, len(r.prompt_token_ids)]
        elif kind == "abort":
            for request_id in envelope.abort.request_ids:
                self.running.pop(request_id, None)

    def _step(self) -> None:
        deltas = []
        for request_id, entry in list(self.running.items()):
            entry[0] -= 1
            finished = entry[0] <= 0
            deltas.append(worker_pb2.TokenDelta(request_id=request_id, new_token_ids=[TOKEN_ID], finished=finished,
                                                finish_reason="length" if finished else "",
                                                num_prompt_tokens=entry[1]))
            if finished:
                del self.running[request_id]
        if deltas:
            sent = time.perf_counter()
            self.socket.send(worker_pb2.Envelope(outputs=worker_pb2.StepOutputs(deltas=deltas,
                                                                                step_ms=self.step_s * 1e3)))
            for d in deltas:
                self.trace.setdefault(d.request_id, []).append(sent)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        next_step = time.perf_counter()
        try:
            while not self.stopping:
                timeout = max(0.0, next_step - time.perf_counter()) if self.running else 0.02
                for envelope in self.socket.recv_all(timeout):
                    self._handle(envelope)
                now = time.perf_counter()
                if self.running and now >= next_step:
                    self._step()
                    # Fixed cadence like a model whose step always takes step_s.
                    next_step = max(next_step + self.step_s, now)
                elif not self.running:
                    next_step = now + self.step_s  # a new request's first token comes one step after it lands
                self._heartbeat()
        finally:
            self.trace_path.write_text(json.dumps(self.trace))
            self.socket.close()
        return 0

    def _stop(self, *_):
        self.stopping = True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fake_worker", description=__doc__)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--trace", type=Path, required=True)
    add_config_flags(p)
    args = p.parse_args(argv)
    return FakeWorker(config_from_args(args), args.worker_id, args.step_ms / 1e3, args.trace).run()


if __name__ == "__main__":
    sys.exit(main())
