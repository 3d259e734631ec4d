"""`python -m worker --worker-id worker-0 [--connect ENDPOINT] [--config FILE] [overrides]`: one model process.

Loads the engine, connects to the gateway over ZeroMQ and serves until SIGTERM (exit 0).
A bad config value exits 2 naming it, as argparse does. A fatal error exits non-zero so its
supervisor (worker/supervisor.py) restarts it; a checkpoint it refuses or cannot read, or settings
the engine refuses for this model or device (a ConfigError: every start would refuse them again),
exits EXIT_DO_NOT_RESTART, which its supervisor does not restart.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys

import zmq

from shared.config import ConfigError, add_config_flags
from shared.cpu_affinity import pin_process
from shared.supervisor import EXIT_DO_NOT_RESTART
from shared.worker_identity import add_worker_flags, default_worker_id, expand_connect, worker_config
from worker.process_environment import apply_model_process_environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    add_worker_flags(parser)
    add_config_flags(parser)
    args = parser.parse_args(expand_connect(list(sys.argv[1:] if argv is None else argv)))
    config = worker_config(parser, args)
    args.worker_id = args.worker_id or default_worker_id(config)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.worker_id} %(levelname)s %(message)s")
    # Before torch starts its threads: they inherit the mask.
    if cores := pin_process(args.worker_id, config):
        logging.getLogger("worker").info("pinned to cores %s", cores)
    if environment := apply_model_process_environment(config.worker.cpu_huge_pages, config.worker.cuda_alloc_conf):
        logging.getLogger("worker").info("torch environment: %s", " ".join(f"{k}={v}" for k, v in environment.items()))
    from worker.model.config import CheckpointError, UnsupportedModelError
    from worker.service import EXIT_LINGER_MS, WorkerService  # imports torch: after the environment is set
    try:
        try:
            service = WorkerService(config, args.worker_id)
        except (CheckpointError, UnsupportedModelError, ConfigError) as e:
            # Every start would fail the same way: no restart (the gateway was told why). The message
            # names the fault; a traceback would only bury it.
            logging.getLogger("worker").error("%s cannot load the model in %s: %s: %s", args.worker_id,
                                              config.model_dir, type(e).__name__, e)
            return EXIT_DO_NOT_RESTART
        return service.run()
    finally:
        # libzmq waits out a closed socket's linger only when its context ends: the last frame
        # (WorkerExit) leaves before the process does.
        zmq.Context.instance().destroy(linger=EXIT_LINGER_MS)


if __name__ == "__main__":
    code = main()
    # The exit handlers run (logs flushed), then the process ends without the interpreter's
    # teardown: freeing torch's and the kernels' state module by module took over a second, which
    # every stop and restart waited on, and leaves nothing a model process needs done.
    atexit._run_exitfuncs()
    os._exit(code)
