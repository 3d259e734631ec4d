"""Several gateways that share nothing, each with its own workers: gateway.reuse_port sharing one port between
gateway processes and the error a taken port gives without it (gateway/listen.py), Procfile.partitioned's
entries, and two real gateways with a worker each behind the client-side pool."""
from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from bench.cluster_process import _signal_group, free_port
from cluster_harness import ROOT, Cluster
from gateway.gateway_pool import GatewayPool, rendezvous_weight
from gateway.listen import ListenError, add_grpc_port, grpc_server_options, listen_socket
from protos import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.timeout(300)
SAMPLING = {"max_tokens": 16, "temperature": 0.0}


# ---- binding, in this process ------------------------------------------------------------------------------
def test_a_taken_port_names_its_address_and_the_setting_and_reuse_port_shares_it():
    first = listen_socket("127.0.0.1", 0, reuse_port=False)
    port = first.getsockname()[1]
    try:
        with pytest.raises(ListenError, match=rf"127\.0\.0\.1:{port} for HTTP \(gateway.http_port\).*"
                                              r"gateway.reuse_port = true"):
            listen_socket("127.0.0.1", port, reuse_port=False)
        with pytest.raises(ListenError, match="processes that set SO_REUSEPORT too"):  # the holder did not
            listen_socket("127.0.0.1", port, reuse_port=True)
    finally:
        first.close()
    shared = [listen_socket("127.0.0.1", port, reuse_port=True) for _ in range(2)]
    for s in shared:
        s.close()

    async def grpc_ports():
        held = grpc.aio.server(options=grpc_server_options(False))
        taken = add_grpc_port(held, "127.0.0.1", 0, None, reuse_port=False)
        with pytest.raises(ListenError, match=rf"127\.0\.0\.1:{taken} for gRPC \(gateway.port\)"):
            add_grpc_port(grpc.aio.server(options=grpc_server_options(False)), "127.0.0.1", taken, None, False)
        one, two = (grpc.aio.server(options=grpc_server_options(True)) for _ in range(2))
        port = add_grpc_port(one, "127.0.0.1", 0, None, reuse_port=True)
        assert add_grpc_port(two, "127.0.0.1", port, None, reuse_port=True) == port

    asyncio.run(grpc_ports())


def test_a_taken_metrics_port_says_each_gateway_needs_its_own():
    from gateway.metrics import Metrics
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ListenError, match=rf"127\.0\.0\.1:{port} for metrics.*needs a metrics port of its own"):
            Metrics().serve(port, "127.0.0.1")


# ---- Procfile.partitioned ----------------------------------------------------------------------------------
def procfile_configs() -> dict[str, object]:
    """Each entry of Procfile.partitioned parsed with its own module's flags: name -> ClusterConfig."""
    import argparse
    from shared.config import add_config_flags, config_from_args
    from shared.worker_identity import add_worker_flags, expand_connect
    configs = {}
    for line in (ROOT / "Procfile.partitioned").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, command = line.split(":", 1)
        command = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", command)  # the shell's defaults
        argv = shlex.split(command)
        assert argv[:4] in (["exec", ".venv/bin/python", "-m", "gateway"],
                            ["exec", ".venv/bin/python", "-m", "worker.supervisor"]), line
        parser = argparse.ArgumentParser()
        add_config_flags(parser)
        if argv[3] == "gateway":
            parser.add_argument("--supervise", action="store_true")
            args = parser.parse_args(argv[4:])
            assert args.supervise, name
        else:
            add_worker_flags(parser)
            args = parser.parse_args(expand_connect(argv[4:]))
        configs[name] = (config_from_args(args), getattr(args, "worker_id", None))
    return configs


