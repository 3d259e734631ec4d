// The AVX-512 register tiles of the weight-only INT8 / INT4 small-batch linears (linear.cpp says
// what they compute): 16 input features per 512-bit register, up to kRows rows of x by kCols
// weight rows per tile, each weight widened to float32 once per tile and the arithmetic float32
// FMAs as in the AVX2 tiles. Widening 16 weights into one register takes as many instructions as
// 8 into a 256-bit one, and the 32 registers hold 8 weight rows' accumulators for 3 rows of x,
// enough independent FMA chains for a single row. Empty unless the compiler targets AVX-512 F,
// BW, DQ and VL.
#pragma once

#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512_WEIGHT_ONLY 1

namespace weight_only_avx512 {

constexpr int64_t kLanes = 16;  // float32 per register
constexpr int64_t kRows = 3;    // rows of x per tile
constexpr int64_t kCols = 8;    // weight rows per tile
constexpr int64_t kStep = 2 * kLanes;  // features per step: K and the groups are whole steps

// Each tile reads 8 weight rows as 8 streams, more than the hardware prefetchers keep ahead of
// (measured: INT4 weights streamed from memory at 16 GB/s without this, 25 with it), so each
// step asks for the line kPrefetchBytes further along its row; past a row's end that is the
// next row, which a later tile reads.
constexpr int64_t kPrefetchBytes = 256;
inline void prefetch_ahead(const void* weights) {
  _mm_prefetch(static_cast<const char*>(weights) + kPrefetchBytes, _MM_HINT_T0);
}

// 16 int8 weights -> 16 floats.
inline __m512 widen_int8(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// The nibble-split order of INT4 weights for 16 lanes: 16 bytes hold 32 features, and lane i of
// the low half (k % 32 == 0) is feature 2i (the low nibble of byte i), lane i of the high half
// (k % 32 == 16) feature 2i + 1; x is put in the same order (split_features<kSplitRun>).
constexpr int64_t kSplitRun = 2 * kLanes;
inline __m512 widen_int4_split(const uint8_t* run, int64_t k) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run)));
  return _mm512_cvtepi32_ps(k % kSplitRun ? _mm512_srli_epi32(bytes, 4)
                                          : _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
}

// sums[j] = the sum of acc[j]'s 16 lanes, for the 8 accumulators of one row of a tile: halving
// all 8 together takes about 3 instructions per accumulator where one reduction each takes 8.
inline void sum_each(const __m512 acc[kCols], float sums[kCols]) {
  __m256 half[kCols];
  for (int j = 0; j < kCols; ++j)
    half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
  // hadd pairs neighbours within each 128-bit lane: after two rounds lane l of quarter[h] holds
  // a partial sum of accumulator 4h + l (its low 128 bits) and another (its high 128 bits).
  const __m256 h01 = _mm256_hadd_ps(half[0], half[1]), h23 = _mm256_hadd_ps(half[2], half[3]);
  const __m256 h45 = _mm256_hadd_ps(half[4], half[5]), h67 = _mm256_hadd_ps(half[6], half[7]);
  const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
  const __m256 low = _mm256_permute2f128_ps(q0, q1, 0x20), high = _mm256_permute2f128_ps(q0, q1, 0x31);
  _mm256_storeu_ps(sums, _mm256_add_ps(low, high));
}

