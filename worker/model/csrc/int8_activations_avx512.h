// The AVX-512 VNNI tiles of the int8-activation kernels (linear_int8_activations.cpp says what
// they compute): two blocks of 32 per 512-bit register. Empty where the compiler does not target
// AVX-512 F, BW, VL and VNNI.
#pragma once

#include "int8_activations.h"
#include "output_tiles.h"
#include "vector_math.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace int8_activations {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_AVX512_VNNI 1
constexpr int64_t kSlot = 2 * kBlock;  // input features per 512-bit step: two blocks
constexpr int64_t kPrefetchTiles = 2;  // how far ahead (in tiles of kCols weight rows) rows are prefetched

// x [M, K] for the 512-bit tiles: per row, per group, ceil(G / 64) slots of 64 bytes, each two
// blocks (a group's odd last block padded with zeros) laid out as the weight's register holds
// them, with 16 lane scales per slot (the lanes of the int32 products each block's sums land in).
struct SlottedActivations {
  std::vector<uint8_t> bytes;  // int8 weights: xq + 128, in order; int4: xq, [evens b, evens b+1, odds b, odds b+1]
  std::vector<float> lane_scales;
  int64_t slots_per_group = 0, slots_per_row = 0;
};

SlottedActivations slot_activations(const QuantizedActivations& a, int64_t rows, int64_t in_features,
                                    int64_t group_size, bool int8_weights) {
  SlottedActivations s;
  s.slots_per_group = (group_size + kSlot - 1) / kSlot;
  s.slots_per_row = s.slots_per_group * (in_features / group_size);
  s.bytes.assign(rows * s.slots_per_row * kSlot, int8_weights ? 128 : 0);  // 128: xq 0
  s.lane_scales.assign(rows * s.slots_per_row * 16, 0.f);
  const int64_t blocks_per_group = group_size / kBlock;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < in_features / group_size; ++g)
      for (int64_t local = 0; local < blocks_per_group; ++local) {
        const int64_t b = g * blocks_per_group + local, half = local % 2;
        const int64_t slot = m * s.slots_per_row + g * s.slots_per_group + local / 2;
        const int8_t* q = a.q.data() + m * in_features + b * kBlock;
        uint8_t* out = s.bytes.data() + slot * kSlot;
        float* scales = s.lane_scales.data() + slot * 16;
        const float scale = a.scales[m * a.blocks_per_row + b];
        if (int8_weights) {
          for (int64_t l = 0; l < kBlock; ++l) out[half * kBlock + l] = static_cast<uint8_t>(q[l] + 128);
          for (int l = 0; l < 8; ++l) scales[half * 8 + l] = scale;
        } else {
          for (int64_t l = 0; l < kBlock / 2; ++l) {
            out[half * 16 + l] = static_cast<uint8_t>(q[2 * l]);
            out[32 + half * 16 + l] = static_cast<uint8_t>(q[2 * l + 1]);
          }
          for (int l = 0; l < 4; ++l) scales[half * 4 + l] = scales[8 + half * 4 + l] = scale;
        }
      }
  return s;
}

