// Where a weight-only INT4 weight's nibbles, scales and zeros lie, for the kernels that read
// either layout through one interface (linear.cpp's below-AVX-512 routes, weight_only_avx2.h):
// row-major ([N, K/2] bytes, feature 2j in the low nibble of byte j; [N, K/G] float32 scales and
// zeros) or held tiles (worker/model/int4_weight_tiles.py: per tile of kTileRows rows and per
// group of kHeldGroup features, each row's 64 bytes as they lie row-major, then one line of the
// rows' scales and zeros, so a tile is one forward stream).
#pragma once

#include <cstdint>

namespace int4_layout {

constexpr int64_t kTileRows = 8;
constexpr int64_t kHeldGroup = 128;
constexpr int64_t kLineBytes = 64;
constexpr int64_t kHeldGroupBytes = (kTileRows + 1) * kLineBytes;
static_assert(kHeldGroup / 2 == kLineBytes, "a held group of one row is one line");

// In both layouts `bytes(n, k)` is the byte holding feature k of row n (its low nibble where k is
// even), and the row's bytes run on contiguously to the end of k's group; `bytes(n, k, g)` the
// same where the caller knows k's group g (fewer instructions in a loop over a group's k); `group_bytes` is the
// step from a row's bytes of one group to its bytes of the next, and `next_tile_bytes` the step
// from any byte of a row to the same byte of the row kTileRows on.
struct RowMajor {
  const uint8_t* q;
  const float* s;
  const float* z;
  int64_t row_bytes, num_groups;
  const uint8_t* bytes(int64_t n, int64_t k) const { return q + n * row_bytes + k / 2; }
  const uint8_t* bytes(int64_t n, int64_t k, int64_t) const { return bytes(n, k); }
  float scale(int64_t n, int64_t g) const { return s[n * num_groups + g]; }
  float zero(int64_t n, int64_t g) const { return z[n * num_groups + g]; }
  int64_t group_bytes(int64_t group_size) const { return group_size / 2; }
  int64_t next_tile_bytes() const { return kTileRows * row_bytes; }
};

// Held tiles (groups of kHeldGroup features only); rows past N are zero weights with zero
// scales and zeros.
struct HeldTiles {
  const uint8_t* tiles;
  int64_t tile_bytes;
  const uint8_t* group_of(int64_t n, int64_t g) const {
    return tiles + n / kTileRows * tile_bytes + g * kHeldGroupBytes;
  }
  const uint8_t* bytes(int64_t n, int64_t k, int64_t g) const {
    return group_of(n, g) + n % kTileRows * kLineBytes + (k - g * kHeldGroup) / 2;
  }
  const uint8_t* bytes(int64_t n, int64_t k) const { return bytes(n, k, k / kHeldGroup); }
  // Group g's scales of the tile holding row n, then its zeros: kTileRows floats each.
  const float* columns(int64_t n, int64_t g) const {
    return reinterpret_cast<const float*>(group_of(n, g) + kTileRows * kLineBytes);
  }
  float scale(int64_t n, int64_t g) const { return columns(n, g)[n % kTileRows]; }
  float zero(int64_t n, int64_t g) const { return columns(n, g)[kTileRows + n % kTileRows]; }
  int64_t group_bytes(int64_t) const { return kHeldGroupBytes; }
  int64_t next_tile_bytes() const { return tile_bytes; }
};

}  // namespace int4_layout
