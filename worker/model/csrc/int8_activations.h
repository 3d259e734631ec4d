// What the int8-activation kernels share (linear_int8_activations.cpp, int8_activations_avx512.h):
// the tile shape, x quantized per block of 32, and the weights' panel layout.
#pragma once

#include <cstdint>
#include <vector>

namespace int8_activations {

constexpr int64_t kBlock = 32;  // input features per activation scale
constexpr int64_t kRows = 3;    // rows of x per register tile
constexpr int64_t kCols = 4;    // weight rows per register tile
constexpr int64_t kSlot = 2 * kBlock;  // input features per slot of the panels: two blocks
constexpr int64_t kColumnRows = 8;     // weight rows per run of the scales' group columns

// x [M, K] quantized: q in -127..127 per element, |q| for the int8 weights' sign trick, and one
// scale per block of 32 (xs = max|x| / 127; x ~ q * xs).
struct QuantizedActivations {
  std::vector<int8_t> q;
  std::vector<uint8_t> magnitude;
  std::vector<float> scales;
  int64_t blocks_per_row = 0;
};

// The weights as panels (worker/model/int8_activation_panels.py): per tile of kCols weight rows,
// its units of 64 bytes in order, the kCols rows' bytes of each unit side by side, so a tile
// reads one contiguous run. Features go in slots of kSlot, none straddling a group (a group's odd
// last block and the rows past N hold zero weights). An int8 unit is one slot, each byte the
// weight + 128 (an unsigned operand: x's sums undo the offset); an int4 unit is two slots, byte i
// holding feature i of the first in its low nibble and of the second in its high one.
struct WeightPanels {
  const uint8_t* data = nullptr;
  int64_t slots_per_group = 0, slots_per_row = 0, units_per_row = 0;

  const uint8_t* unit(int64_t column_tile, int64_t u, int64_t j) const {
    return data + ((column_tile * units_per_row + u) * kCols + j) * 64;
  }
};

}  // namespace int8_activations
