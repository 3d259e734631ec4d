"""The fast paged-attention path against the plain reference, on random pools and tables."""
from __future__ import annotations

import pytest
import torch

from worker.model import attention, cpu_kernels
from worker.model.attention import AttentionMetadata, paged_attention, paged_attention_reference, write_kv


def _random_step(seed: int, query_lens, context_lens, num_heads=8, num_kv_heads=2, head_dim=16,
                 block_size=4, num_blocks=64):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, out-of-order blocks
    tables, slots, seq_lens = [], [], []
    for q_len, ctx in zip(query_lens, context_lens):
        n = -(-(q_len + ctx) // block_size)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        seq_lens.append(ctx + q_len)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens), query_lens=list(query_lens), context_lens=list(context_lens),
        num_decodes=sum(1 for q in query_lens if q == 1))
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("query_lens, context_lens", [
    ([1, 1, 1], [7, 30, 0]),  # decodes only, one of them a 1-token prompt
    ([1] * 11, [40, 33, 30, 20, 19, 18, 9, 8, 5, 2, 0]),  # more decodes than one group
    ([9], [0]),  # one fresh prompt
    ([5, 12], [8, 3]),  # prompt chunks after cached context
    ([1, 1, 6, 13, 4], [12, 4, 0, 9, 0]),  # everything at once, decodes first
])
@pytest.mark.parametrize("decode_path", ["cpu-kernel", "torch"])
def test_fast_path_matches_reference(query_lens, context_lens, decode_path, monkeypatch):
    if decode_path == "torch":
        monkeypatch.setattr(attention, "_cpu_kernels", lambda *tensors: None)
    elif cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot be built here")
    q, k, v, k_cache, v_cache, meta = _random_step(0, query_lens, context_lens)
    scale = 16 ** -0.5
    fast = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    ref = paged_attention_reference(q, k, v, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


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
