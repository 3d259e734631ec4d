"""The engine's settings, checked when built: a bad value fails here, before any weight is read."""
from __future__ import annotations

from dataclasses import dataclass

from worker.model.attention import paged_attention, paged_attention_reference
from worker.model.calibration import CalibrationSettings
from worker.model.placement import validate_load_mode
from worker.model.quantize_model import PRESETS, QuantizationRule

ATTENTION = {"fast": paged_attention, "reference": paged_attention_reference}


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # "auto": cuda if available, else cpu
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's half type on CUDA
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; else sized from memory
    kv_cache_bytes: int = 1 << 30  # CPU: the pool's byte budget
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the worker may use
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_prefill_chunk_tokens: int | None = None
    enable_prefix_caching: bool = True
    attention: str = "fast"  # "fast" or "reference"
    seed: int | None = None  # for requests without a seed of their own
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    quantization: str = "none"  # weight-only: "none", "int8", "int4" or "mixed" (worker/model/quantize_model.py)
    quantization_group_size: int = 128  # INT4 group size
    quantization_symmetric: bool = False  # INT4 without zero points
    quantization_rule: str | None = None  # replaces the mixed preset's rule, e.g. "params>=1e6:int8,*:int4"
    # Activation-aware scales: "self" (the model's own samples), a text file's path, or "none" (plain rounding).
    quantization_calibration: str = "self"
    # How weights are placed (worker/model/placement.py): "full" (all on `device`), "sharded" (layers
    # split in pipeline stages over `devices`) or "on_demand" (host memory, each layer copied in as it runs).
    load_mode: str = "full"
    devices: tuple[str, ...] = ()  # sharded only: one device per stage, in pipeline order

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))  # a list from TOML or a caller
        validate_load_mode(self.load_mode, self.devices, self.device)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {self.attention!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization not in PRESETS:
            raise ValueError(f"quantization must be one of {sorted(PRESETS)}, got {self.quantization!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        self.quantization_rule_parsed()  # a bad rule is refused here, not at load
        if self.quantization_calibration != "none":
            CalibrationSettings(source=self.quantization_calibration)

    def quantization_rule_parsed(self) -> QuantizationRule:
        return QuantizationRule.preset(self.quantization, self.quantization_rule,
                                       group_size=self.quantization_group_size, symmetric=self.quantization_symmetric)
