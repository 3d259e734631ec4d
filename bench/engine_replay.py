"""Replay a load workload through the in-process engine (worker.engine.Engine): the cluster's baseline.

The loop is the worker's own shape with no sockets: add whatever has arrived, run one step,
stamp each request's new tokens with the time the step returned. Open loop adds requests at
their arrival times (sleeping while idle); closed loop keeps N requests in flight. Records
are bench/load_stats.RequestRecord, so both sides are summarised the same way.
"""

from __future__ import annotations

import time
from collections import deque

from bench.load_stats import DEFAULT_BUCKET_BOUNDS, LoadResult, RequestRecord
from bench.load_workload import LoadRequest


def _params(max_tokens: int):
    from shared.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def replay(engine, workload: list[LoadRequest], *, concurrency: int = 0, label: str = "engine",
           bucket_bounds: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS, prefix: str = "replay",
           use_priority: bool = True, run_timeout_s: float = 1800.0) -> LoadResult:
    """concurrency 0: open loop at each request's arrival_s; N > 0: N at a time in workload order."""
    records = {f"{prefix}-{r.index}": RequestRecord(index=r.index, priority=r.priority, prompt_len=r.prompt_len,
                                                    max_tokens=r.max_tokens,
                                                    scheduled_s=r.arrival_s if concurrency <= 0 else 0.0)
               for r in workload}
    pending = deque(workload if concurrency > 0 else sorted(workload, key=lambda r: r.arrival_s))
    in_flight = 0
    steps = 0
    t0 = time.perf_counter()
    deadline = t0 + run_timeout_s

    def add(req: LoadRequest, now: float) -> None:
        nonlocal in_flight
        record = records[f"{prefix}-{req.index}"]
        if concurrency > 0:
            record.scheduled_s = now
        record.sent_s = now
        engine.add_request(f"{prefix}-{req.index}", req.prompt_token_ids, _params(req.max_tokens),
                           priority=req.priority if use_priority else 0)
        in_flight += 1

    while pending or in_flight:
        now = time.perf_counter() - t0
        if time.perf_counter() > deadline:
            raise TimeoutError(f"engine replay {label!r} did not finish within {run_timeout_s:.0f} s")
        if concurrency > 0:
            while pending and in_flight < concurrency:
                add(pending.popleft(), now)
        else:
            while pending and pending[0].arrival_s <= now:
                add(pending.popleft(), now)
        if not engine.has_unfinished_requests():
            if pending and concurrency <= 0:
                time.sleep(max(0.0, pending[0].arrival_s - (time.perf_counter() - t0)))
            continue
        outputs = engine.step()
        steps += 1
        now = time.perf_counter() - t0
        for out in outputs:
            record = records.get(out.request_id)
            if record is None:
                continue
            if out.new_token_ids:
                record.chunks.append((now, len(out.new_token_ids)))
            if out.finished:
                record.end_s = now
                record.finish_reason = out.finish_reason
                if out.finish_reason == "error":
                    record.error = f"ENGINE_ERROR: {(out.error or '')[:80]}"
                in_flight -= 1
    wall = max((r.end_s or 0.0) for r in records.values()) if records else 0.0
    ordered = sorted(records.values(), key=lambda r: r.index)
    mode = f"closed loop, concurrency {concurrency}" if concurrency > 0 else "open loop (Poisson)"
    return LoadResult(label=label, records=ordered, wall_s=wall, bucket_bounds=bucket_bounds,
                      extra={"mode": mode, "steps": steps})
