// Linear kernels: the packed-panel float32 linear of every float projection on the CPU fast
// path, and the weight-only INT8 / INT4 small-batch linears that widen their weights in registers.
#include "dequantized_panels_avx512.h"
#include "int4_weight_layouts.h"
#include "kernels.h"
#include "output_tiles.h"
#include "packed_panels.h"
#include "vector_math.h"
#include "weight_only_avx2.h"
#include "weight_only_avx512.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {
constexpr int64_t kTileM = 3;  // rows of x per quantized register tile
constexpr int64_t kTileN = 4;  // rows of W per quantized register tile
// Above these many rows a weight-only quantized call widens each weight once, into float32
// panels, rather than once per register tile (quantized_through_panels). The AVX-512 tiles
// widen at half the instructions per weight, so they win up to more rows; INT4's widening
// costs more than INT8's, and the AVX-512 panels' 12-row tiles make the panel route cheaper, so
// INT4 crosses over at fewer rows (docs/benchmarks.md has the measured crossovers).
#ifdef HAVE_AVX512_WEIGHT_ONLY
constexpr int64_t kInt8WidenFromRows = 16;
constexpr int64_t kInt4WidenFromRows = 12;
#else
constexpr int64_t kInt8WidenFromRows = 18;
constexpr int64_t kInt4WidenFromRows = 15;
#endif
// Filled by transposing bytes (dequantized_panels_avx512.h), a panel costs a small share of the
// FMAs of a few rows over it, so the panel route wins from far fewer rows. INT4's register
// tiles of several rows (int4_rows_tile) widen each nibble once for all of them and scale once
// a group, so they hold out longer where groups are long.
constexpr int64_t kInt8ByteFillFromRows = 5;
inline int64_t int4_byte_fill_from_rows(int64_t group_size) {
#ifdef HAVE_AVX512_WEIGHT_ONLY
  if (group_size % weight_only_avx512::kSplitRun == 0) return group_size % 128 == 0 ? 10 : 6;
#endif
  (void)group_size;
  return 3;  // the dequantizing tiles of the other groups
}

// Whether the AVX-512 byte-transposing fill takes weights of this many input features.
inline bool fills_by_bytes(int64_t in_features) {
#ifdef HAVE_AVX512_DEQUANTIZED_PANELS
  return in_features % dequantized_panels_avx512::kBlock == 0;
#else
  (void)in_features;
  return false;
#endif
}
}  // namespace

// x [M, K] float32, packed [P, K, kPanel] float32, bfloat16 or float16 (pack_panels in
// worker/model/layers.py) -> out [M, N] float32.
void linear_packed(at::Tensor x, at::Tensor packed, at::Tensor out) {
  TORCH_CHECK(x.dtype() == at::kFloat, "x: float32");
  TORCH_CHECK(is_float_weight(packed), "packed: float32, bfloat16 or float16 panels");
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
              packed.is_contiguous(), "packed must be a contiguous [P, K, 16] tensor matching x [M, K]");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = out.size(1);
  TORCH_CHECK(out.is_contiguous() && out.dtype() == at::kFloat && out.size(0) == rows &&
              (out_features + kPanel - 1) / kPanel == packed.size(0),
              "out must be a contiguous float32 [M, N] tensor with ceil(N / 16) panels");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0, "packed must be 32-byte aligned");
  if (packed.dtype() == at::kFloat)
    linear_panels(x.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), rows, in_features,
                  out_features, packed.size(0));
  else if (packed.dtype() == at::kBFloat16)
    linear_panels(x.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), out.data_ptr<float>(), rows, in_features,
                  out_features, packed.size(0));
  else
    linear_panels(x.data_ptr<float>(), packed.data_ptr<at::Half>(), out.data_ptr<float>(), rows, in_features,
                  out_features, packed.size(0));
}

// Weight-only quantized small-batch linear: register tiles of kTileM rows of x by kTileN weight
// rows (dot-product form, the weight in its plain [N, K] layout), with the weight read as int8
// (one byte) or packed int4 (half a byte) and widened to float in registers, so a
// decode step reads 4x or 8x fewer weight bytes than float32. Per output row n:
//   int8: y = scale[n] * (x . q[n])
//   int4: y = sum over groups g of scale[n, g] * (x_g . q[n]_g) + zero[n, g] * sum(x_g)
// `load_weights(n, k, w)` widens 8 weights of row n from column k into w.
// One kTileM x kTileN tile of the output. kFull: a whole tile, so every loop bound is a
// compile-time constant and the accumulators stay in registers; else the ragged edge.
#ifdef HAVE_AVX2_FMA
// A tile of kRows (<= kTileM) x rows by kTileN weight rows with the accumulators in AVX2
// registers: at most 12 accumulators, the widened weight and one input vector (14 of 16 ymm).
template <int64_t kRows, typename LoadVector, typename Finish>
inline void quantized_tile_avx2(const float* x_ptr, int64_t in_features, int64_t group_size, int64_t m0, int64_t n0,
                                float total[kTileM][kTileN], LoadVector& load_vector, Finish& finish) {
  for (int64_t g = 0; g < in_features / group_size; ++g) {
    __m256 acc[kRows][kTileN];
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t j = 0; j < kTileN; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kLanes)
      for (int64_t j = 0; j < kTileN; ++j) {
        const __m256 w = load_vector(n0 + j, k, g);
        for (int64_t i = 0; i < kRows; ++i)
          acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x_ptr + (m0 + i) * in_features + k), w, acc[i][j]);
      }
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t j = 0; j < kTileN; ++j) total[i][j] += finish(m0 + i, n0 + j, g, horizontal_sum(acc[i][j]));
  }
}

