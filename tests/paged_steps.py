"""Random paged steps for the attention, kernel and fast-path tests: K/V pools holding each
sequence's context, block tables scattered out of order over the pool (so a path that does not
follow the table reads the wrong K/V), the metadata from `AttentionMetadata.build`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from worker.model.attention import AttentionMetadata


@dataclass
class PagedStep:
    meta: AttentionMetadata
    positions: torch.Tensor  # [T]: token i of sequence b sits at context_lens[b] + i
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, K and V pools [N, S, Hkv, D], random


def random_paged_step(query_lens: Sequence[int], context_lens: Sequence[int], *, num_kv_heads: int, head_dim: int,
                      generator: torch.Generator, block_size: int = 16, num_layers: int = 1,
                      num_blocks: int | None = None) -> PagedStep:
    """One step's pools, tables and metadata; sequences in step order (one-token ones first).
    The pool has `num_blocks` blocks, by default 3 more than the sequences need."""
    lens = [q_len + ctx for q_len, ctx in zip(query_lens, context_lens)]
    needed = [-(-n // block_size) for n in lens]
    num_blocks = num_blocks if num_blocks is not None else sum(needed) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kv_caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
                 for _ in range(num_layers)]
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for count in needed:
        tables.append(free[:count])
        free = free[count:]
    meta = AttentionMetadata.build(tables, context_lens, query_lens, block_size)
    positions = torch.tensor([p for ctx, q_len in zip(context_lens, query_lens) for p in range(ctx, ctx + q_len)])
    return PagedStep(meta, positions, kv_caches)
