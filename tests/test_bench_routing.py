"""The routing benchmark (bench/routing.py): its workloads, its numbers, and its quick mode's core on
fake workers, where cache-aware routing must find more of each conversation cached than
least-loaded routing. Behaviour only: timings are never asserted."""
from __future__ import annotations

import pytest

from bench import routing
from bench.load_stats import RequestRecord
from bench.routing_driver import FakeWorkers, TurnRecord
from bench.routing_report import print_report, ratios, summarize
from bench.routing_workload import ChatSpec, make_conversations

VOCAB = 320  # the served checkpoint's


def test_workloads_share_arrivals_and_lengths_and_only_multi_turn_shares_prefixes():
    spec = ChatSpec(num_conversations=5, num_turns=3, rate=2.0)
    multi, think, alone = (make_conversations(spec, VOCAB, w) for w in ("multi_turn", "multi_turn_think", "no_sharing"))
    assert [c.arrival_s for c in multi] == [c.arrival_s for c in alone] == [c.arrival_s for c in think]
    assert all(c.think_s == [0.0] * 3 for c in multi + alone) and any(t > 0 for c in think for t in c.think_s[1:])
    for m, a in zip(multi, alone):
        assert m.reply_lens == a.reply_lens
        history = None
        for turn in range(spec.num_turns):
            prompt = m.prompt(turn, history)
            assert prompt[:spec.system_len] == multi[0].system and (history is None or prompt[:len(history)] == history)
            assert len(a.prompt(turn, None)) == len(prompt) <= spec.max_model_len
            assert all(8 <= t < VOCAB for t in prompt)
            history = prompt + [100] * m.reply_lens[turn]
    firsts = {tuple(c.prompt(0, None)[:16]) for c in alone} | {tuple(multi[0].system[:16]), tuple(think[0].system[:16])}
    assert len(firsts) == len(alone) + 2  # no two share even a first block
    assert make_conversations(spec, VOCAB, "multi_turn")[2].users == multi[2].users  # seeded


def test_summary_and_ratios():
    def record(conv, turn, prompt_len, cached, worker, t0):
        r = TurnRecord(index=0, priority=0, prompt_len=prompt_len, max_tokens=2, scheduled_s=t0, conversation=conv,
                       turn=turn, cached_tokens=cached, worker_id=worker)
        r.chunks, r.end_s = [(t0 + 0.1, 2)], t0 + 0.2  # one message with both tokens: no TPOT, no error
        return r

    records = [record(0, 0, 100, 0, "w0", 0.0), record(0, 1, 200, 150, "w1", 1.0), record(1, 0, 100, 50, "w0", 2.0)]
    s = summarize(records, 4.0, {"inference_prefix_cache_queries_total": 10.0,
                                 "inference_prefix_cache_hits_total": 5.0}, {})
    assert s["hit_rate"] == 200 / 400 and s["worker_hit_rate"] == 0.5
    assert s["workers_per_conversation"] == 1.5 and s["requests_per_worker"] == {"w0": 2, "w1": 1}
    assert s["hit_rate_by_turn"] == {0: 0.25, 1: 0.75} and s["requests_per_s"] == 3 / 4.0
    runs = {"cache_aware": {"multi_turn": {"hit_rate": 0.9, "ttft_ms_p50": 10.0},
                            "no_sharing": {"requests_per_s": 2.0}},
            "least_loaded": {"multi_turn": {"hit_rate": 0.5, "ttft_ms_p50": 30.0},
                             "no_sharing": {"requests_per_s": 2.5}},
            "single_worker": {"multi_turn": {"hit_rate": 0.95}}}
    r = ratios(runs)
    assert r["hit_cache_aware_vs_single/multi_turn"] == pytest.approx(0.9 / 0.95)
    assert r["ttft_p50_least_loaded_vs_cache_aware/multi_turn"] == 3.0
    assert r["throughput_cache_aware_vs_least_loaded/no_sharing"] == 0.8
    assert r["hit_cache_aware_vs_single/multi_turn_think"] is None
    assert isinstance(records[0], RequestRecord) and records[0].tpot_s is None


@pytest.mark.timeout(300)
def test_quick_core_on_fake_workers_cache_aware_finds_more_cached(served_checkpoint, capsys):
    plan = routing.plans(quick=True, fake=FakeWorkers())[1]  # 4 fake workers, 8 conversations x 4 turns
    assert plan.num_workers == 4 and plan.fake is not None
    result = routing.run_plan(served_checkpoint, plan, VOCAB, runs=("cache_aware", "least_loaded"),
                              workloads=("multi_turn_think",))
    assert result["name"] == plan.name and set(result["runs"]) == {"cache_aware", "least_loaded"}
    total = plan.spec.num_conversations * plan.spec.num_turns
    for run, by_workload in result["runs"].items():
        s = by_workload["multi_turn_think"]
        assert s["completed"] == s["requests"] == total, (run, s["errors"])
        assert 0.0 <= s["hit_rate"] <= 1.0 and s["prompt_tokens"] > 0
        assert s["ttft_ms_p50"] is not None and s["ttft_ms_p99"] >= s["ttft_ms_p50"]
        assert s["requests_per_s"] > 0 and sum(s["requests_per_worker"].values()) == total
        decisions = {k: v for k, v in s["counters"].items() if k.startswith("inference_routing_decisions_total")}
        assert sum(decisions.values()) == total
        # The workers' own count agrees with the responses' (both are the fake cache's hits).
        assert s["counters"].get("inference_prefix_cache_hits_total", 0.0) == s["cached_tokens"]
    ca, ll = (result["runs"][p]["multi_turn_think"] for p in ("cache_aware", "least_loaded"))
    assert ca["hit_rate"] > ll["hit_rate"]
    assert ca["counters"].get("inference_routing_decisions_total{cache_hit}", 0) > total / 2
    assert result["ratios"]["ttft_p50_least_loaded_vs_cache_aware/multi_turn_think"] is not None

    print_report({"date": "d", "commit": "c", "command": "cmd", "clusters": [result], "total_s": 1.0})
    out = capsys.readouterr().out
    assert "multi_turn_think" in out and "least_loaded TTFT p50 / cache_aware's" in out


def test_experiment_11_plots_a_png(tmp_path):
    from bench.experiments import exp11_cache_routing as e11
    from bench.experiments import plotting

    point = {"hit_rate": 0.5, "ttft_ms_p50": 30.0}
    data = {"sizes": [2, 4], "by_size": {"2": {p: point for p in routing.RUNS}, "4": {p: point for p in routing.RUNS}}}
    e11.plot(data, tmp_path / "cache_routing.png")
    assert plotting.is_png(tmp_path / "cache_routing.png")
