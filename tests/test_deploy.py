"""deploy/: the Kubernetes manifests and the Grafana dashboard, checked against Kubernetes and against
the code they drive.

The manifests are rendered (kustomize when installed, else the same few transformations done here)
and every document is validated against the Kubernetes schemas of the oldest and newest versions
kubernetes-validate knows of, strictly (unknown fields are errors). Then they must agree with one
another and with the project: names that are referenced exist, Service target ports and probe ports
are container ports, the flags are real config settings that load into ports the pod declares, the
mounted Secrets hold the key files the config points at, the probes parse as tools.health_probe's
own command line. The dashboard must query only metrics a live gateway exports (in front of
model-free workers), under the series names Prometheus stores for them.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "inference-dashboard.json"
SECRETS_EXAMPLE = K8S / "secrets.example.yaml"
KUSTOMIZATIONS = [".", "autoscaling"]  # each a directory of deploy/kubernetes
OLDEST_K8S = "1.27"  # native gRPC probes are GA from here: the oldest these manifests ask for

kubernetes_validate = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.timeout(180)


# ---- rendering ----------------------------------------------------------------------------------
def _kustomize_command(directory: Path) -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build", str(directory)]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize", str(directory)]
    return None


def render_here(directory: Path) -> list[dict]:
    """What kustomize makes of `directory`, for the fields these kustomizations use: resources
    (files and directories), namespace and images. Anything else is refused, not ignored."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - {"apiVersion", "kind", "resources", "namespace", "images"}
    assert not unknown, f"{directory}: render_here does not handle {sorted(unknown)}"
    docs: list[dict] = []
    for resource in spec.get("resources", []):
        path = (directory / resource).resolve()
        docs += render_here(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        if "namespace" in spec and doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = spec["namespace"]
        for image in spec.get("images", []):
            for container in _containers(doc):
                name, _, _tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', _tag)}"
    return docs


def render(directory: Path) -> list[dict]:
    command = _kustomize_command(directory)
    if command is None:
        return render_here(directory)
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request) -> list[dict]:
    return render(K8S / request.param)


@pytest.fixture(scope="module")
def everything() -> list[dict]:
    """The richest rendering (with the HPA), the example Secrets and the ServiceMonitor."""
    return [*render(K8S / "autoscaling"), *_load(SECRETS_EXAMPLE), *_load(K8S / "monitoring" / "servicemonitor.yaml")]


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _containers(doc: dict) -> list[dict]:
    pod = _pod_spec(doc)
    return pod.get("containers", []) if pod else []


def _pod_spec(doc: dict) -> dict | None:
    if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _only(docs: list[dict], kind: str, name: str) -> dict:
    found = _by_kind(docs, kind)
    assert name in found, f"no {kind} {name}; have {sorted(found)}"
    return found[name]


# ---- schemas ------------------------------------------------------------------------------------
def test_fallback_renderer_matches_kustomize():
    """The renderer used where no kustomize is installed makes what kustomize makes."""
    if _kustomize_command(K8S) is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    for name in KUSTOMIZATIONS:
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        assert sorted(render(K8S / name), key=key) == sorted(render_here(K8S / name), key=key), name


def _k8s_version(which: str) -> str:
    """The newest schemas kubernetes-validate has, or the oldest the manifests need (or its oldest)."""
    from packaging.version import Version
    known = kubernetes_validate.utils.all_versions()
    return known[-1] if which == "latest" else max(OLDEST_K8S, known[0], key=Version)


@pytest.mark.parametrize("which", ["oldest", "latest"])
def test_manifests_validate_against_the_kubernetes_schemas(rendered, which):
    version = _k8s_version(which)
    docs = [*rendered, *_load(SECRETS_EXAMPLE)]
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ConfigMap", "Secret", "Deployment", "StatefulSet", "Service",
            "PersistentVolumeClaim"} <= kinds
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {e.message} at "
                        f"{'.'.join(map(str, e.path))}")


def test_every_resource_is_in_the_namespace(everything):
    for doc in everything:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "inference", (doc["kind"], doc["metadata"]["name"])


