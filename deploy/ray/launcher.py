"""Bringing a deployment up on a running Ray cluster, scaling it, reporting on it, taking it down.

Everything the launcher knows lives in Ray: named detached actors in the deployment's namespace
(the gateway actor also holds the spec) and named placement groups, so `status`, `scale` and
`down` can run from any node, any time after `up`, with nothing but the deployment's name.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deploy.ray.actors import GatewayActor, WorkerActor
from deploy.ray.spec import DeploymentSpec, worker_id

log = logging.getLogger("deploy.ray")
POLL_S = 0.5
CALL_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
STOP_SLACK_S = 15.0  # past a process's own drain: its exit and the actor's answer


class DeployError(Exception):
    """Refused or failed, with a message that says why."""


class _NoGroupRestartWarning(logging.Filter):
    """Ray warns that a restartable detached actor in a placement group dies with its group. That is
    how `scale` and `down` remove workers: a group is removed only once its actors are gone."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "restartable detached actor with a placement group" not in record.getMessage()


def connect(namespace: str) -> None:
    """Join the Ray cluster `RAY_ADDRESS` names (or the one running on this node), as Ray's tools do."""
    logging.getLogger("ray.actor").addFilter(_NoGroupRestartWarning())
    address = os.environ.get("RAY_ADDRESS") or "auto"
    check_reachable(address)
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING,
             configure_logging=False)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A RAY_ADDRESS of host:port must answer a TCP connect: `ray.init` waits on one that does not
    for minutes without a word. ("auto" and ray:// addresses are Ray's own to find.)"""
    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise DeployError(f"no Ray cluster answers at RAY_ADDRESS={address} ({e}); is its head running?") from None


def disconnect() -> None:
    ray.shutdown()  # the actors are detached: they run on


def _actor_options(spec: DeploymentSpec, name: str) -> dict:
    # PYTHONPATH: the actors import this project the way `python -m` from its root does.
    return {"name": name, "namespace": spec.namespace, "lifetime": "detached", "max_restarts": spec.max_restarts,
            "runtime_env": {"env_vars": {"PYTHONPATH": spec.project_root}}}


def _get(ref, timeout_s: float = CALL_TIMEOUT_S):
    return ray.get(ref, timeout=timeout_s)


def find_gateway(namespace: str, name: str):
    try:
        return ray.get_actor(f"{name}-gateway", namespace=namespace)
    except ValueError:
        return None


def load_spec(namespace: str, name: str) -> tuple[DeploymentSpec, object]:
    gateway = find_gateway(namespace, name)
    if gateway is None:
        raise DeployError(f"no deployment {name!r} in Ray namespace {namespace!r}; start one with `up`")
    return DeploymentSpec.from_dict(_get(gateway.deployment_spec.remote(), 60.0)), gateway


def worker_handles(spec: DeploymentSpec) -> dict[int, object]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == spec.namespace and a["name"].startswith(spec.worker_actor_prefix)]
    suffixes = [n[len(spec.worker_actor_prefix):] for n in names]
    return {int(s): ray.get_actor(n, namespace=spec.namespace) for n, s in zip(names, suffixes) if s.isdigit()}


