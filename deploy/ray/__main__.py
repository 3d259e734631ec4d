"""`python -m deploy.ray up | status | scale N | down` on a node of a running Ray cluster.

    RAY_ADDRESS=HEAD:6379 python -m deploy.ray up --model-dir /models/m --num-workers 4 --gpus-per-worker 1 \\
        [--config FILE] [--worker-port 5555] [config flags, e.g. --gateway.host 0.0.0.0 --gateway.api_keys_file F]
    python -m deploy.ray status [--json]
    python -m deploy.ray scale 8
    python -m deploy.ray down

`up` starts the gateway on this node and N workers that Ray places (a SPREAD placement group, one
bundle of --cpus-per-worker / --gpus-per-worker each) and restarts (--max-restarts), and waits
until every worker serves. The model folder, this project and its virtual env must be at the same
paths on every node. Exit status: 0 done, 1 failed, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from deploy.ray.spec import DEFAULT_NAMESPACE, PROJECT_ROOT, DeploymentSpec

DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "default.toml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy.ray", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--name", default="inference", help="the deployment's name (default: inference)")
        sub.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="its Ray namespace (default: inference)")
        return sub

    up = command("up", "start the gateway here and N workers placed by Ray; extra flags are config overrides")
    up.add_argument("--model-dir", required=True, help="the checkpoint folder, at this path on every node")
    up.add_argument("--num-workers", type=int, required=True)
    up.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the cluster's TOML config (read here)")
    up.add_argument("--cpus-per-worker", type=float, default=None, help="CPUs per worker (default 1; 1 with GPUs)")
    up.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs per worker (default 0)")
    up.add_argument("--gateway-cpus", type=float, default=1.0, help="CPUs reserved for the gateway (default 1)")
    up.add_argument("--worker-port", type=int, default=5555, help="the port workers join on (default 5555)")
    up.add_argument("--max-restarts", type=int, default=-1, help="Ray's restarts per actor (-1: always)")
    up.add_argument("--strategy", default="SPREAD", help="placement group strategy (default SPREAD)")
    up.add_argument("--wait-s", type=float, default=600.0, help="wait this long for every worker to serve (0: don't)")
    for name, help_text in (("status", "the gateway and each worker: node, process, health"),
                            ("scale", "add or drain-and-remove workers until N run"),
                            ("down", "drain the gateway, stop every worker, free their placement groups")):
        sub = command(name, help_text)
        if name == "status":
            sub.add_argument("--json", action="store_true", help="print JSON")
        if name == "scale":
            sub.add_argument("num_workers", type=int)
            sub.add_argument("--wait-s", type=float, default=600.0)
        if name in ("scale", "down"):
            sub.add_argument("--drain-s", type=float, default=30.0, help="in-flight streams get this long")
    return parser


def _spec(args, overrides: list[str]) -> DeploymentSpec:
    try:
        config_text = args.config.read_text()
    except OSError as e:
        raise ValueError(f"--config: {e}") from None
    cpus = args.cpus_per_worker if args.cpus_per_worker is not None else 1.0
    spec = DeploymentSpec(name=args.name, namespace=args.namespace, model_dir=str(Path(args.model_dir).resolve()),
                          config_text=config_text, overrides=overrides, worker_port=args.worker_port,
                          cpus_per_worker=cpus, gpus_per_worker=args.gpus_per_worker, gateway_cpus=args.gateway_cpus,
                          max_restarts=args.max_restarts, strategy=args.strategy)
    spec.validate()
    if args.num_workers < 0:
        raise ValueError(f"--num-workers {args.num_workers}: >= 0")
    return spec


def print_status(report: dict) -> None:
    if not report["up"]:
        print(f"deployment {report['name']} (namespace {report['namespace']}): not up")
        return
    g = report["gateway"]
    print(f"gateway  {g.get('health', '?'):<12} node {g.get('node_id', '?')[:12]} ({g.get('node_ip', '?')}) "
          f"pid {g.get('pid')}  grpc {g.get('grpc')}  http {g.get('http') or '-'}  workers join "
          f"{g.get('worker_endpoint')}{'  ' + g['error'] if 'error' in g else ''}")
    for w in report["workers"]:
        print(f"{w['worker_id']:<8} {w['health']:<12} node {w.get('node_id', '?')[:12]} ({w.get('node_ip', '?')}) "
              f"pid {w.get('pid')}{'  restarted' if w.get('restarted') else ''}"
              f"{'  ' + w['error'] if 'error' in w else ''}")


def run(parser: argparse.ArgumentParser, args, spec: DeploymentSpec | None) -> dict | None:
    """The command's report (None: nothing to print), or DeployError."""
    from deploy.ray import launcher  # imports ray: after the arguments are known to be good
    launcher.connect(args.namespace)  # DeployError when RAY_ADDRESS does not answer
    try:
        return _command(parser, args, spec, launcher)
    finally:
        launcher.disconnect()


def _command(parser, args, spec, launcher) -> dict | None:
    if args.command == "up":
        return launcher.up(spec, args.num_workers, args.wait_s)
    loaded, gateway = launcher.load_spec(args.namespace, args.name)
    if args.command == "down":
        launcher.down(loaded, args.drain_s)
        return None
    if args.command == "scale":
        if args.num_workers < 0:
            parser.error(f"scale {args.num_workers}: >= 0")
        return launcher.scale(loaded, gateway, args.num_workers, args.wait_s, args.drain_s)
    return launcher.status(loaded)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra and args.command != "up":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        spec = _spec(args, extra) if args.command == "up" else None
    except ValueError as e:
        parser.error(str(e))
    from deploy.ray.launcher import DeployError
    try:
        # Ray prints cluster events (a node marked dead, ...) on stdout: to stderr with them, so
        # stdout carries the report alone.
        with contextlib.redirect_stdout(sys.stderr):
            report = run(parser, args, spec)
    except DeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if report is None:
        print(f"deployment {args.name} is down")
        return 0
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print_status(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
