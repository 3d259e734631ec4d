"""Start a real cluster (gateway + N workers, each its own process) for a benchmark, and always tear it down.

The config is a TOML file written into a short temporary run folder (unix socket paths are
length-limited) with a free loopback port. Every process starts in its own session, every
wait is bounded, and `stop` kills each process group, so nothing outlives the benchmark even
when it fails halfway. Also reports the processes' CPU time, which the benchmark charges to
the cluster when it works out how much of the machine other programs took.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from protos import inference_pb2, inference_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 180.0  # a first start may compile the CPU kernels (about a minute)
STOP_GRACE_S = 10.0


_HANDED_OUT: set[int] = set()
RUN_DIRS: list[Path] = []  # of every cluster this process made: what leftover_processes looks for
_PORT_FLOOR = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback TCP port that is free now and that no other call in this process has returned.

    Taken below the kernel's ephemeral range where there is room: a port handed out by
    `bind(0)` comes from that range, so an outgoing connection opened before the server
    binds may take it as its source port ("Address already in use"). Ports below the range
    are never picked as source ports. Bound without SO_REUSEADDR, so a port still in
    TIME_WAIT is skipped too.
    """
    low, _ = _ephemeral_range()
    if low - _PORT_FLOOR >= 1000:
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        for _ in range(200):
            port = rng.randrange(_PORT_FLOOR, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    while True:  # no room below the range (or every try was taken): the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def leftover_processes() -> list[psutil.Process]:
    """Processes still running whose command line names the run folder of a cluster this process
    made: each cluster's `stop` should have ended them all."""
    folders = [str(d) for d in RUN_DIRS]
    left = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if p.pid != os.getpid() and any(f in arg for arg in cmdline for f in folders):
            left.append(p)
    return left


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def render_config(top: dict, sections: dict[str, dict]) -> str:
    lines = [f"{k} = {_toml(v)}" for k, v in top.items()]
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


class ClusterProcess:
    """`with ClusterProcess(model_dir, 1, {"worker": {...}, "queues": {...}}) as c:` then load c.address."""

    def __init__(self, model_dir: Path, num_workers: int = 1, sections: dict[str, dict] | None = None,
                 gateway_module: list[str] | None = None, worker_module: list[str] | None = None,
                 api_key: str | None = None, tls_root: bytes | None = None, workers_per_process: int = 1):
        """gateway_module / worker_module replace `gateway` / `worker` after `python -m` (e.g. to run the
        gateway under cProfile, or a model-free worker); the worker gets `--worker-id ID` appended.
        `api_key` is sent on this object's own calls; `tls_root` (a CA's PEM) makes them over TLS.
        `workers_per_process` > 1 runs that many workers in each process, named `workers-FIRST-LAST`,
        with one `--worker-id` each (a module that takes several: bench/fake_worker.py)."""
        self.api_key = api_key
        self.tls_root = tls_root
        self.gateway_module = gateway_module or ["gateway"]
        self.worker_module = worker_module or ["worker"]
        self.run_dir = Path(tempfile.mkdtemp(prefix="icb-"))
        RUN_DIRS.append(self.run_dir)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.num_workers = num_workers
        self.workers_per_process = workers_per_process
        sections = {k: dict(v) for k, v in (sections or {}).items()}
        # Metrics off unless asked for: a fixed port would clash with a cluster already running.
        sections["gateway"] = {"host": "127.0.0.1", "port": self.port, "metrics_port": 0, "http_port": 0,
                               **sections.get("gateway", {})}
        self.http_port = sections["gateway"]["http_port"]  # the OpenAI API's, when a caller asked for one
        self.config_text = render_config({"model_dir": str(Path(model_dir).resolve()), "num_workers": num_workers,
                                          "run_dir": str(self.run_dir)}, sections)
        self.config_path = self.run_dir / "cluster.toml"
        self.config_path.write_text(self.config_text)
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, module_args: list[str]) -> None:
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            # A second start (e.g. `with cluster.start():`, whose __enter__ starts again) would leave
            # the first processes running with nothing left to stop them.
            raise RuntimeError(f"{name} of this cluster is already running (pid {running.pid})")
        with open(self.run_dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", *module_args, "--config", str(self.config_path)], cwd=REPO_ROOT,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> "ClusterProcess":
        try:
            self._spawn("gateway", self.gateway_module)
            per = max(1, self.workers_per_process)
            for first in range(0, self.num_workers, per):
                ids = [f"worker-{i}" for i in range(first, min(first + per, self.num_workers))]
                name = ids[0] if per == 1 else f"workers-{first}-{first + len(ids) - 1}"
                self._spawn(name, [*self.worker_module, *(arg for i in ids for arg in ("--worker-id", i))])
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> inference_pb2.ClusterStatus:
        deadline = time.monotonic() + timeout_s
        last = None
        with self.open_channel() as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            while time.monotonic() < deadline:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name} exited {proc.returncode} during start-up:\n{self.logs(name)}")
                try:
                    last = stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=2,
                                                 metadata=self.metadata)
                    if sum(w.ready for w in last.workers) >= self.num_workers:
                        return last
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{self.num_workers} workers not ready within {timeout_s:.0f} s; last status: {last}\n"
                           + "\n".join(self.logs(n) for n in self.procs))

    def open_channel(self) -> grpc.Channel:
        if self.tls_root is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, grpc.ssl_channel_credentials(self.tls_root))

    @property
    def metadata(self) -> tuple:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def pids(self) -> dict[str, list[int]]:
        """Each process and its descendants (a worker may have helper processes)."""
        out = {}
        for name, proc in self.procs.items():
            try:
                parent = psutil.Process(proc.pid)
                out[name] = [proc.pid] + [c.pid for c in parent.children(recursive=True)]
            except psutil.Error:
                out[name] = []
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU time used so far by each process (with its descendants)."""
        out = {}
        for name, pids in self.pids().items():
            total = 0.0
            for pid in pids:
                try:
                    t = psutil.Process(pid).cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            out[name] = total
        return out

    def logs(self, name: str, tail_chars: int = 4000) -> str:
        path = self.run_dir / f"{name}.log"
        return f"--- {name} ---\n" + (path.read_text(errors="replace")[-tail_chars:] if path.exists() else "")

    def stop(self, keep_run_dir: bool = False) -> None:
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Whatever is left of the group (the leader or stray children) goes now.
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if not keep_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "ClusterProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
