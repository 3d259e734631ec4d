"""bench.vs_llama_cpp's machinery, without llama.cpp or a benchmark's worth of time: llama.cpp's
outputs parsed as its tools print them, our child's measurements on a tiny checkpoint (rates
positive, the weight bytes a step reads smaller for each narrower format), and the summary's
medians, ratios and bounds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import llama_cpp_tools, vs_llama_cpp
from bench.ours_decode_child import measure
from conftest import make_checkpoint

BATCHED_OUTPUT = """
main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |      8 |    4 |    160 |    0.057 |  2232.84 |    0.040 |   802.57 |    0.097 |  1646.12 |
"""


def test_the_batched_rate_is_generated_tokens_over_the_whole_run(monkeypatch):
    seen = []
    monkeypatch.setattr(llama_cpp_tools, "_run", lambda argv: seen.append(argv) or BATCHED_OUTPUT)
    rate = llama_cpp_tools.batched_rate(Path("/llama"), Path("m.gguf"), 2, prompt_len=32, new_tokens=8, sequences=4)
    assert rate == pytest.approx(4 * 8 / 0.097)
    assert seen[0][seen[0].index("-npl") + 1] == "4" and "--no-repack" in seen[0]
    with pytest.raises(RuntimeError, match="no row"):
        llama_cpp_tools.batched_rate(Path("/llama"), Path("m.gguf"), 2, prompt_len=64, new_tokens=8, sequences=4)


def test_the_decode_rate_is_llama_benchs_tg_row(monkeypatch):
    rows = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 900.0}, {"n_prompt": 0, "n_gen": 128, "avg_ts": 246.4}]
    monkeypatch.setattr(llama_cpp_tools, "_run", lambda argv: json.dumps(rows))
    assert llama_cpp_tools.decode_rate(Path("/llama"), Path("m.gguf"), 2, 128, 3) == 246.4
    with pytest.raises(RuntimeError, match="tg64"):
        llama_cpp_tools.decode_rate(Path("/llama"), Path("m.gguf"), 2, 64, 3)


def test_our_child_measures_each_format(tmp_path):
    folder = make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                             num_attention_heads=4, num_key_value_heads=2)
    records = {}
    for name, engine, _ in vs_llama_cpp.FORMATS:
        spec = dict(model_dir=str(folder), decode_tokens=6, repeats=1, batched=[3, 10, 4],
                    engine=dict(engine, device="cpu", num_threads=1, quantization_calibration="none",
                                num_kv_blocks=64, max_num_seqs=3))
        records[name] = measure(spec)
    for name, record in records.items():
        # (t(n+1) - t(1)) / n: a difference of wall times, which a loaded machine can make <= 0 (rate 0).
        assert record["decode_tok_s"] >= 0 and record["batched_tok_s"] > 0, name
    sizes = [records[name]["weight_bytes_per_token"] for name in ("float32", "bfloat16", "int8", "int4")]
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3] > 0
    assert all("one call" in record["route"] for record in records.values())
    assert all("int8 activations" in records[name]["route"] for name in records if "activations" in name)


def test_the_summary_takes_medians_and_ratios():
    def runs(decode, batched, weight_bytes, copy_gbps=(20.0, 20.0, 20.0), read_gbps=(40.0, 40.0, 40.0)):
        return [{"decode_tok_s": d, "batched_tok_s": batched, "weight_bytes_per_token": weight_bytes, "route": "r",
                 "copy_gbps": c, "read_gbps": r} for d, c, r in zip(decode, copy_gbps, read_gbps)]

    rounds = {name: {"ours": runs([100.0, 120.0, 110.0], 300.0, 40e6), "theirs": runs([200.0, 220.0, 210.0], 150.0, 50e6)}
              for name, _, _ in vs_llama_cpp.FORMATS}
    rows = vs_llama_cpp.summarize(rounds, batched_bound=600.0)
    assert [r["format"] for r in rows] == [name for name, _, _ in vs_llama_cpp.FORMATS]
    row = rows[0]
    assert row["ours_decode_tok_s"] == 110.0 and row["theirs_decode_tok_s"] == 210.0
    assert row["ratio_decode_tok_s"] == pytest.approx(110 / 210) and row["ratio_batched_tok_s"] == 2.0
    assert row["ours_of_bound"] == pytest.approx(110 / (20e9 / 40e6))
    assert row["ours_of_read_bound"] == pytest.approx(110 / (40e9 / 40e6))
    assert row["ours_of_compute_bound"] == 0.5 and row["theirs_of_compute_bound"] == 0.25
    probes = {"copy_gbps": vs_llama_cpp.probe_range(rounds, "copy_gbps"),
              "read_gbps": vs_llama_cpp.probe_range(rounds, "read_gbps")}
    assert probes == {"copy_gbps": (20.0, 20.0), "read_gbps": (40.0, 40.0)}
    text = vs_llama_cpp.report(rows, {"step_ms": 0.3, "decode_tok_s": 3333.0, "route": "r"}, probes, "bench-small",
                               vs_llama_cpp.SETTINGS["bench-small"], fma_gflops=400.0, batched_bound=600.0)
    assert "| float32 / f32 | 110.0 | 210.0 | 0.52x | 22% / 11% (38) | 52% / 26% (48) |" in text
    assert "0.300 ms" in text and "copy 20.0-20.0 GB/s, read 40.0-40.0 GB/s" in text
    assert "| 300.0 (50%) | 150.0 (25%) | 2.00x |" in text and "at most 600 tok/s" in text


def test_formats_are_picked_by_name_and_summarized_alone():
    picked = vs_llama_cpp.pick_formats("int4 + int8 activations, float32")
    assert [name for name, _, _ in picked] == ["float32", "int4 + int8 activations"]  # the table's order
    assert vs_llama_cpp.pick_formats(None) == vs_llama_cpp.FORMATS
    with pytest.raises(ValueError, match="no format 'int3'"):
        vs_llama_cpp.pick_formats("int4,int3")
    run = {"decode_tok_s": 10.0, "batched_tok_s": None, "weight_bytes_per_token": 1e6, "route": "r"}
    rows = vs_llama_cpp.summarize({"int4": {"ours": [run], "theirs": [run]}})
    assert [r["format"] for r in rows] == ["int4"] and rows[0]["ratio_decode_tok_s"] == 1.0


def test_each_run_is_bounded_by_the_memory_rate_probed_before_it():
    """A host whose memory slows between two rounds: each run's share of the bound uses its own probe, so the
    slow round's rate is not read against the fast round's bandwidth (nor the other way round)."""
    weight_bytes = 1e9
    fast = {"decode_tok_s": 40.0, "weight_bytes_per_token": weight_bytes, "copy_gbps": 50.0, "read_gbps": 80.0,
            "route": "r"}
    slow = {"decode_tok_s": 20.0, "weight_bytes_per_token": weight_bytes, "copy_gbps": 25.0, "read_gbps": 40.0,
            "route": "r"}
    rounds = {name: {"ours": [fast, slow], "theirs": [fast, slow]} for name, _, _ in vs_llama_cpp.FORMATS}
    row = vs_llama_cpp.summarize(rounds)[0]
    assert row["ours_of_bound"] == pytest.approx(0.8) and row["ours_of_read_bound"] == pytest.approx(0.5)
    assert vs_llama_cpp.probe_range(rounds, "copy_gbps") == (25.0, 50.0)


def test_the_memory_probes_measure_positive_rates():
    from bench.hardware_bounds import measure_copy_gbps, measure_read_gbps
    assert measure_copy_gbps(mib=16, repeats=3) > 0.1 and measure_read_gbps(mib=16, repeats=3) > 0.1


def test_the_batched_compute_bound_is_the_runs_flops_at_the_fma_peak(tmp_path):
    folder = make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                             num_attention_heads=4, num_key_value_heads=2)
    bound = vs_llama_cpp.batched_bound_tok_s(folder, (4, 30, 10), fma_gflops=100.0)
    # Per layer 4 x 128 x 128 (q, o and k, v at half the heads: 128 x 64 each) + 3 x 128 x 256 weights.
    layer = 128 * 128 * 2 + 2 * 128 * 64 + 3 * 128 * 256
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    processed = 30 + 10 - 1
    flops = 4 * (2 * 2 * layer * processed + 4 * 128 * 2 * processed * (processed + 1) // 2 + 2 * 128 * vocab * 10)
    assert bound == pytest.approx(4 * 10 / (flops / 100e9))


@pytest.mark.slow
def test_the_fma_peak_is_measured_on_every_thread():
    from bench.fma_peak import measure_fma_gflops
    one, two = measure_fma_gflops(1, iterations=2_000_000, repeats=2), measure_fma_gflops(2, iterations=2_000_000,
                                                                                            repeats=2)
    # At least one 8-lane FMA a nanosecond on one core; two threads never measure less than most of one.
    assert one > 16 and two > 0.5 * one
