"""The gateway's stream_interval: tokens per GenerateResponse, the first at once, none lost or reordered.

One test serves the tiny model (the tokens must equal the model's own greedy output); one puts the
gateway in front of bench/fake_worker.py, whose steps are slower than the hold timer, to show
that held tokens leave when stream_hold_ms passes rather than waiting for the interval to fill.
"""
from __future__ import annotations

import grpc
import pytest

from bench.cluster_process import ClusterProcess
from cluster_harness import Cluster
from protos import inference_pb2, inference_pb2_grpc

MAX_TOKENS = 21


def _stream(stub, **sampling) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9], sampling=inference_pb2.SamplingOptions(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **sampling))
    return list(stub.Generate(request, timeout=60))


def _tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_interval_groups_tokens_and_keeps_every_one(served_checkpoint):
    from worker.engine import Engine, SamplingParams
    # The tokens a token-per-message run sends: the model's greedy output, computed in process.
    expected = Engine.from_model_dir(served_checkpoint, num_kv_blocks=16).generate(
        [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        use_tqdm=False)[0].token_ids
    sections = {"gateway": {"stream_interval": 4, "stream_hold_ms": 60_000}}
    with Cluster(served_checkpoint, num_workers=1, sections=sections) as grouped:
        responses = _stream(grouped.stub)
    assert _tokens(responses) == expected and len(expected) == MAX_TOKENS
    sizes = [len(r.token_ids) for r in responses]
    # The first message carries whatever had arrived by then (a fast model: maybe several); after it,
    # a lagging relay may send more than the interval at once, never fewer but at the end.
    assert all(n >= 4 for n in sizes[1:-1]), sizes
    assert len(responses) < MAX_TOKENS // 2
    assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == MAX_TOKENS


def _fake_stream(served_checkpoint, tmp_path, step_ms: int, max_tokens: int, **gateway) -> list[int]:
    """Message sizes of one stream through the real gateway in front of a model-free worker."""
    fake = ["bench.fake_worker", "--step-ms", str(step_ms), "--trace", str(tmp_path / "trace.json")]
    with ClusterProcess(served_checkpoint, 1, {"gateway": gateway, "worker": {"max_num_seqs": 4}},
                        worker_module=fake) as cluster:
        with grpc.insecure_channel(cluster.address) as channel:
            request = inference_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=inference_pb2.SamplingOptions(
                max_tokens=max_tokens, ignore_eos=True))
            responses = list(inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, timeout=30))
    assert responses[-1].usage.completion_tokens == max_tokens
    return [len(r.token_ids) for r in responses]


def test_first_token_leaves_at_once_then_groups_of_the_interval(served_checkpoint, tmp_path):
    # One token per 60 ms fake step: the gateway always keeps up, so the grouping is exact.
    assert _fake_stream(served_checkpoint, tmp_path, 60, 9, stream_interval=4, stream_hold_ms=60_000) == [1, 4, 4]


def test_held_tokens_leave_when_the_hold_time_passes(served_checkpoint, tmp_path):
    # Fake steps of 150 ms against a 5 ms hold: every token leaves alone although the interval is 8.
    assert _fake_stream(served_checkpoint, tmp_path, 150, 5, stream_interval=8, stream_hold_ms=5) == [1] * 5


def test_bad_interval_is_refused_at_start(served_checkpoint):
    with pytest.raises(RuntimeError, match="gateway.stream_interval"):
        ClusterProcess(served_checkpoint, 1, {"gateway": {"stream_interval": 0}}).start(ready_timeout_s=30)