// A tile of kR (<= kRows) rows of x from m0 by kCols weight rows from n0 (`row(j)` the weight
// row its column j reads: past the last row the caller repeats it, and drops those outputs):
// total[i][j] = finish(row(j), x . w) over all of K. `load(n, k, g)` widens the 16 weights of
// row n from feature k, in group g of group_size features (dequantized as far as the caller
// wants: a per-row scale can wait for finish, a per-group one cannot).
template <int64_t kR, typename Row, typename Load, typename Finish>
inline void tile(const float* x, int64_t in_features, int64_t group_size, int64_t m0, Row& row,
                 float total[kRows][kCols], Load& load, Finish& finish) {
  int64_t rows_of[kCols];
  for (int64_t j = 0; j < kCols; ++j) rows_of[j] = row(j);
  __m512 acc[kR][kCols];
  for (int64_t i = 0; i < kR; ++i)
    for (int64_t j = 0; j < kCols; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < in_features / group_size; ++g)
    // Two registers of features a step: an INT4 run's low and high nibbles come from one load
    // of its bytes, with one broadcast of the group's scale and zero. x is read from L1 by the
    // FMAs themselves, leaving the registers to the accumulators.
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kStep)
      for (int64_t j = 0; j < kCols; ++j) {
        const __m512 w0 = load(rows_of[j], k, g), w1 = load(rows_of[j], k + kLanes, g);
        for (int64_t i = 0; i < kR; ++i) {
          const float* xr = x + (m0 + i) * in_features + k;
          acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + kLanes), w1,
                                      _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[i][j]));
        }
      }
  for (int64_t i = 0; i < kR; ++i) {
    float sums[kCols];
    sum_each(acc[i], sums);
    for (int64_t j = 0; j < kCols; ++j) total[i][j] = finish(rows_of[j], sums[j]);
  }
}

// One row of x (in the nibble-split order) by kCols INT4 weight rows (`rows[j]`: row j's
// packed bytes, `scales[j]`: its group scales): sums[j] = sum over groups g of scales[j][g] *
// x_g . q_g. A single row shares no widened weight with another row, so each group's x_g . q_g
// accumulates on the raw nibbles and one FMA per group and row scales it, where dequantizing
// every weight first takes an FMA per 16 weights, as many as the products. The pointers are
// plain arguments, and each row's low and high nibbles accumulate apart, so that the loop holds
// every pointer in a register and no FMA waits on the one before; one prefetch per 64-byte line
// of a row (a step reads 16 bytes) leaves the load ports to the weights.
inline void int4_row_tile(const float* x, const uint8_t* const rows[kCols], const float* const scales[kCols],
                          int64_t in_features, int64_t group_size, float sums[kCols]) {
  const __m512i low_nibble = _mm512_set1_epi32(0x0F);
  __m512 sum[kCols];
  for (int64_t j = 0; j < kCols; ++j) sum[j] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < in_features; g0 += group_size) {
    __m512 low[kCols], high[kCols];
    for (int64_t j = 0; j < kCols; ++j) low[j] = high[j] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group_size; k += kStep) {
      const __m512 x_low = _mm512_loadu_ps(x + k), x_high = _mm512_loadu_ps(x + k + kLanes);
      const int64_t at = k / 2;
      const bool line_start = at % 64 == 0;
      for (int64_t j = 0; j < kCols; ++j) {
        if (line_start) prefetch_ahead(rows[j] + at);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + at)));
        low[j] = _mm512_fmadd_ps(x_low, _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble)), low[j]);
        high[j] = _mm512_fmadd_ps(x_high, _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), high[j]);
      }
    }
    const int64_t g = g0 / group_size;
    for (int64_t j = 0; j < kCols; ++j)
      sum[j] = _mm512_fmadd_ps(_mm512_add_ps(low[j], high[j]), _mm512_set1_ps(scales[j][g]), sum[j]);
  }
  sum_each(sum, sums);
}

// One row of x by kCols INT8 weight rows (`rows[j]`: row j's weights): sums[j] = x . q_j, laid
// out as int4_row_tile for the same reasons.
inline void int8_row_tile(const float* x, const int8_t* const rows[kCols], int64_t in_features, float sums[kCols]) {
  __m512 low[kCols], high[kCols];
  for (int64_t j = 0; j < kCols; ++j) low[j] = high[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in_features; k += kStep) {
    const __m512 x_low = _mm512_loadu_ps(x + k), x_high = _mm512_loadu_ps(x + k + kLanes);
    const bool line_start = k % 64 == 0;
    for (int64_t j = 0; j < kCols; ++j) {
      if (line_start) prefetch_ahead(rows[j] + k);
      low[j] = _mm512_fmadd_ps(x_low, widen_int8(rows[j] + k), low[j]);
      high[j] = _mm512_fmadd_ps(x_high, widen_int8(rows[j] + k + kLanes), high[j]);
    }
  }
  for (int64_t j = 0; j < kCols; ++j) low[j] = _mm512_add_ps(low[j], high[j]);
  sum_each(low, sums);
}

}  // namespace weight_only_avx512
#endif
