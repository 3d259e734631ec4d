"""The KV pools: per layer a K and a V tensor [N, S, Hkv, D], allocated once, and their sizing.

Owns the tensors only; which request holds which block is the block manager's business.
"""
from __future__ import annotations

import logging

import torch

from worker.model.config import ModelConfig

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    num_blocks = budget_bytes // bytes_per_block(config, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes is smaller than one block "
            f"({bytes_per_block(config, block_size, dtype)} bytes)")
    return int(num_blocks)


def num_blocks_from_free_cuda_memory(config: ModelConfig, block_size: int, dtype: torch.dtype,
                                     device: torch.device, utilization: float) -> int:
    """After a profiling forward has run: what the device has left, times `utilization`
    of its total, minus what is already in use, turned into blocks."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used_bytes = total_bytes - free_bytes
    # Room for the peak activations seen while profiling beyond what is allocated now.
    peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    budget = int(total_bytes * utilization) - used_bytes - peak_extra
    log.info("KV budget on %s: %.1f MiB (total %.1f MiB, used %.1f MiB, activation peak %.1f MiB)",
             device, budget / 2**20, total_bytes / 2**20, used_bytes / 2**20, peak_extra / 2**20)
    return num_blocks_for_budget(config, block_size, dtype, budget)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    # zeros, not empty: a padded slot read by masked attention must never hold NaN bits
    # (0 * NaN is NaN even where the mask removes it).
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]


def copy_blocks(kv_caches: list[KVCache], pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: duplicate block src into block dst in every layer."""
    if not pairs:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], device=device)
    dst = torch.tensor([d for _, d in pairs], device=device)
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