inline __m256 widen_int8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// 4 bytes -> 8 floats: low nibble then high nibble of each byte.
inline __m256 widen_int4(const uint8_t* bytes) {
  int32_t word;
  std::memcpy(&word, bytes, sizeof(word));
  const __m128i doubled = _mm_shuffle_epi8(_mm_cvtsi32_si128(word),
                                           _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i shifted = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(doubled), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  return _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(0x0F)));
}

// The nibble-split order of INT4 weights: 8 bytes hold 16 features, and lane i of the low half
// (k % 16 == 0) is feature 2i (the low nibble of byte i), lane i of the high half (k % 16 == 8)
// feature 2i + 1. Widening so takes a zero-extending load and one mask or shift, where putting
// the nibbles back in feature order (widen_int4) takes a shuffle and a variable shift as well;
// x is put in the same order instead (split_features), once per call.
inline __m256 widen_int4_split(const uint8_t* chunk, int64_t k) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk)));
  return _mm256_cvtepi32_ps(k % 16 ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)));
}

#endif

// Where the nibble-split order over runs of kRun features (widen_int4_split: 16; the AVX-512
// tiles: 32) puts lane i of the vector for features k.. (k a multiple of kRun / 2).
template <int64_t kRun>
inline int64_t split_feature(int64_t k, int64_t i) { return (k & ~(kRun - 1)) + 2 * i + (k % kRun ? 1 : 0); }

// x [rows, K] with each run of kRun features in the nibble-split order: evens, then odds.
template <int64_t kRun>
inline std::vector<float> split_features(const float* x, int64_t rows, int64_t in_features) {
  std::vector<float> split(rows * in_features);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in_features; k += kRun / 2)
      for (int64_t i = 0; i < kRun / 2; ++i)
        split[m * in_features + k + i] = x[m * in_features + split_feature<kRun>(k, i)];
  return split;
}

template <bool kFull, typename LoadWeights, typename Finish>
inline void quantized_tile(const float* x_ptr, int64_t in_features, int64_t group_size, int64_t m0, int64_t m_count,
                           int64_t n0, int64_t n_count, float total[kTileM][kTileN], LoadWeights& load_weights,
                           Finish& finish) {
  const int64_t tm = kFull ? kTileM : m_count, tn = kFull ? kTileN : n_count;
  for (int64_t g = 0; g < in_features / group_size; ++g) {
    float acc[kTileM][kTileN][kLanes] = {};
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kLanes) {
      // One widened weight row at a time, used by every x row while it sits in a register:
      // 12 accumulators + 1 weight + 1 input register fit AVX2's 16 without spilling.
      for (int64_t j = 0; j < tn; ++j) {
        float w[kLanes];
        load_weights(n0 + j, k, w);
        for (int64_t i = 0; i < tm; ++i) {
          const float* xr = x_ptr + (m0 + i) * in_features + k;
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) acc[i][j][l] += xr[l] * w[l];
        }
      }
    }
    for (int64_t i = 0; i < tm; ++i)
      for (int64_t j = 0; j < tn; ++j) {
        float sum = 0.f;
        for (int64_t l = 0; l < kLanes; ++l) sum += acc[i][j][l];
        total[i][j] += finish(m0 + i, n0 + j, g, sum);
      }
  }
}

#ifdef HAVE_AVX2_FMA
// A call of more than kInt8WidenFromRows / kInt4WidenFromRows rows: the register tiles above
// would widen every weight once per 3 rows of x, and on AVX2 that widening, not the FMAs, bounds
// them. Instead each run of kPanel weight rows is dequantized once into a float32 panel (the
// packed-panel layout, L2-resident, one per thread) and the float32 panel tiles pass every row
// of x over it. `fill(n0, n_count, panel, table)` writes the panel of weight rows n0.. (n_count
// of them, the rest zero) with the values of the dequant path's float weight; `table` is
// `table_floats` 64-byte aligned floats of scratch.
template <typename FillPanel>
void quantized_through_panels(const float* x_ptr, int64_t rows, int64_t in_features, int64_t out_features,
                              float* out_ptr, int64_t table_floats, FillPanel fill) {
  const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, grain_for(2 * rows * in_features * kPanel), [&](int64_t begin, int64_t end) {
    std::vector<float> storage, table_storage;
    float* panels = aligned_floats(storage, kPanelPair * in_features * kPanel);
    float* table = aligned_floats(table_storage, table_floats);
    for (int64_t p = begin; p < end;) {
      const PanelRun run = panel_run(p, end, out_features, kPanelPair);
      for (int64_t slot = 0; slot < run.count; ++slot) {  // panel p + slot dequantized into its place
        const int64_t n0 = (p + slot) * kPanel;
        fill(n0, std::min(kPanel, out_features - n0), panels + slot * in_features * kPanel, table);
      }
      run_over_rows<float>(run, x_ptr, rows, in_features, panels, out_ptr + p * kPanel, out_features, false, nullptr);
      p += run.count;
    }
  });
}

// The AVX2 panel fill: `dequantize(n, k, g)` gives the dequantized weights k..k+7 of row n (group
// g), eight rows of which an 8 x 8 transpose turns into panel order.
template <typename Dequantize>
auto fill_by_transposes(int64_t in_features, int64_t group_size, Dequantize dequantize) {
  return [=](int64_t n0, int64_t n_count, float* panel, float*) {
    for (int64_t half = 0; half < kPanel; half += kLanes)
      for (int64_t k = 0; k < in_features; k += kLanes) {
        const int64_t g = k / group_size;
        __m256 r[kLanes];
        for (int64_t j = 0; j < kLanes; ++j)
          r[j] = half + j < n_count ? dequantize(n0 + half + j, k, g) : _mm256_setzero_ps();
        transpose8x8(r);
        for (int64_t i = 0; i < kLanes; ++i) _mm256_store_ps(panel + (k + i) * kPanel + half, r[i]);
      }
  };
}
#endif

template <typename LoadWeights, typename LoadVector, typename Finish>
void quantized_tiles(const float* x_ptr, int64_t rows, int64_t in_features, int64_t out_features,
                     int64_t group_size, float* out_ptr, LoadWeights load_weights, LoadVector load_vector,
                     Finish finish) {
  for_each_output_tile<kTileM, kTileN>(rows, out_features, out_ptr, [&](int64_t, int64_t, int64_t m0, int64_t m_count,
                                                                     int64_t n0, int64_t n_count,
                                                                     float total[kTileM][kTileN]) {
#ifdef HAVE_AVX2_FMA
    if (n_count == kTileN) {
      static_assert(kTileM == 3, "one case per row count below");
      if (m_count == 3)
        quantized_tile_avx2<3>(x_ptr, in_features, group_size, m0, n0, total, load_vector, finish);
      else if (m_count == 2)
        quantized_tile_avx2<2>(x_ptr, in_features, group_size, m0, n0, total, load_vector, finish);
      else
        quantized_tile_avx2<1>(x_ptr, in_features, group_size, m0, n0, total, load_vector, finish);
      return;
    }
#else
    if (m_count == kTileM && n_count == kTileN)
      return quantized_tile<true>(x_ptr, in_features, group_size, m0, m_count, n0, n_count, total, load_weights,
                                  finish);
#endif
    quantized_tile<false>(x_ptr, in_features, group_size, m0, m_count, n0, n_count, total, load_weights, finish);
  });
}

#ifdef HAVE_AVX512_WEIGHT_ONLY
// The register tiles of weight_only_avx512.h over the whole output; `load(n, k, g)` widens 16
// weights of row n from feature k (group g), `finish(n, dot)` gives output n from x . those weights.
// `single_row(m0, row, total)`, where given, computes the tiles of one row of x instead.
template <typename Load, typename Finish, typename SingleRow = std::nullptr_t>
void quantized_tiles_avx512(const float* x_ptr, int64_t rows, int64_t in_features, int64_t out_features,
                            int64_t group_size, float* out_ptr, Load load, Finish finish,
                            SingleRow single_row = nullptr) {
  namespace wide = weight_only_avx512;
  for_each_output_tile<wide::kRows, wide::kCols>(
      rows, out_features, out_ptr,
      [&](int64_t, int64_t, int64_t m0, int64_t m_count, int64_t n0, int64_t, float total[wide::kRows][wide::kCols]) {
        auto row = [&](int64_t j) { return std::min(n0 + j, out_features - 1); };
        static_assert(wide::kRows == 3, "one case per row count below");
        if (m_count == 3)
          wide::tile<3>(x_ptr, in_features, group_size, m0, row, total, load, finish);
        else if (m_count == 2)
          wide::tile<2>(x_ptr, in_features, group_size, m0, row, total, load, finish);
        else if constexpr (!std::is_same_v<SingleRow, std::nullptr_t>)
          single_row(m0, row, total);
        else
          wide::tile<1>(x_ptr, in_features, group_size, m0, row, total, load, finish);
      });
}
#endif

void check_quantized_args(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& out,
                          int64_t out_features) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) % kLanes == 0, "in_features must be a multiple of 8");
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous(), "scales: contiguous float32");
  TORCH_CHECK(out.is_contiguous() && out.dtype() == at::kFloat && out.size(0) == x.size(0) &&
              out.size(1) == out_features, "out must be a contiguous float32 [M, N] tensor");
}

int64_t int8_weight_panel_group() { return kPanelPair; }

// x [M, K] float32, qweight [N, K] int8, [ceil(N / 16), K, 16] int8 panels or those panels in
// groups of int8_weight_panel_group() ([G, K, group, 16], pack_panels in worker/model/layers.py),
// scales [N] float32 -> out [M, N]. Panels run the float32 panel tiles, each weight widened in
// registers and each output scaled once at the end, at every row count: the same arithmetic as
// a float32 weight, from a quarter of its bytes.
void linear_small_batch_int8(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor out) {
  if (qweight.dim() == 3 || qweight.dim() == 4) {
    const int64_t group = qweight.dim() == 4 ? qweight.size(2) : 1;
    TORCH_CHECK(qweight.dtype() == at::kChar && qweight.is_contiguous() && qweight.size(1) == x.size(1) &&
                qweight.size(-1) == kPanel && (group == 1 || group == 2),
                "qweight panels: contiguous int8 [P, K, 16] or [G, K, 2, 16]");
    const int64_t out_features = out.size(1), num_panels = (out_features + kPanel - 1) / kPanel;
    check_quantized_args(x, scales, out, out_features);
    TORCH_CHECK((num_panels + group - 1) / group == qweight.size(0) && scales.numel() == out_features,
                "panels and scales must match out");
    const float* x_ptr = x.data_ptr<float>();
    const int8_t* q_ptr = qweight.data_ptr<int8_t>();
    if (group == 2)
      return linear_panels<int8_t, 2>(x_ptr, q_ptr, out.data_ptr<float>(), x.size(0), x.size(1), out_features,
                                      num_panels, scales.data_ptr<float>());
    return linear_panels(x_ptr, q_ptr, out.data_ptr<float>(), x.size(0), x.size(1), out_features, num_panels,
                         scales.data_ptr<float>());
  }
  TORCH_CHECK(qweight.dtype() == at::kChar && qweight.is_contiguous() && qweight.size(1) == x.size(1),
              "qweight: contiguous int8 [N, K]");
  const int64_t in_features = x.size(1), out_features = qweight.size(0);
  check_quantized_args(x, scales, out, out_features);
  const int8_t* q = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
#ifdef HAVE_AVX2_FMA
  if (x.size(0) > (fills_by_bytes(in_features) ? kInt8ByteFillFromRows : kInt8WidenFromRows)) {
#ifdef HAVE_AVX512_DEQUANTIZED_PANELS
    static_assert(dequantized_panels_avx512::kRows == kPanel, "a fill is one panel");
    if (fills_by_bytes(in_features))
      return quantized_through_panels(x.data_ptr<float>(), x.size(0), in_features, out_features, out.data_ptr<float>(),
                                      0, [&](int64_t n0, int64_t n_count, float* panel, float*) {
                                        dequantized_panels_avx512::int8_panel(q + n0 * in_features, in_features,
                                                                              s + n0, n_count, panel);
                                      });
#endif
    return quantized_through_panels(x.data_ptr<float>(), x.size(0), in_features, out_features, out.data_ptr<float>(),
                                    0, fill_by_transposes(in_features, in_features, [=](int64_t n, int64_t k, int64_t) {
                                      return _mm256_mul_ps(widen_int8(q + n * in_features + k), _mm256_set1_ps(s[n]));
                                    }));
  }
#endif
#ifdef HAVE_AVX512_WEIGHT_ONLY
  if (in_features % weight_only_avx512::kStep == 0)
    return quantized_tiles_avx512(
        x.data_ptr<float>(), x.size(0), in_features, out_features, in_features, out.data_ptr<float>(),
        [&](int64_t n, int64_t k, int64_t) {
          if (k % weight_only_avx512::kStep == 0) weight_only_avx512::prefetch_ahead(q + n * in_features + k);
          return weight_only_avx512::widen_int8(q + n * in_features + k);
        },
        [&](int64_t n, float dot_q) { return s[n] * dot_q; },
        [&](int64_t m0, auto& row, float total[weight_only_avx512::kRows][weight_only_avx512::kCols]) {
          constexpr int64_t kCols = weight_only_avx512::kCols;
          const int8_t* row_weights[kCols];
          for (int64_t j = 0; j < kCols; ++j) row_weights[j] = q + row(j) * in_features;
          float sums[kCols];
          weight_only_avx512::int8_row_tile(x.data_ptr<float>() + m0 * in_features, row_weights, in_features, sums);
          for (int64_t j = 0; j < kCols; ++j) total[0][j] = s[row(j)] * sums[j];
        });
#endif
  quantized_tiles(
      x.data_ptr<float>(), x.size(0), in_features, out_features, in_features, out.data_ptr<float>(),
      [&](int64_t n, int64_t k, float* w) {
        const int8_t* row = q + n * in_features + k;
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) w[l] = static_cast<float>(row[l]);
      },
#ifdef HAVE_AVX2_FMA
      [&](int64_t n, int64_t k, int64_t) { return widen_int8(q + n * in_features + k); },
#else
      nullptr,
#endif
      [&](int64_t, int64_t n, int64_t, float dot_q) { return s[n] * dot_q; });
}

