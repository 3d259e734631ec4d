"""Keep one child process running: restart it whenever it exits, pass stop signals on to it.

`honcho start` stops the whole cluster as soon as any Procfile entry exits, so every entry (the
gateway and each worker) is one of these: a small process that holds no model, no socket and no
request, and restarts its child (`python -m gateway`, `python -m worker`) whenever it dies, with
exponential backoff for crash loops. SIGTERM/SIGINT to the supervisor are passed on to the child,
which drains and exits; the supervisor then exits 0 (1 if the child had to be killed or failed
its drain). A child that exits EXIT_DO_NOT_RESTART is not restarted. A child outlives neither a
stop nor its supervisor: if the supervisor itself is killed, the kernel sends the child SIGTERM
(Linux), so no model process is left orphaned.

Standard library only: a supervisor must start in milliseconds and must not fail on whatever
breaks its child.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger("supervisor")
STOP_TIMEOUT_S = 15.0  # after SIGTERM, how long the child may take before it is killed
STABLE_RUN_S = 30.0  # a run this long resets the backoff
_PR_SET_PDEATHSIG = 1
# Exit statuses of a child that stopped because it was asked to: a child still starting up has
# not installed its handlers yet, and dies of the signal itself.
_CLEAN_STOPS = {0, -signal.SIGTERM, -signal.SIGINT}
# A child that exits with this (sysexits' EX_CONFIG) found a fault it will find again on every
# start (a model it cannot load, a tokenizer that is not there): the supervisor stops and exits
# with it, so the fault shows (honcho stops the cluster naming it; Kubernetes shows the pod's
# crash) instead of a restart loop that loads the model again and again.
EXIT_DO_NOT_RESTART = 78


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved before any fork: the child runs the pre-exec hook between fork and exec, where
# loading a library could deadlock on a lock another thread held at fork time.
_PRCTL = _load_prctl()


def die_with_parent(parent_pid: int) -> None:
    """In the child, before exec (`preexec_fn`): SIGTERM when the parent dies, even by SIGKILL.
    Linux ties this to the thread that forked, so that thread must live as long as the child."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the supervisor died before the request above took hold
        os._exit(1)


class Supervisor:
    def __init__(self, name: str, child_argv: list[str], backoff_s: float, max_backoff_s: float,
                 stop_timeout_s: float = STOP_TIMEOUT_S):
        self.name = name
        self.child_argv = child_argv
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stop_timeout_s = stop_timeout_s
        self.stopping = threading.Event()
        self.child: subprocess.Popen | None = None
        self._child_told = False  # this child has had its SIGTERM: once is enough
        self.num_starts = 0

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def stop(self, signum=None, _frame=None) -> None:
        self.stopping.set()
        self._terminate_child()

    def _terminate_child(self) -> None:
        child = self.child
        if child is None or child.poll() is not None or self._child_told:
            return
        self._child_told = True
        try:
            child.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def run(self) -> int:
        """Until stopped: 0 when the last child stopped cleanly, else 1; EXIT_DO_NOT_RESTART
        when the child exited with it."""
        delay = self.backoff_s
        while not self.stopping.is_set():
            started = time.monotonic()
            parent = os.getpid()
            self._child_told = False
            self.child = subprocess.Popen(self.child_argv, preexec_fn=lambda: die_with_parent(parent))
            self.num_starts += 1
            log.info("started %s pid %d (start #%d)", self.name, self.child.pid, self.num_starts)
            returncode = self._wait()
            if self.stopping.is_set():
                break
            if returncode == EXIT_DO_NOT_RESTART:
                log.error("%s cannot start (exit %d: the reason is in its log above); not restarting it", self.name,
                          returncode)
                self.child = None
                return EXIT_DO_NOT_RESTART
            delay = self.backoff_s if time.monotonic() - started > STABLE_RUN_S else delay
            log.warning("%s exited with %s; restarting in %.1f s", self.name, returncode, delay)
            self.child = None  # gone on its own: a stop during the backoff has nothing to drain
            self.stopping.wait(delay)
            delay = min(delay * 2, self.max_backoff_s)
        return self._reap()

    def _wait(self) -> int | None:
        """The child's exit status, or None as soon as a stop is asked for."""
        while not self.stopping.is_set():
            try:
                return self.child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
        return None

    def _reap(self) -> int:
        child = self.child
        if child is None:
            return 0
        if child.poll() is None:
            self._terminate_child()
            try:
                child.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.error("%s pid %d ignored SIGTERM for %.0f s; killing it", self.name, child.pid,
                          self.stop_timeout_s)
                child.kill()
                child.wait()
                return 1
        if child.returncode not in _CLEAN_STOPS:
            log.error("%s pid %d exited with %s while stopping", self.name, child.pid, child.returncode)
            return 1
        log.info("%s stopped", self.name)
        return 0


def supervise(name: str, child_argv: list[str], backoff_s: float, max_backoff_s: float,
              stop_timeout_s: float = STOP_TIMEOUT_S) -> int:
    """Run `child_argv` under a Supervisor in this process until SIGTERM/SIGINT; its exit status."""
    supervisor = Supervisor(name, child_argv, backoff_s, max_backoff_s, stop_timeout_s)
    supervisor.install_signal_handlers()
    return supervisor.run()