// R rows of x by C weight rows, every group of K: out (through `total`) before the int4 zero term.
// `ahead`: the weight rows of a tile this thread takes later, prefetched a slot at a time as
// these are read, so they stream in from memory during this tile's compute (or nullptr).
template <int64_t R, int64_t C, bool kInt8>
inline void tile_avx512(const SlottedActivations& a, const uint8_t* weights, int64_t weight_row_bytes,
                        const float* weight_scales, int64_t in_features, int64_t group_size, int64_t m0, int64_t n0,
                        const uint8_t* ahead, float total[kRows][kCols]) {
  const int64_t num_groups = in_features / group_size;
  __m512 sum[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) sum[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 acc[R][C];
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t local = 0; local < a.slots_per_group; ++local) {
      const int64_t k = g * group_size + local * kSlot;
      const bool whole = k + kSlot <= (g + 1) * group_size;
      const int64_t slot = g * a.slots_per_group + local;
      __m512i w[C], start[C];
      if (ahead != nullptr)
        for (int64_t j = 0; j < kCols; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + j * weight_row_bytes + (kInt8 ? k : k / 2)), _MM_HINT_T0);
      for (int64_t j = 0; j < C; ++j) {
        const uint8_t* row = weights + (n0 + j) * weight_row_bytes;
        if constexpr (kInt8) {
          w[j] = _mm512_maskz_loadu_epi8(whole ? ~__mmask64{0} : __mmask64{0xFFFFFFFF}, row + k);
          // -128 x the sums of 4 weights per lane: what xq + 128 adds.
          start[j] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                      _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), w[j]));
        } else {
          const __m256i packed = _mm256_maskz_loadu_epi8(whole ? ~__mmask32{0} : __mmask32{0xFFFF}, row + k / 2);
          const __m256i mask = _mm256_set1_epi8(0x0F);
          w[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, mask)),
                                    _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask), 1);
          start[j] = _mm512_setzero_si512();
        }
      }
      for (int64_t i = 0; i < R; ++i) {
        const int64_t at = (m0 + i) * a.slots_per_row + slot;
        const __m512i x = _mm512_loadu_si512(a.bytes.data() + at * kSlot);
        const __m512 scales = _mm512_loadu_ps(a.lane_scales.data() + at * 16);
        for (int64_t j = 0; j < C; ++j) {
          const __m512i products = kInt8 ? _mm512_dpbusd_epi32(start[j], x, w[j]) : _mm512_dpbusd_epi32(start[j], w[j], x);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(products), scales, acc[i][j]);
        }
      }
    }
    for (int64_t j = 0; j < C; ++j) {
      const __m512 scale = _mm512_set1_ps(weight_scales[(n0 + j) * num_groups + g]);
      for (int64_t i = 0; i < R; ++i) sum[i][j] = _mm512_fmadd_ps(acc[i][j], scale, sum[i][j]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) total[i][j] = _mm512_reduce_add_ps(sum[i][j]);
}

template <int64_t R, bool kInt8>
inline void tile_avx512_columns(const SlottedActivations& a, const uint8_t* weights, int64_t weight_row_bytes,
                                const float* weight_scales, int64_t in_features, int64_t group_size, int64_t m0,
                                int64_t n0, int64_t n_count, const uint8_t* ahead, float total[kRows][kCols]) {
  static_assert(kCols == 4, "one case per column count below");
  switch (n_count) {
    case 4: return tile_avx512<R, 4, kInt8>(a, weights, weight_row_bytes, weight_scales, in_features, group_size, m0, n0, ahead, total);
    case 3: return tile_avx512<R, 3, kInt8>(a, weights, weight_row_bytes, weight_scales, in_features, group_size, m0, n0, ahead, total);
    case 2: return tile_avx512<R, 2, kInt8>(a, weights, weight_row_bytes, weight_scales, in_features, group_size, m0, n0, ahead, total);
    default: return tile_avx512<R, 1, kInt8>(a, weights, weight_row_bytes, weight_scales, in_features, group_size, m0, n0, ahead, total);
  }
}

// `finish_zero(m, n)`: the int4 zero-point term (0 for int8).
template <bool kInt8, typename FinishZero>
void int8_activation_tiles_avx512(const QuantizedActivations& q, const uint8_t* weights, int64_t weight_row_bytes,
                                  const float* weight_scales, int64_t rows, int64_t in_features, int64_t out_features,
                                  int64_t group_size, float* out_ptr, FinishZero finish_zero) {
  const SlottedActivations a = slot_activations(q, rows, in_features, group_size, kInt8);
  for_each_output_tile<kRows, kCols>(rows, out_features, out_ptr, [&](int64_t column_tile, int64_t end, int64_t m0,
                                                                     int64_t m_count, int64_t n0, int64_t n_count,
                                                                     float total[kRows][kCols]) {
    // Prefetched once, by the first row tile: later ones find the rows in cache.
    const int64_t ahead_tile = column_tile + kPrefetchTiles;
    const uint8_t* ahead = m0 == 0 && ahead_tile + 1 < end ? weights + ahead_tile * kCols * weight_row_bytes : nullptr;
    static_assert(kRows == 3, "one case per row count below");
    if (m_count == 3)
      tile_avx512_columns<3, kInt8>(a, weights, weight_row_bytes, weight_scales, in_features, group_size, m0, n0,
                                    n_count, ahead, total);
    else if (m_count == 2)
      tile_avx512_columns<2, kInt8>(a, weights, weight_row_bytes, weight_scales, in_features, group_size, m0, n0,
                                    n_count, ahead, total);
    else
      tile_avx512_columns<1, kInt8>(a, weights, weight_row_bytes, weight_scales, in_features, group_size, m0, n0,
                                    n_count, ahead, total);
    for (int64_t i = 0; i < m_count; ++i)
      for (int64_t j = 0; j < n_count; ++j) total[i][j] += finish_zero(m0 + i, n0 + j);
  });
}
#endif

}  // namespace int8_activations
