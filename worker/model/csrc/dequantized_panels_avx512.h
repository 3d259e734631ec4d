// AVX-512 fills of the float32 panels that weight-only INT8 / INT4 calls of many rows run the
// packed-panel tiles over (quantized_through_panels in linear.cpp): kPanel weight rows, stored
// row-major, become the panel layout [K, kPanel] of their dequantized values. The transposition
// is done on the bytes, 64 features of 16 rows at a time (one 512-bit register a row, each
// 128-bit lane a 16 x 16 byte block transposed alongside the other three: 64 unpacks for 1,024
// weights), and each panel row is then one widening, one conversion and one scale: about 6
// instructions per 16 weights where the 8 x 8 float transposes of the AVX2 fill take about 25.
// The values are the dequant path's (int8: q * scale; int4: q * scale + zero, one fused
// multiply-add), bit for bit those of the AVX2 fill. Empty unless the compiler targets AVX-512 F
// and BW.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_DEQUANTIZED_PANELS 1

namespace dequantized_panels_avx512 {

constexpr int64_t kRows = 16;   // weight rows of a panel (kPanel)
constexpr int64_t kBlock = 64;  // features per transposed block: K must be a multiple

// r[j] holds row j's bytes, lane L bytes 16L..16L+15 of its block. On return lane L of r[i] holds
// byte 16L + i of rows 0..15, in row order.
inline void transpose_lanes(__m512i r[kRows]) {
  __m512i a[kRows];
  // Each round interleaves pairs of registers at twice the previous width; after four, element
  // i of every row sits in one register. The index arithmetic follows where each round puts it.
  for (int j = 0; j < 8; ++j) {  // 16-bit pairs: rows 2j, 2j+1; a[2j + h] has bytes 8h..8h+7
    a[2 * j] = _mm512_unpacklo_epi8(r[2 * j], r[2 * j + 1]);
    a[2 * j + 1] = _mm512_unpackhi_epi8(r[2 * j], r[2 * j + 1]);
  }
  for (int q = 0; q < 4; ++q)  // 32-bit quads: rows 4q..4q+3; r[4q + 2h + l] has bytes 8h + 4l..+3
    for (int h = 0; h < 2; ++h) {
      r[4 * q + 2 * h] = _mm512_unpacklo_epi16(a[4 * q + h], a[4 * q + 2 + h]);
      r[4 * q + 2 * h + 1] = _mm512_unpackhi_epi16(a[4 * q + h], a[4 * q + 2 + h]);
    }
  for (int t = 0; t < 2; ++t)  // 64-bit eights: rows 8t..8t+7; a[8t + 2c + m] has bytes 4c + 2m, +1
    for (int c = 0; c < 4; ++c) {
      a[8 * t + 2 * c] = _mm512_unpacklo_epi32(r[8 * t + c], r[8 * t + 4 + c]);
      a[8 * t + 2 * c + 1] = _mm512_unpackhi_epi32(r[8 * t + c], r[8 * t + 4 + c]);
    }
  for (int c = 0; c < 8; ++c) {  // all 16 rows: byte 2c from the low halves, 2c + 1 from the high
    r[2 * c] = _mm512_unpacklo_epi64(a[c], a[8 + c]);
    r[2 * c + 1] = _mm512_unpackhi_epi64(a[c], a[8 + c]);
  }
}

// Lane L of v (16 bytes) as 16 int32.
template <int L>
inline __m512i lane_as_int32(__m512i v, bool is_signed) {
  const __m128i bytes = _mm512_extracti32x4_epi32(v, L);
  return is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
}

// The panel of weight rows n0..n0 + n_count - 1 (the rest zero): int8 [N, K] weights `q` from
// row n0 on, per-row scales `s` from row n0 on -> panel [K, kRows] float32, 64-byte aligned.
inline void int8_panel(const int8_t* q, int64_t in_features, const float* s, int64_t n_count, float* panel) {
  const __mmask16 live = static_cast<__mmask16>((1u << n_count) - 1);
  const __m512 scale = _mm512_maskz_loadu_ps(live, s);
  for (int64_t k0 = 0; k0 < in_features; k0 += kBlock) {
    __m512i r[kRows];
    for (int64_t j = 0; j < kRows; ++j)
      r[j] = j < n_count ? _mm512_loadu_si512(q + j * in_features + k0) : _mm512_setzero_si512();
    transpose_lanes(r);
    float* rows = panel + k0 * kRows;
    for (int i = 0; i < 16; ++i) {
      // Lane L of r[i] is feature 16L + i.
      _mm512_store_ps(rows + (0 + i) * kRows, _mm512_mul_ps(_mm512_cvtepi32_ps(lane_as_int32<0>(r[i], true)), scale));
      _mm512_store_ps(rows + (16 + i) * kRows, _mm512_mul_ps(_mm512_cvtepi32_ps(lane_as_int32<1>(r[i], true)), scale));
      _mm512_store_ps(rows + (32 + i) * kRows, _mm512_mul_ps(_mm512_cvtepi32_ps(lane_as_int32<2>(r[i], true)), scale));
      _mm512_store_ps(rows + (48 + i) * kRows, _mm512_mul_ps(_mm512_cvtepi32_ps(lane_as_int32<3>(r[i], true)), scale));
    }
  }
}

// The same for int4 weights with per-group scales and zeros (the group size a multiple of 8):
// `rows` gives the panel's row j (< n_count): `bytes(j, k)` its 32 packed bytes from feature k (a
// multiple of 64; feature 2b in the low nibble of byte b, 2b + 1 in the high one), `scale(j, g)`
// and `zero(j, g)`. `table` holds 2 x num_groups x kRows floats, 64-byte aligned.
template <typename Rows>
inline void int4_panel(const Rows& rows, int64_t in_features, int64_t group_size, int64_t n_count, float* table,
                       float* panel) {
  const int64_t num_groups = in_features / group_size;
  // Each group's 16 scales (then zeros) side by side, the rows past n_count zero, so a padding
  // row dequantizes to 0 * 0 + 0.
  float* scales = table;
  float* zeros = table + num_groups * kRows;
  for (int64_t g = 0; g < num_groups; ++g)
    for (int64_t j = 0; j < kRows; ++j) {
      scales[g * kRows + j] = j < n_count ? rows.scale(j, g) : 0.f;
      zeros[g * kRows + j] = j < n_count ? rows.zero(j, g) : 0.f;
    }
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t k0 = 0; k0 < in_features; k0 += kBlock) {
    // Row j: lanes 0-1 the low nibbles of its 32 bytes (even features k0, k0 + 2, ...), lanes 2-3
    // the high ones (odd features).
    __m512i r[kRows];
    for (int64_t j = 0; j < kRows; ++j) {
      if (j >= n_count) {
        r[j] = _mm512_setzero_si512();
        continue;
      }
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.bytes(j, k0)));
      r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low_nibbles)),
                                _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles), 1);
    }
    transpose_lanes(r);
    float* rows = panel + k0 * kRows;
    const bool one_group = group_size % kBlock == 0;  // the block's 64 features share a group
    // Lane L of r[i] is feature k0 + 2i + (0, 32, 1, 33)[L].
    auto store = [&](int64_t feature, __m512i values) {
      const int64_t g = one_group ? k0 / group_size : (k0 + feature) / group_size;
      _mm512_store_ps(rows + feature * kRows, _mm512_fmadd_ps(_mm512_cvtepi32_ps(values), _mm512_load_ps(scales + g * kRows),
                                                             _mm512_load_ps(zeros + g * kRows)));
    };
    for (int i = 0; i < 16; ++i) {
      store(2 * i, lane_as_int32<0>(r[i], false));
      store(32 + 2 * i, lane_as_int32<1>(r[i], false));
      store(2 * i + 1, lane_as_int32<2>(r[i], false));
      store(33 + 2 * i, lane_as_int32<3>(r[i], false));
    }
  }
}

}  // namespace dequantized_panels_avx512
#endif
