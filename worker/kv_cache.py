"""The KV pools: per layer a K and a V tensor [N, S, Hkv, D], allocated once, their element type
and their sizing.

Owns the tensors only; which request holds which block is the block manager's business.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from worker.model.config import ModelConfig

log = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The pools' element type for `EngineConfig.kv_cache_dtype` `name`: "" is the compute dtype."""
    return KV_CACHE_DTYPES[name] if name else compute_dtype


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """K and V, every layer (or `num_layers` of them, e.g. one device's share), one block."""
    element_size = torch.empty((), dtype=dtype).element_size()
    num_layers = config.num_layers if num_layers is None else num_layers
    return 2 * num_layers * block_size * config.num_kv_heads * config.head_dim * element_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                          num_layers: int | None = None) -> int:
    num_blocks = budget_bytes // bytes_per_block(config, block_size, dtype, num_layers)
    if num_blocks < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes is smaller than one block "
            f"({bytes_per_block(config, block_size, dtype, num_layers)} bytes)")
    return int(num_blocks)


def num_blocks_from_free_cuda_memory(config: ModelConfig, block_size: int, dtype: torch.dtype,
                                     device: torch.device, utilization: float, num_layers: int | None = None) -> int:
    """After a profiling forward has run: what the device has left, times `utilization`
    of its total, minus what is already in use, turned into blocks of the `num_layers`
    layers whose KV this device holds (all by default)."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used_bytes = total_bytes - free_bytes
    # Room for the peak activations seen while profiling beyond what is allocated now.
    peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    budget = int(total_bytes * utilization) - used_bytes - peak_extra
    log.info("KV budget on %s: %.1f MiB (total %.1f MiB, used %.1f MiB, activation peak %.1f MiB)",
             device, budget / 2**20, total_bytes / 2**20, used_bytes / 2**20, peak_extra / 2**20)
    return num_blocks_for_budget(config, block_size, dtype, budget, num_layers)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str | Sequence[torch.device]) -> list[KVCache]:
    """One (K, V) pair per layer, on `device`, or on each layer's own device when given one per
    layer (a sharded model keeps a layer's KV beside the layer)."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    layer_devices = list(device) if isinstance(device, (list, tuple)) else [device] * config.num_layers
    if len(layer_devices) != config.num_layers:
        raise ValueError(f"got {len(layer_devices)} KV devices for {config.num_layers} layers")
    # zeros, not empty: a padded slot read by masked attention must never hold NaN bits
    # (0 * NaN is NaN even where the mask removes it).
    return [(torch.zeros(shape, dtype=dtype, device=d), torch.zeros(shape, dtype=dtype, device=d))
            for d in layer_devices]

