"""Building blocks of the decoder: linear layers, RMSNorm, rotary position embedding, the gated MLP.

Plain torch: these modules are the reference the tests trust, and what runs wherever the CPU
fast path (worker/model/cpu_fast_path.py) does not. No knowledge of requests, caches or
devices beyond what tensors carry.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import RopeConfig

# BLAS computes x W^T faster in its transposed form (W x^T)^T for some row counts on the CPU;
# where, `python -m bench.kernels` measures (see docs/benchmarks.md): for a layer's weight
# from 32 to 96 rows, for a very wide one (the LM head) up to 64 rows.
PANEL = 16  # output features per packed panel (kPanel in csrc/linear.cpp)
PANEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what our packed linear kernel reads
WIDE_WEIGHT_RATIO = 8  # out_features / in_features at which a weight counts as wide
WIDE_WEIGHT_TRANSPOSED_MAX_ROWS = 64
TRANSPOSED_ROWS = range(32, 97)


def _transposed_is_faster(rows: int, weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    if out_features >= WIDE_WEIGHT_RATIO * in_features:
        return rows <= WIDE_WEIGHT_TRANSPOSED_MAX_ROWS
    return rows in TRANSPOSED_ROWS


def pack_panels(weight: torch.Tensor, group: int = 1) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 16), K, 16]: for each k, a panel's 16 weights side by side
    (the rows past N are zeros). The layout our packed linear kernel reads. With `group` > 1,
    [ceil(N / (16 group)), K, group, 16]: each run of `group` panels interleaved by k, so that
    one k of all of them is one contiguous row (the last group padded with zero panels)."""
    out_features, in_features = weight.shape
    panels = -(-out_features // (PANEL * group)) * group
    padded = F.pad(weight, (0, 0, 0, panels * PANEL - out_features))
    packed = padded.view(panels, PANEL, in_features).transpose(1, 2)
    if group == 1:
        return packed.contiguous()
    return packed.reshape(panels // group, group, in_features, PANEL).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of `pack_panels`: [P, K, 16] or [G, K, group, 16] -> a new [out_features, K] tensor."""
    if panels.dim() == 4:
        panels = panels.transpose(1, 2).reshape(-1, panels.shape[1], PANEL)
    num_panels, in_features, _ = panels.shape
    return panels.transpose(1, 2).reshape(num_panels * PANEL, in_features)[:out_features].contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias), into `out` if given, by the faster BLAS form for the shape."""
    transposed = x.dim() == 2 and x.device.type == "cpu" and _transposed_is_faster(x.shape[0], weight)
    if out is None and not transposed:
        return F.linear(x, weight, bias)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if transposed:
        out.copy_(torch.mm(weight, x.t()).t())  # (W x^T)^T: [N, M] computed, then laid out [M, N]
    else:
        torch.mm(x, weight.t(), out=out)
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """nn.Linear computing through `linear` above.

    Its float32, bfloat16 or float16 CPU weight may be held as packed panels instead (`release_float_weight`), the
    one copy both the modules and the CPU fast path read, so serving does not hold every weight
    twice. Reading `weight` then rebuilds a copy from the panels each time (a read-only
    view of the values, not storage to write into), and `state_dict()` still saves [N, K]."""

    def panels(self) -> torch.Tensor:
        """The weight as packed panels: the ones held, or packed now from the float weight."""
        held = self._buffers.get("weight_panels")
        if held is not None:
            return held
        with torch.no_grad():
            return pack_panels(self.weight.detach())

    def release_float_weight(self, panels: torch.Tensor | None = None) -> bool:
        """Hold the weight as `panels` (packed here if not given) and drop the [N, K] copy; False
        (and nothing changed) where the weight is already released or not float32, bfloat16 or
        float16 on the CPU."""
        weight = self._parameters.get("weight")
        if weight is None or weight.device.type != "cpu" or weight.dtype not in PANEL_DTYPES:
            return False
        panels = self.panels() if panels is None else panels
        del self._parameters["weight"]
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
        weight = self.weight
        # A weight stored narrower than the activations (bf16 or fp16 on the CPU) is widened for the
        # matmul: the modules are the reference, and the fast path widens in registers instead.
        return linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype), self.bias, out=out)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, then scale in the model dtype
        # (the order Hugging Face uses, so half-precision outputs agree bit for bit).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_then_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta in place (the residual stream), then the norm of the sum."""
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
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)
