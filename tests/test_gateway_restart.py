"""The cluster outlives its gateway: the gateway runs under a supervisor (`python -m gateway
--supervise`, the Procfile's entry), and a kill -9 or SIGTERM of the gateway process alone is
followed by a new gateway that the same worker processes, models still loaded, serve within
seconds. SIGTERM to every supervisor (what honcho does on Ctrl-C) still drains and exits 0, and
a gateway's stale socket file is removed at the next start, never a live one's."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from cluster_harness import Cluster, LONG_MAX_TOKENS, ROOT, generate
from protos import inference_pb2_grpc
from shared.ipc import EndpointInUseError, ipc_listener_alive, remove_stale_ipc_socket
from shared.supervisor import Supervisor

pytestmark = pytest.mark.timeout(300)
RESTART_BOUND_S = 15.0  # kill -> first success; measured 0.8-1.0 s on 2 cores (0.5 s of it backoff)
# A client that retries at once: gRPC's default reconnect backoff (1 s, growing) would measure
# the client rather than the restart.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 100)]


def _stale_socket(path: Path) -> Path:
    """A unix socket file with nobody listening: what a kill -9 of its owner leaves."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    return path


def _wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def _first_success_after(address: str, timeout_s: float) -> float:
    """Send a short request until one succeeds; the monotonic time it ended."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
            try:
                ids, _, _ = generate(inference_pb2_grpc.InferenceServiceStub(channel), timeout=5,
                                     prompt_token_ids=[5, 6, 7], sampling=dict(max_tokens=4, ignore_eos=True))
                assert len(ids) == 4
                return time.monotonic()
            except grpc.RpcError as e:
                last = e  # refused (no gateway yet) or UNAVAILABLE (no worker registered yet)
        time.sleep(0.02)
    raise AssertionError(f"no request succeeded within {timeout_s:.0f} s; last: {last}")


# ---- the stale socket -----------------------------------------------------------------------


def test_remove_stale_ipc_socket_removes_only_a_dead_socket(tmp_path):
    path = tmp_path / "gateway.ipc"
    endpoint = f"ipc://{path}"
    assert remove_stale_ipc_socket(endpoint) is False  # nothing there
    assert remove_stale_ipc_socket("tcp://127.0.0.1:5555") is False
    _stale_socket(path)
    assert path.exists() and not ipc_listener_alive(path)
    assert remove_stale_ipc_socket(endpoint) is True
    assert not path.exists()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    try:
        with pytest.raises(EndpointInUseError, match="already listening"):
            remove_stale_ipc_socket(endpoint)
        assert path.exists()  # a live gateway's socket is never taken away
    finally:
        live.close()
        path.unlink()
    path.write_text("not a socket")
    with pytest.raises(ValueError, match="not a socket"):
        remove_stale_ipc_socket(endpoint)
    assert path.read_text() == "not a socket"


def test_the_gateway_removes_a_stale_socket_and_refuses_to_share_a_live_one(served_checkpoint):
    cluster = Cluster(served_checkpoint, num_workers=1)
    ipc = cluster.run_dir / "gateway.ipc"
    try:
        _stale_socket(ipc)
        cluster._spawn("gateway", ["gateway"])
        cluster.connect()
        _wait_until(lambda: _answers(cluster), 60, "the gateway answering")
        assert "removed the stale socket" in cluster.logs("gateway")
        assert ipc_listener_alive(ipc)  # bound afresh where nobody listened
        # A second gateway (or a second whole cluster) on the same run_dir stops at once, with a
        # reason, and leaves the first one's socket alone.
        for module in (["gateway"], ["gateway", "--supervise"]):
            second = subprocess.run([sys.executable, "-m", *module, "--config", str(cluster.config_path),
                                     "--gateway.port", "0", "--gateway.metrics_port", "0", "--gateway.http_port", "0"],
                                    cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert second.returncode == 2, (module, second.stderr)
            assert "already listening" in second.stderr, (module, second.stderr)
        assert ipc_listener_alive(ipc) and _answers(cluster)
    finally:
        cluster.stop()


def _answers(cluster: Cluster) -> bool:
    try:
        cluster.status()
        return True
    except grpc.RpcError:
        return False


# ---- the supervisor on its own ----------------------------------------------------------------


def test_supervisor_restarts_its_child_and_stops_it_cleanly(tmp_path):
    marker = tmp_path / "starts"
    child = [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(60)"]
    supervisor = Supervisor("child", child, backoff_s=0.05, max_backoff_s=0.1)
    thread = threading.Thread(target=lambda: setattr(supervisor, "result", supervisor.run()))
    thread.start()
    try:
        first = _wait_until(lambda: supervisor.child and marker.exists() and supervisor.child.pid, 10, "a child")
        os.kill(first, signal.SIGKILL)
        _wait_until(lambda: marker.exists() and marker.read_text() == "xx", 10, "a restarted child")
        second = supervisor.child.pid
        assert second != first
    finally:
        supervisor.stop()
        thread.join(timeout=20)
    assert not thread.is_alive() and supervisor.result == 0  # killed by our SIGTERM: a clean stop
    assert supervisor.child.pid == second and supervisor.child.returncode == -signal.SIGTERM


def test_the_child_of_a_killed_supervisor_gets_sigterm(tmp_path):
    """A supervisor killed by SIGKILL cannot pass anything on; the kernel tells its child."""
    code = ("import sys, time; from shared.supervisor import supervise; "
            "supervise('child', [sys.executable, '-c', 'import time; time.sleep(120)'], 1.0, 1.0)")
    supervisor = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True)
    try:
        children = _wait_until(lambda: psutil.Process(supervisor.pid).children(), 20, "the child")
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, "the child outlived its supervisor"
    finally:
        try:
            os.killpg(supervisor.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- the whole tree, real processes -----------------------------------------------------------


def test_gateway_restarts_and_the_workers_serve_it_without_reloading(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=1, supervised=True, supervised_gateway=True) as cluster:
        [gateway] = cluster.gateway_pids()
        [model] = cluster.model_pids("worker-0")
        ipc = cluster.run_dir / "gateway.ipc"

        # kill -9 with a stream in flight: its client learns at once, and the stream it left
        # running on the worker is aborted once the new gateway hears of it.
        result: dict = {}

        def stream():
            try:
                result["ok"] = generate(cluster.stub, timeout=120, prompt_token_ids=[5, 6], sampling=dict(
                    max_tokens=LONG_MAX_TOKENS, ignore_eos=True))
            except grpc.RpcError as e:
                result["error"], result["at"] = e, time.monotonic()

        client = threading.Thread(target=stream)
        client.start()
        _wait_until(lambda: cluster.status().workers[0].num_running, 30, "the stream running")
        os.kill(gateway, signal.SIGKILL)
        killed_at = time.monotonic()
        client.join(timeout=30)
        assert result["error"].code() == grpc.StatusCode.UNAVAILABLE, result
        assert result["at"] - killed_at < 2.0, "the client of the dead gateway waited"
        served_at = _first_success_after(cluster.address, RESTART_BOUND_S)
        kill_restart_s = served_at - killed_at
        [restarted] = cluster.gateway_pids()
        assert restarted != gateway
        assert cluster.model_pids("worker-0") == [model], "the worker reloaded its model"
        assert "removed the stale socket" in cluster.logs("gateway")
        assert all(p.poll() is None for p in cluster.procs.values()), "a supervisor exited"
        cluster.channel.close()
        cluster.connect()  # the old channel is in reconnect backoff; the test's own calls need not wait
        _wait_until(lambda: cluster.status().workers[0].num_running == 0, 30,
                    "the dead gateway's stream aborted on the worker")

        # SIGTERM to the gateway alone: it drains, exits 0, and is started again.
        os.kill(restarted, signal.SIGTERM)
        stopped_at = time.monotonic()
        _wait_until(lambda: cluster.gateway_pids() not in ([], [restarted]), 30, "a new gateway process")
        served_at = _first_success_after(cluster.address, RESTART_BOUND_S)
        term_restart_s = served_at - stopped_at
        assert cluster.model_pids("worker-0") == [model]
        assert "gateway exited with 0; restarting" in cluster.logs("gateway")
        print(f"\ngateway restart, kill -9 -> first success: {kill_restart_s:.2f} s; "
              f"SIGTERM -> first success: {term_restart_s:.2f} s")

        # SIGTERM to every supervisor's process group, as honcho sends it: all drain and exit 0.
        for proc in cluster.procs.values():
            os.killpg(proc.pid, signal.SIGTERM)
        for name, proc in cluster.procs.items():
            assert proc.wait(timeout=30) == 0, (name, cluster.logs(name))
        _wait_until(lambda: not _processes_of(cluster), 10, "every process of the cluster gone")
        assert not ipc.exists()  # a drained gateway closes its socket


def _processes_of(cluster: Cluster) -> list[psutil.Process]:
    config = str(cluster.config_path)
    return [p for p in psutil.process_iter(["cmdline"]) if config in (p.info["cmdline"] or [])]


def test_procfile_supervises_every_entry():
    entries = dict(line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines()
                   if line.strip() and not line.startswith("#"))
    assert "-m gateway --supervise" in entries["gateway"]
    workers = [name for name in entries if name != "gateway"]
    assert workers and all("-m worker.supervisor" in entries[name] for name in workers)
    assert all(command.strip().startswith("exec ") for command in entries.values())  # signals reach Python
