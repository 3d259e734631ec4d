"""bench/gpu_decode.py's arithmetic: the single-stream bound from weight bytes and bandwidth, and
the report's ratios (ours over transformers, as speeds; step times from rates)."""
from __future__ import annotations

import torch

from bench.gpu_decode import decode_weight_bytes, report
from conftest import make_checkpoint


def test_decode_weight_bytes_count_the_block_linears_and_head_at_the_dtype(tmp_path):
    path = make_checkpoint(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    head_dim = 16
    per_layer = 64 * 4 * head_dim * 2 + 2 * 64 * 2 * head_dim + 3 * 64 * 128  # q and o, k and v, the MLP
    params = 2 * per_layer + 64 * 256
    assert decode_weight_bytes(path, torch.bfloat16) == 2 * params
    assert decode_weight_bytes(path, torch.float32) == 4 * params


def test_report_prints_rates_ratios_and_the_share_of_the_bound():
    results = dict(model="m", dtype="bfloat16", batched=[32, 332, 140], copy_gbps=4000.0, device_name="GPU",
                   weight_bytes_per_token=2_000_000_000, decode_bound_tok_s=2000.0,
                   ours=dict(decode_tok_s=400.0, batched_tok_s=1200.0), ours_eager=dict(decode_tok_s=50.0),
                   transformers=dict(decode_tok_s=40.0, batched_tok_s=400.0),
                   overhead_probe=dict(ours=dict(decode_tok_s=2000.0), ours_eager=dict(decode_tok_s=125.0),
                                       transformers=dict(decode_tok_s=100.0)))
    lines = report(results).splitlines()
    assert "single-stream bound 2000 tok/s" in lines[0] and "2000 MB" in lines[0]
    assert lines[2].split()[3:] == ["400.0", "50.0", "40.0", "10.00x", "(20%", "of", "bound)"]
    assert lines[3].split()[-3:] == ["1200.0", "400.0", "3.00x"]
    assert lines[4].split()[-4:] == ["0.500", "8.000", "10.000", "20.00x"]
