"""`python -m worker.supervisor --worker-id worker-0 [...]`: keep one model process alive.

`honcho start` stops the whole cluster as soon as any entry exits, so the Procfile runs
this small process, which holds no model, and it restarts the model process
(`python -m worker`) whenever it dies, with exponential backoff for crash loops.
SIGTERM/SIGINT are passed on to the model process; the supervisor then exits 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time

from shared.config import add_config_flags, config_from_args

log = logging.getLogger("supervisor")
STOP_TIMEOUT_S = 15.0
STABLE_RUN_S = 30.0  # a run this long resets the backoff


class Supervisor:
    def __init__(self, child_argv: list[str], backoff_s: float, max_backoff_s: float):
        self.child_argv = child_argv
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stopping = threading.Event()
        self.child: subprocess.Popen | None = None
        self.num_starts = 0

    def stop(self, signum=None, _frame=None) -> None:
        self.stopping.set()
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        delay = self.backoff_s
        while not self.stopping.is_set():
            started = time.monotonic()
            self.child = subprocess.Popen(self.child_argv)
            self.num_starts += 1
            log.info("started model process pid %d (start #%d)", self.child.pid, self.num_starts)
            returncode = self._wait()
            if self.stopping.is_set():
                break
            delay = self.backoff_s if time.monotonic() - started > STABLE_RUN_S else delay
            log.warning("model process exited with %s; restarting in %.1f s", returncode, delay)
            self.stopping.wait(delay)
            delay = min(delay * 2, self.max_backoff_s)
        self._reap()
        return 0

    def _wait(self) -> int:
        while True:
            try:
                return self.child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue

    def _reap(self) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            return
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("model process %d ignored SIGTERM for %.0f s; killing it", child.pid, STOP_TIMEOUT_S)
            child.kill()
            child.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m worker.supervisor", description=__doc__)
    parser.add_argument("--worker-id", required=True)
    add_config_flags(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)  # fail here, once, on a bad config rather than in a restart loop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s supervisor {args.worker_id} %(levelname)s "
                                                   f"%(message)s")
    supervisor = Supervisor([sys.executable, "-m", "worker", *argv], config.worker.restart_backoff_s,
                            config.worker.max_restart_backoff_s)
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
