"""deploy/kubernetes against the code it drives: the command lines load as real config into the ports and
mounts the pods declare, the exec probes parse as tools.health_probe's, the example Secrets are refused."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from deploy_harness import ROOT, SECRETS_EXAMPLE, _by_kind, _container_ports, _load, _only, _pod_spec, render_everything

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def everything() -> list[dict]:
    return render_everything()


# ---- the config and the command lines --------------------------------------------------------------
def _cluster_toml(everything) -> str:
    return _only(everything, "ConfigMap", "inference-config")["data"]["cluster.toml"]


def _expand(args: list[str], container: dict) -> tuple[list[str], dict[str, str]]:
    """Kubernetes' $(VAR) expansion of args, with the pod name for a metadata.name fieldRef."""
    env = {}
    for var in container.get("env", []):
        if var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = "inference-worker-0"
        elif "value" in var:
            env[var["name"]] = var["value"]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args], env


def _parse(container: dict, tmp_path: Path, everything, extra: tuple[str, ...] = ()):
    """The container's command line through the project's own config flags (and `extra` flags of
    its entry point), with the ConfigMap's cluster.toml in place of the mounted one."""
    from shared.config import add_config_flags, config_from_args
    args, env = _expand(container["args"], container)
    toml = tmp_path / "cluster.toml"
    toml.write_text(_cluster_toml(everything))
    mount = next(m for m in container["volumeMounts"] if m.get("subPath") == "cluster.toml")
    args = [a.replace(f"--config={mount['mountPath']}", f"--config={toml}") for a in args]
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    for flag in extra:
        parser.add_argument(flag)
    parsed = parser.parse_args(args)  # an unknown flag exits here, failing the test
    return parsed, config_from_args(parsed), env


def _mounted_files(pod: dict, container: dict, secrets: dict, directory: str) -> set[str]:
    """The files a Secret volume puts at `directory` in the container."""
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == directory)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    secret = secrets[volume["secret"]["secretName"]]
    items = volume["secret"].get("items")
    return {i["path"] for i in items} if items else set(secret.get("stringData", {})) | set(secret.get("data", {}))


def _under_a_mount(container: dict, path: str, volume_name: str) -> bool:
    return any(m["name"] == volume_name and (path + "/").startswith(m["mountPath"].rstrip("/") + "/")
               for m in container["volumeMounts"])


def test_gateway_command_line_is_real_config(everything, tmp_path):
    from gateway.__main__ import STOP_SLACK_S
    deployment = _only(everything, "Deployment", "inference-gateway")
    pod = _pod_spec(deployment)
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "gateway"]
    _, config, _ = _parse(container, tmp_path, everything)
    g = config.gateway
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    endpoint = re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", g.worker_endpoint)
    assert endpoint and int(endpoint.group(1)) == ports["workers"]
    assert (g.port, g.http_port, g.metrics_port) == (ports["grpc"], ports["http"], ports["metrics"])
    assert g.host == g.metrics_host == "0.0.0.0"
    secrets = _by_kind(everything, "Secret")
    # Bound beyond loopback: API keys are required, from the mounted Secret.
    keys_dir, keys_name = g.api_keys_file.rsplit("/", 1)
    assert keys_name in _mounted_files(pod, container, secrets, keys_dir)
    curve = _mounted_files(pod, container, secrets, g.curve_keys_dir)
    assert {"gateway.key_secret", "worker.key"} <= curve and "worker.key_secret" not in curve
    assert _under_a_mount(container, config.model_dir, "models")
    assert _under_a_mount(container, config.run_dir, "tmp")
    # SIGTERM: the drain, then the gateway's own stop, fit in the grace period.
    assert pod["terminationGracePeriodSeconds"] > g.drain_grace_s + STOP_SLACK_S


def test_worker_command_line_is_real_config(everything, tmp_path):
    from shared.supervisor import STOP_TIMEOUT_S
    workers = _only(everything, "StatefulSet", "inference-worker")
    pod = _pod_spec(workers)
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "worker.supervisor"]
    parsed, config, env = _parse(container, tmp_path, everything, extra=("--connect", "--worker-id"))
    assert parsed.worker_id == "inference-worker-0"  # the pod's name, through the downward API
    # --connect names the internal Service on its workers port.
    host, port = re.fullmatch(r"tcp://([\w.-]+):(\d+)", parsed.connect).groups()
    service = _only(everything, "Service", host)
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}[int(port)] == "workers"
    curve = _mounted_files(pod, container, _by_kind(everything, "Secret"), config.worker.curve_keys_dir)
    assert curve == {"gateway.key", "worker.key", "worker.key_secret"}  # never the gateway's secret
    assert _under_a_mount(container, config.model_dir, "models")
    assert all(m.get("readOnly") for m in container["volumeMounts"] if m["name"] in ("models", "curve-keys"))
    gpu = container["resources"]
    assert gpu["requests"]["nvidia.com/gpu"] == gpu["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] > STOP_TIMEOUT_S
    assert "WORKER_ID" in env


def _probe_argv(probe: dict) -> list[str]:
    command = probe["exec"]["command"]
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2])
        command = command[1:] if command[0] == "exec" else command
    assert command[:3] == ["python", "-m", "tools.health_probe"], command
    return command[3:]


def test_exec_probes_are_health_probe_command_lines(everything):
    from tools.health_probe import build_parser
    parser = build_parser()
    gateway = _pod_spec(_only(everything, "Deployment", "inference-gateway"))["containers"][0]
    alive = parser.parse_args(_probe_argv(gateway["livenessProbe"]))
    assert alive.alive and alive.address == f"127.0.0.1:{_container_ports({'containers': [gateway]})['grpc']}"
    assert alive.timeout < gateway["livenessProbe"]["timeoutSeconds"]

    worker = _pod_spec(_only(everything, "StatefulSet", "inference-worker"))["containers"][0]
    ready = parser.parse_args(_probe_argv(worker["readinessProbe"]))
    # Asks the gateway (through the Service that lists it even when not ready) about this worker.
    host, port = ready.address.rsplit(":", 1)
    service = _only(everything, "Service", host)
    assert {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}[int(port)] == "grpc"
    assert ready.service == "$WORKER_ID" and "--worker-id=$(WORKER_ID)" in worker["args"]
    assert ready.timeout < worker["readinessProbe"]["timeoutSeconds"] and not ready.alive
    # Liveness asks no one: the model process the supervisor keeps running.
    live = parser.parse_args(_probe_argv(worker["livenessProbe"]))
    assert live.process == "worker" and live.address is None
    assert (ROOT / "worker" / "__main__.py").is_file()


def test_example_secrets_hold_placeholders_the_gateway_refuses(tmp_path):
    """Applied by mistake, the example Secrets stop the gateway at start instead of serving with
    known keys."""
    from gateway.auth import parse_keys_file
    from shared.config import ConfigError
    from shared.curve import load_server_keys
    secrets = _by_kind(_load(SECRETS_EXAMPLE), "Secret")
    (tmp_path / "keys").write_text(secrets["inference-api-keys"]["stringData"]["keys"])
    with pytest.raises(ConfigError):
        parse_keys_file(tmp_path / "keys")
    curve = tmp_path / "curve"
    curve.mkdir()
    for name, text in secrets["inference-curve-keys"]["stringData"].items():
        (curve / name).write_text(text)
    with pytest.raises(ConfigError):
        load_server_keys(curve)

