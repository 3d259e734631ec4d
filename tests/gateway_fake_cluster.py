"""The real gateway in front of model-free workers (bench/fake_worker.py), for gateway tests.

A fake worker speaks the real wire and gives every running request one token per `step_ms`,
so a test controls how long a stream runs, starts in well under a second, and leaves the CPU
to the gateway. Also: reading the gateway's Prometheus metrics and its request log.
"""
from __future__ import annotations

import json
import signal
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.cluster_process import ClusterProcess, _signal_group, free_port
from protos import inference_pb2, inference_pb2_grpc

READY_TIMEOUT_S = 60.0


class FakeCluster(ClusterProcess):
    def __init__(self, model_dir, num_workers: int = 1, step_ms: float = 20.0, sections: dict | None = None):
        self.metrics_port = free_port()
        sections = {k: dict(v) for k, v in (sections or {}).items()}
        sections["gateway"] = {"metrics_port": self.metrics_port, "metrics_host": "127.0.0.1",
                               **sections.get("gateway", {})}
        super().__init__(model_dir, num_workers, sections, worker_module=["bench.fake_worker", "--step-ms",
                                                                          str(step_ms)])
        self.channel: grpc.Channel | None = None
        self.stub: inference_pb2_grpc.InferenceServiceStub | None = None

    def _spawn(self, name: str, module_args: list[str]) -> None:
        if name.startswith("worker-"):  # each fake worker writes its trace on exit: one file each
            module_args = [*module_args, "--trace", str(self.run_dir / f"{name}.trace.json")]
        super()._spawn(name, module_args)

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> "FakeCluster":
        self.channel = grpc.insecure_channel(self.address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        super().start(ready_timeout_s)
        return self

    def kill_worker(self, worker_id: str) -> None:
        proc = self.procs[worker_id]
        _signal_group(proc, signal.SIGKILL)
        proc.wait(timeout=10)

    def restart_worker(self, worker_id: str) -> None:
        self._spawn(worker_id, [*self.worker_module, "--worker-id", worker_id])

    def status(self) -> inference_pb2.ClusterStatus:
        return self.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=5)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: (name, sorted labels) -> value."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def request_records(self) -> list[dict]:
        """The gateway's request log: one record per finished or refused RPC (a line still being
        written is left for the next read)."""
        records = []
        for line in (self.run_dir / "gateway.log").read_text(errors="replace").splitlines():
            if '"event":"request"' in line:
                try:
                    records.append(json.loads(line[line.index("{"):]))
                except json.JSONDecodeError:
                    pass
        return records

    def stop(self, keep_run_dir: bool = False) -> None:
        if self.channel is not None:
            self.channel.close()
        super().stop(keep_run_dir)


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def request(prompt_token_ids=(5, 6, 7), **fields) -> inference_pb2.GenerateRequest:
    sampling = fields.pop("sampling", {})
    return inference_pb2.GenerateRequest(prompt_token_ids=list(prompt_token_ids),
                                         sampling=inference_pb2.SamplingOptions(**sampling), **fields)
