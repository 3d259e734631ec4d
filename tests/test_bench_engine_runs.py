"""The engine benchmark's pairing of each (c) run with the matmul rate measured around it.

A fake engine and made-up rates: nothing here depends on the machine's speed.
"""
from __future__ import annotations

from bench import engine_runs
from bench.engine_runs import median_run, run_throughput_paired
from bench.run_result import RunResult
from bench.workload import Request


def test_each_run_takes_the_better_rate_around_it_and_the_median_fraction_is_reported(monkeypatch):
    walls = iter([10.0, 8.0, 12.0])
    monkeypatch.setattr(engine_runs, "run_throughput",
                        lambda engine, requests, warmup, timed: RunResult("ours", next(walls), 100))
    rates = iter([50.0, 60.0, 200.0, 150.0, 90.0, 80.0])  # before / after each run
    requests = [Request([1, 2], 3)]
    paired = run_throughput_paired(None, requests, requests, 3, lambda: next(rates))
    assert [p.gflops for p in paired] == [60.0, 200.0, 90.0]
    flops = 1e12
    # fractions: 1000/60/10 = 1.667, 1000/200/8 = 0.625, 1000/90/12 = 0.926: the median is the last
    # run (the median wall time would have picked the first)
    chosen = median_run(paired, flops)
    assert chosen is paired[2]
    assert abs(chosen.compute_bound_fraction(flops) - 1000 / 90 / 12) < 1e-9
    note = chosen.run.notes[-1]
    assert "median of 3 runs" in note and "8.00 s at 200.0 GFLOP/s = 62.5%" in note


def test_one_run_is_reported_as_is(monkeypatch):
    monkeypatch.setattr(engine_runs, "run_throughput",
                        lambda engine, requests, warmup, timed: RunResult("ours", 5.0, 10))
    paired = run_throughput_paired(None, [], [], 1, lambda: 50.0)
    chosen = median_run(paired, 1e11)
    assert chosen.run.wall_s == 5.0 and chosen.run.notes == []
