"""deploy/kubernetes as the deploy tests read it: the kustomizations rendered (by kustomize when installed,
else by the same few transformations done here), and lookups over the rendered documents."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
SECRETS_EXAMPLE = K8S / "secrets.example.yaml"
KUSTOMIZATIONS = [".", "autoscaling"]  # each a directory of deploy/kubernetes


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


def render_everything() -> list[dict]:
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


def _container_ports(pod: dict) -> dict:
    """Every way a pod's ports may be named: number -> number and name -> number."""
    ports = {}
    for container in pod["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports
