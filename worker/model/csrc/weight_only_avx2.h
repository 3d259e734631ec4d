// The AVX2 tile of one row of x against a row-major weight-only INT4 weight (linear.cpp says what
// the weight-only linears compute): the register tiles of several rows widen 8 nibbles at a time
// by a zero-extending load per nibble half, about six instructions per FMA, and a single row
// has only their four weight rows' FMA chains. Here a tile takes 8 weight rows (eight chains)
// and 32 features a step: one broadcast load of their 16 bytes, the low and high nibbles masked
// out once, and each 8 of them put in float lanes by one in-lane byte shuffle and a convert,
// about four instructions per FMA. Beside it, the tile of int8 dot products (int4_parts_row_tile,
// below), which takes x to 2^-16 of its largest |x| per 32 features for half the instructions.
// Empty unless the compiler targets AVX2 and FMA.
#pragma once

#include "int4_weight_layouts.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef HAVE_AVX2_FMA
namespace weight_only_avx2 {

constexpr int64_t kRun = 32;   // features a step: x is split per run (evens, then odds)
constexpr int64_t kCols = int4_layout::kTileRows;  // weight rows per tile
static_assert(kCols == 8, "a tile's sums, scales and zeros of a group are one register each");

// Group g's scales and zeros of a tile's rows n[0..kCols), one register each: gathered from
// row-major columns, loaded from a held tile's own line (n[0] starts the tile).
inline __m256 tile_scales(const int4_layout::RowMajor& w, const int64_t n[kCols], int64_t g) {
  return _mm256_setr_ps(w.scale(n[0], g), w.scale(n[1], g), w.scale(n[2], g), w.scale(n[3], g), w.scale(n[4], g),
                        w.scale(n[5], g), w.scale(n[6], g), w.scale(n[7], g));
}
inline __m256 tile_zeros(const int4_layout::RowMajor& w, const int64_t n[kCols], int64_t g) {
  return _mm256_setr_ps(w.zero(n[0], g), w.zero(n[1], g), w.zero(n[2], g), w.zero(n[3], g), w.zero(n[4], g),
                        w.zero(n[5], g), w.zero(n[6], g), w.zero(n[7], g));
}
inline __m256 tile_scales(const int4_layout::HeldTiles& w, const int64_t n[kCols], int64_t g) {
  return _mm256_loadu_ps(w.columns(n[0], g));
}
inline __m256 tile_zeros(const int4_layout::HeldTiles& w, const int64_t n[kCols], int64_t g) {
  return _mm256_loadu_ps(w.columns(n[0], g) + kCols);
}

// The rows n = n0 + j of a tile (past the last row it repeats it, and the caller drops those
// outputs) and where each one's bytes of group 0 start.
struct TileRows {
  int64_t n[kCols];
  const uint8_t* bytes[kCols];
};
template <typename Weights>
inline TileRows tile_rows(const Weights& w, int64_t out_features, int64_t n0) {
  TileRows rows;
  for (int64_t j = 0; j < kCols; ++j) {
    rows.n[j] = std::min(n0 + j, out_features - 1);
    rows.bytes[j] = w.bytes(rows.n[j], 0);
  }
  return rows;
}

// The end of a group of a tile: total += scales * (x_g . q_g of each row, `acc`'s lanes summed)
// + zeros * sum(x_g), all kCols rows at once.
template <typename Weights>
inline __m256 finish_group(const Weights& w, const TileRows& rows, int64_t g, const __m256 acc[kCols], float x_sum,
                           __m256 total) {
  total = _mm256_fmadd_ps(tile_scales(w, rows.n, g), sums_of_eight(acc), total);
  return _mm256_fmadd_ps(tile_zeros(w, rows.n, g), _mm256_set1_ps(x_sum), total);
}

// The frame both one-row tiles share: per group, kCols accumulators that `step(k, bytes, acc)`
// adds each step of kStep features to, given where each row's bytes of feature k lie (the same
// bytes of the next tile's rows are fetched as the steps go, ahead of the hardware prefetchers,
// which a row-major tile's 8 streams outrun); each group then finished into `total` with its
// scales, zeros and x's sum (`x_sums`).
template <int64_t kStep, typename Weights, typename Step>
inline void row_tile_groups(const Weights& w, const float* x_sums, int64_t in_features, int64_t out_features,
                            int64_t group_size, int64_t n0, float total[kCols], Step&& step) {
  const TileRows rows = tile_rows(w, out_features, n0);
  const int64_t next_tile = w.next_tile_bytes();
  __m256 sums = _mm256_loadu_ps(total);
  for (int64_t g = 0; g < in_features / group_size; ++g) {
    __m256 acc[kCols];
    for (int64_t j = 0; j < kCols; ++j) acc[j] = _mm256_setzero_ps();
    const int64_t group_start = g * w.group_bytes(group_size);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kStep) {
      const uint8_t* bytes[kCols];
      for (int64_t j = 0; j < kCols; ++j) {
        bytes[j] = rows.bytes[j] + group_start + (k - g * group_size) / 2;
        _mm_prefetch(reinterpret_cast<const char*>(bytes[j]) + next_tile, _MM_HINT_T0);
      }
      step(k, bytes, acc);
    }
    sums = finish_group(w, rows, g, acc, x_sums[g], sums);
  }
  _mm256_storeu_ps(total, sums);
}

