"""The end of a request: one JSON log line with its timing breakdown, and its metrics.

Every RPC lands here exactly once, under the gRPC status its client saw: admitted requests
with their timings (`finish_request`), refused ones with the reason (`refuse_request`).
Every duration comes from the gateway's clock except prefill and worker queue time, which
the worker measured on its own clock and reported as durations.
"""
from __future__ import annotations

import json
import logging
import time

from gateway.metrics import Metrics
from gateway.streams import RequestState

log = logging.getLogger("gateway.requests")
MAX_LOGGED_ID_CHARS = 128


def request_record(state: RequestState, status_code: str) -> dict:
    end_s = state.finished_s or time.monotonic()
    num_output = len(state.output_ids)
    decode_ms = ((end_s - state.first_token_s) * 1e3) if state.first_token_s is not None else 0.0
    return {
        "event": "request", "request_id": state.request_id, "internal_id": state.internal_id, "bucket": state.bucket,
        "priority": state.priority,
        "worker_id": state.worker_id, "prompt_tokens": len(state.prompt_ids), "completion_tokens": num_output,
        "cached_prompt_tokens": state.num_cached_tokens, "queue_ms": round(state.queue_ms, 3),
        "worker_queue_ms": round(state.worker_queue_ms, 3), "prefill_ms": round(state.prefill_ms, 3),
        "ttft_ms": round(state.ttft_ms, 3),
        "per_output_token_ms": round(decode_ms / (num_output - 1), 3) if num_output > 1 else 0.0,
        "e2e_ms": round((end_s - state.arrival_s) * 1e3, 3), "preemptions": state.num_preemptions,
        "resumptions": state.num_resumes, "peak_kv_blocks": state.peak_kv_blocks,
        "draft_tokens": state.num_draft_tokens, "accepted_draft_tokens": state.num_accepted_draft_tokens,
        "finish_reason": state.finish_reason, "status_code": status_code, "api_key": state.owner,
    }


def refuse_request(request_id: str, status_code: str, message: str, metrics: Metrics, api_key: str = "") -> dict:
    """A request that ended before it was queued: refused by validation, a bound, or draining.
    `api_key` is the key's name (never the key), "" when it had none or no keys are set."""
    # A refused id may be anything a client sent, megabytes included: the log keeps its start.
    record = {"event": "request", "request_id": request_id[:MAX_LOGGED_ID_CHARS], "status_code": status_code,
              "error": message, "api_key": api_key}
    log.info(json.dumps(record, separators=(",", ":")))
    metrics.rejections.labels(status_code.lower()).inc()
    metrics.request_status.labels(status_code).inc()
    return record


def finish_request(state: RequestState, status_code: str, metrics: Metrics) -> dict:
    record = request_record(state, status_code)
    log.info(json.dumps(record, separators=(",", ":")))
    bucket = str(state.bucket)
    metrics.request_status.labels(status_code).inc()
    if state.finish_reason is not None and status_code == "OK":
        metrics.request_success.labels(state.finish_reason).inc()
    metrics.prompt_tokens.inc(len(state.prompt_ids))
    metrics.e2e.labels(bucket).observe(record["e2e_ms"] / 1e3)
    if state.dispatch_s is not None:
        metrics.queue_time.labels(bucket).observe(record["queue_ms"] / 1e3)
    if state.first_token_s is not None:
        metrics.ttft.labels(bucket).observe(record["ttft_ms"] / 1e3)
        metrics.prefill_time.labels(bucket).observe(state.prefill_ms / 1e3)
        end_s = state.finished_s or time.monotonic()
        metrics.decode_time.labels(bucket).observe(end_s - state.first_token_s)
    return record