# ---- up ---------------------------------------------------------------------------------------------
def up(spec: DeploymentSpec, num_workers: int, wait_s: float) -> dict:
    if find_gateway(spec.namespace, spec.name) is not None:
        raise DeployError(f"deployment {spec.name!r} is already up in namespace {spec.namespace!r}: "
                          f"`scale` or `down` it")
    here = ray.get_runtime_context().get_node_id()
    gateway = ray.remote(GatewayActor).options(
        **_actor_options(spec, spec.gateway_actor), num_cpus=spec.gateway_cpus,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote(spec.to_dict())
    try:
        _wait_gateway_answers(gateway, wait_s)
        add_workers(spec, list(range(num_workers)), wait_s)
        if wait_s:
            wait_ready(spec, gateway, [worker_id(i) for i in range(num_workers)], wait_s)
    except BaseException:
        down(spec, drain_s=0.0)
        raise
    return status(spec)


def _wait_gateway_answers(gateway, wait_s: float) -> None:
    deadline = time.monotonic() + max(wait_s, 60.0)
    last = ""
    while time.monotonic() < deadline:
        try:
            last = _get(gateway.health.remote([""]), 30.0)[""]
        except RayActorError as e:
            raise DeployError(f"the gateway actor failed to start: {e}") from None
        except GetTimeoutError:
            last = "no answer from the gateway actor"
        if not last.startswith("UNREACHABLE"):
            return
        time.sleep(POLL_S)
    raise DeployError(f"the gateway did not start ({last}); its log ends:\n{_tail(gateway)}")


def _tail(actor) -> str:
    try:
        return _get(actor.log_tail.remote())
    except RayError as e:
        return f"(unavailable: {type(e).__name__})"


def add_workers(spec: DeploymentSpec, indices: list[int], wait_s: float) -> None:
    """Start `indices` workers: first in the bundles of this deployment's placement groups that
    removed workers left free (a group cannot shrink, so its bundles stay reserved until its last
    worker goes), then the rest in a new group of one bundle each."""
    bundle = {"CPU": spec.cpus_per_worker} if spec.cpus_per_worker else {}
    if spec.gpus_per_worker:
        bundle["GPU"] = spec.gpus_per_worker
    free = _free_bundles(spec, bundle)
    for index, (group_name, bundle_index) in zip(indices, free):
        _start_worker(spec, index, group_name, bundle_index)
    indices = indices[len(free):]
    if not indices:
        return
    group_name = f"{spec.placement_group(indices[0])}-{uuid.uuid4().hex[:6]}"
    group = placement_group([dict(bundle) for _ in indices], strategy=spec.strategy, name=group_name,
                            lifetime="detached")
    try:
        _get(group.ready(), max(wait_s, 30.0))
    except GetTimeoutError:
        remove_placement_group(group)
        raise DeployError(f"the Ray cluster has no room for {len(indices)} more worker(s) of {bundle} "
                          f"({spec.strategy}); `ray status` shows what it has") from None
    for bundle_index, index in enumerate(indices):
        _start_worker(spec, index, group_name, bundle_index)


def _start_worker(spec: DeploymentSpec, index: int, group_name: str, bundle_index: int) -> None:
    group = ray.util.get_placement_group(group_name)
    ray.remote(WorkerActor).options(
        **_actor_options(spec, spec.worker_actor(index)), num_cpus=spec.cpus_per_worker,
        num_gpus=spec.gpus_per_worker,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index),
    ).remote(spec.to_dict(), index, group_name, bundle_index)


def _worker_infos(spec: DeploymentSpec) -> list[dict] | None:
    """Each worker's own account of itself (where it runs, which group and bundle); None when one
    cannot answer, so nothing is reused or removed on a guess."""
    try:
        return [_get(handle.info.remote()) for handle in worker_handles(spec).values()]
    except RayError:
        return None


def _free_bundles(spec: DeploymentSpec, bundle: dict) -> list[tuple[str, int]]:
    """(group name, bundle index) of this deployment's bundles of exactly `bundle`'s resources
    that no worker holds."""
    infos = _worker_infos(spec)
    if infos is None or any("bundle_index" not in info for info in infos):
        return []  # a worker that cannot say, or started before workers said, which bundle it holds
    held = {(info["placement_group"], info["bundle_index"]) for info in infos}
    wanted = {k: float(v) for k, v in bundle.items()}
    return [(entry["name"], i) for entry in _groups(spec) if entry["state"] == "CREATED"
            for i, resources in sorted(entry["bundles"].items())
            if (entry["name"], i) not in held and {k: float(v) for k, v in resources.items()} == wanted]


def _groups(spec: DeploymentSpec) -> list[dict]:
    prefix = f"{spec.name}-workers-from-"
    return sorted((e for e in placement_group_table().values() if e["name"].startswith(prefix)),
                  key=lambda e: e["name"])


