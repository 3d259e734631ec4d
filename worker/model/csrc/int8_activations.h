// What the int8-activation kernels share (linear_int8_activations.cpp, int8_activations_avx512.h):
// the tile shapes, x quantized per block of 32, and the weights' panel layouts.
#pragma once

#include <cstdint>
#include <vector>

namespace int8_activations {

constexpr int64_t kBlock = 32;  // input features per activation scale
constexpr int64_t kRows = 3;    // rows of x per register tile
constexpr int64_t kCols = 4;    // weight rows per register tile
constexpr int64_t kSlot = 2 * kBlock;  // input features per slot of the panels: two blocks
constexpr int64_t kColumnRows = 8;     // weight rows per run of the scales' group columns
constexpr int64_t kPanelOutputs = 16;  // weight rows per output-major panel: one int32 lane each
constexpr int64_t kQuads = kSlot / 4;  // 4-byte words per slot
constexpr int64_t kPanelUnitBytes = kQuads * kPanelOutputs * 4;  // one unit of an output-major panel
constexpr int64_t kColumnBlockFloats = 2 * kPanelOutputs;  // a group's scales then zeros, of a panel's rows

// x [M, K] quantized: q in -127..127 per element, |q| for the int8 weights' sign trick, and one
// scale per block of 32 (xs = max|x| / 127; x ~ q * xs).
struct QuantizedActivations {
  std::vector<int8_t> q;
  std::vector<uint8_t> magnitude;
  std::vector<float> scales;
  int64_t blocks_per_row = 0;
};

// The weights as panels (worker/model/int8_activation_panels.py), in one of two layouts. Both put
// the features in slots of kSlot, none straddling a group (a group's odd last block and the
// rows past N hold zero weights), and cut each row's slots into units of 64 bytes: an int8 unit
// is one slot, each byte the weight + 128 (an unsigned operand: x's sums undo the offset); an
// int4 unit is two slots, byte i holding feature i of the first in its low nibble and of the
// second in its high one.
// - Tiles (the AVX2 and portable kernels): per tile of kCols weight rows, its units in order, the
//   kCols rows' bytes of each unit side by side, so a tile reads one contiguous run.
// - Output-major (the AVX-512 VNNI kernels): per panel of kPanelOutputs weight rows, its units in
//   order, each as kQuads vectors of 64 bytes, vector c holding bytes 4c..4c + 3 of the unit of
//   each of the panel's rows, row o at 4o: one 32-bit lane per output. An INT4 weight's panels
//   may carry their group columns inside (`columns_inside`): each group's block of
//   kColumnBlockFloats (its 16 rows' scales, then their zeros) right after the unit holding the
//   group's last slot, so a panel is one forward stream (a separate stream of columns measured
//   slower per weight byte than the extra bytes account for).
struct WeightPanels {
  const uint8_t* data = nullptr;
  int64_t slots_per_group = 0, slots_per_row = 0, units_per_row = 0;
  bool columns_inside = false;
  int64_t panel_bytes = 0;  // with columns inside: a panel's units and column blocks

  const uint8_t* unit(int64_t column_tile, int64_t u, int64_t j) const {
    return data + ((column_tile * units_per_row + u) * kCols + j) * 64;
  }
  int64_t tile_bytes() const { return units_per_row * kCols * 64; }  // from a tile's byte to the next tile's
  const uint8_t* panel_unit(int64_t panel, int64_t u) const {
    return data + (panel * units_per_row + u) * kPanelUnitBytes;
  }
  const uint8_t* panel_start(int64_t panel) const { return data + panel * panel_bytes; }
};

// The 32 bytes of block `local` of group g of weight row j of a tile: int8 weights + 128, or
// bytes whose nibbles at `shift` are the int4 weights.
struct BlockBytes {
  const uint8_t* bytes;
  int shift;
};

inline BlockBytes block_bytes(const WeightPanels& panels, bool int8, int64_t tile, int64_t j, int64_t g, int64_t local) {
  const int64_t slot = g * panels.slots_per_group + local / 2, half = local % 2;
  if (int8) return {panels.unit(tile, slot, j) + half * kBlock, 0};
  return {panels.unit(tile, slot / 2, j) + half * kBlock, static_cast<int>(4 * (slot % 2))};
}

// The bytes of one output-major INT4 panel with its group columns inside.
inline int64_t panel_bytes_with_columns(int64_t units_per_row, int64_t num_groups) {
  return units_per_row * kPanelUnitBytes + num_groups * kColumnBlockFloats * 4;
}

}  // namespace int8_activations
