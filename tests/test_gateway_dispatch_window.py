"""The batch window as the real gateway applies it (gateway/dispatch_window.py), in front of one
fake worker: a request that finds the dispatcher quiet leaves at once, and one that arrives within
a window of that pass waits out the window's rest. The window is long (2 s) so that the two cases
differ by far more than a loaded host's delays."""
from __future__ import annotations

import pytest

from cluster_harness import generate
from gateway_fake_cluster import FakeCluster

pytestmark = pytest.mark.timeout(120)
WINDOW_MS = 2000.0
SHORT = dict(max_tokens=2, ignore_eos=True)


def _final(cluster, request_id: str):
    return generate(cluster.stub, timeout=30, prompt_token_ids=[5, 6, 7], request_id=request_id, sampling=SHORT)[2]


def test_a_lone_request_skips_the_window_and_the_next_one_waits_out_its_rest(served_checkpoint):
    with FakeCluster(served_checkpoint, step_ms=5, sections={"queues": {"batch_window_ms": WINDOW_MS}}) as cluster:
        first = _final(cluster, "first")  # the dispatcher has been quiet since start-up
        second = _final(cluster, "second")  # sent as the first ends, tens of ms after its pass
    assert first.finish_reason and second.finish_reason
    assert first.timing.queue_ms < WINDOW_MS / 2
    assert second.timing.queue_ms > WINDOW_MS / 4
