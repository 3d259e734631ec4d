"""Apply weight-only quantization to a loaded Transformer by a rule (shared/quantization_rule.py), in place.

Embeddings stay in the model's dtype; so does the output head unless a clause names it, and a
tied head quantized stands apart from the embedding it was tied to. Optional per-layer input scales (activation-aware, from calibration) are folded in.
Returns what was done and the bytes it saved.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from shared.quantization_rule import LAYER_TYPES, PRESETS, QuantizationRule
from worker.model.quantization import QuantizationPlan, QuantizedLinear
from worker.model.quantized_weight import quantize

__all__ = ["PRESETS", "QuantizationReport", "QuantizationRule", "quantization_targets", "quantize_model"]


def quantization_targets(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(full name, parent, attribute, linear) for every projection a rule may quantize."""
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if name in LAYER_TYPES and isinstance(child, nn.Linear):
                yield f"{parent_name}.{name}" if parent_name else name, parent, name, child


@dataclass
class QuantizationReport:
    num_quantized: dict[str, int] = field(default_factory=dict)  # "attention:int8" -> layers
    float_bytes: int = 0  # of the layers quantized, before
    quantized_bytes: int = 0  # and after
    paths: dict[str, int] = field(default_factory=dict)  # compute path -> layers
    layers: dict[str, dict] = field(default_factory=dict)  # module name -> {bits, group_size, ...}

    @property
    def saved_bytes(self) -> int:
        return self.float_bytes - self.quantized_bytes

    def count_paths(self, model: nn.Module) -> None:
        """`paths` from the quantized layers as they are now."""
        self.paths = {}
        for m in model.modules():
            if isinstance(m, QuantizedLinear):
                key = f"{m.small_path}/{m.path}" + (" int8 activations" if m.int8_activations else "")
                self.paths[key] = self.paths.get(key, 0) + 1


def quantize_model(model: nn.Module, rule: QuantizationRule, measure_paths: bool = True,
                   input_scales: dict[str, torch.Tensor] | None = None) -> QuantizationReport:
    """Replace each targeted nn.Linear by a QuantizedLinear. With `input_scales[name]` (s^-1
    per input channel), the weight quantized is W * s and the layer scales its input by s^-1,
    which leaves the product unchanged and the salient channels better resolved. Every new
    layer belongs to one QuantizationPlan made for this model, which measures the paths."""
    report = QuantizationReport()
    plan = QuantizationPlan()
    input_scales = input_scales or {}
    embedding = getattr(model, "embed_tokens", None)
    for full_name, parent, name, linear in list(quantization_targets(model)):
        bits = rule.bits_for(full_name, linear.weight)
        if bits is None:
            continue
        # Quantized from, and scaled in, what the model computes in (a bf16 weight on the CPU is
        # widened first: its layer's scales and input scale are float32 like its activations).
        dtype = getattr(model, "compute_dtype", linear.weight.dtype)
        weight = linear.weight.data.to(dtype)
        input_scale = input_scales.get(full_name)
        if input_scale is not None:
            input_scale = input_scale.to(weight.device, torch.float32)
            weight = weight.float() / input_scale[None, :]
        qw = quantize(weight, bits, rule.group_size, rule.symmetric)
        quantized = QuantizedLinear(qw, linear.bias.data if linear.bias is not None else None,
                                    dtype=dtype, input_scale=input_scale, plan=plan)
        if measure_paths:
            plan.choose_paths(quantized)
        setattr(parent, name, quantized)
        key = f"{LAYER_TYPES[name]}:int{bits}"
        report.num_quantized[key] = report.num_quantized.get(key, 0) + 1
        if embedding is None or linear.weight is not embedding.weight:  # a tied head's float bytes stay, as the embedding
            report.float_bytes += linear.weight.numel() * linear.weight.element_size()
        report.quantized_bytes += qw.nbytes
        report.layers[full_name] = dict(bits=bits, group_size=qw.group_size, shape=list(qw.shape),
                                        has_bias=linear.bias is not None, has_input_scale=input_scale is not None)
    report.count_paths(model)  # decode-sized / prefill-sized steps
    return report
