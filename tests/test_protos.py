"""The committed generated modules match the .proto files, and every wire message round-trips."""
from __future__ import annotations

import filecmp

import pytest

from gateway.streams import RequestState
from protos import inference_pb2, worker_pb2
from shared import ipc
from shared.block_hash import chain_hashes
from shared.sampling_params import SamplingParams
from shared.wire import (TokenLogprob, logprobs_from_wire, logprobs_to_wire, prompt_logprobs_from_wire,
                         prompt_logprobs_to_wire, sampling_from_wire, sampling_to_wire)
from tools.gen_protos import ROOT, generate


def test_generated_modules_are_current(tmp_path):
    for path in generate(tmp_path):
        committed = ROOT / "protos" / path.name
        assert committed.exists(), f"{path.name} is not committed; run `make protos`"
        assert filecmp.cmp(path, committed, shallow=False), f"{path.name} is stale; run `make protos`"


def _examples() -> list[worker_pb2.Envelope]:
    sampling = sampling_to_wire(SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1,
                                               repetition_penalty=1.2, seed=2**62, stop_token_ids=(3, 4),
                                               logprobs=True, top_logprobs=2, presence_penalty=0.5,
                                               frequency_penalty=-0.5, logit_bias={3: -100.0}, min_tokens=1))
    return [
        worker_pb2.Envelope(submit=worker_pb2.SubmitBatch(requests=[worker_pb2.WireRequest(
            request_id="r1", prompt_token_ids=[1, 2, 3], output_token_ids=[9], sampling=sampling, priority=-2)])),
        worker_pb2.Envelope(abort=worker_pb2.AbortRequests(request_ids=["r1", "r2"])),
        worker_pb2.Envelope(probe=worker_pb2.Probe(probe_id=5, deep=True)),
        worker_pb2.Envelope(outputs=worker_pb2.StepOutputs(step_ms=3.5, deltas=[worker_pb2.TokenDelta(
            request_id="r1", new_token_ids=[7], finished=True, finish_reason="length", num_prompt_tokens=3,
            num_cached_tokens=0, logprobs=logprobs_to_wire([-0.25], [((7, -0.25), (2, -1.5))]))])),
        worker_pb2.Envelope(heartbeat=worker_pb2.Heartbeat(ready=True, num_running=2, kv_blocks_total=64,
                                                           kv_blocks_free=60, memory_level="OK", device="cpu",
                                                           kv_events_seq=3)),
        worker_pb2.Envelope(probe_reply=worker_pb2.ProbeReply(probe_id=5, ok=True, latency_ms=1.5)),
        worker_pb2.Envelope(kv_events=worker_pb2.KvEvents(seq=3, stored=chain_hashes(range(12), 4),
                                                          removed=[b"\x00" * 16], block_size=4)),
        worker_pb2.Envelope(kv_snapshot_request=worker_pb2.KvSnapshotRequest()),
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
    assert unseeded.seed is None and unseeded == SamplingParams()


def test_openai_sampling_fields_round_trip_exactly():
    # Values that float32 could not hold exactly: the wire carries doubles.
    params = SamplingParams(max_tokens=9, temperature=0.0, logprobs=True, top_logprobs=5, presence_penalty=0.1,
                            frequency_penalty=-1.9999999, min_tokens=9,
                            logit_bias={2**31: -99.99999999, 0: 0.1, 17: 100.0})
    wire = sampling_to_wire(params)
    assert [(b.token_id, b.bias) for b in wire.logit_bias] == list(params.logit_bias)
    decoded = sampling_from_wire(worker_pb2.WireSampling.FromString(wire.SerializeToString()))
    assert decoded == params
    for name in ("logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens"):
        assert getattr(decoded, name) == getattr(params, name), name
    # The worker refuses what the gateway should never send, as a ValueError naming the field.
    wire.top_logprobs, wire.logprobs = 3, False
    with pytest.raises(ValueError, match="top_logprobs=3 needs logprobs=True"):
        sampling_from_wire(wire)


def test_token_logprobs_round_trip_through_a_delta():
    top = [((7, -0.25), (2, -1.5)), ((4, -0.5), (7, -0.75))]
    delta = worker_pb2.TokenDelta(request_id="r", new_token_ids=[7, 9], logprobs=logprobs_to_wire([-0.25, -3.0], top))
    decoded = logprobs_from_wire(worker_pb2.TokenDelta.FromString(delta.SerializeToString()))
    # Binary fractions: exact in float32 too.
    assert decoded == [TokenLogprob(7, -0.25, top[0]), TokenLogprob(9, -3.0, top[1])]
    plain = worker_pb2.TokenDelta(request_id="r", new_token_ids=[7], logprobs=logprobs_to_wire([-0.1]))
    [only] = logprobs_from_wire(plain)
    assert only.token_id == 7 and only.top == () and only.logprob == pytest.approx(-0.1, abs=1e-7)
    assert logprobs_from_wire(worker_pb2.TokenDelta(request_id="r", new_token_ids=[7])) == []
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        logprobs_from_wire(worker_pb2.TokenDelta(request_id="r", new_token_ids=[7, 8],
                                                 logprobs=logprobs_to_wire([-1.0])))
    with pytest.raises(ValueError, match="1 logprobs but 2 top-logprob"):
        logprobs_to_wire([-1.0], top)


def test_prompt_logprobs_round_trip_and_a_resumed_request_does_not_ask_again():
    for k in (None, 0, 20):
        assert sampling_from_wire(sampling_to_wire(SamplingParams(prompt_logprobs=k))).prompt_logprobs == k
    entries = [(-0.5, 3, ((4, -0.25), (9, -0.5))), (-2.0, 1, ((6, -2.0), (4, -2.5)))]
    delta = worker_pb2.TokenDelta(request_id="r", new_token_ids=[8], prompt_logprobs=prompt_logprobs_to_wire(entries))
    decoded = prompt_logprobs_from_wire(worker_pb2.TokenDelta.FromString(delta.SerializeToString()), [1, 9, 6])
    assert decoded == [TokenLogprob(9, -0.5, entries[0][2], rank=3), TokenLogprob(6, -2.0, entries[1][2], rank=1)]
    with pytest.raises(ValueError, match="2 prompt logprobs for a prompt of 4 tokens"):
        prompt_logprobs_from_wire(delta, [1, 9, 6, 5])
    state = RequestState("r", "r-1", [1, 9, 6], SamplingParams(prompt_logprobs=2), 0, None)
    assert state.wire_sampling().prompt_logprobs == 2
    assert state.prompt_logprobs_of(delta) == decoded  # the first delta with tokens carries them
    state.output_ids.append(8)  # resumed after its first token: they came with it
    assert not state.wire_sampling().HasField("prompt_logprobs") and state.prompt_logprobs_of(delta) is None


def test_a_delta_that_cannot_be_read_ends_its_request_with_an_error(tokenizer):
    state = RequestState("r", "r-1", [1, 9, 6, 5], SamplingParams(prompt_logprobs=2), 0, tokenizer)
    delta = worker_pb2.TokenDelta(request_id="r-1", new_token_ids=[8],
                                  prompt_logprobs=prompt_logprobs_to_wire([(-0.5, 1, ())]))
    assert state.on_delta(delta, 0.0) is True  # the dispatcher then forgets it and aborts it on its worker
    event = state.events.get_nowait()
    assert event.finish_reason == "error" and "1 prompt logprobs for a prompt of 4 tokens" in event.error


def test_a_long_prompts_log_probabilities_leave_in_pieces_before_the_first_tokens():
    from gateway.server import PROMPT_LOGPROBS_PER_MESSAGE as most, _prompt_pieces
    response = inference_pb2.GenerateResponse(request_id="r", token_ids=[5], text="x")
    response.prompt_logprobs.extend(inference_pb2.TokenLogprob(token_id=i % 7, logprob=-i) for i in range(2 * most + 3))
    pieces = _prompt_pieces(response)
    assert [len(p.prompt_logprobs) for p in pieces] == [most, most] and len(response.prompt_logprobs) == 3
    assert not any(p.token_ids or p.text for p in pieces) and list(response.token_ids) == [5]
    order = [e.logprob for p in [*pieces, response] for e in p.prompt_logprobs]
    assert order == [-i for i in range(2 * most + 3)]
    short = inference_pb2.GenerateResponse(request_id="r", prompt_logprobs=[inference_pb2.TokenLogprob()])
    assert _prompt_pieces(short) == [] and len(short.prompt_logprobs) == 1


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


def test_a_large_kv_events_snapshot_round_trips():
    # Tens of thousands of 16-byte hashes fit one frame (about 18 bytes each on the wire).
    stored = [i.to_bytes(16, "little") for i in range(50_000)]
    envelope = worker_pb2.Envelope(kv_events=worker_pb2.KvEvents(seq=9, snapshot=True, stored=stored,
                                                                 block_size=16))
    frame = ipc.encode(envelope)
    assert len(frame) < 50_000 * 20
    decoded = ipc.decode(frame).kv_events
    assert decoded.snapshot and decoded.seq == 9 and list(decoded.stored) == stored and not decoded.removed
