"""The engine's part of a scheduler step, played by hand for the scheduler's tests (no model)."""
from __future__ import annotations

from worker.scheduler import Scheduler


def play_step(s: Scheduler, token_id: int) -> dict[str, int]:
    """Schedule, then advance each scheduled request, register its computed blocks, append
    `token_id` when it has caught up, and finish what that stops; request id -> tokens scheduled."""
    out = s.schedule()
    for item in out.scheduled:
        r = item.request
        r.num_computed_tokens += item.num_new_tokens
        s.blocks.cache_blocks(r.request_id, r.token_ids, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(token_id)
            status = r.stop_status()
            if status:
                s.finish(r, status)
    s.blocks.check_integrity()
    return {item.request.request_id: item.num_new_tokens for item in out.scheduled}
