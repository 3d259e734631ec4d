"""The committed generated modules match the .proto files, and every wire message round-trips."""
from __future__ import annotations

import filecmp

import pytest

from protos import worker_pb2
from shared import ipc
from shared.sampling_params import SamplingParams
from shared.wire import sampling_from_wire, sampling_to_wire
from tools.gen_protos import ROOT, generate


def test_generated_modules_are_current(tmp_path):
    for path in generate(tmp_path):
        committed = ROOT / "protos" / path.name
        assert committed.exists(), f"{path.name} is not committed; run `make protos`"
        assert filecmp.cmp(path, committed, shallow=False), f"{path.name} is stale; run `make protos`"


def _examples() -> list[worker_pb2.Envelope]:
    sampling = sampling_to_wire(SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1,
                                               repetition_penalty=1.2, seed=2**62, stop_token_ids=(3, 4)))
    return [
        worker_pb2.Envelope(submit=worker_pb2.SubmitBatch(requests=[worker_pb2.WireRequest(
            request_id="r1", prompt_token_ids=[1, 2, 3], output_token_ids=[9], sampling=sampling, priority=-2)])),
        worker_pb2.Envelope(abort=worker_pb2.AbortRequests(request_ids=["r1", "r2"])),
        worker_pb2.Envelope(probe=worker_pb2.Probe(probe_id=5, deep=True)),
        worker_pb2.Envelope(outputs=worker_pb2.StepOutputs(step_ms=3.5, deltas=[worker_pb2.TokenDelta(
            request_id="r1", new_token_ids=[7], finished=True, finish_reason="length", num_prompt_tokens=3,
            num_cached_tokens=0)])),
        worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(ready=True, num_running=2, kv_blocks_total=64,
                                                           kv_blocks_free=60, memory_level="OK", device="cpu")),
        worker_pb2.Envelope(probe_reply=worker_pb2.ProbeReply(probe_id=5, ok=True, latency_ms=1.5)),
    ]


@pytest.mark.parametrize("envelope", _examples(), ids=lambda e: e.WhichOneof("body"))
def test_every_wire_message_round_trips(envelope):
    envelope.worker_id, envelope.incarnation = "worker-0", "123-abc"
    decoded = ipc.decode(ipc.encode(envelope))
    assert decoded == envelope and decoded.version == ipc.WIRE_VERSION


def test_sampling_params_round_trip_exactly():
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.3, top_k=2, min_p=0.05, repetition_penalty=1.1,
                            seed=12345, stop_token_ids=(5,), ignore_eos=True)
    assert sampling_from_wire(sampling_to_wire(params)) == params
    unseeded = sampling_from_wire(sampling_to_wire(SamplingParams()))
    assert unseeded.seed is None


def test_wrong_version_and_garbage_are_refused():
    envelope = worker_pb2.Envelope(worker_id="w", abort=worker_pb2.AbortRequests(request_ids=["x"]))
    envelope.version = ipc.WIRE_VERSION + 1
    with pytest.raises(ipc.WireError, match="wire version"):
        ipc.decode(envelope.SerializeToString())
    with pytest.raises(ipc.WireError):
        ipc.decode(b"\xff\xff\xff not a protobuf")
    with pytest.raises(ipc.WireError, match="no body"):
        ipc.decode(ipc.encode(worker_pb2.Envelope(worker_id="w")))


def test_overlong_ipc_path_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="limit of unix sockets"):
        ipc.check_endpoint("ipc:///tmp/" + "x" * 200)
    with pytest.raises(ValueError, match="ipc:// or tcp://"):
        ipc.check_endpoint("udp://x")
