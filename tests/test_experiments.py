"""The experiments' measurement logic (bench/experiments/) on tiny inputs: token accounting, KV
utilisation, gaps, step splits, saturation, tables and figures. Timings are never asserted."""
from __future__ import annotations

import importlib

import pytest

from bench.experiments import common, plotting
from bench.experiments import exp01_batching as e1
from bench.experiments import exp02_paged_kv as e2
from bench.experiments import exp04_chunked_prefill as e4
from bench.experiments import exp05_prefix_cache as e5
from bench.experiments import exp06_step_buffers as e6
from bench.experiments import exp09_sched_overhead as e9
from bench.experiments import exp10_load_test as e10
from bench.experiments.registry import EXPERIMENTS, select
from bench.workload import Request
from conftest import make_checkpoint


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("exp") / "llama", "llama")


def tiny_engine(path, **overrides):
    settings = dict(max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=False, num_kv_blocks=64,
                    num_threads=1)
    return common.make_engine(path, **{**settings, **overrides})


def req(prompt_len: int, output_len: int) -> Request:
    return Request(list(range(10, 10 + prompt_len)), output_len)


# ---- experiment 1: static vs continuous batching --------------------------------------------------
def test_static_batch_accounting_pads_to_the_batch_maxima():
    batch = [req(5, 3), req(2, 7), req(4, 1)]
    assert e1.padded_slots(batch) == 3 * (5 + 7)
    assert e1.static_computed_tokens(batch) == 3 * (5 + 7 - 1)
    assert e1.continuous_computed_tokens(batch) == (5 + 3 - 1) + (2 + 7 - 1) + (4 + 1 - 1)
    padded = e1.pad_batch(batch)
    assert [len(r.prompt_token_ids) for r in padded] == [5, 5, 5]
    assert [r.output_len for r in padded] == [7, 7, 7]
    assert padded[1].prompt_token_ids[-2:] == batch[1].prompt_token_ids  # left padding keeps the prompt's end
    assert [len(b) for b in e1.static_batches([req(1, 1)] * 5, 2)] == [2, 2, 1]


def test_the_engine_computes_exactly_the_padded_and_the_unpadded_token_counts(tiny_model):
    engine = tiny_engine(tiny_model)
    counter = common.StepCounter(engine)
    requests = [req(9, 4), req(30, 2), req(17, 6)]
    static = e1.run_batches(engine, [e1.pad_batch(requests)], counter, "s")
    assert static["computed_tokens"] == e1.static_computed_tokens(requests) == 3 * (30 + 6 - 1)
    continuous = e1.run_batches(engine, [requests], counter, "c")
    assert continuous["computed_tokens"] == e1.continuous_computed_tokens(requests)
    # Batches of 2 (two static batches one after the other) and the scheduler, each twice.
    runs = e1.run_workload(engine, counter, requests, (2,), "w", repeats=2)
    assert runs["static, batches of 2"]["computed_tokens"] == 2 * (30 + 4 - 1) + 1 * (17 + 6 - 1)
    assert runs[e1.CONTINUOUS]["computed_tokens"] == runs[e1.CONTINUOUS]["expected"]
    assert all(len(m["walls_s"]) == 2 and m["wall_s"] == min(m["walls_s"]) for m in runs.values())
    counter.detach()
    assert "execute_splitting" not in vars(engine.runner)


# ---- experiment 2: paged vs contiguous KV ------------------------------------------------------------
def test_kv_slot_samples_and_utilisation():
    s = e2.sample([(20, 20, 10), (33, 30, 5)], used_blocks=5, block_size=16, max_model_len=100)
    assert s == {"live": 53, "paged": 80, "exact": 65, "max_len": 200}
    s2 = e2.sample([(7, 7, 1)], used_blocks=1, block_size=16, max_model_len=100)
    util = e2.utilisation([s, s2])
    assert util["paged"] == pytest.approx(60 / 96)
    assert util["exact"] == pytest.approx(60 / 73)
    assert util["max_len"] == pytest.approx(60 / 300)
    assert e2.contiguous_fit([400, 300, 200, 100], 800) == 2  # in order: the third would overflow
    assert e2.blocks_for(33) == 3 and e2.blocks_for(32) == 2


def test_paged_samples_read_the_engines_blocks(tiny_model):
    engine = tiny_engine(tiny_model, block_size=16, max_model_len=256)
    samples, peak, preemptions = e2.run_sampled(engine, [(list(range(10, 30)), 5)], 256, "t")
    # After the first step: 20 prompt tokens computed in 2 blocks of 16.
    assert samples[0] == {"live": 20, "paged": 32, "exact": 25, "max_len": 256}
    assert peak == 1 and preemptions == 0
    assert engine.block_manager.num_used_blocks == 0


# ---- experiments 4, 5, 6, 9, 10 -----------------------------------------------------------------------
def test_decode_gaps_pair_consecutive_tokens_per_request():
    gaps = e4.decode_gaps({"a": [1.0, 1.5, 3.0], "b": [2.0], "c": [0.0, 0.25]})
    assert sorted(gaps) == [(0.25, 0.25), (1.5, 0.5), (3.0, 1.5)]