def test_procfile_partitioned_pairs_each_worker_with_its_own_gateway(monkeypatch):
    monkeypatch.chdir(ROOT)  # the paths in it are relative to the repository
    configs = procfile_configs()
    gateways = {n: c for n, (c, _) in configs.items() if n.startswith("gateway")}
    workers = {n: (c, w) for n, (c, w) in configs.items() if n.startswith("worker")}
    assert len(gateways) == len(workers) == 2
    for what in ("port", "http_port", "metrics_port"):
        assert len({getattr(c.gateway, what) for c in gateways.values()}) == 2, what
    endpoints = {c.worker_endpoint for c in gateways.values()}
    assert len(endpoints) == 2 and {c.worker_endpoint for c, _ in workers.values()} == endpoints
    assert len({w for _, w in workers.values()}) == 2  # ids distinct across the host
    assert {c.worker.reserved_cores for c, _ in configs.values()} == {2}  # a core for each gateway


# ---- real processes ----------------------------------------------------------------------------------------
def ok_count(cluster: Cluster) -> int:
    """The gateway's own count of RPCs that ended OK (its metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    match = re.search(r'^inference_request_status_total\{code="OK"\} (\S+)$', text, re.M)
    return int(float(match.group(1))) if match else 0


def ok_counts(clusters, expected_total: int, timeout_s: float = 10.0) -> list[int]:
    """Each gateway's OK count once together they reach `expected_total` (the last RPC's count
    may land just after its client saw the end)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [ok_count(c) for c in clusters]
        if sum(counts) >= expected_total or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def run_to_end(pool: GatewayPool, **fields) -> tuple[list[int], inference_pb2.GenerateResponse]:
    sampling = fields.pop("sampling", SAMPLING)
    request = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingOptions(**sampling), **fields)
    ids, last = [], None
    for response in pool.generate(request, timeout=60):
        ids.extend(response.token_ids)
        last = response
    return ids, last


def test_two_gateways_behind_the_pool_serve_sessions_and_survive_one_killed(served_checkpoint, capsys):
    from worker.engine import Engine, SamplingParams
    prompts = [[3 + (7 * i + 11 * j) % 300 for j in range(8 + 3 * i)] for i in range(16)]
    engine = Engine.from_model_dir(served_checkpoint, num_kv_blocks=256)
    expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(**SAMPLING), use_tqdm=False)]
    del engine
    with contextlib.ExitStack() as stack:
        a, b = (Cluster(served_checkpoint, num_workers=1) for _ in range(2))
        stack.callback(a.stop)
        stack.callback(b.stop)
        with ThreadPoolExecutor(2) as starting:
            list(starting.map(lambda c: c.start(), (a, b)))
        pool = stack.enter_context(GatewayPool([a.address, b.address]))

        # 16 greedy streams at once: the engine's outputs, and both gateways take a share.
        results: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run_to_end(
            pool, prompt_token_ids=prompts[i])[0])) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [results.get(i) for i in range(16)] == expected
        counts = ok_counts((a, b), 16)
        assert sum(counts) == 16 and min(counts) >= 1, counts

        # Sessions: every turn of a conversation reaches the one gateway (so the one worker) that
        # holds its history, whose prefix cache serves the earlier turns. Two sessions per gateway.
        homes = {s: max((a.address, b.address), key=lambda g: rendezvous_weight(g, s))
                 for s in (f"conv-{i}" for i in range(64))}
        sessions = [s for s in homes if homes[s] == a.address][:2] + [s for s in homes if homes[s] == b.address][:2]
        total = 16
        for s, session in enumerate(sessions):
            before = ok_counts((a, b), total)
            history = prompts[s][:40] + [5] * 32  # two full KV blocks at least
            for turn in range(3):
                ids, last = run_to_end(pool, prompt_token_ids=history, session_id=session)
                if turn:
                    assert last.usage.cached_prompt_tokens >= 32, (session, turn, last.usage)
                history = history + ids + [7, 8, 9]
            total += 3
            after = ok_counts((a, b), total)
            landed = [x - y for x, y in zip(after, before)]
            assert sorted(landed) == [0, 3], (session, landed)
            assert landed[[a.address, b.address].index(homes[session])] == 3

        # Gateway b is killed: a session it held is refused UNAVAILABLE before any token, retried
        # on a and served there; the requests after it go to a while b is marked down.
        _signal_group(b.procs["gateway"], signal.SIGKILL)
        b.procs["gateway"].wait(timeout=10)
        before = ok_count(a)
        b_session = sessions[2]
        assert run_to_end(pool, prompt_token_ids=prompts[0], session_id=b_session)[0] == expected[0]
        assert pool.healthy() == [a.address]
        for i in range(1, 5):
            assert run_to_end(pool, prompt_token_ids=prompts[i])[0] == expected[i]
        assert ok_counts((a,), before + 5) == [before + 5]
        # The command-line client over the same two addresses: one of them is down, the answer comes.
        from gateway import client
        capsys.readouterr()
        assert client.main(["--address", f"{a.address},{b.address}", "--session-id", b_session, "--max-tokens",
                            "4", "--ignore-eos", "-v", "hello"]) == 0
        assert "on worker-0: length" in capsys.readouterr().err


