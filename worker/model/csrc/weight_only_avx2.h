// The AVX2 tile of one row of x against a row-major weight-only INT4 weight (linear.cpp says what
// the weight-only linears compute): the register tiles of several rows widen 8 nibbles at a time
// by a zero-extending load per nibble half, about six instructions per FMA, and a single row
// has only their four weight rows' FMA chains. Here a tile takes 8 weight rows (eight chains)
// and 32 features a step: one broadcast load of their 16 bytes, the low and high nibbles masked
// out once, and each 8 of them put in float lanes by one in-lane byte shuffle and a convert,
// about four instructions per FMA. Empty unless the compiler targets AVX2 and FMA.
#pragma once

#include "vector_math.h"

#include <algorithm>
#include <cstdint>

#ifdef HAVE_AVX2_FMA
namespace weight_only_avx2 {

constexpr int64_t kRun = 32;   // features a step: x is split per run (evens, then odds)
constexpr int64_t kCols = 8;   // weight rows per tile

// One tile: `total[j]` += finish(n, g, x_g . q[n]_g) for each group g of weight rows n = n0 + j
// (past the last row the tile repeats it, and the caller drops those outputs), `split_x` one row
// of x in the nibble-split order over runs of 32 (the low nibbles of a run's 16 bytes are its
// even features, the high ones its odd features), q [N, K/2].
template <typename Finish>
inline void int4_row_tile(const float* split_x, const uint8_t* q, int64_t in_features, int64_t out_features,
                          int64_t group_size, int64_t n0, float total[kCols], Finish& finish) {
  const int64_t row_bytes = in_features / 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  // Bytes 0-3 of the 16 to the low lane's four 32-bit words, 4-7 to the high lane's (the 16 bytes
  // are in both lanes), and bytes 8-15 likewise: 8 nibbles a shuffle, each zero-extended.
  const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                         4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i second = _mm256_add_epi8(first, _mm256_setr_epi8(8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0,
                                                                 8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0, 8, 0, 0, 0));
  int64_t n[kCols];
  for (int64_t j = 0; j < kCols; ++j) n[j] = std::min(n0 + j, out_features - 1);
  for (int64_t g = 0; g < in_features / group_size; ++g) {
    __m256 acc[kCols];
    for (int64_t j = 0; j < kCols; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kRun) {
      const float* x = split_x + k;
      for (int64_t j = 0; j < kCols; ++j) {
        const uint8_t* bytes = q + n[j] * row_bytes + k / 2;
        // The same bytes of the next tile's row: a tile's 8 rows lie end to end and the next
        // tile's after them, so the steps of this tile fetch all of the next one, ahead of the
        // hardware prefetchers, which 8 streams outrun.
        _mm_prefetch(reinterpret_cast<const char*>(bytes) + kCols * row_bytes, _MM_HINT_T0);
        const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
        const __m256i low = _mm256_and_si256(both, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_cvtepi32_ps(_mm256_shuffle_epi8(low, first)), acc[j]);
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), _mm256_cvtepi32_ps(_mm256_shuffle_epi8(low, second)),
                                 acc[j]);
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), _mm256_cvtepi32_ps(_mm256_shuffle_epi8(high, first)),
                                 acc[j]);
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), _mm256_cvtepi32_ps(_mm256_shuffle_epi8(high, second)),
                                 acc[j]);
      }
    }
    for (int64_t j = 0; j < kCols; ++j) total[j] += finish(n[j], g, horizontal_sum(acc[j]));
  }
}

}  // namespace weight_only_avx2
#endif
