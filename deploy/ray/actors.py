"""The two actors of a deployment on Ray, each owning one process of the cluster.

`GatewayActor` (named `<name>-gateway`, pinned to the node `up` ran on) runs `python -m gateway` with
no workers of its own and its worker endpoint on tcp://<node address>:<worker port>; it also holds
the deployment's spec, so `scale` and `down` need nothing but the name, and admits workers' keys.
`WorkerActor` (named `<name>-worker-<i>`, placed by a placement group) makes its key pair, has the
gateway admit it, and runs `python -m worker --connect ...`, as `honcho start` runs it on one host.
Both keep their files in the spec's state dir on their node; the gateway's survives its restarts,
so a restarted gateway actor has the same keys and port and the running workers re-join it.
"""
from __future__ import annotations

import os
import socket
import sys
import time

import ray

from deploy.ray import keys
from deploy.ray.process import ChildProcess
from deploy.ray.spec import DeploymentSpec, resolve_config
from shared.curve import GATEWAY, public_file

ADMIT_TIMEOUT_S = 300.0  # a worker waits this long for a gateway actor that is (re)starting
_PROCESS_ENV_DROP = ("RAY_ADDRESS",)  # the child processes are not Ray drivers


def _node() -> dict:
    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "restarted": context.was_current_actor_reconstructed}


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _PROCESS_ENV_DROP}


class GatewayActor:
    def __init__(self, spec: dict):
        self.spec = DeploymentSpec.from_dict(spec)
        self.state = self.spec.state_dir(GATEWAY)
        self.keys_dir = self.state / "keys"
        keys.make_pair(self.keys_dir, GATEWAY)  # kept: workers that hold its public key re-join
        config_path = self.state / "cluster.toml"
        config_path.write_text(self.spec.config_text)
        self.config = resolve_config(config_path, self.spec.model_dir, self.spec.overrides)
        self.endpoint = f"tcp://{ray.util.get_node_ip_address()}:{self.spec.worker_port}"
        argv = [sys.executable, "-m", "gateway", "--config", str(config_path), "--model-dir", self.spec.model_dir,
                "--num_workers", "0", "--run_dir", str(self.state / "run"), "--gateway.worker_endpoint",
                self.endpoint, "--gateway.curve_keys_dir", str(self.keys_dir), *self.spec.overrides]
        self.child = ChildProcess(argv, self.state / "gateway.log", cwd=self.spec.project_root, env=_child_env())

    def deployment_spec(self) -> dict:
        return self.spec.to_dict()

    def admit(self, worker_id: str, public_text: str) -> tuple[str, str]:
        """Admit a worker's public key; (the endpoint to connect to, the gateway's public key)."""
        keys.admit(self.keys_dir, worker_id, public_text)
        return self.endpoint, public_file(self.keys_dir, GATEWAY).read_text()

    def revoke(self, worker_id: str) -> None:
        keys.revoke(self.keys_dir, worker_id)

    def addresses(self) -> dict:
        """Where clients reach this gateway from other nodes (its host, or the node's address when it
        listens on all of them)."""
        g = self.config.gateway
        host = ray.util.get_node_ip_address() if g.host in ("0.0.0.0", "::", "") else g.host
        return {"grpc": f"{host}:{g.port}", "http": f"{host}:{g.http_port}" if g.http_port else "",
                "metrics": f"{host}:{g.metrics_port}" if g.metrics_port else "", "worker_endpoint": self.endpoint}

    def health(self, services: list[str]) -> dict[str, str]:
        """The gateway's grpc.health.v1 status of each service ("" = the gateway; a worker id = that
        worker), asked from this node, so a loopback-only gateway answers too."""
        from tools.health_probe import check_health  # the actor's PYTHONPATH is the project root
        address = f"127.0.0.1:{self.config.gateway.port}" if self.config.gateway.host in (
            "0.0.0.0", "127.0.0.1", "") else self.addresses()["grpc"]
        return {s: check_health(address, s, timeout_s=3.0) for s in services}

    def info(self) -> dict:
        return {**_node(), "pid": self.child.pid, "alive": self.child.alive(), **self.addresses(),
                "log": str(self.child.log_path)}

    def log_tail(self) -> str:
        return self.child.log_tail()

    def stop(self, timeout_s: float) -> int | None:
        """Drain and stop the gateway; the files go with it (the deployment is over)."""
        code = self.child.stop(timeout_s)
        self.spec.remove_state_dir(GATEWAY)
        return code


class WorkerActor:
    def __init__(self, spec: dict, index: int, placement_group: str, bundle_index: int = 0):
        from deploy.ray.spec import worker_id
        self.spec = DeploymentSpec.from_dict(spec)
        self.worker_id = worker_id(index)
        self.placement_group, self.bundle_index = placement_group, bundle_index
        self.spec.remove_state_dir(self.worker_id)  # nothing of a previous incarnation is reused
        self.state = self.spec.state_dir(self.worker_id)
        keys_dir = self.state / "keys"
        public_text = keys.new_worker_pair(keys_dir)
        gateway = ray.get_actor(self.spec.gateway_actor, namespace=self.spec.namespace)
        endpoint, gateway_public = ray.get(gateway.admit.remote(self.worker_id, public_text), timeout=ADMIT_TIMEOUT_S)
        keys.write_gateway_public(keys_dir, gateway_public)
        config_path = self.state / "cluster.toml"
        config_path.write_text(self.spec.config_text)
        argv = [sys.executable, "-m", "worker", "--config", str(config_path), "--model-dir", self.spec.model_dir,
                "--run_dir", str(self.state / "run"), "--worker-id", self.worker_id, "--connect", endpoint,
                "--worker.curve_keys_dir", str(keys_dir), "--worker.pin_cores", "false"]  # Ray assigns the CPUs
        if not self.spec.gpus_per_worker and self.spec.cpus_per_worker >= 1:
            argv += ["--worker.num_threads", str(int(self.spec.cpus_per_worker))]  # its share, not the node's cores
        argv += self.spec.overrides
        self.started = time.time()
        self.child = ChildProcess(argv, self.state / f"{self.worker_id}.log", cwd=self.spec.project_root,
                                  env=_child_env())

    def info(self) -> dict:
        return {**_node(), "worker_id": self.worker_id, "pid": self.child.pid, "alive": self.child.alive(),
                "placement_group": self.placement_group, "bundle_index": self.bundle_index,
                "host": socket.gethostname(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "log": str(self.child.log_path)}

    def log_tail(self) -> str:
        return self.child.log_tail()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM: the worker tells the gateway, which resumes its streams on the others."""
        code = self.child.stop(timeout_s)
        self.spec.remove_state_dir(self.worker_id)
        return code
