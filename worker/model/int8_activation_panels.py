"""The weight layouts the int8-activation kernels read (worker/model/csrc/linear_int8_activations.cpp).

A quantized weight is stored row-major, [N, K] int8 or [N, K/2] uint8 nibbles (element 2j low,
2j+1 high). The kernels take 64 input features (two blocks of 32: a slot) per step, and the
panels hold each weight row's slots as units of 64 bytes, in one of two layouts:

- Tiles (`output_major=False`, the AVX2 and portable kernels, which compute a tile of 4 output
  rows at a time): what one tile reads in the order it reads it, [ceil(N / 4), units_per_row * 4,
  64], unit u of row j of tile t at [t, 4 u + j].
- Output-major (`output_major=True`, the AVX-512 VNNI kernels, one 32-bit lane per output):
  [ceil(N / 16), units_per_row, 16, 64], bytes 4c..4c + 3 of unit u of row o of panel p at
  [p, u, c, 4 o..4 o + 3], so one 64-byte load gives 4 features of 16 outputs.

An output-major INT4 weight may also carry its scales and zeros (`with_group_columns`): [ceil(N /
16), bytes per panel / 64, 64], each group's block of the panel's 16 scales then its 16 zeros (float32)
right after the unit that holds the group's last slot, so that a panel is one forward stream.

In both:

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

from worker.model import cpu_kernels

TILE_ROWS = 4  # weight rows per tile: the kernels' kCols
PANEL_ROWS = 16  # weight rows per output-major panel: the kernels' kPanelOutputs
SLOT_FEATURES = 64  # input features per slot: the kernels' kSlot
UNIT_BYTES = 64
PANEL_UNIT_BYTES = PANEL_ROWS * UNIT_BYTES  # one unit of an output-major panel: the kernels' kPanelUnitBytes
COLUMN_BLOCK_BYTES = 2 * PANEL_ROWS * 4  # a group's scales then zeros of a panel's rows: the kernels' kColumnBlockFloats


def _slots(weights: torch.Tensor, in_features: int, group: int) -> torch.Tensor:
    """[N, K] one value per feature -> [N, slots per row, 64], each group padded to whole slots."""
    rows = weights.shape[0]
    slots_per_group = -(-group // SLOT_FEATURES)
    padded = weights.new_zeros(rows, in_features // group, slots_per_group * SLOT_FEATURES)
    padded[:, :, :group] = weights.view(rows, in_features // group, group)
    return padded.view(rows, -1, SLOT_FEATURES)


def host_layout_is_output_major() -> bool:
    """Whether this host's kernels read the output-major layout (the AVX-512 VNNI build)."""
    kernels = cpu_kernels.load()
    return kernels is not None and kernels.int8_activations_output_major()