namespace {
// Which tile multiplies a single row of x by INT4 weights: float FMAs on the raw nibbles, bf16
// dot products (AVX512_BF16 builds), int8 dot products (AVX512_VNNI builds) or their AVX2 form
// ("int8": builds without the AVX-512 kernels). Measured per call (docs/benchmarks.md, "One INT4
// row"): on an Intel Xeon the VNNI tile is the fastest, on AMD Zen 5 the bf16 tile was measured
// faster than the FMA one, and on an AVX2 Zen 3 the int8 tile is. "auto" picks by the CPU's
// vendor among the tiles this build has; tests and benchmarks force any of them.
enum class Int4RowTile { kAuto, kFma, kBf16, kVnni, kInt8 };
std::atomic<Int4RowTile> g_int4_row_tile{Int4RowTile::kAuto};

#ifdef HAVE_AVX512_BF16_NIBBLES
constexpr bool kBf16TileBuilt = true;
#else
constexpr bool kBf16TileBuilt = false;
#endif
#ifdef HAVE_AVX512_VNNI_NIBBLES
constexpr bool kVnniTileBuilt = true;
#else
constexpr bool kVnniTileBuilt = false;
#endif
#if defined(HAVE_AVX2_FMA) && !defined(HAVE_AVX512_WEIGHT_ONLY)
constexpr bool kInt8TileBuilt = true;
#else
constexpr bool kInt8TileBuilt = false;
#endif

Int4RowTile int4_row_tile_in_use() {
  static const Int4RowTile automatic = [] {
    bool amd = false;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    amd = __builtin_cpu_is("amd") != 0;
#endif
    if (amd && kBf16TileBuilt) return Int4RowTile::kBf16;
    if (kVnniTileBuilt) return Int4RowTile::kVnni;
    return kInt8TileBuilt ? Int4RowTile::kInt8 : Int4RowTile::kFma;
  }();
  const Int4RowTile choice = g_int4_row_tile.load(std::memory_order_relaxed);
  return choice == Int4RowTile::kAuto ? automatic : choice;
}
}  // namespace

std::string int4_row_kernel(const std::string& choice) {
  if (!choice.empty()) {
    TORCH_CHECK(choice == "auto" || choice == "fma" || (choice == "bf16" && kBf16TileBuilt) ||
                    (choice == "vnni" && kVnniTileBuilt) || (choice == "int8" && kInt8TileBuilt),
                "int4_row_kernel: \"auto\", \"fma\"", kBf16TileBuilt ? ", \"bf16\"" : "",
                kVnniTileBuilt ? ", \"vnni\"" : "", kInt8TileBuilt ? ", \"int8\"" : "",
                " (the tiles this build has), got ", choice);
    g_int4_row_tile.store(choice == "auto"   ? Int4RowTile::kAuto
                          : choice == "bf16" ? Int4RowTile::kBf16
                          : choice == "vnni" ? Int4RowTile::kVnni
                          : choice == "int8" ? Int4RowTile::kInt8
                                             : Int4RowTile::kFma,
                          std::memory_order_relaxed);
  }
  switch (int4_row_tile_in_use()) {
    case Int4RowTile::kBf16: return "bf16";
    case Int4RowTile::kVnni: return "vnni";
    case Int4RowTile::kInt8: return "int8";
    default: return "fma";
  }
}

namespace {
// sums[m * G + g] = sum(x_g) of each of the first `rows` rows of x and each group g (the INT4
// zero-point term's factor).
void sum_x_groups(const float* x, int64_t rows, int64_t in_features, int64_t group_size, float* sums) {
  const int64_t num_groups = in_features / group_size;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) sum += x[m * in_features + k];
      sums[m * num_groups + g] = sum;
    }
}
}  // namespace

#ifdef HAVE_AVX512_DEQUANTIZED_PANELS
namespace {
// Rows of a row-major INT4 weight from row n0 on, as int4_panel reads them.
struct RowMajorPanelRows {
  const uint8_t* q;
  const float *s, *z;
  int64_t row_bytes, num_groups;
  const uint8_t* bytes(int64_t j, int64_t k) const { return q + j * row_bytes + k / 2; }
  float scale(int64_t j, int64_t g) const { return s[j * num_groups + g]; }
  float zero(int64_t j, int64_t g) const { return z[j * num_groups + g]; }
};

// Each 16 weight rows dequantized once into a float32 panel that every row of x passes over
// (quantized_through_panels), for INT4 weights in any layout: `panel_rows(n0)` gives the 16 rows
// from n0 as int4_panel reads them.
template <typename PanelRows>
void int4_through_panels(const float* x_ptr, int64_t rows, int64_t in_features, int64_t out_features,
                         int64_t group_size, float* out_ptr, PanelRows panel_rows) {
  quantized_through_panels(x_ptr, rows, in_features, out_features, out_ptr, 2 * in_features / group_size * kPanel,
                           [&](int64_t n0, int64_t n_count, float* panel, float* table) {
                             dequantized_panels_avx512::int4_panel(panel_rows(n0), in_features, group_size, n_count,
                                                                   table, panel);
                           });
}

}  // namespace
#endif

