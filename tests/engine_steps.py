"""An engine's queued requests run to the end by hand, step by step, for the engine-level tests."""
from __future__ import annotations

from worker.engine import Engine
from worker.outputs import RequestOutput


def drain(engine: Engine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until no request is left unfinished, checking the engine's integrity after every step;
    request id -> final output of each request that finished meanwhile."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.final
        engine.check_integrity()
    raise AssertionError("engine did not finish")
