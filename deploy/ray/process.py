"""The one process an actor owns: started, watched, stopped, and never outliving the actor.

Ray restarts an actor whose process dies, which is what replaces the local supervisor here: when
the child exits on its own, the actor's process exits too (`on_exit`), and Ray starts a new actor
that starts a new child; not after a child that exits EXIT_DO_NOT_RESTART (a model it cannot
load), which would fail the same way in every new actor. The child is started from a thread that
lives as long as it does, because Linux ties the parent-death signal to the thread that forked:
when the actor's process dies (a node removed, `ray.kill`), the child gets SIGTERM and drains,
so no model process is left behind holding a GPU. Standard library only.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from shared.supervisor import EXIT_DO_NOT_RESTART, die_with_parent

log = logging.getLogger("deploy.ray")
STOP_TIMEOUT_S = 20.0
# A child that dies this soon after starting is crash-looping: wait before letting Ray restart it.
CRASH_LOOP_RUN_S = 10.0
CRASH_LOOP_DELAY_S = 5.0


def exit_actor_process() -> None:
    """End this actor's process as a crash, so Ray restarts the actor (up to its max_restarts)."""
    os._exit(1)


class ChildProcess:
    def __init__(self, argv: list[str], log_path: Path, cwd: Path, env: dict[str, str] | None = None,
                 on_exit: Callable[[], None] = exit_actor_process):
        self.argv = argv
        self.log_path = Path(log_path)
        self.stopping = threading.Event()
        self._started = threading.Event()
        self._on_exit = on_exit
        self.proc: subprocess.Popen | None = None
        self.start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._own, args=(cwd, env), name="child-owner", daemon=True)
        self._thread.start()
        self._started.wait()
        if self.start_error is not None:
            raise self.start_error

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _own(self, cwd: Path, env: dict[str, str] | None) -> None:
        parent = os.getpid()
        try:
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(self.argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             preexec_fn=lambda: die_with_parent(parent))
        except BaseException as e:  # noqa: BLE001 - raised again in the constructor
            self.start_error = e
            self._started.set()
            return
        started = time.monotonic()
        self._started.set()
        returncode = self.proc.wait()
        if self.stopping.is_set():
            return
        log.error("%s exited with %s (log: %s)", self.argv[2:4], returncode, self.log_path)
        if returncode == EXIT_DO_NOT_RESTART:  # it would fail the same way in a new actor: stay down
            log.error("%s cannot start; not restarting it", self.argv[2:4])
            return
        if time.monotonic() - started < CRASH_LOOP_RUN_S:
            time.sleep(CRASH_LOOP_DELAY_S)
        self._on_exit()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (the process drains), SIGKILL after `timeout_s`; its exit status."""
        self.stopping.set()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.error("pid %d ignored SIGTERM for %.0f s; killing it", self.proc.pid, timeout_s)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - num_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""
