"""`python -m deploy.ray` on a local multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head and
worker nodes, each a raylet with its own resources, all on this machine). `up` places the workers
on different nodes and they serve greedy streams identical to the in-process engine; removing a
node mid-stream resumes its streams on the other worker and Ray restarts the lost one on a new
node; `scale` up and down while streams run, and up again into the bundles scaling down left;
`down` leaves no process behind. A bad spec is
refused before anything starts."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

import grpc
import pytest

from bench.cluster_process import free_port
from cluster_harness import ROOT, generate
from protos import inference_pb2, inference_pb2_grpc

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

SAMPLING = {"max_tokens": 24, "temperature": 0.0}
LONG = {"max_tokens": 160, "temperature": 0.0, "ignore_eos": True}
CONFIG = """
[gateway]
heartbeat_timeout_s = 3.0
forget_worker_after_s = 6.0
metrics_port = 0
http_port = 0
[worker]
num_kv_blocks = 256
"""


class RayDeployment:
    """The CLI against one Ray cluster, as a user on its head node runs it."""

    def __init__(self, cluster, tmp_path):
        self.env = {**os.environ, "RAY_ADDRESS": cluster.address}
        self.config = tmp_path / "cluster.toml"
        self.config.write_text(CONFIG)
        self.grpc_port = free_port()
        self.worker_port = free_port()

    def cli(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "deploy.ray", *args, "--name", "t", "--namespace", "test-deploy"],
                              cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check:
            assert done.returncode == 0, f"{args}: {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
        return done

    def up(self, model_dir, num_workers: int) -> None:
        self.cli("up", "--model-dir", str(model_dir), "--num-workers", str(num_workers), "--config", str(self.config),
                 "--worker-port", str(self.worker_port), "--gateway.port", str(self.grpc_port))

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    def wait_for(self, predicate, what: str, timeout_s: float = 180) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            report = self.status()
            if predicate(report):
                return report
            assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}; last {report}"
            time.sleep(1.0)


def serving(report: dict, count: int) -> bool:
    """`count` workers the gateway serves, each with its actor answering and its process alive (a
    restarting actor does not answer, while the gateway may still list its old process)."""
    return len(report["workers"]) == count and all(w["health"] == "SERVING" and w.get("alive")
                                                   for w in report["workers"])


def stream_all(stub, prompts, sampling) -> tuple[list, list]:
    """Open one stream per prompt and take each one's first message (so each is running somewhere)."""
    streams = [stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=p, sampling=inference_pb2.SamplingOptions(
        **sampling)), timeout=240) for p in prompts]
    return streams, [next(s) for s in streams]


def finish(streams, firsts) -> list[list[int]]:
    return [list(f.token_ids) + [t for r in s for t in r.token_ids] for f, s in zip(firsts, streams)]


def pids_gone(pids, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.5)
    return False