def wait_ready(spec: DeploymentSpec, gateway, ids: list[str], wait_s: float) -> None:
    """Until the gateway reports every one of `ids` ready (health SERVING)."""
    deadline = time.monotonic() + wait_s
    health: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            health = _get(gateway.health.remote(ids), 30.0)
        except GetTimeoutError:
            continue
        if all(health.get(i) == "SERVING" for i in ids):
            return
        time.sleep(POLL_S)
    handles = worker_handles(spec)
    waiting = [i for i in ids if health.get(i) != "SERVING"]
    tails = "\n".join(f"--- {i}:\n{_tail(handles[int(i.rsplit('-', 1)[1])])}" for i in waiting
                      if int(i.rsplit("-", 1)[1]) in handles)
    raise DeployError(f"not ready within {wait_s:.0f} s: {', '.join(waiting)} ({health}); their logs end:\n{tails}")


# ---- scale, down ------------------------------------------------------------------------------------
def scale(spec: DeploymentSpec, gateway, num_workers: int, wait_s: float, drain_s: float) -> dict:
    """Add the lowest free indices, or drain and remove the highest ones, until `num_workers` run."""
    current = sorted(worker_handles(spec))
    if num_workers > len(current):
        free = [i for i in range(num_workers + len(current)) if i not in current][:num_workers - len(current)]
        add_workers(spec, free, wait_s)
        if wait_s:
            wait_ready(spec, gateway, [worker_id(i) for i in free], wait_s)
    elif num_workers < len(current):
        handles = worker_handles(spec)
        remove_workers(spec, gateway, {i: handles[i] for i in current[num_workers:]}, drain_s)
    return status(spec)


def remove_workers(spec: DeploymentSpec, gateway, handles: dict[int, object], drain_s: float) -> None:
    stops = {i: h.stop.remote(drain_s) for i, h in handles.items()}
    for i, ref in stops.items():
        try:
            _get(ref, drain_s + STOP_SLACK_S)
        except RayError as e:
            log.warning("%s did not stop cleanly (%s); killing its actor", worker_id(i), type(e).__name__)
    for i, handle in handles.items():
        ray.kill(handle, no_restart=True)
        if gateway is not None:
            try:
                _get(gateway.revoke.remote(worker_id(i)))
            except RayError:
                pass
    _remove_unused_groups(spec)


def _remove_unused_groups(spec: DeploymentSpec) -> None:
    infos = _worker_infos(spec)
    if infos is None:
        return  # a worker that cannot say which group it is in: keep them all
    in_use = {info["placement_group"] for info in infos}
    for entry in _groups(spec):
        if entry["name"] not in in_use and entry["state"] != "REMOVED":
            remove_placement_group(ray.util.get_placement_group(entry["name"]))


def down(spec: DeploymentSpec, drain_s: float) -> None:
    """Drain the gateway (in-flight streams finish within `drain_s`), then stop every worker."""
    gateway = find_gateway(spec.namespace, spec.name)
    if gateway is not None:
        try:
            _get(gateway.stop.remote(drain_s), drain_s + STOP_SLACK_S)
        except RayError as e:
            log.warning("the gateway did not stop cleanly (%s)", type(e).__name__)
    remove_workers(spec, None, worker_handles(spec), drain_s=min(drain_s, 15.0) or 5.0)
    if gateway is not None:
        ray.kill(gateway, no_restart=True)


# ---- status -----------------------------------------------------------------------------------------
def _try(ref, default):
    try:
        return _get(ref)
    except RayError as e:
        return {**default, "error": type(e).__name__}


def status(spec: DeploymentSpec) -> dict:
    gateway = find_gateway(spec.namespace, spec.name)
    if gateway is None:
        return {"name": spec.name, "namespace": spec.namespace, "up": False, "workers": []}
    handles = worker_handles(spec)
    infos = {i: _try(h.info.remote(), {"worker_id": worker_id(i)}) for i, h in sorted(handles.items())}
    health = _try(gateway.health.remote(["", *(worker_id(i) for i in handles)]), {})
    return {"name": spec.name, "namespace": spec.namespace, "up": True,
            "gateway": {**_try(gateway.info.remote(), {}), "health": health.get("", "UNKNOWN")},
            "workers": [{"index": i, **info, "health": health.get(worker_id(i), "UNKNOWN")}
                        for i, info in infos.items()]}