def to_panels(qweight: torch.Tensor, bits: int, in_features: int, group_size: int = 0,
              output_major: bool | None = None) -> torch.Tensor:
    """Row-major [N, K] int8 or [N, K/2] uint8 -> the panels above (a new tensor), in the layout
    `output_major` names (None: the one this host's kernels read)."""
    if output_major is None:
        output_major = host_layout_is_output_major()
    rows = qweight.shape[0]
    if bits == 8:  # INT8 scales are per row: its one group is the whole row
        units = (_slots(qweight.to(torch.int16), in_features, in_features) + 128).to(torch.uint8)
    else:
        features = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).view(rows, in_features)
        slots = _slots(features, in_features, group_size)
        if slots.shape[1] % 2:
            slots = torch.cat((slots, slots.new_zeros(rows, 1, SLOT_FEATURES)), dim=1)
        units = slots[:, 0::2] | (slots[:, 1::2] << 4)
    per = PANEL_ROWS if output_major else TILE_ROWS
    count = -(-rows // per)
    padded = units.new_full((count * per, units.shape[1], UNIT_BYTES), 128 if bits == 8 else 0)
    padded[:rows] = units
    if output_major:  # [p, o, u, c, 4] -> [p, u, c, o, 4]
        panels = padded.view(count, per, units.shape[1], UNIT_BYTES // 4, 4).permute(0, 2, 3, 1, 4).reshape(
            count, units.shape[1], UNIT_BYTES // 4, UNIT_BYTES)
    else:
        panels = padded.view(count, per, units.shape[1], UNIT_BYTES).transpose(1, 2).reshape(
            count, units.shape[1] * per, UNIT_BYTES)
    return panels.view(torch.int8) if bits == 8 else panels


def _stream_offsets(in_features: int, group_size: int) -> tuple[list[int], list[int], int]:
    """Within one output-major INT4 panel with its group columns inside: the byte offset of each
    unit, of each group's column block, and the panel's bytes."""
    slots_per_group = -(-group_size // SLOT_FEATURES)
    slots = slots_per_group * (in_features // group_size)
    units, blocks, at = [], [], 0
    for unit in range(-(-slots // 2)):
        units.append(at)
        at += PANEL_UNIT_BYTES
        for slot in (2 * unit, 2 * unit + 1):
            if slot < slots and (slot + 1) % slots_per_group == 0:
                blocks.append(at)
                at += COLUMN_BLOCK_BYTES
    return units, blocks, at


def with_group_columns(panels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """Output-major INT4 panels [P, U, 16, 64] and their scales and zeros [N, K / G] -> the panels
    with each group's columns inside (a new [P, bytes per panel / 64, 64] uint8 tensor; the rows
    past N zero)."""
    count, num_groups = panels.shape[0], scales.shape[1]
    units, blocks, total = _stream_offsets(num_groups * group_size, group_size)
    columns = scales.new_zeros(count * PANEL_ROWS, 2, num_groups)
    columns[:scales.shape[0], 0] = scales
    columns[:scales.shape[0], 1] = zeros
    columns = columns.view(count, PANEL_ROWS, 2, num_groups).permute(0, 3, 2, 1).contiguous()
    column_bytes = columns.view(torch.uint8).view(count, num_groups, COLUMN_BLOCK_BYTES)
    unit_bytes = panels.reshape(count, len(units), PANEL_UNIT_BYTES)
    out = panels.new_empty(count, total)
    for unit, at in enumerate(units):
        out[:, at:at + PANEL_UNIT_BYTES] = unit_bytes[:, unit]
    for group, at in enumerate(blocks):
        out[:, at:at + COLUMN_BLOCK_BYTES] = column_bytes[:, group]
    return out.view(count, total // UNIT_BYTES, UNIT_BYTES)


def without_group_columns(panels: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor:
    """The output-major panels [P, U, 16, 64] of panels that carry their group columns inside."""
    units, _, _ = _stream_offsets(in_features, group_size)
    panels = panels.reshape(panels.shape[0], -1)
    return torch.stack([panels[:, at:at + PANEL_UNIT_BYTES] for at in units], dim=1).view(
        panels.shape[0], len(units), UNIT_BYTES // 4, UNIT_BYTES)


def from_panels(panels: torch.Tensor, bits: int, shape: tuple[int, int], group_size: int = 0) -> torch.Tensor:
    """The inverse of `to_panels` (either layout, told apart by rank; output-major INT4 panels with
    their group columns inside too): a new row-major [N, K] int8 or [N, K/2] uint8 tensor."""
    rows, in_features = shape
    if bits == 4 and panels.dim() == 3 and panels.shape[1] * UNIT_BYTES == _stream_offsets(in_features, group_size)[2]:
        panels = without_group_columns(panels, in_features, group_size)  # a tile layout's rows are 4 units long
    group = in_features if bits == 8 else group_size
    count = panels.shape[0]
    raw = panels.view(torch.uint8)
    if panels.dim() == 4:
        units = raw.view(count, raw.shape[1], UNIT_BYTES // 4, PANEL_ROWS, 4).permute(0, 3, 1, 2, 4).reshape(
            count * PANEL_ROWS, raw.shape[1], UNIT_BYTES)[:rows]
    else:
        units = raw.view(count, -1, TILE_ROWS, UNIT_BYTES).transpose(1, 2).reshape(
            count * TILE_ROWS, -1, UNIT_BYTES)[:rows]
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