def test_conversations_reuse_the_previous_turn_from_the_prefix_cache(tiny_model):
    engine = tiny_engine(tiny_model, enable_prefix_caching=True)
    system, users = e5.conversation_script(2, 2, 256)
    records = e5.run_conversations(engine, system, users)
    first, second = [r for r in records if r["conversation"] == 0]
    assert second["prompt_tokens"] == first["prompt_tokens"] + e5.REPLY_LEN + e5.USER_LEN
    # The previous prompt and reply are cached up to the last full block before the new message.
    assert second["cached_tokens"] == (first["prompt_tokens"] + e5.REPLY_LEN - 1) // 16 * 16
    turns = e5.per_turn(records)
    assert turns[1]["prompt_tokens"] == 2 * (e5.SYSTEM_LEN + e5.USER_LEN)
    assert turns[2]["cached_tokens"] == sum(r["cached_tokens"] for r in records if r["turn"] == 2)


def test_allocating_runner_allocates_every_step_and_changes_no_token(tiny_model):
    def generate(engine):
        for i in range(3):
            engine.add_request(f"r{i}", list(range(10, 20 + 7 * i)), common.greedy(6))
        return {k: v.token_ids for k, v in common.run_to_completion(engine).items()}

    baseline = tiny_engine(tiny_model)
    expected = generate(baseline)
    engine = tiny_engine(tiny_model)
    e6.use_allocating_runner(engine)
    seen = []
    inner = engine.runner._prepare
    engine.runner._prepare = lambda seqs: (seen.append(engine.runner.logits), inner(seqs))[1]
    assert generate(engine) == expected
    assert len({id(t) for t in seen}) == len(seen) > 1
    assert e6.step_buffer_bytes(engine.runner) == e6.step_buffer_bytes(baseline.runner) > 8 * 256 * 4


def test_step_split_and_timer():
    split = e9.split_step([0.010, 0.020], [0.001, 0.002], [0.008, 0.016], [0.002, 0.004])
    assert split["forward_ms"] == pytest.approx(9.0)  # runner less its packing
    assert split["rest_ms"] == pytest.approx(1.5)  # step less scheduler and runner

    class Box:
        def f(self, x):
            return x + 1
    box = Box()
    timer = e9.Timer(box, "f")
    assert box.f(1) == 2 and len(timer.samples) == 1
    timer.detach()
    assert "f" not in vars(box)


def test_saturation_rule_and_cluster_sections():
    assert not e10.is_saturated([1.0])
    assert not e10.is_saturated([1.0, 2.0, 3.5])
    assert e10.is_saturated([1.0, 2.0, 2.1])
    assert e10.is_saturated([1.0, 3.0, 2.5])
    num_workers, sections = e10.cluster_sections()
    assert num_workers >= 1 and not {"host", "port", "metrics_port", "http_port"} & set(sections.get("gateway", {}))


# ---- registry, tables, figures --------------------------------------------------------------------------
def test_registry_modules_match_their_entries():
    numbers = [e.number for e in EXPERIMENTS]
    assert numbers == sorted(set(numbers))
    for entry in EXPERIMENTS:
        module = importlib.import_module(entry.module)
        assert (module.NUMBER, module.NAME) == (entry.number, entry.name)
        assert callable(module.run) and callable(module.plot) and module.__doc__
    assert [e.number for e in select(["paged_kv", "1"])] == [1, 2]
    with pytest.raises(SystemExit):
        select(["nope"])


def test_markdown_table_aligns_numbers_right():
    table = common.markdown_table(["name", "value", "share"], [["a 1", 12345, "5.0%"], ["b", 0.5, "10.0%"]])
    lines = table.splitlines()
    assert lines[1] == "|---|---:|---:|"
    assert lines[2] == "| a 1 | 12,345 | 5.0% |"


SAMPLE_DATA = {
    e1: {"workloads": {"8 requests": {
        "static, batches of 8": {"computed_tokens": 30, "expected": 30, "useful_tokens_per_s": 5.0},
        "continuous (this engine)": {"computed_tokens": 20, "expected": 20, "useful_tokens_per_s": 9.0}}}},
    e2: {"samples": [{"live": 5, "paged": 16, "exact": 8, "max_len": 64}] * 3, "max_model_len": 64,
         "fit": {"max_len": 1, "exact": 2, "paged": 3}, "budget_slots": 128},
    e4: {"modes": {"a": {"gaps": [(0.0, 0.01), (0.1, 0.2)]}}, "long_len": 100, "num_decodes": 2},
    e5: {"off": {1: {"ttft_ms": 3.0, "prompt_tokens": 10, "cached_tokens": 0}},
         "on": {1: {"ttft_ms": 2.0, "prompt_tokens": 10, "cached_tokens": 4}}},
    e6: {"runs": {"a": {"memory_delta": [0, 1 << 20]}}, "num_steps": 2, "device": "cpu", "what": "resident set"},
    e9: {"by_running": {4: {"schedule_ms": 0.1, "prepare_ms": 0.2, "rest_ms": 0.1, "forward_ms": 3.0}}},
    e10: {"levels": {1: {"requests_per_s": 1.0, "e2e_mean_s": 0.5, "e2e_p99_s": 0.7},
                     2: {"requests_per_s": 1.8, "e2e_mean_s": 0.6, "e2e_p99_s": 0.9}},
          "memory": [(0.5, {"gateway": 50 << 20, "worker-0": 500 << 20})], "marks": [(0.0, "c=1")],
          "num_workers": 1},
}


@pytest.mark.parametrize("module", list(SAMPLE_DATA), ids=lambda m: m.NAME)
def test_plots_write_valid_pngs(module, tmp_path):
    path = tmp_path / f"{module.NAME}.png"
    module.plot(SAMPLE_DATA[module], path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"IEND" in data[-16:]
    assert plotting.is_png(path) and not plotting.is_png(tmp_path / "missing.png")
