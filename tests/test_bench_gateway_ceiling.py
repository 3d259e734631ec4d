"""The gateway-ceiling benchmark (bench/gateway_ceiling.py) at a tiny scale: two fake workers in one
process behind the real gateway over tcp:// with CURVE, a few closed-loop streams, both stream
intervals. It checks that what the benchmark computes is consistent (the tokens it counts against
the tokens the workers sent, CPU figures positive, the JSON's shape), never how fast anything is."""
from __future__ import annotations

import json
import os

import pytest

from bench import gateway_ceiling
from bench.experiments.plotting import is_png
from bench.gateway_ceiling_driver import CLOCK_TICK_S, CpuSample, CpuSampler, FleetSpec
from bench.results_file import write_results

LEVELS = (3, 6)
REQUESTS_PER_STREAM = 4


def test_samples_interpolate_between_their_neighbours():
    sampler = CpuSampler(os.getpid(), [])
    sampler.samples = [CpuSample(10.0, 1.0, 0.5, 2.0, 3.0, [1.0, 2.0]), CpuSample(12.0, 3.0, 1.5, 2.0, 4.0, [2.0, 4.0])]
    mid = sampler.at(11.5)
    assert (mid.t, mid.gateway, mid.gateway_main, mid.fleet, mid.client) == (11.5, 2.5, 1.25, 2.0, 3.75)
    assert mid.cores == [1.75, 3.5]
    assert sampler.at(5.0).gateway == 1.0 and sampler.at(99.0).gateway == 3.0  # clamped to the ends
    d = sampler.at(12.0).minus(sampler.at(10.0))
    assert d.t == 2.0 and d.gateway == 2.0 and d.cores == [1.0, 2.0]


@pytest.mark.timeout(300)
def test_tiny_run_counts_every_token_and_reports_its_cpu(served_checkpoint, tmp_path, capsys):
    affinity = os.sched_getaffinity(0)
    spec = FleetSpec(processes=1, output_tokens=(20, 30), requests_per_stream=REQUESTS_PER_STREAM, warmup_s=0.2)
    plan = gateway_ceiling.Plan(fleets=(2,), intervals=(1, 8), levels=LEVELS, idle_s=1.0, spec=spec)
    report = gateway_ceiling.run(plan, served_checkpoint, "test", quick=True)
    assert os.sched_getaffinity(0) == affinity  # the client's pinning is undone

    assert [(r["num_workers"], r["stream_interval"], r["processes"]) for r in report["runs"]] == [(2, 1, 1), (2, 8, 1)]
    for run in report["runs"]:
        # Every token a worker sent reached the client, none twice: the workers' traces against the streams.
        assert run["tokens_sent_by_workers"] == run["tokens_received"] > 0
        assert [lv["concurrency"] for lv in run["levels"]] == list(LEVELS)
        for level in run["levels"]:
            n = level["concurrency"] * REQUESTS_PER_STREAM
            assert level["requests"] == level["completed"] == level["exact_requests"] == n, level["errors"]
            assert level["errors"] == {}
            assert 0 < level["tokens"] <= level["tokens_received"] and level["messages"] >= 1
            assert level["tokens_per_s"] > 0 and level["window_s"] > 0
            cpu = level["cpu"]
            for key in ("gateway_cpu_s", "fleet_cpu_s", "client_cpu_s"):
                assert cpu[key] > 0, key
            # The process's and its main thread's times come from two /proc files read a moment
            # apart, each counted in whole clock ticks, at the window's start and at its end: each
            # delta may be off by up to a tick, so the thread's may show up to two more.
            assert cpu["gateway_cpu_s"] + 2 * CLOCK_TICK_S >= cpu["gateway_main_cpu_s"] >= 0
            assert level["gateway_us_per_token"] > 0 and level["client_us_per_token"] > 0
            assert 0.0 <= cpu["foreign_share"] <= 1.0 and len(cpu["core_busy"]) == os.cpu_count()
            assert level["dispatch_ms_p50"] is not None and level["dispatch_ms_p99"] >= level["dispatch_ms_p50"]
            assert level["ttft_ms_p50"] is not None
    one, eight = report["runs"]
    assert "idle" in one and "idle" not in eight  # heartbeats are measured once per fleet
    assert one["idle"]["gateway_cpu_s"] >= 0 and one["idle"]["wall_s"] >= 1.0
    # Grouping: the interval-8 streams carried more tokens per message.
    assert eight["levels"][0]["tokens_per_message"] > one["levels"][0]["tokens_per_message"] >= 1.0

    rows = report["summary"]
    assert [(r["num_workers"], r["stream_interval"]) for r in rows] == [(2, 1), (2, 8)]
    for row in rows:
        assert row["tokens_match"] and row["exact_requests"]
        assert row["tokens_per_s_per_core"] > 0 and row["gateway_us_per_token"] > 0
        assert set(row["bottleneck"].split(" + ")) <= {"gateway event loop", "gateway's core", "client/fleet core",
                                                       "all cores", "other load", "offered load"}
        assert row["kept_up_tokens_per_s"] is None or row["kept_up_tokens_per_s"] <= row["tokens_per_s"]
        assert set(row["gateways_for"]) == {str(t) for t in gateway_ceiling.TARGETS_TOKENS_PER_S}
    assert rows[0]["heartbeats_per_s"] == 2 / report["heartbeat_interval_s"] and "us_per_heartbeat" in rows[0]
    assert "heartbeats_per_s" not in rows[1]

    path = write_results(report, tmp_path / "gc.json", tmp_path / "unused.json", quick=True)
    back = json.loads(path.read_text())
    assert {"date", "commit", "command", "plan", "idle_baseline", "runs", "summary",
            "heartbeat_interval_s"} <= set(back)
    assert back["plan"]["levels"] == list(LEVELS) and back["summary"][0]["num_workers"] == 2
    assert is_png(gateway_ceiling.plot(back, tmp_path / "gc.png"))
    gateway_ceiling.print_report(back)
    assert "us per heartbeat" in capsys.readouterr().out
