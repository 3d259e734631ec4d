"""bench/kv_cache_dtype.py's measurement on a tiny checkpoint: every type gets a row, the float32 row is its
own reference, the half rows hold twice the blocks and agree closely; never a wall-clock threshold."""
from __future__ import annotations

import math

from bench.kv_cache_dtype import Settings, fit_to_model, measure, prefix_match, table
from conftest import make_checkpoint

TINY = Settings(num_prompts=3, prompt_lens=(8, 40), new_tokens=6, chunk_tokens=16, context_len=48, decode_tokens=4,
                batch=2, rounds=2, kv_cache_bytes=1 << 20)


def test_prefix_match_counts_positions_before_the_first_divergence():
    assert prefix_match([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == (4 / 6, 1 / 2)
    assert prefix_match([[1, 2]], [[1, 2]]) == (1.0, 1.0)


def test_the_measurement_runs_on_a_tiny_checkpoint(tmp_path):
    folder = make_checkpoint(tmp_path / "llama", "llama")  # 512 positions
    assert fit_to_model(TINY, folder) == TINY
    fitted = fit_to_model(Settings(), folder)
    assert fitted.prompt_lens == (64, 512 - fitted.new_tokens) and fitted.context_len == 512 - fitted.decode_tokens - 1
    results = measure(folder, TINY)
    assert [r.kv_cache_dtype for r in results] == ["float32", "float16", "bfloat16"]
    base, *halves = results
    assert (base.positions_matched, base.sequences_matched, base.max_logit_diff, base.argmax_agreement) == (1, 1, 0, 1)
    assert all(r.max_abs_logit > 0 for r in results)
    for r in results:
        assert len(r.single_tok_s) == len(r.batched_tok_s) == TINY.rounds
        assert all(rate > 0 and math.isfinite(rate) for rate in r.single_tok_s + r.batched_tok_s)
    for r in halves:
        assert r.num_blocks == 2 * base.num_blocks
        assert 0 <= r.positions_matched <= 1 and 0 <= r.sequences_matched <= 1
        assert 0 < r.max_logit_diff < 0.1 and r.argmax_agreement > 0.5
    lines = table(results, TINY)
    assert len(lines) == 2 + len(results) and lines[0].startswith("| KV dtype |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
