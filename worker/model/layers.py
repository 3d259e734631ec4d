"""Building blocks of the decoder: RMSNorm, rotary position embedding, the gated MLP.

Pure tensor code; no knowledge of requests, caches or devices beyond what tensors carry.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.model import cpu_kernels
from worker.model.config import RopeConfig

# Where each matmul form wins on the CPU, measured by `python -m bench.kernels` (see
# docs/benchmarks.md). With our kernels built, a Linear's float32 weight is packed once into
# 16-feature panels and `linear_packed` runs every row count: 1.0-3x BLAS from 4 to ~128 rows,
# on a par at 512, and at memory bandwidth for one row. Without them (no compiler, another
# device), BLAS, which does better computing (W x^T)^T than x W^T at 32..96 rows for layer
# weights and at up to 64 rows for a very wide one (the LM head).
PANEL = 16  # output features per packed panel (kPanel in csrc/linear.cpp)
WIDE_WEIGHT_RATIO = 8  # out_features / in_features at which a weight counts as wide
WIDE_WEIGHT_TRANSPOSED_MAX_ROWS = 64
TRANSPOSED_ROWS = range(32, 97)


def _transposed_is_faster(rows: int, weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    if out_features >= WIDE_WEIGHT_RATIO * in_features:
        return rows <= WIDE_WEIGHT_TRANSPOSED_MAX_ROWS
    return rows in TRANSPOSED_ROWS


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 16), K, 16]: for each k, a panel's 16 weights side by side
    (the rows past N are zeros)."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = F.pad(weight, (0, 0, 0, panels * PANEL - out_features))
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of `pack_panels`: [P, K, 16] -> a new [out_features, K] tensor."""
    num_panels, in_features, _ = panels.shape
    return panels.transpose(1, 2).reshape(num_panels * PANEL, in_features)[:out_features].contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias), into `out` if given: through our kernel when the
    caller has the weight packed (`pack_panels`), else by the faster BLAS form for the shape."""
    # A packed weight is a float32 CPU weight and our kernels are built (Linear.packed_weight).
    kernels = cpu_kernels.load() if (packed is not None and x.dim() == 2 and x.dtype == torch.float32
                                     and x.device.type == "cpu") else None
    if kernels is None and out is None and not (x.dim() == 2 and x.device.type == "cpu"
                                                and _transposed_is_faster(x.shape[0], weight)):
        return F.linear(x, weight, bias)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if kernels is not None:
        kernels.linear_packed(x, packed, out)
    elif x.device.type == "cpu" and _transposed_is_faster(x.shape[0], weight):
        out.copy_(torch.mm(weight, x.t()).t())  # (W x^T)^T: [N, M] computed, then laid out [M, N]
    else:
        torch.mm(x, weight.t(), out=out)
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear` above, with its weight packed for our CPU
    kernel on first use. The packed copy is rebuilt whenever the weight changes (new storage or
    an in-place write), and it is not part of the state dict. `pack = False` keeps the plain
    BLAS path (a weight rewritten before every use, as in an on-demand slot).

    `release_float_weight()` then drops the float weight and keeps only the panels (a buffer,
    `weight_panels`), so serving does not hold every weight twice. Reading `weight` afterwards
    (quantizing, calibrating) rebuilds a float copy from the panels each time: a read-only view
    of the values, not storage to write into."""

    pack = True

    def packed_weight(self) -> torch.Tensor | None:
        panels = self._buffers.get("weight_panels")
        if panels is not None:
            return panels
        weight = self.weight
        cached = self.__dict__.get("_packed")
        key = (weight.data_ptr(), weight._version)  # new storage (even under .data =) or an in-place write
        if cached is not None and cached[0] is weight and cached[1] == key:
            return cached[2]
        packed = None
        if self.pack and weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_kernels.load() is not None:
            with torch.no_grad():
                packed = pack_panels(weight.detach())
        self.__dict__["_packed"] = (weight, key, packed)
        return packed

    def release_float_weight(self) -> bool:
        """Keep only the packed panels; False (and nothing changed) where this Linear does not pack."""
        panels = self.packed_weight() if "weight" in self._parameters else None
        if panels is None:
            return False
        del self._parameters["weight"]
        self.__dict__.pop("_packed", None)
        self.register_buffer("weight_panels", panels, persistent=False)
        return True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A released layer still saves what a checkpoint holds: the float weight, [N, K].
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if (panels := self._buffers.get("weight_panels")) is not None:
            destination[prefix + "weight"] = unpack_panels(panels, self.out_features)

    def __getattr__(self, name: str):
        if name == "weight" and (panels := self._buffers.get("weight_panels")) is not None:
            return unpack_panels(panels, self.out_features)
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        panels = self._buffers.get("weight_panels")
        if panels is None:
            return linear(x, self.weight, self.bias, out=out, packed=self.packed_weight())
        # The released path runs ~30 times a decode step: plain dict lookups, no property reads.
        if out is None:
            out = x.new_empty((x.shape[0], self.out_features))
        cpu_kernels.load().linear_packed(x, panels, out)
        bias = self._parameters["bias"]
        return out if bias is None else out.add_(bias)


def release_float_weights(model: nn.Module, keep: tuple[nn.Module, ...] = ()) -> int:
    """Every packing Linear of `model` but those in `keep` drops its float weight; how many did."""
    return sum(m.release_float_weight() for m in model.modules() if isinstance(m, Linear) and m not in keep)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (kernels := cpu_kernels.for_tensors(x, self.weight)) is not None:
            x = x.contiguous()
            out = torch.empty_like(x)
            kernels.rms_norm(x, self.weight, self.eps, out)
            return out
        # Normalise in float32 whatever the model dtype, then scale in the model dtype
        # (the order Hugging Face uses, so half-precision outputs agree bit for bit).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_then_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta in place (the residual stream), then the norm of the sum: one pass on the CPU."""
        if (x.is_contiguous() and delta.is_contiguous()
                and (kernels := cpu_kernels.for_tensors(x, delta, self.weight)) is not None):
            out = torch.empty_like(x)
            kernels.add_rms_norm(x, delta, self.weight, self.eps, out)
            return out
        return self(x.add_(delta))


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[D/2] float32 inverse frequencies, with linear or Llama-3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3: wavelengths longer than the original context are stretched by `factor`,
    # short ones kept, and the band between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position, reading cos/sin from a table built once."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int):
        super().__init__()
        self.head_dim, self.rope, self.max_positions = head_dim, rope, max_positions
        # Non-persistent: derived from config, never part of a checkpoint.
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_table()

    def build_table(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the [P, D/2] cos/sin tables, e.g. after the model was built on 'meta'."""
        inv_freq = rope_inverse_frequencies(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, D/2]; looked up once per forward and
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by position, in the half-split ("rotate_half") layout of the
    Hugging Face Llama checkpoints: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    # Written into halves of one buffer: no temporaries, no concatenation.
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin)
    return out


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        # One pass with a vectorised exp: 3-8x torch's silu + mul from 1 to 512 rows.
        if (kernels := cpu_kernels.for_tensors(gate_up)) is not None:
            hidden = torch.empty(*gate_up.shape[:-1], self.intermediate_size)
            kernels.silu_and_mul(gate_up.contiguous(), hidden)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = F.silu(gate) * up
        return self.down_proj(hidden)
