"""Start a real cluster (gateway + workers as processes) for a test, and always clean it up.

Built on bench/cluster_process.py: sockets live in a short temporary folder (unix socket
paths are length-limited), the gRPC port is a free loopback port, every wait is bounded,
and every process group started is killed at the end, whatever the test did.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import psutil

from bench.cluster_process import ClusterProcess, _signal_group, free_port, render_config
from protos import inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 180.0  # a first start compiles the CPU kernels
# The served checkpoint's context (conftest.served_checkpoint) and a generation that fills most
# of it and of the test clusters' KV blocks of 16: long enough to keep the worker busy well past
# a test's short deadlines on a fast engine (the tiny model streams about 4,000 tokens a second),
# which tests of deadlines, draining and killing behind a busy worker rely on.
SERVED_MAX_POSITIONS = 8192
LONG_MAX_TOKENS = 8000
TEST_KV_BLOCKS = SERVED_MAX_POSITIONS // 16


def write_config(path: Path, model_dir: Path, run_dir: Path, port: int, num_workers: int,
                 sections: dict[str, dict] | None = None, metrics_port: int = 0) -> Path:
    sections = {k: dict(v) for k, v in (sections or {}).items()}
    sections["gateway"] = {"host": "127.0.0.1", "port": port, "metrics_port": metrics_port, "http_port": 0,
                           **sections.get("gateway", {})}
    sections["worker"] = {"num_threads": 1, "num_kv_blocks": TEST_KV_BLOCKS, **sections.get("worker", {})}
    path.write_text(render_config({"model_dir": str(model_dir), "num_workers": num_workers,
                                   "run_dir": str(run_dir)}, sections))
    return path


class Cluster(ClusterProcess):
    """A ClusterProcess with the tests' defaults (1 torch thread and TEST_KV_BLOCKS per worker,
    metrics on a free port), an open channel and stub, and supervised workers (and gateway) on
    request."""

    def __init__(self, model_dir: Path, num_workers: int = 2, supervised: bool = False,
                 sections: dict[str, dict] | None = None, supervised_gateway: bool = False,
                 api_key: str | None = None, tls_root: bytes | None = None):
        self.metrics_port = free_port()
        sections = {k: dict(v) for k, v in (sections or {}).items()}
        sections["gateway"] = {"metrics_port": self.metrics_port, **sections.get("gateway", {})}
        sections["worker"] = {"num_threads": 1, "num_kv_blocks": TEST_KV_BLOCKS, **sections.get("worker", {})}
        super().__init__(model_dir, num_workers, sections,
                         gateway_module=["gateway", "--supervise"] if supervised_gateway else None,
                         worker_module=["worker.supervisor"] if supervised else None, api_key=api_key,
                         tls_root=tls_root)
        self.channel: grpc.Channel | None = None
        self.stub: inference_pb2_grpc.InferenceServiceStub | None = None

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> "Cluster":
        self.connect()
        super().start(ready_timeout_s)
        return self

    def connect(self) -> None:
        self.channel = self.open_channel()
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    def status(self) -> inference_pb2.ClusterStatus:
        return self.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=5, metadata=self.metadata)

    def model_pids(self, worker_id: str) -> list[int]:
        """The pids of `python -m worker --worker-id <id>` processes of this cluster."""
        pids = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd[1:3] == ["-m", "worker"] and worker_id in cmd and str(self.config_path) in cmd:
                pids.append(p.pid)
        return pids

    def gateway_pids(self) -> list[int]:
        """The pids of this cluster's gateway processes (`python -m gateway`, not its supervisor)."""
        pids = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd[1:3] == ["-m", "gateway"] and "--supervise" not in cmd and str(self.config_path) in cmd:
                pids.append(p.pid)
        return pids

    def stop(self, keep_run_dir: bool = False) -> None:
        if self.channel is not None:
            self.channel.close()
        super().stop(keep_run_dir)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    _signal_group(proc, sig)


def generate(stub, timeout: float = 60.0, metadata: tuple = (), **fields
             ) -> tuple[list[int], str, inference_pb2.GenerateResponse]:
    """Run one Generate to its end: (token ids, text, last response)."""
    sampling = fields.pop("sampling", {})
    request = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingOptions(**sampling), **fields)
    return drain(stub.Generate(request, timeout=timeout, metadata=metadata))


def drain(call) -> tuple[list[int], str, inference_pb2.GenerateResponse]:
    """Read a started Generate call to its end: (token ids, text, last response)."""
    ids, text, last = [], "", None
    for response in call:
        ids.extend(response.token_ids)
        text += response.text
        last = response
    return ids, text, last


def wait_all_free(cluster, timeout_s: float = 10.0) -> inference_pb2.ClusterStatus:
    """Wait until nothing is queued or running and every worker's KV pool is all free."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = cluster.status()
        if status.num_queued == 0 and all(w.num_running == 0 and w.num_waiting == 0 and
                                          w.kv_blocks_free == w.kv_blocks_total for w in status.workers):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not all free after {timeout_s} s: {status}")
        time.sleep(0.1)
