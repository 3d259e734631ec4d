"""Nothing slow runs on the gateway's event loop: while a ~3 MB prompt is tokenized (truncated to its
last 100 tokens) a concurrent stream's tokens keep coming, no worker is taken for dead, and the
loop's own lag metric shows no stall. Chat templates of many messages render off the loop too.

The real gateway serves one fake worker (20 ms a token), so the stream's cadence is the worker's
and any gap beyond it is the gateway's. Bounds are generous: they catch a stall, not a slow host.
"""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from gateway.tokenizer import Tokenizer
from gateway_fake_cluster import FakeCluster, metric, request
from protos import inference_pb2

pytestmark = pytest.mark.timeout(180)

MAX_GAP_S = 0.5  # the old gateway stalled for the whole tokenization: seconds
WORDS = ["Once", "upon", "a", "time", "héllo", "wörld", "日本語", "the", "quick", "brown", "fox", "🙂", "paged"]


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with FakeCluster(served_checkpoint, step_ms=20, sections={"worker": {"max_num_seqs": 8}}) as c:
        yield c


class Stream:
    """A long stream in a thread, noting when each message arrives."""

    def __init__(self, cluster, request_id: str):
        self.call = cluster.stub.Generate(request(request_id=request_id, sampling=dict(max_tokens=400,
                                                                                      ignore_eos=True)), timeout=60)
        self.arrivals: list[float] = []
        self.thread = threading.Thread(target=self._read)
        self.thread.start()
        deadline = time.monotonic() + 10
        while len(self.arrivals) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.arrivals) >= 5, "the stream did not start"

    def _read(self):
        try:
            for _ in self.call:
                self.arrivals.append(time.monotonic())
        except grpc.RpcError:
            pass  # cancelled by stop(); a stream that stopped early shows in max_gap_s

    def max_gap_s(self, start_s: float, end_s: float) -> float:
        times = [t for t in self.arrivals if start_s <= t <= end_s]
        assert len(times) >= 2, "the stream stopped"
        return max(b - a for a, b in zip(times, times[1:]))

    def stop(self):
        self.call.cancel()
        self.thread.join(timeout=10)


def beside_a_stream(cluster, neighbour_id: str, call):
    """Run `call()` while a neighbour streams; (its result or the RpcError it raised, its duration
    in seconds, the neighbour's largest gap between messages meanwhile)."""
    stream = Stream(cluster, neighbour_id)
    try:
        sent_s = time.monotonic()
        try:
            result = call()
        except grpc.RpcError as e:
            result = e
        done_s = time.monotonic()
        time.sleep(0.2)
        return result, done_s - sent_s, stream.max_gap_s(sent_s, done_s + 0.2)
    finally:
        stream.stop()


def test_a_3mb_prompt_does_not_stall_other_streams(cluster):
    rng = random.Random(0)
    prompt = " ".join(rng.choice(WORDS) for _ in range(700_000))[:3_000_000]
    before = cluster.metrics()
    responses, elapsed_s, gap_s = beside_a_stream(cluster, "loop-neighbour", lambda: list(cluster.stub.Generate(
        inference_pb2.GenerateRequest(prompt=prompt, truncate_prompt_tokens=100, request_id="loop-3mb",
                                      sampling=inference_pb2.SamplingOptions(max_tokens=2, ignore_eos=True)),
        timeout=60)))
    print(f"3 MB prompt: {elapsed_s:.2f} s to serve; the neighbour's largest token gap meanwhile "
          f"{gap_s * 1e3:.0f} ms")
    assert responses[-1].usage.prompt_tokens == 100
    assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert gap_s < MAX_GAP_S
    after = cluster.metrics()
    # No worker was taken for dead (which would have moved the neighbour), and no stall was measured.
    resumptions = "inference_request_resumptions_total"
    assert metric(after, resumptions) == metric(before, resumptions)
    lag = "inference_gateway_event_loop_lag_seconds"
    ticks = metric(after, lag + "_count") - metric(before, lag + "_count")
    on_time = metric(after, lag + "_bucket", le="0.5") - metric(before, lag + "_bucket", le="0.5")
    assert ticks > 0 and on_time == ticks, f"{ticks - on_time} loop stalls over 0.5 s"


def test_a_2mb_chat_renders_off_the_loop(cluster, served_checkpoint):
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " + "héllo wörld " * 200}
                for i in range(1000)]
    expected = len(Tokenizer(served_checkpoint).encode_chat(messages))
    responses, elapsed_s, gap_s = beside_a_stream(cluster, "chat-neighbour", lambda: list(cluster.stub.Generate(
        inference_pb2.GenerateRequest(messages=[inference_pb2.ChatMessage(**m) for m in messages],
                                      truncate_prompt_tokens=100, sampling=inference_pb2.SamplingOptions(max_tokens=2)),
        timeout=60)))
    last = responses[-1]
    print(f"1000-message chat (2.4 M characters): {elapsed_s:.2f} s to serve; the neighbour's largest token "
          f"gap meanwhile {gap_s * 1e3:.0f} ms")
    assert expected > 100 and last.usage.prompt_tokens == 100
    assert gap_s < MAX_GAP_S


def test_too_many_chat_messages_are_refused_before_any_work(cluster):
    error, _, gap_s = beside_a_stream(cluster, "refusal-neighbour", lambda: list(cluster.stub.Generate(
        inference_pb2.GenerateRequest(messages=[inference_pb2.ChatMessage(role="user", content="x")] * 100_000),
        timeout=30)))
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "100000 chat messages" in error.details() and "gateway.max_chat_messages" in error.details()
    assert gap_s < MAX_GAP_S
