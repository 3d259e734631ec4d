// Vector helpers shared by our CPU kernels: AVX2 + FMA where the compiler targets it
// (HAVE_AVX2_FMA; the kernels keep a portable path without it), and the element types a KV
// pool may hold (float32, float16, bfloat16: kv_cache_dtype), widened to float32 as they are read.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_FMA 1
#endif

constexpr int64_t kLanes = 8;  // one AVX2 register of float32

// Below about this many float operations a loop runs on the calling thread: waking the other
// threads costs microseconds, and every parallel region is a point where all of them wait for
// the slowest (one descheduled by a neighbour process stalls the step).
constexpr int64_t kMinParallelWork = 32768;

// The output of one group of an INT4 row, scale * dot + zero * x_sum, as one explicit fma where
// the build has the instruction: a tile's finish is inlined into each tile shape (one row or
// several, row-major or held weights), and left to itself the compiler contracts the sum into
// an fma in some of them and not others, so the same row would round differently.
inline float group_output(float scale, float dot, float zero, float x_sum) {
#ifdef HAVE_AVX2_FMA
  return std::fma(scale, dot, zero * x_sum);
#else
  return scale * dot + zero * x_sum;
#endif
}

// at::parallel_for's grain (iterations per chunk) for iterations of `work_per_item` operations.
inline int64_t grain_for(int64_t work_per_item) {
  return work_per_item <= 0 ? 1 : (kMinParallelWork + work_per_item - 1) / work_per_item;
}

// b may be a KV pool's row, of any of its element types.
template <typename B>
inline float dot(const float* a, const B* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * static_cast<float>(b[i]);
  return acc;
}

// Runs body(KV{}) with KV the element type of both pools (float, c10::Half or c10::BFloat16), so
// a kernel is compiled once per type and its loops hold no per-element choice; refuses others.
inline void check_kv_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* kernel) {
  const at::ScalarType type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == type && (type == at::kFloat || type == at::kHalf || type == at::kBFloat16),
              kernel, ": the K and V pools must both be float32, float16 or bfloat16; got ", k_cache.scalar_type(),
              " and ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), kernel, ": the K and V pools must be contiguous");
}

template <typename Body>
inline void with_kv_type(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* kernel, Body&& body) {
  check_kv_pools(k_cache, v_cache, kernel);
  const at::ScalarType type = k_cache.scalar_type();
  if (type == at::kHalf) {
    body(c10::Half{});
  } else if (type == at::kBFloat16) {
    body(c10::BFloat16{});
  } else {
    body(float{});
  }
}

// dst[0 .. n) = src in a pool's element type, rounded to nearest even (c10's conversions and
// F16C's both round so, as torch's .to() does).
template <typename KV>
inline void store_row(KV* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<KV, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
#if defined(HAVE_AVX2_FMA) && defined(__F16C__)
    if constexpr (std::is_same_v<KV, c10::Half>) {
      for (; i + kLanes <= n; i += kLanes)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; i < n; ++i) dst[i] = KV(src[i]);
  }
}

#ifdef HAVE_AVX2_FMA
// Eight consecutive elements of a KV pool's row, widened to float32 in registers.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  // bfloat16 is the upper half of a float32: widening is a shift of its bits.
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load8(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(lanes);
#endif
}

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// 8 bfloat16 (the upper halves of float32s) -> 8 float32, exactly.
inline __m256 widen_bf16(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Lane i of the result = the sum of all lanes of v[i]: eight dot products finished at once.
inline __m256 sums_of_eight(const __m256 v[8]) {
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | the same for the upper halves], so two rounds
  // leave each vector's lower-half sum in the low 128 bits and its upper-half sum in the high.
  const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20), _mm256_permute2f128_ps(first, second, 0x31));
}

// Lane i of the result = the sum of all lanes of v[i], for four vectors (sums_of_eight's order).
inline __m128 sums_of_four(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 quarters = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(quarters), _mm256_extractf128_ps(quarters, 1));
}

// r[i] = column i of the 8 x 8 block whose rows r held on entry.
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    s[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// e^x, lane by lane, to about 2 ulp (x clamped to [-87, 88], so the result is finite and normal):
// e^x = 2^n * e^r with n = round(x / ln 2) and |r| <= ln2 / 2, e^r by a degree-7 polynomial
// (the Taylor coefficients, slightly adjusted to minimise the error over that range).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln 2 split in two so n * ln2_high is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n built from its exponent bits: (n + 127) << 23.
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// Softmax of s[0 .. len) in place, each value divided by the sum (so P V needs no final scaling).
inline void softmax_in_place(float* s, int64_t len) {
  __m256 max_v = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) max_v = _mm256_max_ps(max_v, _mm256_loadu_ps(s + t));
  float max_score = horizontal_max(max_v);
  for (; t < len; ++t) max_score = std::max(max_score, s[t]);
  const __m256 max_b = _mm256_set1_ps(max_score);
  __m256 total_v = _mm256_setzero_ps();
  for (t = 0; t + kLanes <= len; t += kLanes) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), max_b));
    _mm256_storeu_ps(s + t, e);
    total_v = _mm256_add_ps(total_v, e);
  }
  float total = horizontal_sum(total_v);
  for (; t < len; ++t) total += (s[t] = std::exp(s[t] - max_score));
  const float inverse = 1.f / total;
  const __m256 inverse_v = _mm256_set1_ps(inverse);
  for (t = 0; t + kLanes <= len; t += kLanes) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inverse_v));
  for (; t < len; ++t) s[t] *= inverse;
}
#endif
