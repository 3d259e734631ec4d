// The AVX2 tiles of the int8-activation linears (linear_int8_activations.cpp): the u8 x s8 block
// dot products (VNNI where built, maddubs + madd otherwise) of x's quantized blocks against the
// weights' tile panels (int8_activations.h), scaled per block in float32.
#pragma once

#include "int8_activations.h"
#include "vector_math.h"

#include <cstdint>

namespace int8_activations {

#ifdef HAVE_AVX2_FMA
// 8 int32 lanes, each the sum of 4 products of unsigned u and signed s bytes.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  // Pairs in int16 cannot saturate: |u| <= 127 against |s| <= 127, or u <= 15.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// sums[j] = the sum of acc[j]'s lanes for j < C: every tile reduces its C (<= kCols) accumulators
// together, in one order, so that one row's sums are the same in a tile of any row count.
template <int64_t C>
inline void sum_columns(const __m256 acc[C], float sums[kCols]) {
  static_assert(kCols == 4 && C <= kCols, "four accumulators a reduction");
  __m256 v[kCols];
  for (int64_t j = 0; j < kCols; ++j) v[j] = j < C ? acc[j] : _mm256_setzero_ps();
  _mm_storeu_ps(sums, sums_of_four(v[0], v[1], v[2], v[3]));
}

// One tile of R rows of x by C weight rows (column tile `tile`); per group, a float accumulator
// per (row, weight row).
template <int64_t R, int64_t C, bool kInt8, typename Finish>
inline void tile_avx2(const QuantizedActivations& a, const WeightPanels& panels, int64_t in_features,
                      int64_t group_size, int64_t m0, int64_t tile, float total[kRows][kCols], Finish& finish) {
  const int64_t next_tile_bytes = panels.tile_bytes();
  for (int64_t g = 0; g < in_features / group_size; ++g) {
    __m256 acc[R][C];
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t local = 0; local < group_size / kBlock; ++local) {
      const int64_t k = g * group_size + local * kBlock, b = k / kBlock;
      for (int64_t j = 0; j < C; ++j) {
        const BlockBytes block = block_bytes(panels, kInt8, tile, j, g, local);
        // The same bytes of the next tile, as int4_unit_row_avx2 asks for them, on the first
        // pass over this tile only (later passes of more rows find the next tile fetched).
        if (m0 == 0) _mm_prefetch(reinterpret_cast<const char*>(block.bytes + next_tile_bytes), _MM_HINT_T0);
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.bytes));
        __m256i w;
        if constexpr (kInt8)
          w = _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));
        else
          w = _mm256_and_si256(block.shift ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
        for (int64_t i = 0; i < R; ++i) {
          const int64_t at = (m0 + i) * in_features + k;
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + at));
          __m256i products;
          if constexpr (kInt8)
            products = dot_u8s8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.magnitude.data() + at)),
                                _mm256_sign_epi8(w, xq));
          else
            products = dot_u8s8(w, xq);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products),
                                      _mm256_set1_ps(a.scales[(m0 + i) * a.blocks_per_row + b]), acc[i][j]);
        }
      }
    }
    for (int64_t i = 0; i < R; ++i) {
      float sums[kCols];
      sum_columns<C>(acc[i], sums);
      for (int64_t j = 0; j < C; ++j) total[i][j] += finish(m0 + i, tile * kCols + j, g, sums[j]);
    }
  }
}