@pytest.fixture
def ray_cluster():
    from ray.cluster_utils import Cluster
    # The head's one CPU goes to the gateway, so the workers' bundles land on the other nodes.
    # The GCS's health checks find a killed node in about 3 s rather than Ray's default 15.
    checks = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": checks})
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_up_serve_lose_a_node_scale_and_down(served_checkpoint, ray_cluster, tmp_path):
    from worker.engine import Engine, SamplingParams
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(4, 60))] for _ in range(8)]
    engine = Engine.from_model_dir(served_checkpoint, num_kv_blocks=256)
    expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(**SAMPLING), use_tqdm=False)]
    expected_long = [o.token_ids for o in engine.generate(prompts[:4], SamplingParams(**LONG), use_tqdm=False)]
    deployment = RayDeployment(ray_cluster, tmp_path)
    seen_pids: set[int] = set()
    deployment.up(served_checkpoint, 2)
    try:
        report = deployment.status()
        head = ray_cluster.head_node.node_id
        assert report["gateway"]["node_id"] == head and report["gateway"]["health"] == "SERVING"
        assert serving(report, 2)
        nodes = {w["worker_id"]: w["node_id"] for w in report["workers"]}
        assert len(set(nodes.values())) == 2 and head not in nodes.values(), report
        seen_pids |= {report["gateway"]["pid"], *(w["pid"] for w in report["workers"])}

        with grpc.insecure_channel(f"127.0.0.1:{deployment.grpc_port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            results: dict[int, tuple] = {}
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate(
                stub, prompt_token_ids=prompts[i], sampling=SAMPLING))) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert [results[i][0] for i in range(8)] == expected
            assert {results[i][2].worker_id for i in range(8)} == {"worker-0", "worker-1"}

            # A node is lost mid-stream: its worker's streams resume on the other one, and Ray
            # restarts the lost worker (its placement group bundle moves) on a spare node. The
            # spare joins before the loss: a raylet started while the GCS handles a killed node
            # can miss Ray's fixed 30 s registration wait on a 2-core host.
            ray_cluster.add_node(num_cpus=2)
            ray_cluster.wait_for_nodes()
            streams, firsts = stream_all(stub, prompts[:4], LONG)
            victim = firsts[0].worker_id
            node = next(n for n in ray_cluster.list_all_nodes() if n.node_id == nodes[victim])
            ray_cluster.remove_node(node, allow_graceful=False)
            assert finish(streams, firsts) == expected_long
            report = deployment.wait_for(lambda r: serving(r, 2) and any(
                w["worker_id"] == victim and w["restarted"] for w in r["workers"]), "the lost worker restarted")
            restarted = next(w for w in report["workers"] if w["worker_id"] == victim)
            assert restarted["restarted"] and restarted["node_id"] not in nodes.values()
            seen_pids |= {w["pid"] for w in report["workers"]}

            # Scale up while streams run: they finish, and the new worker takes traffic.
            streams, firsts = stream_all(stub, prompts[:4], LONG)
            deployment.cli("scale", "3")
            assert finish(streams, firsts) == expected_long
            report = deployment.wait_for(lambda r: serving(r, 3), "three workers")
            seen_pids |= {w["pid"] for w in report["workers"]}
            served_by = {generate(stub, prompt_token_ids=p, sampling=SAMPLING)[2].worker_id for p in prompts * 2}
            assert "worker-2" in served_by

            # Scale down while streams run: the removed workers drain, their streams resume.
            streams, firsts = stream_all(stub, prompts[:4], LONG)
            deployment.cli("scale", "1", "--drain-s", "10")
            assert finish(streams, firsts) == expected_long
            report = deployment.status()
            assert [w["worker_id"] for w in report["workers"]] == ["worker-0"] and serving(report, 1)
            assert generate(stub, prompt_token_ids=prompts[0], sampling=SAMPLING)[0] == expected[0]

            # Scale up again: the bundles the removed workers left in their placement groups stay
            # reserved (a group cannot shrink), so the new worker takes one of them rather than
            # asking the cluster for room it no longer has.
            deployment.cli("scale", "2")
            report = deployment.wait_for(lambda r: serving(r, 2), "two workers again")
            groups = {w["worker_id"]: (w["placement_group"], w["bundle_index"]) for w in report["workers"]}
            assert groups["worker-1"][0] == groups["worker-0"][0] and groups["worker-1"][1] != groups["worker-0"][1]
            seen_pids |= {w["pid"] for w in report["workers"]}
            served_by = {generate(stub, prompt_token_ids=p, sampling=SAMPLING)[2].worker_id for p in prompts * 2}
            assert served_by == {"worker-0", "worker-1"}
    finally:
        down = deployment.cli("down", "--drain-s", "5", check=False)
    assert down.returncode == 0, down.stderr
    gone = deployment.cli("status", check=False)
    assert gone.returncode == 1 and "no deployment 't'" in gone.stderr
    assert pids_gone(seen_pids), f"processes left behind: {seen_pids}"


def test_a_bad_spec_is_refused_before_anything_starts(served_checkpoint, tmp_path):
    def refused(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "deploy.ray", "up", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
        assert done.returncode == 2, done
        return done.stderr

    assert "no config.json" in refused("--model-dir", str(tmp_path), "--num-workers", "1")
    model = ["--model-dir", str(served_checkpoint), "--num-workers", "1"]
    assert "set by the launcher" in refused(*model, "--gateway.worker_endpoint", "tcp://127.0.0.1:1")
    assert "not config flags" in refused(*model, "--no-such-flag", "1")
    assert "gateway.port" in refused(*model, "--gateway.port", "-5")
    assert "--gpus-per-worker" in refused(*model, "--cpus-per-worker", "0")


def test_a_ray_address_that_does_not_answer_is_named_at_once():
    """`ray.init` waits minutes on an address nobody answers; the launcher says so at once."""
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "deploy.ray", "status", "--name", "t", "--namespace", "x"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": address})
    assert done.returncode == 1 and f"no Ray cluster answers at RAY_ADDRESS={address}" in done.stderr, done