// One tile: `total[j]` += the output of weight row n0 + j (`Weights`: int4_layout::RowMajor or
// HeldTiles), `split_x` one row of x in the nibble-split order over runs of 32 (the low nibbles
// of a run's 16 bytes are its even features, the high ones its odd features), `x_sums` its sum
// per group.
template <typename Weights>
inline void int4_row_tile(const float* split_x, const float* x_sums, const Weights& w, int64_t in_features,
                          int64_t out_features, int64_t group_size, int64_t n0, float total[kCols]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  // Bytes 0-3 of the 16 to the low lane's four 32-bit words, 4-7 to the high lane's (the 16 bytes
  // are in both lanes), and bytes 8-15 likewise: 8 nibbles a shuffle, each zero-extended.
  const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                         4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i second = _mm256_add_epi8(first, _mm256_setr_epi8(8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0,
                                                                 8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0));
  row_tile_groups<kRun>(w, x_sums, in_features, out_features, group_size, n0, total,
                        [&](int64_t k, const uint8_t* const bytes[kCols], __m256 acc[kCols]) {
    const float* x = split_x + k;
    for (int64_t j = 0; j < kCols; ++j) {
      const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes[j])));
      const __m256i low = _mm256_and_si256(both, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_cvtepi32_ps(_mm256_shuffle_epi8(low, first)), acc[j]);
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), _mm256_cvtepi32_ps(_mm256_shuffle_epi8(low, second)), acc[j]);
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), _mm256_cvtepi32_ps(_mm256_shuffle_epi8(high, first)), acc[j]);
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), _mm256_cvtepi32_ps(_mm256_shuffle_epi8(high, second)),
                               acc[j]);
    }
  });
}

// A single row of x by INT4 weights through int8 dot products (maddubs: 32 unsigned bytes by 32
// signed ones, summed in pairs into int16, then in pairs into int32 by madd), the AVX2 form of
// the AVX-512 VNNI tile (weight_only_avx512.h, int4_row_tile_vnni) and the same arithmetic: x as
// two int8 parts on a grid per 32 features, x ~ unit * (256 * upper + lower), upper = x rounded
// to 1/127 of the largest |x| of its 32 features, lower its residual in 1/256 of that step, so
// each element keeps 2^-16 of that largest; the integer dots are exact, and the result is the
// float32 product of that x and the INT4 weights. A step takes 64 features, one 32-byte load of
// each weight row: the masked low nibbles are the even features of its two runs of 32 (one run
// per 128-bit lane) and the high ones the odd features, each multiplied by the parts in that
// order. About 15 instructions per 64 weights where int4_row_tile takes about 30. The zero-point
// term must take the same x (RowParts::sums).
constexpr int64_t kPartsRun = 64;  // features a step of the int8 tile