// A tile of one row of x by C weight rows (column tile `tile`) of INT4 weights whose groups are
// whole units (group_size a multiple of 128): unit u of a row is then features 128u.. (byte i
// holding 128u + i in its low nibble and 128u + 64 + i in its high one), so each unit's bytes are
// loaded once for its four blocks (tile_avx2 loads them once per nibble) and the loop steps by
// pointers. The same products in the same order as tile_avx2, so the same sums.
template <int64_t C, typename Finish>
inline void int4_unit_row_avx2(const QuantizedActivations& a, const WeightPanels& panels, int64_t in_features,
                               int64_t group_size, int64_t m0, int64_t tile, float total[kRows][kCols],
                               Finish& finish) {
  constexpr int64_t kUnitFeatures = 2 * kSlot;
  static_assert(kUnitFeatures == 4 * kBlock, "a unit is four blocks");
  const int64_t units_per_group = group_size / kUnitFeatures;
  const int8_t* xq = a.q.data() + m0 * in_features;
  const float* xs = a.scales.data() + m0 * a.blocks_per_row;
  const uint8_t* unit = panels.unit(tile, 0, 0);
  const int64_t next_tile_bytes = panels.tile_bytes();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  auto block_dot = [](__m256i w, const int8_t* x) {
    return _mm256_cvtepi32_ps(dot_u8s8(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
  };
  for (int64_t g = 0; g < in_features / group_size; ++g) {
    __m256 acc[C];
    for (int64_t j = 0; j < C; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units_per_group; ++u, unit += kCols * 64, xq += kUnitFeatures, xs += 4) {
      const __m256 s0 = _mm256_set1_ps(xs[0]), s1 = _mm256_set1_ps(xs[1]);
      const __m256 s2 = _mm256_set1_ps(xs[2]), s3 = _mm256_set1_ps(xs[3]);
      for (int64_t j = 0; j < C; ++j) {
        // The same line of the next tile (tiles lie end to end): its rows arrive as this tile's
        // steps go, ahead of the hardware prefetchers.
        _mm_prefetch(reinterpret_cast<const char*>(unit + j * 64 + next_tile_bytes), _MM_HINT_T0);
        const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + j * 64));
        const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + j * 64 + kBlock));
        acc[j] = _mm256_fmadd_ps(block_dot(_mm256_and_si256(first, nibble), xq), s0, acc[j]);
        acc[j] = _mm256_fmadd_ps(block_dot(_mm256_and_si256(second, nibble), xq + kBlock), s1, acc[j]);
        acc[j] = _mm256_fmadd_ps(block_dot(_mm256_and_si256(_mm256_srli_epi16(first, 4), nibble), xq + 2 * kBlock),
                                 s2, acc[j]);
        acc[j] = _mm256_fmadd_ps(block_dot(_mm256_and_si256(_mm256_srli_epi16(second, 4), nibble), xq + 3 * kBlock),
                                 s3, acc[j]);
      }
    }
    float sums[kCols];
    sum_columns<C>(acc, sums);
    for (int64_t j = 0; j < C; ++j) total[0][j] += finish(m0, tile * kCols + j, g, sums[j]);
  }
}

template <int64_t R, bool kInt8, typename Finish>
inline void tile_columns(const QuantizedActivations& a, const WeightPanels& panels, int64_t in_features,
                         int64_t group_size, int64_t m0, int64_t tile, int64_t n_count, float total[kRows][kCols],
                         Finish& finish) {
  static_assert(kCols == 4, "one case per column count below");
  if constexpr (R == 1 && !kInt8) {
    if (group_size % (2 * kSlot) == 0) {
      switch (n_count) {
        case 4: return int4_unit_row_avx2<4>(a, panels, in_features, group_size, m0, tile, total, finish);
        case 3: return int4_unit_row_avx2<3>(a, panels, in_features, group_size, m0, tile, total, finish);
        case 2: return int4_unit_row_avx2<2>(a, panels, in_features, group_size, m0, tile, total, finish);
        default: return int4_unit_row_avx2<1>(a, panels, in_features, group_size, m0, tile, total, finish);
      }
    }
  }
  switch (n_count) {
    case 4: return tile_avx2<R, 4, kInt8>(a, panels, in_features, group_size, m0, tile, total, finish);
    case 3: return tile_avx2<R, 3, kInt8>(a, panels, in_features, group_size, m0, tile, total, finish);
    case 2: return tile_avx2<R, 2, kInt8>(a, panels, in_features, group_size, m0, tile, total, finish);
    default: return tile_avx2<R, 1, kInt8>(a, panels, in_features, group_size, m0, tile, total, finish);
  }
}
#endif

}  // namespace int8_activations
