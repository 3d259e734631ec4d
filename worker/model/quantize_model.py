"""Apply weight-only quantization to a loaded Transformer by a rule, in place.

A rule is an ordered list of clauses `selector:bits`, the first match wins: the selector
is a layer type ("attention": the qkv and o projections, "mlp": gate/up and down), one
projection's name, a size test on the matrix ("params>=1e6", "params<1e6") or "*"; bits are
int8, int4 or none. Embeddings stay in the model's dtype; so does the output head unless a
clause names it ("head:int8"; "*" and size tests never reach it), and a tied head quantized
stands apart from the embedding it was tied to. Optional per-layer input scales (activation-aware, from calibration) are folded in.
Returns what was done and the bytes it saved.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from worker.model.quantization import INT4_GROUP_SIZE, QuantizedLinear, choose_paths, quantize

LAYER_TYPES = {"qkv_proj": "attention", "o_proj": "attention", "gate_up_proj": "mlp", "down_proj": "mlp",
               "lm_head": "head"}
# Only named on purpose: "*" and size tests leave the output head in the model's dtype.
_OPT_IN = {"lm_head"}
PRESETS = {
    "none": "",
    "int8": "*:int8",
    "int4": "*:int4",
    # The seeds' trade: attention is the more sensitive, the MLP holds most of the weights.
    "mixed": "attention:int8,mlp:int4",
}
_BITS = {"int8": 8, "8": 8, "int4": 4, "4": 4, "none": None, "float": None}
_SIZE = re.compile(r"params(>=|<)([0-9.eE+]+)([kKmMgG]?)$")
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def _parse_clause(clause: str) -> tuple[str, int | None]:
    selector, sep, bits = clause.strip().rpartition(":")
    selector = selector.strip()
    if not sep or bits.strip().lower() not in _BITS:
        raise ValueError(f"quantization rule clause {clause!r} must be 'selector:bits' with bits int8, int4 or none")
    if selector not in ("*", *LAYER_TYPES, *set(LAYER_TYPES.values())) and not _SIZE.match(selector):
        raise ValueError(f"quantization rule selector {selector!r} must be '*', a layer type (attention, mlp, head), "
                         f"a projection ({', '.join(LAYER_TYPES)}) or a size test like params>=1e6")
    return selector, _BITS[bits.strip().lower()]


def _matches(selector: str, module_name: str, weight: torch.Tensor) -> bool:
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf in _OPT_IN:
        return selector in (leaf, LAYER_TYPES[leaf])
    if selector in ("*", leaf, LAYER_TYPES.get(leaf)):
        return True
    size = _SIZE.match(selector)
    if size is None:
        return False
    threshold = float(size.group(2)) * _SUFFIX[size.group(3).lower()]
    return weight.numel() >= threshold if size.group(1) == ">=" else weight.numel() < threshold


@dataclass(frozen=True)
class QuantizationRule:
    clauses: tuple[tuple[str, int | None], ...] = ()  # (selector, bits or None = keep float)
    group_size: int = INT4_GROUP_SIZE
    symmetric: bool = False

    @classmethod
    def parse(cls, text: str, **overrides) -> "QuantizationRule":
        clauses = tuple(_parse_clause(c) for c in text.split(",") if c.strip())
        return cls(clauses=clauses, **overrides)

    @classmethod
    def preset(cls, name: str, mixed_rule: str | None = None, **overrides) -> "QuantizationRule":
        """A named preset; `mixed_rule` replaces the mixed preset's clauses."""
        if name not in PRESETS:
            raise ValueError(f"quantization must be one of {sorted(PRESETS)}, got {name!r}")
        return cls.parse(mixed_rule if name == "mixed" and mixed_rule else PRESETS[name], **overrides)

    @property
    def text(self) -> str:
        """The canonical form: equal rules have equal text (calibration files are keyed by it)."""
        body = ",".join(f"{s}:{'none' if b is None else f'int{b}'}" for s, b in self.clauses)
        return f"{body};g{self.group_size}{';sym' if self.symmetric else ''}"

    def bits_for(self, module_name: str, weight: torch.Tensor) -> int | None:
        bits = next((b for s, b in self.clauses if _matches(s, module_name, weight)), None)
        if bits == 4 and weight.shape[1] % self.group_size:
            return 8  # INT4 groups must tile the row; fall back rather than refuse the model
        return bits


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


def quantize_model(model: nn.Module, rule: QuantizationRule, measure_paths: bool = True,
                   input_scales: dict[str, torch.Tensor] | None = None) -> QuantizationReport:
    """Replace each targeted nn.Linear by a QuantizedLinear. With `input_scales[name]` (s^-1
    per input channel), the weight quantized is W * s and the layer scales its input by s^-1,
    which leaves the product unchanged and the salient channels better resolved."""
    report = QuantizationReport()
    input_scales = input_scales or {}
    embedding = getattr(model, "embed_tokens", None)
    for full_name, parent, name, linear in list(quantization_targets(model)):
        bits = rule.bits_for(full_name, linear.weight)
        if bits is None:
            continue
        weight = linear.weight.data
        input_scale = input_scales.get(full_name)
        if input_scale is not None:
            input_scale = input_scale.to(weight.device, torch.float32)
            weight = weight.float() / input_scale[None, :]
        qw = quantize(weight, bits, rule.group_size, rule.symmetric)
        quantized = QuantizedLinear(qw, linear.bias.data if linear.bias is not None else None,
                                    dtype=linear.weight.dtype, input_scale=input_scale)
        if measure_paths:
            choose_paths(quantized)
        setattr(parent, name, quantized)
        key = f"{LAYER_TYPES[name]}:int{bits}"
        report.num_quantized[key] = report.num_quantized.get(key, 0) + 1
        if embedding is None or linear.weight is not embedding.weight:  # a tied head's float bytes stay, as the embedding
            report.float_bytes += linear.weight.numel() * linear.weight.element_size()
        report.quantized_bytes += qw.nbytes
        paths = f"{quantized.small_path}/{quantized.path}"  # decode-sized / prefill-sized steps
        report.paths[paths] = report.paths.get(paths, 0) + 1
        report.layers[full_name] = dict(bits=bits, group_size=qw.group_size, shape=list(qw.shape),
                                        has_bias=linear.bias is not None, has_input_scale=input_scale is not None)
    return report
