"""Building blocks of the decoder: RMSNorm, rotary position embedding, the gated MLP.

Pure tensor code; no knowledge of requests, caches or devices beyond what tensors carry.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, then scale in the model dtype
        # (the order Hugging Face uses, so half-precision outputs agree bit for bit).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions [T]; q [T, H, D]; k [T, Hkv, D]. Half-split ("rotate_half") layout,
        # as in the Hugging Face Llama checkpoints.
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
