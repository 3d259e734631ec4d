"""deploy/kubernetes: every rendered document validated, strictly, against the Kubernetes schemas of the
oldest and newest versions kubernetes-validate knows; and the references between the manifests."""
from __future__ import annotations

import re

import pytest
import yaml

from deploy_harness import (K8S, KUSTOMIZATIONS, SECRETS_EXAMPLE, _by_kind, _container_ports, _kustomize_command,
                            _load, _only, _pod_spec, render, render_everything, render_here)

OLDEST_K8S = "1.27"  # native gRPC probes are GA from here: the oldest these manifests ask for

kubernetes_validate = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request) -> list[dict]:
    return render(K8S / request.param)


@pytest.fixture(scope="module")
def everything() -> list[dict]:
    return render_everything()


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

