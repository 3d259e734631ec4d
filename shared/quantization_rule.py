"""Which projections a weight-only quantization quantizes, to how many bits: the rule's grammar.

A rule is ordered clauses `selector:bits`, the first match wins: the selector is a layer type
("attention": the qkv and o projections, "mlp": gate/up and down), one projection's name, a
size test on the matrix ("params>=1e6", "params<1e6") or "*"; bits are int8, int4 or none.
The output head is reached only by a clause that names it ("head:int8"). Stdlib only, so the
config refuses a bad rule when it is read, before a worker starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_GROUP_SIZE = 128  # INT4: input channels per scale (and zero point)
LAYER_TYPES = {"qkv_proj": "attention", "o_proj": "attention", "gate_up_proj": "mlp", "down_proj": "mlp",
               "lm_head": "head"}
# Only named on purpose: "*" and size tests leave the output head in the model's dtype.
_OPT_IN = {"lm_head"}
PRESETS = {
    "none": "",
    "int8": "*:int8",
    "int4": "*:int4",
    # Attention is the more sensitive, the MLP holds most of the weights.
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


def _matches(selector: str, module_name: str, num_params: int) -> bool:
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf in _OPT_IN:
        return selector in (leaf, LAYER_TYPES[leaf])
    if selector in ("*", leaf, LAYER_TYPES.get(leaf)):
        return True
    size = _SIZE.match(selector)
    if size is None:
        return False
    threshold = float(size.group(2)) * _SUFFIX[size.group(3).lower()]
    return num_params >= threshold if size.group(1) == ">=" else num_params < threshold


@dataclass(frozen=True)
class QuantizationRule:
    clauses: tuple[tuple[str, int | None], ...] = ()  # (selector, bits or None = keep float)
    group_size: int = DEFAULT_GROUP_SIZE
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

    def bits_for(self, module_name: str, weight) -> int | None:
        """Bits for the projection `module_name` whose [out, in] weight is `weight` (anything with
        numel() and shape, a tensor in practice), or None to keep it float."""
        bits = next((b for s, b in self.clauses if _matches(s, module_name, weight.numel())), None)
        if bits == 4 and weight.shape[1] % self.group_size:
            return 8  # INT4 groups must tile the row; fall back rather than refuse the model
        return bits
