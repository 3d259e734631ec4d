"""Apply weight-only quantization to a loaded Transformer by a rule, in place.

The rule names the bits per layer type ("attention": qkv and o projections, "mlp": gate/up
and down projections), and may leave small matrices alone (`min_params`). Embeddings and the
output head stay in the model's dtype. Returns what was done and the bytes it saved.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from worker.model.quantization import INT4_GROUP_SIZE, QuantizedLinear, choose_path, quantize

LAYER_TYPES = {"qkv_proj": "attention", "o_proj": "attention", "gate_up_proj": "mlp", "down_proj": "mlp"}
PRESETS = {
    "none": {},
    "int8": {"attention": 8, "mlp": 8},
    "int4": {"attention": 4, "mlp": 4},
    # The seeds' trade: attention is the more sensitive, the MLP holds most of the weights.
    "mixed": {"attention": 8, "mlp": 4},
}


@dataclass(frozen=True)
class QuantizationRule:
    bits_by_type: dict[str, int] = field(default_factory=dict)  # layer type -> 8 or 4
    group_size: int = INT4_GROUP_SIZE
    symmetric: bool = False
    min_params: int = 0  # matrices with fewer weights stay in float

    @classmethod
    def preset(cls, name: str, **overrides) -> "QuantizationRule":
        if name not in PRESETS:
            raise ValueError(f"quantization must be one of {sorted(PRESETS)}, got {name!r}")
        return cls(bits_by_type=dict(PRESETS[name]), **overrides)

    def bits_for(self, layer_type: str, weight: torch.Tensor) -> int | None:
        bits = self.bits_by_type.get(layer_type)
        if bits is None or weight.numel() < self.min_params:
            return None
        if bits == 4 and weight.shape[1] % self.group_size:
            return 8  # INT4 groups must tile the row; fall back rather than refuse the model
        return bits


@dataclass
class QuantizationReport:
    num_quantized: dict[str, int] = field(default_factory=dict)  # "attention:int8" -> layers
    float_bytes: int = 0  # of the layers quantized, before
    quantized_bytes: int = 0  # and after
    paths: dict[str, int] = field(default_factory=dict)  # compute path -> layers

    @property
    def saved_bytes(self) -> int:
        return self.float_bytes - self.quantized_bytes


def quantize_model(model: nn.Module, rule: QuantizationRule, measure_paths: bool = True) -> QuantizationReport:
    report = QuantizationReport()
    targets = [(parent, name, module) for parent in model.modules()
               for name, module in parent.named_children() if name in LAYER_TYPES and isinstance(module, nn.Linear)]
    for parent, name, linear in targets:
        layer_type = LAYER_TYPES[name]
        bits = rule.bits_for(layer_type, linear.weight)
        if bits is None:
            continue
        qw = quantize(linear.weight.data, bits, rule.group_size, rule.symmetric)
        quantized = QuantizedLinear(qw, linear.bias.data if linear.bias is not None else None,
                                    dtype=linear.weight.dtype)
        if measure_paths:
            choose_path(quantized, rows=1, repeats=3)
        setattr(parent, name, quantized)
        key = f"{layer_type}:int{bits}"
        report.num_quantized[key] = report.num_quantized.get(key, 0) + 1
        report.float_bytes += linear.weight.numel() * linear.weight.element_size()
        report.quantized_bytes += qw.nbytes
        report.paths[quantized.path] = report.paths.get(quantized.path, 0) + 1
    return report
