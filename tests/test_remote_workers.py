"""Workers that join over the network: a gateway with no workers of its own on tcp://127.0.0.1
with CURVE keys, and workers started as separate processes with `--connect`. They serve greedy
streams identical to the in-process engine, a third joins mid-run and takes traffic, a killed one's
streams resume on the others and it leaves the table, one serving another model is refused, and
a restarted gateway is re-joined by the running workers without a model reload."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from bench.cluster_process import ClusterProcess, _signal_group, free_port
from cluster_harness import ROOT, SERVED_MAX_POSITIONS, generate
from conftest import make_checkpoint
from protos import inference_pb2, inference_pb2_grpc
from tokenizer_fixture import make_tokenizer

pytestmark = pytest.mark.timeout(420)
SAMPLING = {"max_tokens": 24, "temperature": 0.0}


class RemoteCluster(ClusterProcess):
    """A gateway alone on tcp:// with CURVE keys; workers join it one by one."""

    def __init__(self, model_dir, keys_dir):
        self.worker_port = free_port()
        self.keys_dir = keys_dir
        super().__init__(model_dir, num_workers=0, sections={
            "gateway": {"worker_endpoint": f"tcp://127.0.0.1:{self.worker_port}", "curve_keys_dir": str(keys_dir),
                        "forget_worker_after_s": 3.0},
            "worker": {"num_threads": 1, "num_kv_blocks": 256}})
        self.workers: dict[str, subprocess.Popen] = {}

    def join(self, worker_id: str | None, model_dir=None) -> subprocess.Popen:
        args = [sys.executable, "-m", "worker.supervisor", "--config", str(self.config_path), "--connect",
                f"tcp://127.0.0.1:{self.worker_port}", "--worker.curve_keys_dir", str(self.keys_dir)]
        args += ["--worker-id", worker_id] if worker_id else []
        args += ["--model-dir", str(model_dir)] if model_dir else []
        name = worker_id or "default-id"
        with open(self.run_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.workers[name] = proc
        return proc

    def kill(self, name: str) -> None:
        _signal_group(self.workers[name], signal.SIGKILL)
        self.workers[name].wait(timeout=10)

    def status(self, stub) -> inference_pb2.ClusterStatus:
        return stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=5)

    def wait_for(self, stub, predicate, what: str, timeout_s: float = 120):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status = self.status(stub)
                if predicate({w.worker_id: w for w in status.workers}):
                    return status
            except grpc.RpcError:
                status = None  # the gateway is restarting
            assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}; last {status}"
            time.sleep(0.1)

    def stop(self, keep_run_dir: bool = False) -> None:
        for proc in self.workers.values():
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)
        super().stop(keep_run_dir)


@pytest.fixture
def keys_dir(tmp_path):
    subprocess.run([sys.executable, "-m", "tools.curve_keys", str(tmp_path / "keys")], cwd=ROOT, check=True,
                   timeout=60)
    return tmp_path / "keys"


def ready(*ids):
    return lambda workers: all(i in workers and workers[i].ready for i in ids)