#ifdef HAVE_AVX512_WEIGHT_ONLY
namespace {
namespace wide = weight_only_avx512;
static_assert(wide::kHeldGroup == int4_layout::kHeldGroup && wide::kHeldGroupBytes == int4_layout::kHeldGroupBytes &&
                  wide::kCols == int4_layout::kTileRows,
              "Int4HeldTile reads the held tiles of int4_weight_layouts.h");

// A 16-row panel of held INT4 tiles (two tiles) as int4_panel reads it.
struct HeldPanelRows {
  const uint8_t* first_tile;
  int64_t tile_bytes;
  wide::Int4HeldTile tile_of(int64_t j) const { return {first_tile + j / wide::kCols * tile_bytes, tile_bytes}; }
  const uint8_t* bytes(int64_t j, int64_t k) const { return tile_of(j).bytes(j % wide::kCols, k); }
  float scale(int64_t j, int64_t g) const { return tile_of(j).scale(j % wide::kCols, g); }
  float zero(int64_t j, int64_t g) const { return tile_of(j).columns(g)[wide::kCols + j % wide::kCols]; }
};
static_assert(dequantized_panels_avx512::kRows % wide::kCols == 0, "a panel is whole tiles");

// The AVX-512 INT4 register tiles over any layout (`tile_rows(n0)`: where the kCols weight rows
// from n0 lie, Int4RowPointers or Int4HeldTile; groups whole steps): each tile accumulates every
// group's x_g . q_g on the raw nibbles, in the nibble-split order, scales it once per group and
// adds the zero-point term at the end (int4_row_tile for one row, int4_rows_tile for two or
// three).
template <typename TileRows>
void int4_tiles(const float* x_ptr, int64_t rows, int64_t in_features, int64_t out_features, int64_t group_size,
                float* out_ptr, TileRows tile_rows) {
  const int64_t num_groups = in_features / group_size;
  std::vector<float> x_sums(rows * num_groups);
  static_assert(wide::kSplitRun == wide::kStep, "a step is one run of split nibbles");
  // The row a tile of kRows leaves alone (the last, where rows % kRows == 1) goes through the
  // chosen one-row tile; the bf16 and int8 ones take x prepared once for all their tiles (the
  // int8 one with its own sums of x, for the zero-point term), and only the rows before it are
  // split for the float tiles.
  const Int4RowTile row_tile = rows % wide::kRows == 1 ? int4_row_tile_in_use() : Int4RowTile::kFma;
  const float* last_x = x_ptr + (rows - 1) * in_features;
#ifdef HAVE_AVX512_BF16_NIBBLES
  const bool bf16_row = row_tile == Int4RowTile::kBf16 && group_size % wide::kNibbleRun == 0;
  const wide::NibbleRowX last_row = bf16_row ? wide::split_x_bf16(last_x, in_features, group_size) : wide::NibbleRowX{};
#else
  constexpr bool bf16_row = false;
#endif
#ifdef HAVE_AVX512_VNNI_NIBBLES
  const bool vnni_row = row_tile == Int4RowTile::kVnni && group_size % wide::kVnniRun == 0;
  const wide::NibbleRowParts last_parts =
      vnni_row ? wide::split_x_int8(last_x, in_features, group_size) : wide::NibbleRowParts{};
  if (vnni_row) std::copy(last_parts.sums.begin(), last_parts.sums.end(), x_sums.begin() + (rows - 1) * num_groups);
#else
  constexpr bool vnni_row = false;
#endif
  (void)last_x;
  sum_x_groups(x_ptr, rows - (vnni_row ? 1 : 0), in_features, group_size, x_sums.data());  // the int8 tile's row has its sums already
  const std::vector<float> split_x =
      split_features<wide::kSplitRun>(x_ptr, rows - (bf16_row || vnni_row ? 1 : 0), in_features);
  for_each_output_tile<wide::kRows, wide::kCols>(
      rows, out_features, out_ptr,
      [&](int64_t, int64_t, int64_t m0, int64_t m_count, int64_t n0, int64_t, float total[wide::kRows][wide::kCols]) {
        const auto weights = tile_rows(n0);
        const float* x_rows = split_x.data() + m0 * in_features;
        static_assert(wide::kRows == 3, "one case per row count below");
        if (m_count == 3)
          wide::int4_rows_tile<3>(x_rows, in_features, weights, in_features, group_size, total);
        else if (m_count == 2)
          wide::int4_rows_tile<2>(x_rows, in_features, weights, in_features, group_size, total);
#ifdef HAVE_AVX512_BF16_NIBBLES
        else if (bf16_row)
          wide::int4_row_tile_bf16(last_row, weights, in_features, group_size, total[0]);
#endif
#ifdef HAVE_AVX512_VNNI_NIBBLES
        else if (vnni_row)
          wide::int4_row_tile_vnni(last_parts, weights, in_features, group_size, total[0]);
#endif
        else
          wide::int4_row_tile(x_rows, weights, in_features, group_size, total[0]);
        for (int64_t i = 0; i < m_count; ++i)
          wide::add_zero_terms(weights, x_sums.data() + (m0 + i) * num_groups, num_groups, total[i]);
      });
}
}  // namespace
#endif

