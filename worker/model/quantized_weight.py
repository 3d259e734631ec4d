"""The stored formats of weight-only quantization, as pure tensor code (device independent):
- INT8: `qweight` int8 [N, K] with symmetric per-row `scales` [N]: w ~ q * scale.
- INT4: `qweight` uint8 [N, K/2] (element 2j in the low nibble, 2j+1 in the high one), with
  per-group `scales` and `zeros` [N, K/G]: w ~ q * scale + zero, q in 0..15 (asymmetric),
  or w ~ (q - 8) * scale with zeros = -8 * scale (symmetric).
How a layer computes with them is worker/model/quantization.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZE = 128
_EPS = 1e-8


@dataclass
class QuantizedWeight:
    bits: int  # 8 or 4
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None  # INT4 only
    shape: tuple[int, int]  # (N, K) of the float weight
    group_size: int = 0  # INT4 only

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


# ---- INT8 --------------------------------------------------------------------------------------
def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel: each row's largest |w| maps to 127."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=_EPS) / 127.0  # [N]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(8, q, scales, None, tuple(w.shape))


def dequantize_int8(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (qw.qweight.to(dtype) * qw.scales.to(dtype)[:, None])


# ---- INT4 --------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, K/2], low nibble first."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] -> uint8 values 0..15 [N, K]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE, symmetric: bool = False
                  ) -> QuantizedWeight:
    n, k = weight.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"in_features {k} must be a multiple of the INT4 group size {group_size} (even)")
    w = weight.detach().float().view(n, k // group_size, group_size)  # [N, K/G, G]
    if symmetric:
        scales = w.abs().amax(dim=-1).clamp(min=_EPS) / 7.0
        zeros = -8.0 * scales
    else:
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = (high - low).clamp(min=_EPS) / 15.0
        zeros = low
    q = torch.round((w - zeros[..., None]) / scales[..., None]).clamp(0, 15).view(n, k)
    return QuantizedWeight(4, pack_int4(q), scales, zeros, (n, k), group_size)


def dequantize_int4(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = qw.shape
    q = unpack_int4(qw.qweight).to(dtype).view(n, k // qw.group_size, qw.group_size)
    return (q * qw.scales.to(dtype)[..., None] + qw.zeros.to(dtype)[..., None]).view(n, k)


def quantize(weight: torch.Tensor, bits: int, group_size: int = INT4_GROUP_SIZE, symmetric: bool = False
             ) -> QuantizedWeight:
    if bits == 8:
        return quantize_int8(weight)
    if bits == 4:
        return quantize_int4(weight, group_size, symmetric)
    raise ValueError(f"bits must be 8 or 4, got {bits}")


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_int8(qw, dtype) if qw.bits == 8 else dequantize_int4(qw, dtype)