def spawn_gateway(tmp_path: Path, name: str, port: int, *flags: str, supervise: bool = False) -> subprocess.Popen:
    """`python -m gateway` with no workers of its own, its own run_dir and log, on `port`."""
    argv = [sys.executable, "-m", "gateway", *(["--supervise"] if supervise else []), "--run_dir",
            str(tmp_path / name), "--gateway.port", str(port), "--gateway.metrics_port", "0",
            "--gateway.http_port", "0", "--num_workers", "0", *flags]
    log = open(tmp_path / f"{name}.log", "wb")
    try:
        return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def wait_listening(proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while "gateway listening" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.05)


def test_reuse_port_lets_gateways_share_a_port_and_without_it_a_taken_port_fails_by_name(served_checkpoint,
                                                                                         tmp_path):
    model = ["--model-dir", str(served_checkpoint)]
    shared_port, shared_http, taken_port = free_port(), free_port(), free_port()
    reuse = ["--gateway.reuse_port", "true", "--gateway.http_port", str(shared_http)]
    # The two sharing gateways tell themselves apart by their worker tables: one lists worker-0.
    procs = {"shared-0": spawn_gateway(tmp_path, "shared-0", shared_port, *model, *reuse),
             "shared-1": spawn_gateway(tmp_path, "shared-1", shared_port, *model, *reuse, "--num_workers", "1"),
             "alone": spawn_gateway(tmp_path, "alone", taken_port, *model)}
    try:
        for name, proc in procs.items():
            wait_listening(proc, tmp_path / f"{name}.log")
        # A second gateway on a taken port, started alone or under its supervisor, fails at once
        # and names the address and the setting.
        for name, supervise in (("second", False), ("second-supervised", True)):
            proc = spawn_gateway(tmp_path, name, taken_port, *model, supervise=supervise)
            procs[name] = proc
            assert proc.wait(timeout=60) == 2
            log = (tmp_path / f"{name}.log").read_text()
            assert f"cannot listen on 127.0.0.1:{taken_port} for gRPC (gateway.port)" in log, log
            assert "gateway.reuse_port" in log and "Traceback" not in log, log
        # So does one whose HTTP port alone is taken, with that one line and nothing after it.
        proc = procs["http-taken"] = spawn_gateway(tmp_path, "http-taken", free_port(), *model, "--gateway.http_port",
                                                   str(shared_http))
        assert proc.wait(timeout=60) == 2
        log = (tmp_path / "http-taken.log").read_text()
        assert log.rstrip().endswith(f"cannot listen on 127.0.0.1:{shared_http} for HTTP (gateway.http_port): Address "
                                     f"already in use; stop what holds it, choose another port, or set "
                                     f"gateway.reuse_port = true on every gateway that is to share it"), log
        # Each new connection to the shared port reaches one of the two; calls succeed on both.
        seen = set()
        for _ in range(24):
            channel = grpc.insecure_channel(f"127.0.0.1:{shared_port}", options=[("grpc.use_local_subchannel_pool", 1)])
            with channel:
                status = inference_pb2_grpc.InferenceServiceStub(channel).GetClusterStatus(
                    inference_pb2.GetClusterStatusRequest(), timeout=10)
                seen.add(len(status.workers))
            with urllib.request.urlopen(f"http://127.0.0.1:{shared_http}/v1/models", timeout=10) as r:
                assert r.status == 200
        assert seen == {0, 1}, seen
    finally:
        for proc in procs.values():
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)
