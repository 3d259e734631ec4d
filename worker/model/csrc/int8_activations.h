// What the int8-activation kernels share (linear_int8_activations.cpp, int8_activations_avx512.h):
// the tile shape and x quantized per block of 32.
#pragma once

#include <cstdint>
#include <vector>

namespace int8_activations {

constexpr int64_t kBlock = 32;  // input features per activation scale
constexpr int64_t kRows = 3;    // rows of x per register tile
constexpr int64_t kCols = 4;    // weight rows per register tile

// x [M, K] quantized: q in -127..127 per element, |q| for the int8 weights' sign trick, and one
// scale per block of 32 (xs = max|x| / 127; x ~ q * xs).
struct QuantizedActivations {
  std::vector<int8_t> q;
  std::vector<uint8_t> magnitude;
  std::vector<float> scales;
  int64_t blocks_per_row = 0;
};

}  // namespace int8_activations