// Whether `weight` has the shape of held INT4 tiles: [tiles, groups, 8 rows + 1 of columns, 64].
bool held_int4_tiles(const at::Tensor& weight) {
  return weight.dtype() == at::kByte && weight.dim() == 4 && weight.size(2) == int4_layout::kTileRows + 1 &&
         weight.size(3) == int4_layout::kLineBytes;
}

bool int4_weight_tiles_supported(int64_t in_features, int64_t group_size) {
#ifdef HAVE_AVX2_FMA
  return group_size == int4_layout::kHeldGroup && in_features % group_size == 0;
#else
  (void)in_features, (void)group_size;
  return false;
#endif
}

namespace {
// The weight-only INT4 routes below the AVX-512 kernels, over either layout (`w`:
// int4_layout::RowMajor or HeldTiles): many rows through float32 panels, one row through the
// AVX2 one-row tiles, the rest through the register tiles of kTileM x kTileN.
template <typename Weights>
void int4_small_batch(const float* x_ptr, int64_t rows, int64_t in_features, int64_t out_features,
                      int64_t group_size, float* out_ptr, const Weights& w) {
  const int64_t num_groups = in_features / group_size;
#ifdef HAVE_AVX2_FMA
  if (rows > (fills_by_bytes(in_features) ? int4_byte_fill_from_rows(group_size) : kInt4WidenFromRows))
    return quantized_through_panels(x_ptr, rows, in_features, out_features, out_ptr, 0,
                                    fill_by_transposes(in_features, group_size, [=](int64_t n, int64_t k, int64_t g) {
                                      return _mm256_fmadd_ps(widen_int4(w.bytes(n, k, g)),
                                                             _mm256_set1_ps(w.scale(n, g)),
                                                             _mm256_set1_ps(w.zero(n, g)));
                                    }));
#endif
#if defined(HAVE_AVX2_FMA) && !defined(HAVE_AVX512_WEIGHT_ONLY)
  // One row on AVX2: tiles of weight_only_avx2::kCols weight rows, tile(n0, total) filling each.
  auto row_tiles = [&](auto tile) {
    constexpr int64_t kCols = weight_only_avx2::kCols;
    for_each_output_tile<1, kCols>(1, out_features, out_ptr,
                                   [&](int64_t, int64_t, int64_t, int64_t, int64_t n0, int64_t,
                                       float total[1][kCols]) { tile(n0, total[0]); });
  };
  if (rows == 1 && group_size % weight_only_avx2::kPartsRun == 0 && int4_row_tile_in_use() == Int4RowTile::kInt8) {
    const weight_only_avx2::RowParts parts = weight_only_avx2::split_x_parts(x_ptr, in_features, group_size);
    return row_tiles([&](int64_t n0, float* total) {
      weight_only_avx2::int4_parts_row_tile(parts, w, in_features, out_features, group_size, n0, total);
    });
  }
#endif
  std::vector<float> x_sums(rows * num_groups);
  sum_x_groups(x_ptr, rows, in_features, group_size, x_sums.data());
#if defined(HAVE_AVX2_FMA) && !defined(HAVE_AVX512_WEIGHT_ONLY)
  if (rows == 1 && group_size % weight_only_avx2::kRun == 0) {
    const std::vector<float> split_x = split_features<weight_only_avx2::kRun>(x_ptr, 1, in_features);
    return row_tiles([&](int64_t n0, float* total) {
      weight_only_avx2::int4_row_tile(split_x.data(), x_sums.data(), w, in_features, out_features, group_size, n0,
                                      total);
    });
  }
#endif
  auto finish = [&](int64_t m, int64_t n, int64_t g, float dot_q) {
    return group_output(w.scale(n, g), dot_q, w.zero(n, g), x_sums[m * num_groups + g]);
  };
  // kSplit: the weights and x in the nibble-split order, where groups are whole runs of 16.
  auto tiles = [&](auto split) {
    constexpr bool kSplit = decltype(split)::value;
    const std::vector<float> split_x = kSplit ? split_features<16>(x_ptr, rows, in_features) : std::vector<float>();
    quantized_tiles(
        kSplit ? split_x.data() : x_ptr, rows, in_features, out_features, group_size, out_ptr,
        [&](int64_t n, int64_t k, float* weights) {
          for (int64_t i = 0; i < kLanes; ++i) {
            const int64_t f = kSplit ? split_feature<16>(k, i) : k + i;
            weights[i] = static_cast<float>((*w.bytes(n, f) >> (4 * (f % 2))) & 0x0F);
          }
        },
#ifdef HAVE_AVX2_FMA
        [&](int64_t n, int64_t k, int64_t g) {
          if constexpr (kSplit)
            return widen_int4_split(w.bytes(n, k & ~int64_t{15}, g), k);
          else
            return widen_int4(w.bytes(n, k, g));
        },
#else
        nullptr,
#endif
        finish);
  };
#ifdef HAVE_AVX2_FMA
  if (group_size % 16 == 0) return tiles(std::true_type{});
#endif
  tiles(std::false_type{});
}
}  // namespace