# ---- references between manifests ----------------------------------------------------------------
def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _container_ports(pod: dict) -> dict:
    """Every way a pod's ports may be named: number -> number and name -> number."""
    ports = {}
    for container in pod["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def _workloads(docs):
    return [d for d in docs if _pod_spec(d) is not None]


def test_workloads_reference_what_exists(everything):
    config_maps, secrets = _by_kind(everything, "ConfigMap"), _by_kind(everything, "Secret")
    claims = _by_kind(everything, "PersistentVolumeClaim")
    for workload in _workloads(everything):
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert _matches(workload["spec"]["selector"]["matchLabels"], labels), where
        pod = _pod_spec(workload)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                data = config_maps[volume["configMap"]["name"]]["data"]
                assert all(item["key"] in data for item in volume["configMap"].get("items", [])), where
            if "secret" in volume:
                secret = secrets[volume["secret"]["secretName"]]
                keys = {**secret.get("data", {}), **secret.get("stringData", {})}
                missing = [i["key"] for i in volume["secret"].get("items", []) if i["key"] not in keys]
                assert not missing, f"{where}: secret {secret['metadata']['name']} lacks {missing}"
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, where
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}: mount of unknown volume {mount['name']}"
                volume = volumes[mount["name"]]
                if "subPath" in mount and "configMap" in volume:
                    assert mount["subPath"] in config_maps[volume["configMap"]["name"]]["data"], where
            ports = _container_ports(pod)
            for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = container.get(probe_name)
                if not probe:
                    continue
                for kind in ("grpc", "httpGet", "tcpSocket"):
                    if kind in probe:
                        assert probe[kind]["port"] in ports, f"{where}: {probe_name} on port {probe[kind]['port']}"
                assert any(k in probe for k in ("grpc", "httpGet", "tcpSocket", "exec")), where
        if workload["kind"] == "StatefulSet":
            service = _only(everything, "Service", workload["spec"]["serviceName"])
            assert service["spec"].get("clusterIP") == "None", "a StatefulSet's governing Service is headless"


