"""The weight layout the int8-activation kernels read (worker/model/csrc/linear_int8_activations.cpp).

A quantized weight is stored row-major, [N, K] int8 or [N, K/2] uint8 nibbles (element 2j low,
2j+1 high). The kernels compute a tile of 4 output rows at a time, 64 input features (two blocks
of 32: a slot) per step, and the panels hold what one tile reads in the order it reads it, as
units of 64 bytes: [ceil(N / 4), units_per_row * 4, 64], unit u of row j of tile t at [t, 4 u + j].

- Slots never straddle a group: a group of G features takes ceil(G / 64) slots, its odd last
  block padded with zero weights (which add nothing to any dot product); so do the rows past N.
- INT8: a unit is one slot, each byte the weight + 128 (the unsigned operand of the CPU's
  u8 x s8 dot instruction, so no per-weight correction is needed), held as int8 bits.
- INT4: a unit is two slots, byte i holding feature i of the first slot in its low nibble and
  feature i of the second in its high one: one 512-bit load and two masks give both slots'
  weights in feature order (a row's last unit may hold one slot).
"""
from __future__ import annotations

import torch

TILE_ROWS = 4  # weight rows per tile: the kernels' kCols
SLOT_FEATURES = 64  # input features per slot: the kernels' kSlot
UNIT_BYTES = 64


def _slots(weights: torch.Tensor, in_features: int, group: int) -> torch.Tensor:
    """[N, K] one value per feature -> [N, slots per row, 64], each group padded to whole slots."""
    rows = weights.shape[0]
    slots_per_group = -(-group // SLOT_FEATURES)
    padded = weights.new_zeros(rows, in_features // group, slots_per_group * SLOT_FEATURES)
    padded[:, :, :group] = weights.view(rows, in_features // group, group)
    return padded.view(rows, -1, SLOT_FEATURES)


def to_panels(qweight: torch.Tensor, bits: int, in_features: int, group_size: int = 0) -> torch.Tensor:
    """Row-major [N, K] int8 or [N, K/2] uint8 -> the panels above (a new tensor)."""
    rows = qweight.shape[0]
    if bits == 8:  # INT8 scales are per row: its one group is the whole row
        units = (_slots(qweight.to(torch.int16), in_features, in_features) + 128).to(torch.uint8)
    else:
        features = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).view(rows, in_features)
        slots = _slots(features, in_features, group_size)
        if slots.shape[1] % 2:
            slots = torch.cat((slots, slots.new_zeros(rows, 1, SLOT_FEATURES)), dim=1)
        units = slots[:, 0::2] | (slots[:, 1::2] << 4)
    tiles = -(-rows // TILE_ROWS)
    padded = units.new_full((tiles * TILE_ROWS, units.shape[1], UNIT_BYTES), 128 if bits == 8 else 0)
    padded[:rows] = units
    panels = padded.view(tiles, TILE_ROWS, units.shape[1], UNIT_BYTES).transpose(1, 2).reshape(
        tiles, units.shape[1] * TILE_ROWS, UNIT_BYTES)
    return panels.view(torch.int8) if bits == 8 else panels


def from_panels(panels: torch.Tensor, bits: int, shape: tuple[int, int], group_size: int = 0) -> torch.Tensor:
    """The inverse of `to_panels`: a new row-major [N, K] int8 or [N, K/2] uint8 tensor."""
    rows, in_features = shape
    group = in_features if bits == 8 else group_size
    tiles = panels.shape[0]
    units = panels.view(torch.uint8).view(tiles, -1, TILE_ROWS, UNIT_BYTES).transpose(1, 2).reshape(
        tiles * TILE_ROWS, -1, UNIT_BYTES)[:rows]
    if bits == 8:
        slots = units.to(torch.int16) - 128
    else:
        slots = torch.stack((units & 0x0F, units >> 4), dim=2).view(rows, -1, SLOT_FEATURES)
    slots_per_group = -(-group // SLOT_FEATURES)
    grouped = slots[:, :slots_per_group * (in_features // group)].reshape(rows, in_features // group, -1)
    features = grouped[:, :, :group].reshape(rows, in_features)
    if bits == 8:
        return features.to(torch.int8).contiguous()
    pairs = features.view(rows, in_features // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
