"""A worker's command line beyond the config: `--connect ENDPOINT` (where its gateway listens:
`--gateway.worker_endpoint` by a shorter name) and `--worker-id ID`, which defaults to one derived
from the host and the device, so `python -m worker.supervisor --connect tcp://gw:5555 --model-dir
DIR` is a whole command on a host with one worker per device; and the config such a command line
gives, checked once at the command. No torch (the supervisor loads no model)."""
from __future__ import annotations

import argparse
import os
import re
import socket

from shared.config import ClusterConfig, ConfigError, config_from_args
from shared.curve import WORKER, transport_keys

CONNECT_FLAG = "--connect"


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-id", default=None,
                        help="this worker's id (default: HOST-DEVICE, e.g. node7-cuda0 or node7-cpu)")
    parser.add_argument(CONNECT_FLAG, default=None, metavar="ENDPOINT",
                        help="the gateway's worker endpoint, e.g. tcp://gateway:5555 (= --gateway.worker_endpoint)")


def worker_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ClusterConfig:
    """The config a worker's command line gives, or argparse's exit (2) naming what is wrong: a bad
    value, or a transport it may not use (plain tcp://, missing keys). Checked once, at the command,
    so a bad value is never met again in a restart loop."""
    try:
        config = config_from_args(args)
        transport_keys(config, WORKER)
    except ConfigError as e:  # argparse's error line without its usage, which lists every config flag
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return config


def expand_connect(argv: list[str]) -> list[str]:
    """`--connect X` / `--connect=X` as the config flag it stands for, so the config loader sees it."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == CONNECT_FLAG and i + 1 < len(argv):
            out += ["--gateway.worker_endpoint", argv[i + 1]]
            i += 2
            continue
        if arg.startswith(CONNECT_FLAG + "="):
            arg = "--gateway.worker_endpoint=" + arg[len(CONNECT_FLAG) + 1:]
        out.append(arg)
        i += 1
    return out


def default_worker_id(config: ClusterConfig, environ=os.environ) -> str:
    """HOST-DEVICE: the device the config names, else the first GPU CUDA_VISIBLE_DEVICES gives
    this process, else the CPU. Several workers on one device need ids of their own."""
    device = config.worker.device
    if device in ("", "auto"):
        visible = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        device = f"cuda{visible}" if visible and visible != "-1" else "cpu"
    host = socket.gethostname().split(".")[0] or "host"
    return re.sub(r"[^A-Za-z0-9_.-]", "", f"{host}-{device.replace(':', '')}")
