"""Failures: kill -9 of a worker mid-stream, SIGTERM drain of the gateway, and the whole
cluster under `honcho start` surviving a crashed model process and a killed gateway
(tests/test_gateway_restart.py has the gateway's restart in detail)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest

from cluster_harness import Cluster, LONG_MAX_TOKENS, ROOT, _kill_group, generate
from protos import inference_pb2

pytestmark = pytest.mark.timeout(400)
DRAINED_MAX_TOKENS = 2500


def run_streams(cluster, requests: dict[str, dict], results: dict) -> list[threading.Thread]:
    def client(name, fields):
        try:
            results[name] = generate(cluster.stub, timeout=120, **fields)
        except grpc.RpcError as e:
            results[name] = e

    threads = [threading.Thread(target=client, args=item) for item in requests.items()]
    for t in threads:
        t.start()
    return threads


def reference_then_streams_running(cluster, requests: dict[str, dict]) -> tuple[dict, dict, list[threading.Thread]]:
    """Each request's undisturbed result, then the same requests started again, returned once
    worker-0 runs some of them (results fill in as their threads end)."""
    reference: dict = {}
    for t in run_streams(cluster, requests, reference):
        t.join(timeout=120)
    assert all(not isinstance(r, Exception) for r in reference.values()), reference
    results: dict = {}
    threads = run_streams(cluster, requests, results)
    deadline = time.monotonic() + 30
    while cluster.status().workers[0].num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return reference, results, threads


def assert_streams_match(reference: dict, results: dict, threads: list[threading.Thread], timeout_s: float = 120):
    """Every disturbed stream gave its undisturbed tokens and text: no gap, no duplicate."""
    for t in threads:
        t.join(timeout=timeout_s)
    for name, want in reference.items():
        got = results[name]
        assert not isinstance(got, Exception), (name, got)
        assert (got[0], got[1]) == (want[0], want[1]), name


def test_kill_9_of_a_worker_mid_stream_resumes_every_stream_elsewhere(served_checkpoint):
    requests = {f"greedy-{i}": dict(prompt_token_ids=[5 + i, 6, 7, 8], sampling=dict(
        max_tokens=400, temperature=0.0, ignore_eos=True)) for i in range(4)}  # long enough to be cut
    requests.update({f"seeded-{i}": dict(prompt_token_ids=[9, 10 + i], sampling=dict(
        max_tokens=400, temperature=1.0, seed=100 + i, ignore_eos=True)) for i in range(4)})
    with Cluster(served_checkpoint, num_workers=2, supervised=True) as cluster:
        reference, results, threads = reference_then_streams_running(cluster, requests)
        [victim] = cluster.model_pids("worker-0")
        time.sleep(0.2)  # mid-stream
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        deadline = time.monotonic() + 10
        while cluster.status().workers[0].alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.monotonic() - killed_at < 2.0, "the gateway took over 2 s to notice"
        assert_streams_match(reference, results, threads)
        # The supervisor restarted the model process; it rejoins and is used again.
        status = cluster.wait_ready(timeout_s=120)
        assert status.workers[0].num_restarts >= 1
        assert cluster.model_pids("worker-0") and cluster.model_pids("worker-0") != [victim]
        used = set()
        for i in range(6):
            used.add(generate(cluster.stub, prompt_token_ids=[30 + i], sampling=dict(max_tokens=2))[2].worker_id)
            if "worker-0" in used:
                break
        assert "worker-0" in used


def test_streams_end_unavailable_when_no_worker_is_left(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=1) as cluster:
        results: dict = {}
        threads = run_streams(cluster, {"only": dict(prompt_token_ids=[5, 6], sampling=dict(
            max_tokens=LONG_MAX_TOKENS, ignore_eos=True))}, results)
        deadline = time.monotonic() + 30
        while cluster.status().workers[0].num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        _kill_group(cluster.procs["worker-0"], signal.SIGKILL)
        for t in threads:
            t.join(timeout=30)
        assert isinstance(results["only"], grpc.RpcError)
        assert results["only"].code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as e:
            generate(cluster.stub, prompt="x", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_drains_the_gateway(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=1, sections={"gateway": {"drain_grace_s": 60.0}}) as cluster:
        results: dict = {}
        # Long enough that the streams are still running when the probe below arrives (seconds on any
        # host; the probe comes within milliseconds of the drain), short enough not to hold the suite.
        threads = run_streams(cluster, {f"s{i}": dict(prompt_token_ids=[5, i + 6], sampling=dict(
            max_tokens=DRAINED_MAX_TOKENS, temperature=0.0, ignore_eos=True)) for i in range(3)}, results)
        deadline = time.monotonic() + 30
        while cluster.status().workers[0].num_running < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        gateway = cluster.procs["gateway"]
        gateway.send_signal(signal.SIGTERM)
        # Probed as soon as the drain has begun: a fixed wait could outlast the streams on a fast
        # host, and a gateway with nothing in flight stops listening as it drains.
        deadline = time.monotonic() + 10
        while not cluster.status().draining and time.monotonic() < deadline:
            time.sleep(0.005)
        with pytest.raises(grpc.RpcError) as e:
            generate(cluster.stub, prompt="x", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        for t in threads:
            t.join(timeout=60)
        for name, got in results.items():
            assert not isinstance(got, Exception), (name, got)
            assert len(got[0]) == DRAINED_MAX_TOKENS and got[2].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert gateway.wait(timeout=30) == 0


def test_honcho_start_keeps_the_cluster_up_when_a_model_process_or_the_gateway_dies(served_checkpoint):
    """The repository's own Procfile under `honcho start`, with only the interpreter and the config
    swapped for the test's: a kill -9 of a model process or of the gateway process stops nothing,
    and SIGTERM to honcho, with a stream in flight, ends that stream UNAVAILABLE, stops every entry
    with status 0 and leaves no process behind."""
    cluster = Cluster(served_checkpoint, num_workers=2)  # used for its config, channel and helpers only
    config = cluster.config_path
    procfile = cluster.run_dir / "Procfile"
    procfile.write_text((ROOT / "Procfile").read_text().replace(".venv/bin/python", sys.executable)
                        .replace("configs/default.toml", str(config)))
    log_path = cluster.run_dir / "honcho.log"
    log = open(log_path, "wb")
    honcho = subprocess.Popen([sys.executable, "-m", "honcho", "start", "-f", str(procfile), "-d", str(ROOT)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "MODEL": str(served_checkpoint)})
    cluster.procs["honcho"] = honcho
    try:
        cluster.connect()
        cluster.wait_ready(timeout_s=120)
        [victim] = cluster.model_pids("worker-0")
        os.kill(victim, signal.SIGKILL)
        time.sleep(1.0)
        assert honcho.poll() is None, "honcho stopped the cluster"
        ids, _, _ = generate(cluster.stub, prompt="still up", sampling=dict(max_tokens=3))
        assert ids
        status = cluster.wait_ready(timeout_s=120)
        assert status.workers[0].num_restarts >= 1
        # The gateway next: its supervisor starts another, which both workers serve, models still loaded.
        models = {w: cluster.model_pids(w) for w in ("worker-0", "worker-1")}
        [gateway] = cluster.gateway_pids()
        os.kill(gateway, signal.SIGKILL)
        time.sleep(1.0)
        assert honcho.poll() is None, "honcho stopped the cluster with the gateway"
        cluster.channel.close()
        cluster.connect()
        status = cluster.wait_ready(timeout_s=30)
        assert cluster.gateway_pids() not in ([], [gateway])
        assert {w: cluster.model_pids(w) for w in models} == models, "a worker reloaded its model"
        assert generate(cluster.stub, prompt="still up", sampling=dict(max_tokens=3))[0]
        # Stopping honcho stops everything: each supervisor drains its process and exits 0. A stream
        # in flight ends UNAVAILABLE once its worker has stopped, well inside honcho's 5 s before
        # SIGKILL (its worker is not coming back to a draining gateway).
        results: dict = {}
        threads = run_streams(cluster, {"in flight": dict(prompt_token_ids=[5, 6], sampling=dict(
            max_tokens=LONG_MAX_TOKENS, ignore_eos=True))}, results)
        deadline = time.monotonic() + 30
        while sum(w.num_running for w in cluster.status().workers) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(w.num_running for w in cluster.status().workers) > 0, "the stream never started"
        honcho.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive(), "the stream outlived the cluster"
        got = results["in flight"]
        assert isinstance(got, grpc.RpcError) and got.code() == grpc.StatusCode.UNAVAILABLE, got
        assert "every worker stopped" in got.details(), got.details()
        honcho.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (cluster.model_pids("worker-0") or cluster.model_pids("worker-1")
                                               or cluster.gateway_pids()):
            time.sleep(0.1)
        assert not cluster.model_pids("worker-0") and not cluster.model_pids("worker-1")
        assert not cluster.gateway_pids()
        leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(config) in (p.info["cmdline"] or [])]
        assert not leftovers
        log.flush()
        stops = dict(re.findall(r"(\S+) stopped \(rc=(-?\d+)\)", log_path.read_text(errors="replace")))
        assert set(stops) >= {"gateway.1", "worker0.1", "worker1.1"} and set(stops.values()) == {"0"}, stops
    finally:
        cluster.stop()
        log.close()


def test_a_worker_stopped_by_sigterm_hands_its_streams_on_at_once(served_checkpoint):
    """A stopped worker leaves its unfinished requests behind like a crashed one, and says so
    (WorkerExit, stopping): they resume on the other worker at once. The gateway's heartbeat
    timeout here outlasts the streams' deadline, so a gateway that waited for missed heartbeats
    would fail them DEADLINE_EXCEEDED."""
    requests = {f"greedy-{i}": dict(prompt_token_ids=[5 + i, 6, 7, 8], sampling=dict(
        max_tokens=3000, temperature=0.0, ignore_eos=True)) for i in range(4)}
    sections = {"gateway": {"heartbeat_timeout_s": 200.0, "forget_worker_after_s": 200.0}}
    with Cluster(served_checkpoint, num_workers=2, sections=sections) as cluster:
        reference, results, threads = reference_then_streams_running(cluster, requests)
        [worker] = cluster.model_pids("worker-0")
        os.kill(worker, signal.SIGTERM)
        assert_streams_match(reference, results, threads, timeout_s=150)
        [entry] = [w for w in cluster.status().workers if w.worker_id == "worker-0"]
        assert not entry.alive and entry.exit_reason == "stopped on a signal"


def test_a_worker_declared_dead_that_comes_back_finishes_its_streams(served_checkpoint):
    """A worker paused past gateway.heartbeat_timeout_s (a stall, not a crash) is declared dead and
    its streams requeued; when it runs again it still holds them under their first ids, and the
    resumed streams, sent back to it as the only worker, must not collide with those."""
    requests = {f"greedy-{i}": dict(prompt_token_ids=[5 + i, 6, 7, 8], sampling=dict(
        max_tokens=300, temperature=0.0, ignore_eos=True)) for i in range(3)}
    requests["seeded"] = dict(prompt_token_ids=[9, 10], sampling=dict(max_tokens=300, temperature=1.0, seed=5,
                                                                      ignore_eos=True))
    with Cluster(served_checkpoint, num_workers=1) as cluster:
        reference, results, threads = reference_then_streams_running(cluster, requests)
        [worker] = cluster.model_pids("worker-0")
        os.kill(worker, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while cluster.status().workers[0].alive and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not cluster.status().workers[0].alive
        finally:
            os.kill(worker, signal.SIGCONT)
        assert_streams_match(reference, results, threads)