def test_workers_join_serve_leave_and_rejoin_a_restarted_gateway(served_checkpoint, keys_dir, tmp_path):
    from worker.engine import Engine, SamplingParams
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(4, 60))] for _ in range(16)]
    engine = Engine.from_model_dir(served_checkpoint, num_kv_blocks=256)
    expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(**SAMPLING), use_tqdm=False)]
    other_model = make_checkpoint(tmp_path / "other", "llama", seed=7, vocab_size=320,
                                  max_position_embeddings=SERVED_MAX_POSITIONS, num_hidden_layers=3)
    make_tokenizer(other_model, vocab_size=320)

    with RemoteCluster(served_checkpoint, keys_dir) as cluster, grpc.insecure_channel(cluster.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        assert cluster.status(stub).workers == []  # no worker of its own
        cluster.join("remote-a")
        cluster.join("remote-b")
        cluster.wait_for(stub, ready("remote-a", "remote-b"), "two workers joined")

        results: dict[int, tuple] = {}

        def run(i):
            results[i] = generate(stub, prompt_token_ids=prompts[i], sampling=SAMPLING)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [results[i][0] for i in range(16)] == expected
        assert {results[i][2].worker_id for i in range(16)} == {"remote-a", "remote-b"}

        # A third worker (its id derived from host and device) joins mid-run and takes traffic.
        cluster.join(None)
        status = cluster.wait_for(stub, lambda w: len(w) == 3 and all(x.ready for x in w.values()), "a third worker")
        third = ({w.worker_id for w in status.workers} - {"remote-a", "remote-b"}).pop()
        assert third.endswith("-cpu")
        seen = set()
        for i in range(12):
            seen.add(generate(stub, prompt_token_ids=prompts[i], sampling=SAMPLING)[2].worker_id)
        assert third in seen

        # A worker serving another model is refused, named in the log, and never listed.
        cluster.join("remote-other", model_dir=other_model)
        deadline = time.monotonic() + 120
        while "refusing remote-other" not in (cluster.run_dir / "gateway.log").read_text():
            assert time.monotonic() < deadline, cluster.logs("gateway")
            time.sleep(0.2)
        assert "remote-other" not in {w.worker_id for w in cluster.status(stub).workers}

        # Killed mid-stream: its streams resume on the others, then it leaves the table.
        long = dict(SAMPLING, max_tokens=200, ignore_eos=True)
        streams = [stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=p, sampling=inference_pb2.SamplingOptions(
            **long)), timeout=120) for p in prompts[:6]]
        firsts = [next(s) for s in streams]
        victim = firsts[0].worker_id
        cluster.kill(victim if victim in cluster.workers else "default-id")
        for first, stream in zip(firsts, streams):
            tokens = list(first.token_ids) + [t for r in stream for t in r.token_ids]
            assert len(tokens) == 200
        cluster.wait_for(stub, lambda w: victim not in w, "the killed worker forgotten", timeout_s=30)

        # The gateway restarts (kill -9 and a new process): the running workers re-join it,
        # models still loaded.
        survivors = [n for n in ("remote-a", "remote-b", "default-id") if cluster.workers[n].poll() is None]
        pids = {n: cluster.workers[n].pid for n in survivors}
        _signal_group(cluster.procs["gateway"], signal.SIGKILL)
        cluster.procs["gateway"].wait(timeout=10)
        cluster._spawn("gateway", cluster.gateway_module)
        status = cluster.wait_for(stub, lambda w: sum(x.ready for x in w.values()) == len(survivors),
                                  "the workers re-joined the new gateway")
        assert {n: cluster.workers[n].pid for n in survivors} == pids
        for name in survivors:
            log = (cluster.run_dir / f"{name}.log").read_text()
            assert log.count(" ready (incarnation") == 1, name  # loaded once: no model process restart
        ids, _, _ = generate(stub, prompt_token_ids=prompts[0], sampling=SAMPLING)
        assert ids == expected[0]


def test_plain_tcp_without_keys_is_refused_unless_allowed(served_checkpoint, tmp_path):
    """On an address other hosts reach; loopback tcp:// uses the cluster's own keys, as ipc:// does."""
    endpoint = f"tcp://0.0.0.0:{free_port()}"
    common = [sys.executable, "-m", "gateway", "--model-dir", str(served_checkpoint), "--run_dir",
              str(tmp_path / "run"), "--gateway.port", "0", "--gateway.http_port", "0", "--gateway.metrics_port", "0",
              "--num_workers", "0", "--gateway.worker_endpoint", endpoint]
    done = subprocess.run(common, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "allow_insecure_tcp" in done.stdout + done.stderr
    proc = subprocess.Popen([*common, "--gateway.allow_insecure_tcp", "true"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while not any("gateway listening" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(proc.stdout.readline())
        assert any("WITHOUT authentication" in line for line in lines), "".join(lines)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
