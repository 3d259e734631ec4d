"""The layout a weight-only INT4 weight is held in where our AVX2 and AVX-512 kernels read it
(worker/model/csrc/int4_weight_layouts.h; `Int4HeldTile` in weight_only_avx512.h): one forward
stream per tile of 8 output rows, with the scales and zeros inside.

A row-major INT4 weight is [N, K/2] uint8 nibbles (feature 2j in the low nibble of byte j, 2j + 1
in the high one) with scales and zeros [N, K/G] float32. With groups of 128 features, a group of
one row is 64 bytes, one cache line. The held tiles are [ceil(N / 8), K / 128, 9, 64] uint8: for
tile t and group g, lines 0-7 are the group's 64 bytes of rows 8t..8t + 7 as they lie row-major,
line 8 their 8 scales then their 8 zeros (float32). The rows past N are zero weights with zero
scales and zeros. A tile's kernels then read one stream, where row-major they read 8 row streams
and two more of scales and zeros.
"""
from __future__ import annotations

import torch

from worker.model import cpu_kernels

TILE_ROWS = 8  # output rows per tile: the kernels' kCols
GROUP_FEATURES = 128  # the one group size held this way: the kernels' kHeldGroup
LINE_BYTES = 64


def supported(in_features: int, group_size: int) -> bool:
    """Whether this host's kernels take held tiles for a weight of this K and group size."""
    kernels = cpu_kernels.load()
    return kernels is not None and kernels.int4_weight_tiles_supported(in_features, group_size)


def to_tiles(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Row-major [N, K/2] uint8 with scales and zeros [N, K / 128] -> the held tiles (a new tensor)."""
    rows, groups = scales.shape
    if qweight.shape != (rows, groups * LINE_BYTES):
        raise ValueError(f"held INT4 tiles take groups of {GROUP_FEATURES} features: qweight "
                         f"{tuple(qweight.shape)} does not match {groups} groups of {rows} rows")
    count = -(-rows // TILE_ROWS)
    padded = qweight.new_zeros(count * TILE_ROWS, groups * LINE_BYTES)
    padded[:rows] = qweight
    columns = scales.new_zeros(count * TILE_ROWS, 2, groups, dtype=torch.float32)
    columns[:rows, 0] = scales
    columns[:rows, 1] = zeros
    # [t, row, g, 64] -> [t, g, row, 64]; columns [t, row, 2, g] -> [t, g, 2, row] as 64 bytes.
    lines = padded.view(count, TILE_ROWS, groups, LINE_BYTES).transpose(1, 2)
    column_lines = columns.view(count, TILE_ROWS, 2, groups).permute(0, 3, 2, 1).contiguous()
    column_lines = column_lines.view(torch.uint8).view(count, groups, 1, LINE_BYTES)
    return torch.cat((lines, column_lines), dim=2).contiguous()


def from_tiles(tiles: torch.Tensor, rows: int) -> torch.Tensor:
    """The row-major [rows, K/2] uint8 weight of held tiles (a new tensor)."""
    count, groups = tiles.shape[:2]
    return tiles[:, :, :TILE_ROWS].transpose(1, 2).reshape(count * TILE_ROWS, groups * LINE_BYTES)[:rows].contiguous()


def columns_of(tiles: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales and zeros [rows, K / 128] float32 held inside the tiles (new tensors)."""
    count, groups = tiles.shape[:2]
    columns = tiles[:, :, TILE_ROWS].contiguous().view(torch.float32).view(count, groups, 2, TILE_ROWS)
    columns = columns.permute(0, 3, 2, 1).reshape(count * TILE_ROWS, 2, groups)[:rows]
    return columns[:, 0].contiguous(), columns[:, 1].contiguous()
