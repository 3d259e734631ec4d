"""What a deployment on Ray is (its spec), what its actors and placement groups are called, and where
each actor keeps its files on its node. No Ray import: the CLI checks a spec before connecting."""
from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.config import ClusterConfig, ConfigError, add_config_flags, config_from_args

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_NAMESPACE = "inference"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# Set by the launcher, never by a user: each actor's process gets its own.
_LAUNCHER_FLAGS = ("--num_workers", "--run_dir", "--gateway.worker_endpoint", "--gateway.curve_keys_dir",
                   "--worker.curve_keys_dir", "--worker-id", "--connect", "--model-dir", "--model_dir", "--config")


@dataclass
class DeploymentSpec:
    name: str  # the deployment's name; actors are "<name>-gateway" and "<name>-worker-<i>"
    namespace: str
    model_dir: str  # the same path on every node (a shared volume or an identical copy)
    config_text: str  # the cluster's TOML config, written to every actor's node
    overrides: list[str] = field(default_factory=list)  # config flags, e.g. ["--gateway.port", "50051"]
    worker_port: int = 5555  # the gateway's worker endpoint: tcp://<its node's address>:<port>
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    gateway_cpus: float = 1.0
    max_restarts: int = -1  # Ray's actor restarts; -1: always
    strategy: str = "SPREAD"  # the placement group's: SPREAD, STRICT_SPREAD, PACK, STRICT_PACK
    project_root: str = str(PROJECT_ROOT)  # the same path on every node, with the same virtual env

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DeploymentSpec":
        return cls(**data)

    def validate(self) -> ClusterConfig:
        """Raise ValueError naming the problem; return the cluster config the processes will read."""
        for what, value in (("name", self.name), ("namespace", self.namespace)):
            if not _NAME.match(value):
                raise ValueError(f"{what} {value!r}: letters, digits, '_', '.', '-' (at most 63)")
        for flag in self.overrides:
            if flag.split("=", 1)[0] in _LAUNCHER_FLAGS:
                raise ValueError(f"{flag} is set by the launcher for each process; it cannot be overridden")
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"--model-dir {self.model_dir}: no config.json there (a Hugging Face checkpoint "
                             f"folder, at the same path on every node)")
        if not 0 < self.worker_port < 65536:
            raise ValueError(f"--worker-port {self.worker_port}: a TCP port")
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0 or self.gateway_cpus < 0:
            raise ValueError("--cpus-per-worker, --gpus-per-worker and --gateway-cpus must be >= 0")
        if self.cpus_per_worker == 0 and self.gpus_per_worker == 0:
            raise ValueError("a worker needs --cpus-per-worker or --gpus-per-worker")
        if self.strategy not in ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"):
            raise ValueError(f"--strategy {self.strategy}: SPREAD, STRICT_SPREAD, PACK or STRICT_PACK")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cluster.toml")
            path.write_text(self.config_text)
            return resolve_config(path, self.model_dir, self.overrides)

    # ---- names ----------------------------------------------------------------------------------
    @property
    def gateway_actor(self) -> str:
        return f"{self.name}-gateway"

    @property
    def worker_actor_prefix(self) -> str:
        return f"{self.name}-worker-"

    def worker_actor(self, index: int) -> str:
        return f"{self.worker_actor_prefix}{index}"

    def placement_group(self, first_index: int) -> str:
        return f"{self.name}-workers-from-{first_index}"

    # ---- files on a node ----------------------------------------------------------------------
    def state_dir(self, role: str) -> Path:
        """`<tmp>/inference-ray/<namespace>.<name>/<role>`, made 0700 at every level of ours."""
        path = Path(tempfile.gettempdir(), "inference-ray", f"{self.namespace}.{self.name}", role)
        for _ in range(3):  # another role's remove_state_dir may take away an empty parent meanwhile
            try:
                for part in (path.parents[1], path.parent, path):
                    part.mkdir(mode=0o700, exist_ok=True)
                return path
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"cannot make {path}")

    def remove_state_dir(self, role: str) -> None:
        """`role`'s files, and the deployment's dir on this node once no role has one there."""
        path = self.state_dir(role)
        shutil.rmtree(path, ignore_errors=True)
        for parent in (path.parent, path.parents[1]):
            try:
                parent.rmdir()  # only when empty
            except OSError:
                break


def worker_id(index: int) -> str:
    return f"worker-{index}"


def resolve_config(config_path: Path, model_dir: str, overrides: list[str]) -> ClusterConfig:
    """The config a process started with `--config config_path --model-dir model_dir *overrides` reads."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_config_flags(parser)
    try:
        args, unknown = parser.parse_known_args(["--config", str(config_path), "--model_dir", model_dir, *overrides])
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    if unknown:
        raise ValueError(f"not config flags: {' '.join(unknown)}")
    try:
        return config_from_args(args)
    except ConfigError as e:
        raise ValueError(str(e)) from None
