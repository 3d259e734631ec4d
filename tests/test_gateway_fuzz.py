"""Property-based fuzzing of Generate against a real gateway: whatever a GenerateRequest holds (extreme
numbers, NaN and infinities, huge repeated fields, odd unicode, any mix of set and unset fields),
the RPC ends with OK or a specific refusal and its message, never INTERNAL or UNKNOWN, never hung,
and the gateway's memory comes back near where it started.

The gateway serves one fake worker (1 ms a token). 60 examples by default; set
GATEWAY_FUZZ_EXAMPLES (e.g. 2000) for a longer run.
"""
from __future__ import annotations

import os
import time

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_fake_cluster import FakeCluster
from protos import inference_pb2

pytestmark = pytest.mark.timeout(600)

NUM_EXAMPLES = int(os.environ.get("GATEWAY_FUZZ_EXAMPLES", "60"))
RPC_TIMEOUT_S = 30.0  # far above any example's work: reaching it means a hung stream
# Refusals a client may get for what it sent; anything else (INTERNAL, UNKNOWN, a deadline) is a bug.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.FAILED_PRECONDITION}
INT32 = st.integers(-2**31, 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, 1e-45, 3.4e38, float("nan"),
                                                         float("inf"), float("-inf")]))
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)  # proto strings are UTF-8: no surrogates
ODD = st.sampled_from(["\x00", "\u200b", "\ufeff", "\U0001f642" * 3, "e\u0301", "\u202e", "\ufffd", "</s>",
                       "<|user|>", "{{ 7 * 7 }}", "{% for %}"])


def huge(piece, sizes=(1_000, 100_000, 5_000_000)):
    """`piece` repeated to sizes past the gateway's bounds (the largest, but for "a", past gRPC's
    message limit too)."""
    return st.builds(lambda p, n: p * n, piece, st.sampled_from(sizes))


prompts = st.one_of(st.just(""), TEXT, TEXT, ODD, st.lists(st.one_of(TEXT, ODD), max_size=8).map("".join),
                    huge(st.sampled_from(["a", "héllo ", "日本語", "\U0001f642"])))
token_ids = st.one_of(st.lists(st.integers(3, 319), max_size=40),
                      st.lists(st.one_of(st.integers(0, 400), UINT32), max_size=40),
                      huge(st.sampled_from([[5], [5, 6, 7], [2**32 - 1]]), sizes=(1_000, 1_000_000)))
roles = st.sampled_from(["system", "user", "assistant", "", "robot", "USER", "tool"])
messages = st.one_of(
    st.lists(st.builds(inference_pb2.ChatMessage, role=st.sampled_from(["system", "user", "assistant"]),
                       content=st.one_of(TEXT, ODD)), max_size=6),
    st.lists(st.builds(inference_pb2.ChatMessage, role=roles, content=st.one_of(TEXT, ODD)), max_size=6),
    st.builds(lambda n: [inference_pb2.ChatMessage(role="user", content="x")] * n, st.sampled_from([1025, 100_000])))
stops = st.one_of(st.just([]), st.lists(st.one_of(TEXT, ODD), max_size=5), huge(st.just(["s"]), sizes=(17, 20_000)),
                  st.builds(lambda n: ["x" * n], st.sampled_from([256, 257, 1_000_000])))


def optional(strategy):
    """Unset two times in three: a request with every field set is almost always refused."""
    return st.one_of(st.none(), st.none(), strategy)


@st.composite
def sampling_options(draw) -> inference_pb2.SamplingOptions:
    fields = {name: draw(optional(strategy)) for name, strategy in [
        ("max_tokens", st.one_of(INT32, st.integers(1, 64))), ("temperature", FLOATS), ("top_p", FLOATS),
        ("top_k", INT32), ("min_p", FLOATS), ("repetition_penalty", FLOATS), ("seed", UINT64)]}
    options = inference_pb2.SamplingOptions(**{k: v for k, v in fields.items() if v is not None})
    options.stop.extend(draw(stops))
    options.stop_token_ids.extend(draw(st.one_of(st.just([]), st.lists(st.one_of(st.integers(0, 400), UINT32),
                                                                       max_size=8),
                                                 huge(st.just([3]), sizes=(257, 100_000)))))
    options.ignore_eos = draw(st.booleans())
    return options


@st.composite
def generate_requests(draw) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest()
    # Mostly one prompt form, as a client means to send; sometimes several, or none.
    forms = draw(st.sampled_from([["prompt"], ["ids"], ["messages"]] * 3 + [["prompt", "ids"],
                                                                           ["ids", "messages"], []]))
    if "prompt" in forms:
        request.prompt = draw(prompts)
    if "ids" in forms:
        request.prompt_token_ids.extend(draw(token_ids))
    if "messages" in forms:
        request.messages.extend(draw(messages))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_options()))
    request.priority = draw(st.one_of(st.just(0), INT32))
    request.request_id = draw(st.one_of(st.just(""), st.just(""), TEXT, ODD,
                                        st.text("abc-_.:", min_size=1, max_size=200)))
    request.truncate_prompt_tokens = draw(st.one_of(st.just(0), st.integers(1, 64), UINT32))
    return request


def idle(status: inference_pb2.ClusterStatus) -> bool:
    return status.num_queued == 0 and all(w.alive and w.num_running == 0 for w in status.workers)


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    # A chat that sets no max_tokens would otherwise run to the end of the context (several seconds
    # an example through the fake worker, a run's time set by how many such examples it draws): 64
    # tokens, like a prompt's default, keeps every example short.
    sections = {"worker": {"max_num_seqs": 8}, "gateway": {"chat_default_max_tokens": 64}}
    with FakeCluster(served_checkpoint, step_ms=1, sections=sections) as c:
        yield c


def test_any_generate_request_ends_ok_or_with_a_specific_refusal(cluster):
    gateway = psutil.Process(cluster.procs["gateway"].pid)
    baseline_rss = gateway.memory_info().rss
    outcomes: dict[str, int] = {}

    @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                     HealthCheck.function_scoped_fixture])
    @given(request=generate_requests())
    def one(request):
        try:
            responses = list(cluster.stub.Generate(request, timeout=RPC_TIMEOUT_S))
        except grpc.RpcError as e:
            assert e.code() in REFUSALS, f"{e.code().name}: {e.details()}"
            assert e.details(), f"{e.code().name} without a message"
            outcomes[e.code().name] = outcomes.get(e.code().name, 0) + 1
            return
        last = responses[-1]
        assert last.finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)
        assert last.usage.completion_tokens == sum(len(r.token_ids) for r in responses)
        outcomes["OK"] = outcomes.get("OK", 0) + 1

    one()
    print(f"fuzz outcomes: {outcomes}")
    # Nothing left behind: every request ended on the worker too (heartbeats report it within 0.2 s).
    deadline = time.monotonic() + 5
    while not idle(status := cluster.status()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(status), status
    # Large prompts' tokenizer memory is handed back after each one (gateway/offload.py).
    assert gateway.memory_info().rss < baseline_rss + (256 << 20)
