"""Every size a client picks is bounded before work is done on it: prompt characters, chat messages,
stop strings (count and length) and stop token ids, each refused with INVALID_ARGUMENT naming the
setting; gRPC's own message limit lets every request within them through; a full tokenizer pool
answers RESOURCE_EXHAUSTED with a retry hint."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest

from gateway.offload import Offload, OffloadBusyError
from gateway_fake_cluster import FakeCluster, request
from protos import inference_pb2
from shared.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"max_prompt_chars": 1000, "max_chat_messages": 4, "max_stop_strings": 2, "max_stop_chars": 8,
          "max_stop_token_ids": 3}


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with FakeCluster(served_checkpoint, step_ms=5, sections={"gateway": LIMITS}) as c:
        yield c


def chat(*contents: str) -> list[inference_pb2.ChatMessage]:
    return [inference_pb2.ChatMessage(role="user", content=c) for c in contents]


OVER = [
    ("prompt chars", dict(prompt="x" * 1001), "the prompt is 1001 characters", "gateway.max_prompt_chars"),
    ("chat messages", dict(messages=chat(*"abcde")), "5 chat messages", "gateway.max_chat_messages"),
    ("chat chars", dict(messages=chat("x" * 600, "y" * 600)), "1208 characters together",
     "gateway.max_prompt_chars"),
    # Named by what makes up the bulk: a chat over the bound by its tools says so first.
    ("chat tools chars", dict(messages=chat("hi"), tools_json="[" + " " * 1000 + "]"),
     "tools_json and messages are 1008 characters together (1002 of them tools_json)", "gateway.max_prompt_chars"),
    ("stop strings", dict(prompt_token_ids=[5], sampling=inference_pb2.SamplingOptions(stop=["a", "b", "c"])),
     "3 stop strings", "gateway.max_stop_strings"),
    ("stop chars", dict(prompt_token_ids=[5], sampling=inference_pb2.SamplingOptions(stop=["ok", "x" * 9])),
     "stop[1] is 9 characters", "gateway.max_stop_chars"),
    ("stop token ids", dict(prompt_token_ids=[5], sampling=inference_pb2.SamplingOptions(
        stop_token_ids=[1, 2, 3, 4])), "4 stop_token_ids", "gateway.max_stop_token_ids"),
]


@pytest.mark.parametrize("name, fields, what, setting", OVER, ids=[o[0] for o in OVER])
def test_over_a_bound_is_invalid_argument_naming_it(cluster, name, fields, what, setting):
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.stub.Generate(inference_pb2.GenerateRequest(**fields), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert what in e.value.details() and setting in e.value.details(), e.value.details()


def test_at_the_bounds_is_served(cluster):
    calls = [dict(prompt="x" * 1000, truncate_prompt_tokens=10), dict(messages=chat("a", "b", "c", "d")),
             dict(prompt_token_ids=[5], sampling=inference_pb2.SamplingOptions(stop=["abcdefgh", "b"],
                                                                              stop_token_ids=[1, 2, 3]))]
    for fields in calls:
        fields.setdefault("sampling", inference_pb2.SamplingOptions())
        fields["sampling"].max_tokens = 3
        last = list(cluster.stub.Generate(inference_pb2.GenerateRequest(**fields), timeout=10))[-1]
        assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH, fields


def test_a_million_prompt_token_ids_are_refused_without_reading_them(cluster):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.stub.Generate(request([5] * 1_000_000), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.value.details()
    # Truncated, the same ids are fine: only the kept ones are copied and checked.
    last = list(cluster.stub.Generate(request([5] * 1_000_000, truncate_prompt_tokens=8,
                                              sampling=dict(max_tokens=2)), timeout=30))[-1]
    assert last.usage.prompt_tokens == 8
    assert time.monotonic() - started < 30


def test_a_prompt_of_max_prompt_chars_is_taken_over_grpc(served_checkpoint):
    """gRPC's own message limit (4 MiB unless set) would refuse the default bound's prompt with a
    RESOURCE_EXHAUSTED of its own: it follows the bounds, UTF-8's longest characters included."""
    with FakeCluster(served_checkpoint, step_ms=5) as cluster:
        limit = load_config().gateway.max_prompt_chars
        last = list(cluster.stub.Generate(inference_pb2.GenerateRequest(
            prompt="x" * limit, truncate_prompt_tokens=8, sampling=inference_pb2.SamplingOptions(max_tokens=2)),
            timeout=60))[-1]
        assert last.usage.prompt_tokens == 8
        with pytest.raises(grpc.RpcError) as e:  # uncut, it is the model's context that refuses it
            list(cluster.stub.Generate(inference_pb2.GenerateRequest(prompt="x" * limit), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.value.details()
        for prompt in ("x" * (limit + 1), "\U0001f642" * (limit + 1)):  # 1 and 4 bytes a character
            with pytest.raises(grpc.RpcError) as e:
                list(cluster.stub.Generate(inference_pb2.GenerateRequest(prompt=prompt), timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "gateway.max_prompt_chars" in e.value.details()


def test_a_full_tokenizer_pool_is_resource_exhausted(served_checkpoint):
    # One thread and four jobs at most: eight 1.5 MB prompts at once cannot all be taken.
    with FakeCluster(served_checkpoint, step_ms=5, sections={"gateway": {"tokenizer_threads": 1}}) as cluster:
        prompt = "héllo wörld the quick brown fox " * 48_000
        codes, trailers = [], []

        def client():
            try:
                list(cluster.stub.Generate(inference_pb2.GenerateRequest(
                    prompt=prompt, truncate_prompt_tokens=16,
                    sampling=inference_pb2.SamplingOptions(max_tokens=1)), timeout=60))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "preparing" in e.details() and "at most 4 at once" in e.details(), e.details()
                    trailers.append(dict(e.trailing_metadata()).get("retry-after-ms"))

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(codes) == 8 and set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1 and codes.count(grpc.StatusCode.OK) >= 1, codes
        assert trailers and set(trailers) == {"1000"}


def test_offload_queue_is_bounded_and_a_cancelled_queued_job_never_runs():
    async def scenario():
        offload = Offload(num_threads=1, max_pending=2)
        release, ran = threading.Event(), []
        running = asyncio.ensure_future(offload.run(release.wait, 10))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(offload.run(ran.append, "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(OffloadBusyError, match="at most 2 at once"):
            await offload.run(ran.append, "refused")
        queued.cancel()
        await asyncio.sleep(0.05)  # the cancel reaches the pool's queue on the loop's next turn
        release.set()
        assert await running is True
        assert await offload.run(ran.append, "after") is None
        offload.shutdown()
        return ran

    assert asyncio.run(scenario()) == ["after"]


def test_small_jobs_do_not_count_against_the_bound_of_large_ones():
    """A small request offloaded only for its structured-output check holds little memory: a pool
    busy with large jobs up to its bound still takes it, and it takes no large job's place."""
    async def scenario():
        offload = Offload(num_threads=1, max_pending=1)
        release = threading.Event()
        running = asyncio.ensure_future(offload.run(release.wait, 10))
        await asyncio.sleep(0.05)
        small = [asyncio.ensure_future(offload.run(lambda i=i: i, large=False)) for i in range(5)]
        await asyncio.sleep(0.05)
        with pytest.raises(OffloadBusyError, match="at most 1 at once"):
            await offload.run(lambda: None)
        release.set()
        assert await running is True and await asyncio.gather(*small) == [0, 1, 2, 3, 4]
        assert offload.num_pending == 0 and await offload.run(lambda: "large again") == "large again"
        offload.shutdown()

    asyncio.run(scenario())


def test_bounds_are_config_values_checked_at_start():
    defaults = load_config(ROOT / "configs" / "default.toml").gateway
    assert (defaults.max_prompt_chars, defaults.max_chat_messages, defaults.max_stop_strings,
            defaults.max_stop_chars, defaults.resume_grace_s) == (4 << 20, 1024, 16, 256, 5.0)
    for name, bad in [("max_prompt_chars", 0), ("max_stop_strings", -1), ("tokenizer_threads", 0),
                      ("resume_grace_s", -1.0)]:
        with pytest.raises(ConfigError, match=f"gateway.{name}"):
            load_config(overrides={f"gateway.{name}": bad})
