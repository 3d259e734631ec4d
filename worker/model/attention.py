"""Paged attention in torch: write new K/V into the block pool, attend through block tables.

Owns the step's attention metadata (`AttentionMetadata`, built by `AttentionMetadata.build`,
the one place the slot arithmetic lives) and two torch implementations behind one signature:
`paged_attention_reference`, a plain per-sequence loop that tests trust, and `paged_attention`,
the batched path the modules run. Our C++ kernels for the same job belong to the CPU fast path
(worker/model/cpu_fast_path.py). Knows nothing of requests or schedulers.

The pools may hold another dtype than the model computes in (`kv_cache_dtype`): K/V are rounded
to it when written and every path attends to them as stored, widened to the query's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

DECODE_GROUP_SIZE = 8
# Makes one of the metadata's tensors from its values: `put(name, values)` with name one of
# "slot_mapping" ([T]), "block_tables" ([B, W]) or "seq_lens" ([B]).
TensorMaker = Callable[[str, list], torch.Tensor]


@dataclass
class AttentionMetadata:
    """Where a step's packed tokens live. Built once per step (`build`).

    Sequences are ordered decodes first: the first `num_decodes` sequences bring exactly
    one new token each, longest context first; the rest bring a chunk of prompt (or of
    recomputed tokens).
    Token t of sequence b with `query_lens[b]` new tokens sits at position
    `seq_lens[b] - query_lens[b] + i` and its K/V goes to flat slot `slot_mapping[t]`
    = block_id * S + offset.
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (masked out)
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new)
    query_lens: list[int]  # [B] new tokens per sequence
    context_lens: list[int]  # [B] tokens already in the cache before this step
    num_decodes: int

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int], query_lens: Sequence[int],
              block_size: int, device: torch.device | str = "cpu", put: TensorMaker | None = None
              ) -> "AttentionMetadata":
        """The metadata of a step from each sequence's block table, tokens already cached and new
        tokens, sequences in step order (one-token sequences first). Tensors are new int64 tensors
        on `device`, or whatever `put` makes of the values (the runner writes them into its
        preallocated, staged buffers)."""
        query_lens, context_lens = list(query_lens), list(context_lens)
        slots: list[int] = []
        seq_lens: list[int] = []
        for table, ctx, q_len in zip(block_tables, context_lens, query_lens):
            # Flat slot of position p: its block's id * S + its offset in the block.
            if q_len == 1:  # a decode: one slot, no range
                slots.append(table[ctx // block_size] * block_size + ctx % block_size)
            else:
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len))
            seq_lens.append(ctx + q_len)
        # Each table cut (or padded with block 0) to the blocks the longest sequence needs.
        width = -(-max(seq_lens) // block_size)
        tables = [table if type(table) is list and len(table) == width
                  else list(table[:width]) + [0] * (width - len(table[:width])) for table in block_tables]
        if put is None:
            def put(name: str, values: list) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)
        num_decodes = len(query_lens)
        if query_lens.count(1) != num_decodes:  # a prompt chunk: the decodes are the sequences before the first
            num_decodes = next(b for b, q_len in enumerate(query_lens) if q_len != 1)
        return cls(slot_mapping=put("slot_mapping", slots), block_tables=put("block_tables", tables),
                   seq_lens=put("seq_lens", seq_lens), query_lens=query_lens, context_lens=context_lens,
                   num_decodes=num_decodes)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @cached_property
    def prefill_query_starts(self) -> torch.Tensor:
        """[P + 1] int64 on the CPU: where each of the P prompt chunks' tokens start among the
        chunks' own tokens, then their total (what the prefill kernel takes). Built once a step,
        however many layers read it."""
        starts = [0]
        for q_len in self.query_lens[self.num_decodes:]:
            starts.append(starts[-1] + q_len)
        return torch.tensor(starts)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k_cache [N, S, Hkv, D] viewed as [N*S, Hkv, D]; k [T, Hkv, D].
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """This step's K or V as `cache` holds it (rounded to its dtype), back in x's dtype: a chunk
    attending to its own fresh K/V sees what a later step will read from the pool."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache [N, S, Hkv, D] -> the first `length` tokens of one sequence, [L, Hkv, D].
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks])  # [n, S, Hkv, D]
    return blocks.flatten(0, 1)[:length]


def paged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]. Slow, obvious, float32; reads all K/V (this step's
    included, already written) through the block tables, so `k` and `v` go unused."""
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens.tolist())):
        qb = q[start:start + q_len].float()  # [q, H, D]
        kb = _gather_context(k_cache, meta.block_tables[b], seq_len).float()  # [L, Hkv, D]
        vb = _gather_context(v_cache, meta.block_tables[b], seq_len).float()
        group = num_heads // kb.shape[1]
        kb = kb.repeat_interleave(group, dim=1)  # [L, H, D]
        vb = vb.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,lhd->hql", qb, kb) * scale  # [H, q, L]
        # Query i sits at position seq_len - q_len + i and sees keys at positions <= it.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start:start + q_len] = torch.einsum("hql,lhd->qhd", probs, vb).to(q.dtype)
        start += q_len
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batched, same result as the reference. q [T, H, D]; k, v [T, Hkv, D] (this step's,
    already written to the pools).

    Decodes run as batched SDPA over K/V gathered from their blocks, the query heads of one KV
    head laid out as SDPA's query axis so grouped-query attention needs no K/V copy per head; a
    prompt chunk with nothing cached attends to its own fresh K/V (causal, no gather), a chunk
    after cached context gathers its context.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode_attention(q, k_cache, v_cache, meta, scale, out)
    prefill_attention(q, k, v, k_cache, v_cache, meta, scale, out)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, out: torch.Tensor) -> None:
    """The decodes' rows of `out` (the first `meta.num_decodes`), in groups of neighbours in
    length (the runner sorts them longest first), so each group pads its gathered K/V only to
    its own longest sequence."""
    num_decodes = meta.num_decodes
    for start in range(0, num_decodes, DECODE_GROUP_SIZE):
        end = min(start + DECODE_GROUP_SIZE, num_decodes)
        max_len = max(meta.context_lens[start:end]) + 1
        out[start:end] = _decode_attention(q[start:end], k_cache, v_cache, meta.block_tables[start:end],
                                           meta.seq_lens[start:end], max_len, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """The prompt chunks' rows of `out` (after the decodes'), one chunk at a time."""
    start = meta.num_decodes
    for b in range(meta.num_decodes, meta.num_seqs):
        q_len, ctx_len = meta.query_lens[b], meta.context_lens[b]
        end = start + q_len
        if ctx_len == 0:
            kb, vb = _as_stored(k[start:end], k_cache), _as_stored(v[start:end], v_cache)
        else:
            seq_len = ctx_len + q_len
            kb = _gather_context(k_cache, meta.block_tables[b], seq_len).to(q.dtype)
            vb = _gather_context(v_cache, meta.block_tables[b], seq_len).to(q.dtype)
        out[start:end] = _prefill_attention(q[start:end], kb, vb, ctx_len, scale)
        start = end


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    # q [B, H, D]; one new token per sequence, already written to the cache.
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    max_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :max_blocks]
    # [B, n, S, Hkv, D] -> [B, Hkv, L, D] with L = n * S (padding masked below)
    keys = k_cache[tables].to(q.dtype).flatten(1, 2).transpose(1, 2)
    values = v_cache[tables].to(q.dtype).flatten(1, 2).transpose(1, 2)
    length = keys.shape[2]
    mask = torch.arange(length, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
    queries = q.view(num_seqs, num_kv_heads, group, head_dim)  # heads of one KV head share its K/V
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def fixed_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *, queries: int,
                          context_lens: torch.Tensor) -> torch.Tensor:
    """Every sequence brings `queries` tokens (q [B * queries, H, D], sequence b's at rows
    b * queries on), already written to the pools; token i of sequence b sits at position
    context_lens[b] + i and sees the keys at or before it, within seq_lens[b]. Shapes depend on
    B, `queries` and the tables' width alone, and masks are made on the device, so a graph can
    capture it (worker/decode_graphs.py: steps that verify speculative drafts)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = num_tokens // queries
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = k_cache[meta.block_tables].to(q.dtype).flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[meta.block_tables].to(q.dtype).flatten(1, 2).transpose(1, 2)
    length = keys.shape[2]
    key_positions = torch.arange(length, device=q.device)
    query_positions = context_lens.unsqueeze(1) + torch.arange(queries, device=q.device)  # [B, Q]
    mask = ((key_positions <= query_positions.unsqueeze(2))
            & (key_positions < meta.seq_lens.view(num_seqs, 1, 1)))  # [B, Q, L]
    # The query heads of one KV head side by side, for every token: [B, Hkv, Q * group, D].
    grouped = q.reshape(num_seqs, queries, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    grouped = grouped.reshape(num_seqs, num_kv_heads, queries * group, head_dim)
    mask = mask.unsqueeze(2).expand(num_seqs, queries, group, length).reshape(num_seqs, 1, queries * group, length)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, queries, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(num_tokens, num_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int,
                       scale: float) -> torch.Tensor:
    # q [q, H, D]; k, v [ctx + q, Hkv, D] -> [q, H, D]. On the CPU, SDPA's own grouped-query
    # support reads each KV head for its query heads rather than a copy of K/V per query head;
    # elsewhere K/V are repeated, which every backend takes.
    gqa = q.shape[1] != k.shape[1] and q.device.type == "cpu"
    group = 1 if gqa else q.shape[1] // k.shape[1]
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # [1, H or Hkv, L, D]
    if ctx_len == 0:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        seq_len = k.shape[0]
        q_pos = torch.arange(ctx_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=k_pos <= q_pos, scale=scale,
                                             enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)
