"""Speculative decoding seen from the gateway: the per-request opt-in travels from gRPC and the OpenAI body
over the wire to the engine, a delta of several tokens keeps nothing past a stop string, and the acceptance
counters reach the request log and /metrics; end to end on a real one-worker cluster."""
from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from cluster_harness import Cluster, generate, wait_all_free
from gateway.metrics import Metrics
from gateway.openai_requests import BadRequest, completion_requests
from gateway.openai_schema import CompletionRequest
from gateway.request_log import request_record
from gateway.streams import RequestState
from protos import inference_pb2, worker_pb2
from shared.config import GatewayConfig
from shared.sampling_params import SamplingParams
from shared.wire import sampling_from_wire, sampling_to_wire


@pytest.mark.parametrize("k", [None, 0, 5])
def test_the_request_k_survives_the_wire(k):
    params = SamplingParams(speculative_ngram_k=k, seed=3)
    wire = sampling_to_wire(params)
    assert wire.HasField("speculative_ngram_k") == (k is not None)
    assert sampling_from_wire(worker_pb2.WireSampling.FromString(wire.SerializeToString())) == params


def test_the_openai_body_takes_it_and_refuses_what_is_out_of_range():
    def options(**fields):
        body = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
        return completion_requests(body, GatewayConfig())[0][0].sampling

    assert options(speculative_ngram_k=4).speculative_ngram_k == 4
    assert options(speculative_ngram_k=0).HasField("speculative_ngram_k")
    assert not options().HasField("speculative_ngram_k")
    for bad in (-1, 33):
        with pytest.raises(BadRequest, match="speculative_ngram_k"):
            options(speculative_ngram_k=bad)


@pytest.mark.parametrize("argv, expected", [([], None), (["--speculative-ngram-k", "0"], 0),
                                             (["--speculative-ngram-k", "6"], 6)])
def test_the_command_line_client_sends_it(monkeypatch, argv, expected):
    from gateway import client
    parsed = []
    monkeypatch.setattr(client, "generate", lambda args: parsed.append(args) or 0)
    assert client.main(["hello", *argv]) == 0
    sampling = client.build_request(parsed[0]).sampling
    assert (sampling.speculative_ngram_k if sampling.HasField("speculative_ngram_k") else None) == expected


def test_a_delta_of_several_tokens_keeps_none_past_a_stop_string(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over")
    stop_at = next(i for i in range(len(ids)) if "brown" in tokenizer.decode(ids[:i + 1]))

    def stream(chunks):
        state = RequestState(request_id="r", internal_id="g-1", prompt_ids=[5],
                             params=SamplingParams(stop=("brown",), max_tokens=100), priority=0, tokenizer=tokenizer)
        for chunk in chunks:
            if state.on_tokens(chunk, 0.0):
                break
        events = []
        while not state.events.empty():
            events.append(state.events.get_nowait())
        return state.output_ids, "".join(e.text for e in events), [t for e in events for t in e.token_ids]

    one_by_one = stream([[i] for i in ids])
    assert one_by_one[1] == "The quick " and one_by_one[0] == ids[:stop_at + 1]
    assert stream([ids]) == one_by_one  # the whole text in one delta
    assert stream([ids[:2], ids[2:stop_at + 3], ids[stop_at + 3:]]) == one_by_one


def test_the_counters_reach_metrics_and_the_log_line(tokenizer):
    metrics = Metrics()
    for drafts, tokens, accepted in ((2, 10, 7), (5, 20, 15)):
        metrics.on_heartbeat("w", "inc-1", worker_pb2.Heartbeat(num_spec_drafts=drafts, num_spec_draft_tokens=tokens,
                                                                num_spec_accepted_tokens=accepted))
    value = metrics.registry.get_sample_value
    assert value("inference_spec_decode_num_draft_tokens_total", {"worker": "w"}) == 20
    assert value("inference_spec_decode_num_accepted_tokens_total", {"worker": "w"}) == 15
    assert value("inference_spec_decode_num_drafts_total", {"worker": "w"}) == 5
    state = RequestState(request_id="r", internal_id="g-1", prompt_ids=[5], params=SamplingParams(), priority=0,
                         tokenizer=tokenizer, num_draft_tokens=12, num_accepted_draft_tokens=9)
    record = request_record(state, "OK")
    assert (record["draft_tokens"], record["accepted_draft_tokens"]) == (12, 9)


# ---- end to end ----------------------------------------------------------------------------------------------
def scrape(cluster) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.timeout(300)
def test_a_cluster_serves_opted_in_requests_identically_and_counts_their_drafts(served_checkpoint, tokenizer):
    from worker.engine import Engine
    prompts = [[5, 6, 7, 8, 9] * 6, list(range(40, 70)) * 2, [11, 12] * 10]
    engine = Engine.from_model_dir(served_checkpoint, num_kv_blocks=128)
    expected = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
    with Cluster(served_checkpoint, num_workers=1, sections={"worker": {"speculative_ngram_max_k": 8}}) as cluster:
        served = {}
        for i, p in enumerate(prompts):
            served[f"spec-{i}"] = generate(cluster.stub, request_id=f"spec-{i}", prompt_token_ids=p, sampling=dict(
                max_tokens=40, temperature=0.0, ignore_eos=True, speculative_ngram_k=6))
        plain = generate(cluster.stub, request_id="plain", prompt_token_ids=prompts[0],
                         sampling=dict(max_tokens=40, temperature=0.0, ignore_eos=True))
        # A stop string inside what the drafts confirm: the same text as without them.
        full_text = tokenizer.decode(expected[0].token_ids)
        stop = full_text[len(full_text) // 3:len(full_text) // 3 + 3]
        assert stop.strip()
        _, stopped, last = generate(cluster.stub, prompt_token_ids=prompts[0], sampling=dict(
            max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop], speculative_ngram_k=6))
        assert stopped == full_text[:full_text.find(stop)] and last.finish_reason == inference_pb2.FINISH_REASON_STOP
        with pytest.raises(grpc.RpcError) as e:
            generate(cluster.stub, prompt_token_ids=[5], sampling=dict(speculative_ngram_k=33))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_all_free(cluster)
        time.sleep(0.5)  # a heartbeat carries the worker's counters
        metrics = scrape(cluster)
        lines = [json.loads(line[line.index("{"):]) for line in
                 (cluster.run_dir / "gateway.log").read_text().splitlines() if '"event":"request"' in line]
    for (rid, (ids, _, _)), want in zip(served.items(), expected):
        assert ids == want.token_ids, rid
    assert plain[0] == expected[0].token_ids
    records = {r["request_id"]: r for r in lines}
    drafted = sum(records[rid]["draft_tokens"] for rid in served)
    accepted = sum(records[rid]["accepted_draft_tokens"] for rid in served)
    assert 0 < accepted <= drafted and records["plain"]["draft_tokens"] == 0
    labels = (("worker", "worker-0"),)
    assert metrics[("inference_spec_decode_num_draft_tokens_total", labels)] >= drafted
    assert metrics[("inference_spec_decode_num_accepted_tokens_total", labels)] >= accepted
