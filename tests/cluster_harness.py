"""Start a real cluster (gateway + workers as processes) for a test, and always clean it up.

Sockets live in a short temporary folder (unix socket paths are length-limited), the gRPC
port is a free loopback port, every wait is bounded, and every process group started is
killed at the end, whatever the test did.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from bench.cluster_process import free_port, render_config
from protos import inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0


def write_config(path: Path, model_dir: Path, run_dir: Path, port: int, num_workers: int,
                 sections: dict[str, dict] | None = None, metrics_port: int = 0) -> Path:
    sections = {k: dict(v) for k, v in (sections or {}).items()}
    sections["gateway"] = {"host": "127.0.0.1", "port": port, "metrics_port": metrics_port,
                           **sections.get("gateway", {})}
    sections["worker"] = {"num_threads": 1, "num_kv_blocks": 128, **sections.get("worker", {})}
    path.write_text(render_config({"model_dir": str(model_dir), "num_workers": num_workers,
                                   "run_dir": str(run_dir)}, sections))
    return path


class Cluster:
    def __init__(self, model_dir: Path, num_workers: int = 2, supervised: bool = False,
                 sections: dict[str, dict] | None = None):
        self.run_dir = Path(tempfile.mkdtemp(prefix="ic-"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.num_workers = num_workers
        self.supervised = supervised
        self.config_path = write_config(self.run_dir / "cluster.toml", model_dir, self.run_dir, self.port,
                                        num_workers, sections, self.metrics_port)
        self.procs: dict[str, subprocess.Popen] = {}
        self.channel: grpc.Channel | None = None
        self.stub: inference_pb2_grpc.InferenceServiceStub | None = None

    # ---- processes ------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", *args, "--config", str(self.config_path)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start(self) -> "Cluster":
        try:
            self._spawn("gateway", ["gateway"])
            for i in range(self.num_workers):
                module = "worker.supervisor" if self.supervised else "worker"
                self._spawn(f"worker-{i}", [module, "--worker-id", f"worker-{i}"])
            self.channel = grpc.insecure_channel(self.address)
            self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
            self.wait_ready(self.num_workers)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, num_ready: int, timeout_s: float = READY_TIMEOUT_S) -> inference_pb2.ClusterStatus:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and name in ("gateway", "honcho"):
                    raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.logs(name)}")
            try:
                last = self.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=2)
                if sum(w.ready for w in last.workers) >= num_ready:
                    return last
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{num_ready} workers not ready within {timeout_s} s; last status {last}\n"
                           + "\n".join(self.logs(n) for n in self.procs))

    def status(self) -> inference_pb2.ClusterStatus:
        return self.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=5)

    def model_pids(self, worker_id: str) -> list[int]:
        """The pids of `python -m worker --worker-id <id>` processes of this cluster."""
        pids = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd[1:3] == ["-m", "worker"] and worker_id in cmd and str(self.config_path) in cmd:
                pids.append(p.pid)
        return pids

    def logs(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        return f"--- {name} ---\n" + (path.read_text(errors="replace")[-4000:] if path.exists() else "")

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        for proc in self.procs.values():
            _kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def generate(stub, timeout: float = 60.0, **fields) -> tuple[list[int], str, inference_pb2.GenerateResponse]:
    """Run one Generate to its end: (token ids, text, last response)."""
    sampling = fields.pop("sampling", {})
    request = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingOptions(**sampling), **fields)
    ids, text, last = [], "", None
    for response in stub.Generate(request, timeout=timeout):
        ids.extend(response.token_ids)
        text += response.text
        last = response
    return ids, text, last
