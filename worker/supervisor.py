"""`python -m worker.supervisor --worker-id worker-0 [...]`: keep one model process alive.

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

from shared.config import add_config_flags, config_from_args
from shared.supervisor import supervise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m worker.supervisor", description=__doc__)
    parser.add_argument("--worker-id", required=True)
    add_config_flags(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)  # fail here, once, on a bad config rather than in a restart loop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s supervisor {args.worker_id} %(levelname)s "
                                                   f"%(message)s")
    return supervise("model process", [sys.executable, "-m", "worker", *argv], config.worker.restart_backoff_s,
                     config.worker.max_restart_backoff_s)


if __name__ == "__main__":
    sys.exit(main())