// x [M, K] float32 -> out [M, N] by an INT4 weight with groups of G features: qweight [N, K/2]
// uint8 (column 2j in the low nibble of byte j, 2j+1 in the high one) with scales and zeros
// [N, K/G] float32, or held tiles [ceil(N / 8), K / 128, 9, 64] uint8 (int4_weight_layouts.h,
// where int4_weight_tiles_supported: the scales and zeros inside them; `scales` and `zeros` then
// only give their sizes, and `out` the number of outputs).
void linear_small_batch_int4(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor zeros,
                             int64_t group_size, at::Tensor out) {
  const int64_t in_features = x.size(1);
  TORCH_CHECK(group_size % kLanes == 0 && in_features % group_size == 0, "group size must tile K in 8s");
  TORCH_CHECK(zeros.dtype() == at::kFloat && zeros.is_contiguous(), "zeros: contiguous float32");
  const bool held = held_int4_tiles(qweight);
  const int64_t out_features = held ? out.size(1) : qweight.size(0);
  check_quantized_args(x, scales, out, out_features);
  const int64_t rows = x.size(0), num_groups = in_features / group_size;
  TORCH_CHECK(scales.numel() == out_features * num_groups && zeros.numel() == out_features * num_groups,
              "scales and zeros: [N, K/G]");
  const float* x_ptr = x.data_ptr<float>();
  if (held) {
    TORCH_CHECK(int4_weight_tiles_supported(in_features, group_size),
                "held INT4 tiles need this build's AVX2 or AVX-512 kernels and groups of ", int4_layout::kHeldGroup,
                " features, got ", group_size);
    TORCH_CHECK(qweight.dtype() == at::kByte && qweight.is_contiguous() &&
                    qweight.size(0) == (out_features + int4_layout::kTileRows - 1) / int4_layout::kTileRows &&
                    qweight.size(1) == num_groups,
                "held INT4 tiles: contiguous uint8 [ceil(N / ", int4_layout::kTileRows, "), K / ",
                int4_layout::kHeldGroup, ", ", int4_layout::kTileRows + 1, ", 64] for out [M, N]");
    const uint8_t* tiles = qweight.data_ptr<uint8_t>();
    const int64_t tile_bytes = num_groups * int4_layout::kHeldGroupBytes;
#ifdef HAVE_AVX512_WEIGHT_ONLY
    auto tile_of = [=](int64_t n0) { return tiles + n0 / wide::kCols * tile_bytes; };  // the tile of output n0
    if (rows > int4_byte_fill_from_rows(group_size))
      return int4_through_panels(x_ptr, rows, in_features, out_features, group_size, out.data_ptr<float>(),
                                 [=](int64_t n0) { return HeldPanelRows{tile_of(n0), tile_bytes}; });
    return int4_tiles(x_ptr, rows, in_features, out_features, group_size, out.data_ptr<float>(),
                      [=](int64_t n0) { return wide::Int4HeldTile{tile_of(n0), tile_bytes}; });
#else
    return int4_small_batch(x_ptr, rows, in_features, out_features, group_size, out.data_ptr<float>(),
                            int4_layout::HeldTiles{tiles, tile_bytes});
#endif
  }
  TORCH_CHECK(qweight.dtype() == at::kByte && qweight.is_contiguous() && qweight.dim() == 2 &&
                  qweight.size(1) * 2 == in_features,
              "qweight: contiguous uint8 [N, K/2]");
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* z = zeros.data_ptr<float>();
#ifdef HAVE_AVX512_DEQUANTIZED_PANELS
  if (fills_by_bytes(in_features) && rows > int4_byte_fill_from_rows(group_size))
    return int4_through_panels(x_ptr, rows, in_features, out_features, group_size, out.data_ptr<float>(),
                               [=](int64_t n0) {
                                 return RowMajorPanelRows{q + n0 * (in_features / 2), s + n0 * num_groups,
                                                          z + n0 * num_groups, in_features / 2, num_groups};
                               });
#endif
#ifdef HAVE_AVX512_WEIGHT_ONLY
  if (rows <= (fills_by_bytes(in_features) ? int4_byte_fill_from_rows(group_size) : kInt4WidenFromRows) &&
      group_size % wide::kSplitRun == 0)
    return int4_tiles(x_ptr, rows, in_features, out_features, group_size, out.data_ptr<float>(), [=](int64_t n0) {
      // Past the last weight row a tile repeats it, and those outputs are dropped.
      wide::Int4RowPointers weights{{}, {}, {}, in_features / 2};
      for (int64_t j = 0; j < wide::kCols; ++j) {
        const int64_t n = std::min(n0 + j, out_features - 1);
        weights.rows[j] = q + n * (in_features / 2);
        weights.scales[j] = s + n * num_groups;
        weights.zeros[j] = z + n * num_groups;
      }
      return weights;
    });
#endif
  int4_small_batch(x_ptr, rows, in_features, out_features, group_size, out.data_ptr<float>(),
                   int4_layout::RowMajor{q, s, z, in_features / 2, num_groups});
}
