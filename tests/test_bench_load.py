"""The load generator's arithmetic on synthetic timings: percentiles, ITL, buckets, summaries, workloads.

No cluster and no clocks: every time here is made up, so nothing depends on the machine.
"""
from __future__ import annotations

import pytest

from bench.load_stats import LoadResult, RequestRecord, Summary, bucket_label, bucket_of, itl_samples, percentile
from bench.load_workload import LoadSpec, make_load_workload


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([10, 0, 5], 0) == 0 and percentile([10, 0, 5], 100) == 10


def test_itl_splits_a_gap_evenly_over_the_tokens_of_the_later_message():
    # first message at 1.0 (TTFT, not an ITL), then one token 0.1 s later, then 3 tokens 0.3 s after that
    assert itl_samples([(1.0, 1), (1.1, 1), (1.4, 3)]) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert itl_samples([(1.0, 2)]) == []
    assert itl_samples([]) == []


def test_record_latencies_count_from_the_scheduled_arrival():
    r = RequestRecord(index=0, priority=0, prompt_len=10, max_tokens=4, scheduled_s=2.0, sent_s=2.5,
                      chunks=[(3.0, 1), (3.2, 1), (3.4, 2)], end_s=3.5)
    assert r.ok and r.num_tokens == 4
    assert r.ttft_s == pytest.approx(1.0)
    assert r.e2e_s == pytest.approx(1.5)
    assert r.tpot_s == pytest.approx(0.4 / 3)
    failed = RequestRecord(index=1, priority=0, prompt_len=10, max_tokens=4, scheduled_s=0.0, error="UNAVAILABLE")
    assert not failed.ok and failed.ttft_s is None and failed.tpot_s is None
    at_once = RequestRecord(index=2, priority=0, prompt_len=10, max_tokens=4, scheduled_s=0.0,
                            chunks=[(1.0, 4)], end_s=1.0)  # one message carried every token
    assert at_once.ok and at_once.ttft_s == pytest.approx(1.0) and at_once.tpot_s is None


def test_buckets_follow_the_gateway_rule():
    bounds = (128, 512, 2048)
    assert [bucket_of(n, bounds) for n in (1, 128, 129, 512, 513, 2048, 2049)] == [0, 0, 1, 1, 2, 2, 3]
    assert [bucket_label(i, bounds) for i in range(4)] == ["1-128", "129-512", "513-2048", ">2048"]


def _record(i, priority, prompt_len, start, gaps, error=None):
    t, chunks = start + 0.5, []
    for gap in gaps:
        t += gap
        chunks.append((t, 1))
    return RequestRecord(index=i, priority=priority, prompt_len=prompt_len, max_tokens=len(gaps), scheduled_s=start,
                         sent_s=start, chunks=[] if error else chunks, end_s=None if error else t, error=error)


def test_summary_groups_by_bucket_and_priority_and_counts_errors():
    records = [_record(0, 0, 50, 0.0, [0.0, 0.01, 0.01]), _record(1, 10, 600, 0.0, [0.0, 0.02, 0.02]),
               _record(2, 10, 40, 1.0, [0.0, 0.03]), _record(3, 0, 40, 1.0, [], error="RESOURCE_EXHAUSTED")]
    result = LoadResult("synthetic", records, wall_s=2.0)
    s = result.summary()
    assert (s.requests, s.completed, s.output_tokens) == (4, 3, 8)
    assert s.errors == {"RESOURCE_EXHAUSTED": 1}
    assert s.tokens_per_s == pytest.approx(4.0) and s.requests_per_s == pytest.approx(1.5)
    assert s.ttft_ms[0] == pytest.approx(500.0)
    assert s.itl_ms[0] == pytest.approx(20.0)  # samples 10, 10, 20, 20, 30 ms
    assert set(result.by_bucket()) == {"1-128", "513-2048"}
    by_p = result.by_priority()
    assert by_p[0].completed == 1 and by_p[0].errors == {"RESOURCE_EXHAUSTED": 1}
    assert by_p[10].itl_ms == (pytest.approx(20.0), pytest.approx(29.8))
    assert "priority 10" in result.format() and isinstance(Summary.of([], 0.0), Summary)


def test_workload_is_seeded_fits_the_context_and_mixes_classes():
    spec = LoadSpec(num_requests=200, rate=5.0, seed=3)
    a = make_load_workload(spec, vocab_size=1000, max_model_len=512)
    b = make_load_workload(spec, vocab_size=1000, max_model_len=512)
    assert [(r.prompt_token_ids, r.max_tokens, r.priority, r.arrival_s) for r in a] == \
        [(r.prompt_token_ids, r.max_tokens, r.priority, r.arrival_s) for r in b]
    assert all(r.prompt_len + r.max_tokens <= 512 and r.prompt_len >= 1 for r in a)
    assert all(8 <= t < 1000 for r in a for t in r.prompt_token_ids)
    assert {r.priority for r in a} == {spec.urgent_priority, spec.bulk_priority}
    assert {r.kind for r in a} == {"short", "long"}
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and 200 / arrivals[-1] == pytest.approx(5.0, rel=0.3)
    burst = make_load_workload(LoadSpec(num_requests=5, rate=0), vocab_size=1000, max_model_len=2048)
    assert all(r.arrival_s == 0 for r in burst)