// One row of x for int4_parts_row_tile. Per step of 64 features: 128 bytes (the upper parts of
// its even features, of its odd ones, then the lower parts of each; in each, 16 bytes of its
// first 32 features then 16 of its last) and 8 units (4 lanes of the first 32's unit, 4 of the
// last's). Per group, the sum of x as the parts give it.
struct RowParts {
  std::vector<int8_t> bytes;
  std::vector<float> units, sums;
};

inline RowParts split_x_parts(const float* x, int64_t in_features, int64_t group_size) {
  RowParts out{std::vector<int8_t>(2 * in_features, 0), std::vector<float>(in_features / kLanes),
               std::vector<float>(in_features / group_size, 0.f)};
  for (int64_t k = 0; k < in_features; k += 32) {
    const float* block = x + k;
    const int64_t step = k / kPartsRun, half = k % kPartsRun / 32;  // each step's first 32, then its last
    float top = 0.f;
    bool finite = true;
    for (int64_t i = 0; i < 32; ++i) {
      finite &= std::isfinite(block[i]);
      top = std::max(top, std::fabs(block[i]));
    }
    // A NaN or infinity in x makes the unit NaN, so every output is NaN as the float product's
    // would not be finite either (the parts alone would turn it into some finite value).
    const float unit = finite ? top / 127.f / 256.f : std::numeric_limits<float>::quiet_NaN();
    std::fill_n(out.units.data() + step * kLanes + 4 * half, 4, unit);
    if (top == 0.f || !finite) continue;  // parts stay zero
    const float to_upper = 127.f / top;
    if (!std::isfinite(to_upper)) continue;  // |x| below about 4e-37: zero parts, as good as its product
    int8_t* bytes = out.bytes.data() + step * 2 * kPartsRun + 16 * half;
    int32_t total = 0;
    for (int64_t i = 0; i < 32; ++i) {
      const float scaled = block[i] * to_upper;
      const float upper = std::nearbyint(scaled);
      const float lower = std::min(127.f, std::max(-128.f, std::nearbyint((scaled - upper) * 256.f)));
      const int64_t at = 32 * (i % 2) + i / 2;  // evens, then odds
      bytes[at] = static_cast<int8_t>(upper);
      bytes[kPartsRun + at] = static_cast<int8_t>(lower);
      total += 256 * static_cast<int32_t>(upper) + static_cast<int32_t>(lower);
    }
    out.sums[k / group_size] += unit * static_cast<float>(total);
  }
  return out;
}

// One tile: `total[j]` += the output of weight row n0 + j (`Weights`: int4_layout::RowMajor or
// HeldTiles; groups whole steps of 64), x as its parts, whose sums the zero-point term takes.
template <typename Weights>
inline void int4_parts_row_tile(const RowParts& x, const Weights& w, int64_t in_features, int64_t out_features,
                                int64_t group_size, int64_t n0, float total[kCols]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1), upper_weight = _mm256_set1_epi16(256);
  row_tile_groups<kPartsRun>(w, x.sums.data(), in_features, out_features, group_size, n0, total,
                             [&](int64_t k, const uint8_t* const bytes[kCols], __m256 acc[kCols]) {
    const int8_t* parts = x.bytes.data() + 2 * k;
    const __m256i upper_even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(parts));
    const __m256i upper_odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(parts + 32));
    const __m256i lower_even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(parts + 64));
    const __m256i lower_odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(parts + 96));
    const __m256 units = _mm256_loadu_ps(x.units.data() + k / kLanes);
    for (int64_t j = 0; j < kCols; ++j) {
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes[j]));
      const __m256i even = _mm256_and_si256(both, nibble);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
      // int16 sums of four products each: at most 4 * 15 * 128, no saturation.
      const __m256i upper = _mm256_add_epi16(_mm256_maddubs_epi16(even, upper_even),
                                             _mm256_maddubs_epi16(odd, upper_odd));
      const __m256i lower = _mm256_add_epi16(_mm256_maddubs_epi16(even, lower_even),
                                             _mm256_maddubs_epi16(odd, lower_odd));
      const __m256i dots = _mm256_add_epi32(_mm256_madd_epi16(upper, upper_weight), _mm256_madd_epi16(lower, ones));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), units, acc[j]);
    }
  });
}

}  // namespace weight_only_avx2
#endif
