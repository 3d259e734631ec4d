"""`python -m worker.supervisor --worker-id worker-0 [...]`: keep one model process alive.

`python -m worker.supervisor --connect tcp://GATEWAY:PORT --model-dir DIR [--worker-id ID]`
runs a worker anywhere: it joins that gateway (with the CURVE keys of `worker.curve_keys_dir`)
and is served once it reports ready; the id defaults to HOST-DEVICE.

`honcho start` stops the whole cluster as soon as any entry exits, so the Procfile runs
this small process, which holds no model, and it restarts the model process
(`python -m worker`) whenever it dies, with exponential backoff for crash loops.
SIGTERM/SIGINT are passed on to the model process; the supervisor then exits 0.
The restart loop itself is shared with the gateway's (shared/supervisor.py).
"""
from __future__ import annotations

import argparse
import logging
import sys

from shared.config import add_config_flags
from shared.supervisor import supervise
from shared.worker_identity import add_worker_flags, default_worker_id, expand_connect, worker_config


def main(argv: list[str] | None = None) -> int:
    argv = expand_connect(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="python -m worker.supervisor", description=__doc__)
    add_worker_flags(parser)
    add_config_flags(parser)
    args = parser.parse_args(argv)
    config = worker_config(parser, args)  # fails here, once, on a bad config rather than in a restart loop
    if args.worker_id is None:  # fixed now, so every restart of the model process keeps it
        args.worker_id = default_worker_id(config)
        argv = [*argv, "--worker-id", args.worker_id]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s supervisor {args.worker_id} %(levelname)s "
                                                   f"%(message)s")
    return supervise("model process", [sys.executable, "-m", "worker", *argv], config.worker.restart_backoff_s,
                     config.worker.max_restart_backoff_s)


if __name__ == "__main__":
    sys.exit(main())
