"""The fast paged-attention path against the plain reference, on random pools and tables, in
float32 and in the half types a KV pool may hold."""
from __future__ import annotations

import pytest
import torch

from paged_steps import random_paged_step
from worker.model import cpu_kernels
from worker.model.attention import AttentionMetadata, paged_attention, paged_attention_reference, write_kv
from worker.model.cpu_fast_path import kernel_paged_attention


def _random_step(seed: int, query_lens, context_lens, num_heads=8, num_kv_heads=2, head_dim=16,
                 block_size=4, num_blocks=64, kv_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    step = random_paged_step(query_lens, context_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=g,
                             block_size=block_size, num_blocks=num_blocks)
    (k_cache, v_cache), = step.kv_caches
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    write_kv(k_cache, v_cache, k, v, step.meta.slot_mapping)
    return q, k, v, k_cache, v_cache, step.meta


@pytest.mark.parametrize("query_lens, context_lens", [
    ([1, 1, 1], [7, 30, 0]),  # decodes only, one of them a 1-token prompt
    ([1] * 11, [40, 33, 30, 20, 19, 18, 9, 8, 5, 2, 0]),  # more decodes than one group
    ([9], [0]),  # one fresh prompt
    ([5, 12], [8, 3]),  # prompt chunks after cached context
    ([1, 1, 6, 13, 4], [12, 4, 0, 9, 0]),  # everything at once, decodes first
])
@pytest.mark.parametrize("decode_path", ["cpu-kernel", "cpu-kernel, torch prefill", "torch"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fast_path_matches_reference(query_lens, context_lens, decode_path, kv_dtype):
    if decode_path.startswith("cpu-kernel") and cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here")
    q, k, v, k_cache, v_cache, meta = _random_step(0, query_lens, context_lens, kv_dtype=kv_dtype)
    scale = 16 ** -0.5
    if decode_path == "torch":
        fast = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    else:
        fast = kernel_paged_attention(cpu_kernels.load(), q, k, v, k_cache, v_cache, meta, scale,
                                      prefill_kernel=decode_path == "cpu-kernel")
    ref = paged_attention_reference(q, k, v, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_metadata_build_maps_each_token_to_its_slot_through_the_table():
    meta = AttentionMetadata.build([[7, 2], [5], [3, 9, 4]], context_lens=[5, 0, 6], query_lens=[1, 3, 4],
                                   block_size=4)
    # position p of a sequence lands in block table[p // 4], offset p % 4
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2,
                                          9 * 4 + 2, 9 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1]
    assert meta.block_tables.tolist() == [[7, 2, 0], [5, 0, 0], [3, 9, 4]]  # padded with block 0
    assert meta.seq_lens.tolist() == [6, 3, 10] and meta.num_decodes == 1
    assert meta.prefill_query_starts.tolist() == [0, 3, 7]
    made = []
    meta = AttentionMetadata.build([[1, 2, 3, 8]], [0], [5], block_size=4,
                                   put=lambda name, values: made.append(name) or torch.tensor(values))
    assert sorted(made) == ["block_tables", "seq_lens", "slot_mapping"]
    assert meta.block_tables.tolist() == [[1, 2]]  # cut to the blocks the step reaches


def test_reference_is_causal_and_reads_through_tables():
    # Changing a future token's K/V must not change an earlier query's output, and
    # changing a block outside the table must change nothing at all.
    q, k, v, k_cache, v_cache, meta = _random_step(1, [6], [0], block_size=4, num_blocks=16)
    scale = 0.25
    before = paged_attention_reference(q, k, v, k_cache, v_cache, meta, scale)
    table = meta.block_tables[0].tolist()
    unused = next(b for b in range(16) if b not in table)
    k_cache[unused] += 100.0
    last_block, last_offset = table[5 // 4], 5 % 4
    v_cache[last_block, last_offset] += 100.0  # position 5, the last token
    after = paged_attention_reference(q, k, v, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(after[:5], before[:5])
    assert not torch.allclose(after[5], before[5])