def test_services_reach_container_ports(everything):
    workloads = _workloads(everything)
    for service in _by_kind(everything, "Service").values():
        name = service["metadata"]["name"]
        pods = [w for w in workloads if _matches(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert pods, f"Service {name} selects no pods"
        for port in service["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            for workload in pods:
                assert target in _container_ports(_pod_spec(workload)), f"Service {name} port {port['name']}"


def test_disruption_budget_autoscaler_and_service_monitor_targets(everything):
    workers = _only(everything, "StatefulSet", "inference-worker")
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert _matches(_only(everything, "PodDisruptionBudget", "inference-worker")["spec"]["selector"]["matchLabels"],
                    labels)
    hpa = _only(everything, "HorizontalPodAutoscaler", "inference-worker")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "inference-worker"}
    assert "replicas" not in workers["spec"], "a replicas field would undo the autoscaler's count on every apply"
    monitor = _only(everything, "ServiceMonitor", "inference-gateway")
    services = [s for s in _by_kind(everything, "Service").values()
                if _matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in services] == ["inference-gateway-internal"]
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in services[0]["spec"]["ports"]}
    # Scraped and reached by workers whether or not the gateway is ready (else no first worker).
    assert services[0]["spec"]["publishNotReadyAddresses"] is True


def test_autoscaler_metrics_are_served_by_the_adapter_rules(everything):
    from gateway.metrics import Metrics
    hpa = _only(everything, "HorizontalPodAutoscaler", "inference-worker")
    wanted = {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "External"}
    assert "inference_num_requests_queued" in wanted
    values = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-values.yaml").read_text())
    rules = values["rules"]["external"]
    assert {r["name"]["as"] for r in rules} == wanted
    gauges = {family.name for family in Metrics().registry.collect() if family.type == "gauge"}
    for rule in rules:
        series = re.match(r"[a-zA-Z_:][\w:]*", rule["seriesQuery"]).group(0)
        assert series in gauges, f"the adapter reads {series}, which the gateway does not export as a gauge"


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


# ---- the dashboard ----------------------------------------------------------------------------------
_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
             "group_left", "group_right", "start", "end"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    aggregations, keywords, label names (in matchers or clauses) or Grafana variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries
    expr = _CLAUSE.sub(" ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w$:.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        if not m.group(2) and m.group(1) not in _KEYWORDS:
            names.add(m.group(1))
    return names


def grafana_query_metrics(query: str) -> set[str]:
    """A template variable's query: label_values(METRIC{...}, label), metrics(...), or PromQL."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
    return promql_metrics(m.group(1)) if m else promql_metrics(query)


def test_promql_metrics():
    assert promql_metrics('histogram_quantile(0.9, sum by (le, bucket) (rate(a_seconds_bucket{ns=~"$ns", '
                          'w="x(y)"}[$__rate_interval])))') == {"a_seconds_bucket"}
    assert promql_metrics("sum by (worker) (rate(hits_total[5m])) / sum(rate(queries_total[5m])) by (worker)") == {
        "hits_total", "queries_total"}
    assert promql_metrics("1 - max(free_bytes offset 5m) > bool 0 and on(worker) group_left(kind) up") == {
        "free_bytes", "up"}
    assert promql_metrics('max_over_time(gauge_a[1h:5m]) or vector(0)') == {"gauge_a"}
    assert grafana_query_metrics('label_values(worker_up{namespace=~"$namespace"}, worker)') == {"worker_up"}


def dashboard_queries(dashboard: dict) -> list[str]:
    exprs = []

    def walk(panels):
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))  # collapsed rows hold their panels
    walk(dashboard["panels"])
    return exprs


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            # Brackets balance, and every variable used is defined (or Grafana's own).
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            for var in re.findall(r"\$(\w+)", expr):
                assert var.startswith("__") or var in variables, (panel["title"], var)


def _exported_series(text: str) -> tuple[set[str], set[str]]:
    """The series names Prometheus stores from a /metrics page: a counter `x` as x_total, a
    histogram as x_bucket/_sum/_count; and, of those, the ones with samples now."""
    from prometheus_client.parser import text_string_to_metric_families
    declared, sampled = set(), set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created")}
    for family in text_string_to_metric_families(text):
        declared |= {family.name + s for s in suffixes.get(family.type, ("",))}
        sampled |= {s.name for s in family.samples}
    return declared, sampled


def test_dashboard_metrics_exist_in_a_live_gateway(served_checkpoint):
    from gateway_fake_cluster import FakeCluster, request
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set().union(*map(promql_metrics, dashboard_queries(dashboard)))
    queried |= set().union(*(grafana_query_metrics(v["definition"]) for v in dashboard["templating"]["list"]
                             if v["type"] == "query"))
    assert len(queried) >= 20
    # Two workers (so routing has a choice); the same long prompt twice, so the second finds the
    # first's blocks in the prefix cache.
    with FakeCluster(served_checkpoint, num_workers=2, step_ms=5) as cluster:
        for i in range(2):
            for _ in cluster.stub.Generate(request(prompt_token_ids=range(5, 45), request_id=f"dash-{i}",
                                                   sampling=dict(max_tokens=4, ignore_eos=True)), timeout=30):
                pass
        time.sleep(1.0)  # a few heartbeats, with the prefix-cache counters of both requests
        text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    declared, sampled = _exported_series(text)
    missing = sorted(queried - declared)
    assert not missing, f"the dashboard queries series the gateway does not export: {missing}"
    # What one served request must have put on every panel's main series: the latency histograms,
    # throughput, status, queues, KV, watchdog, readiness, routing and the prefix cache.
    expected_live = {n for n in queried if n.endswith("_bucket")} | {
        "inference_generation_tokens_total", "inference_request_status_total", "inference_request_success_total",
        "inference_kv_cache_usage_perc", "inference_worker_memory_level", "inference_worker_ready",
        "inference_routing_decisions_total", "inference_prefix_cache_queries_total",
        "inference_prefix_cache_hits_total", "inference_num_requests_running"}
    assert not sorted(expected_live - sampled), f"no samples yet for {sorted(expected_live - sampled)}"
