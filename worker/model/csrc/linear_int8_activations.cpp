// Quantized linears with int8 activations (the opt-in `quantization_activations = "int8"`): x is
// quantized per block of 32 input features (symmetric, the block's largest |x| maps to 127, as
// llama.cpp's q8_0 activations), and each block's dot product with the weight is an integer one,
// four 8-bit products per 32-bit lane in one instruction where the CPU has VNNI (AVX-512 VNNI or
// AVX-VNNI; AVX2's maddubs + madd pair otherwise), then scaled by the block's activation scale in
// float32. The weights are the weight-only formats of linear.cpp laid out as panels
// (int8_activations.h, worker/model/int8_activation_panels.py), so each tile reads one stream:
//   int8 in -127..127 (quantize_int8's range: the sign trick below cannot negate -128),
//        per-row scales: y = scale[n] * sum_b xs[b] * (xq_b . q[n]_b);
//   int4 unsigned nibbles with per-group scales and zeros (group size a multiple of 32):
//        y = sum_g scale[n, g] * sum_{b in g} xs[b] * (xq_b . q[n]_b) + zero[n, g] * sum(xs xq_g),
//        so either way y is the rounded x against the dequantized weight.
// The unsigned operand of the u8 x s8 product is the weight (int4's nibble, or int8's weight +
// 128 as stored, whose offset x's block sums take back out in the accumulator the product starts
// from: one per block of x, shared by every weight row). With AVX-512 VNNI the weights are held
// output-major (int8_activations_avx512.h: one 32-bit lane per output, a block's dot whole in its
// lane); the AVX2 and portable tiles read the tile layout, and AVX2, which has a byte sign
// instruction, takes int8 as |xq| against the weight carrying xq's sign.
#include "kernels.h"
#include "int8_activations.h"
#include "int8_activations_avx2.h"
#include "int8_activations_avx512.h"
#include "output_tiles.h"
#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace int8_activations {

inline void quantize_block(const float* x, int8_t* q, float* scale) {
#ifdef HAVE_AVX2_FMA
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 values[4], largest = _mm256_setzero_ps();
  for (int v = 0; v < 4; ++v) {
    values[v] = _mm256_loadu_ps(x + 8 * v);
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, values[v]));
  }
  const float amax = horizontal_max(largest);
#else
  float amax = 0.f;
  for (int64_t l = 0; l < kBlock; ++l) amax = std::max(amax, std::fabs(x[l]));
#endif
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
#ifdef HAVE_AVX2_FMA
  const __m256 factor = _mm256_set1_ps(inverse);
  __m256i lanes[4];
  for (int v = 0; v < 4; ++v)  // rounds half to even (the default MXCSR mode), as torch.round
    lanes[v] = _mm256_cvtps_epi32(_mm256_mul_ps(values[v], factor));
  // packs interleave the 128-bit halves; the permutation puts the 32 bytes back in order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(lanes[0], lanes[1]), _mm256_packs_epi32(lanes[2], lanes[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  for (int64_t l = 0; l < kBlock; ++l) q[l] = static_cast<int8_t>(std::nearbyint(x[l] * inverse));
#endif
}

QuantizedActivations quantize_activations(const float* x, int64_t rows, int64_t in_features, bool magnitudes) {
  QuantizedActivations a;
  a.blocks_per_row = in_features / kBlock;
  a.q.resize(rows * in_features);
  a.scales.resize(rows * a.blocks_per_row);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t b = 0; b < a.blocks_per_row; ++b)
      quantize_block(x + m * in_features + b * kBlock, a.q.data() + m * in_features + b * kBlock,
                     a.scales.data() + m * a.blocks_per_row + b);
  if (magnitudes) {
    a.magnitude.resize(a.q.size());
    for (size_t i = 0; i < a.q.size(); ++i) a.magnitude[i] = static_cast<uint8_t>(std::abs(a.q[i]));
  }
  return a;
}



// The portable tile: the same integer block dots, scaled and summed in float per group.
template <bool kInt8, typename Finish>
inline void tile_portable(const QuantizedActivations& a, const WeightPanels& panels, int64_t in_features,
                          int64_t group_size, int64_t m0, int64_t m_count, int64_t tile, int64_t n_count,
                          float total[kRows][kCols], Finish& finish) {
  for (int64_t g = 0; g < in_features / group_size; ++g)
    for (int64_t i = 0; i < m_count; ++i)
      for (int64_t j = 0; j < n_count; ++j) {
        float sum = 0.f;
        for (int64_t local = 0; local < group_size / kBlock; ++local) {
          const BlockBytes block = block_bytes(panels, kInt8, tile, j, g, local);
          const int64_t k = g * group_size + local * kBlock;
          int32_t dot = 0;
          for (int64_t l = 0; l < kBlock; ++l) {
            const int32_t w = kInt8 ? block.bytes[l] - 128 : (block.bytes[l] >> block.shift) & 0x0F;
            dot += w * a.q[(m0 + i) * in_features + k + l];
          }
          sum += static_cast<float>(dot) * a.scales[(m0 + i) * a.blocks_per_row + k / kBlock];
        }
        total[i][j] += finish(m0 + i, tile * kCols + j, g, sum);
      }
}

template <bool kInt8, typename Finish>
void int8_activation_tiles(const QuantizedActivations& a, const WeightPanels& panels, int64_t rows, int64_t in_features,
                           int64_t out_features, int64_t group_size, float* out_ptr, Finish finish) {
  for_each_output_tile<kRows, kCols>(rows, out_features, out_ptr, [&](int64_t tile, int64_t, int64_t m0,
                                                                     int64_t m_count, int64_t, int64_t n_count,
                                                                     float total[kRows][kCols]) {
#ifdef HAVE_AVX2_FMA
    static_assert(kRows == 3, "one case per row count below");
    if (m_count == 3)
      tile_columns<3, kInt8>(a, panels, in_features, group_size, m0, tile, n_count, total, finish);
    else if (m_count == 2)
      tile_columns<2, kInt8>(a, panels, in_features, group_size, m0, tile, n_count, total, finish);
    else
      tile_columns<1, kInt8>(a, panels, in_features, group_size, m0, tile, n_count, total, finish);
#else
    tile_portable<kInt8>(a, panels, in_features, group_size, m0, m_count, tile, n_count, total, finish);
#endif
  });
}

void check_args(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& out, int64_t out_features) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) % kBlock == 0, "in_features must be a multiple of 32 for int8 activations");
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.is_contiguous(), "scales: contiguous float32");
  TORCH_CHECK(out.is_contiguous() && out.dtype() == at::kFloat && out.size(0) == x.size(0) &&
              out.size(1) == out_features, "out must be a contiguous float32 [M, N] tensor");
}

// The panels of an [out_features, in_features] weight in groups of group_size, checked: the
// layout this build's kernels read (int8_activations.h).
WeightPanels panels_of(const at::Tensor& panels, bool int8, int64_t out_features, int64_t in_features,
                       int64_t group_size) {
  WeightPanels p;
  p.slots_per_group = (group_size + kSlot - 1) / kSlot;
  p.slots_per_row = p.slots_per_group * (in_features / group_size);
  p.units_per_row = int8 ? p.slots_per_row : (p.slots_per_row + 1) / 2;
  TORCH_CHECK(panels.dtype() == (int8 ? at::kChar : at::kByte) && panels.is_contiguous(),
              "weight: contiguous ", int8 ? "int8" : "uint8", " panels (worker/model/int8_activation_panels.py)");
#ifdef HAVE_AVX512_VNNI
  const int64_t num_panels = (out_features + kPanelOutputs - 1) / kPanelOutputs;
  if (!int8 && panels.dim() == 3) {
    p.columns_inside = true;
    p.panel_bytes = panel_bytes_with_columns(p.units_per_row, in_features / group_size);
    TORCH_CHECK(panels.size(0) == num_panels && panels.size(1) * panels.size(2) == p.panel_bytes &&
                    panels.size(2) == 64,
                "weight: output-major panels with their group columns inside [ceil(N/16), ", p.panel_bytes / 64,
                ", 64] (worker/model/int8_activation_panels.py, with_group_columns)");
  } else {
    TORCH_CHECK(panels.dim() == 4 && panels.size(0) == num_panels && panels.size(1) == p.units_per_row &&
                    panels.size(2) == kQuads && panels.size(3) == 64,
                "weight: output-major panels [ceil(N/16), ", p.units_per_row, ", 16, 64] ",
                "(worker/model/int8_activation_panels.py, output_major=True)");
  }
#else
  TORCH_CHECK(panels.dim() == 3 && panels.size(0) == (out_features + kCols - 1) / kCols &&
              panels.size(1) == p.units_per_row * kCols && panels.size(2) == 64,
              "weight: tile panels [ceil(N/4), ", p.units_per_row * kCols, ", 64] ",
              "(worker/model/int8_activation_panels.py, output_major=False)");
#endif
  p.data = reinterpret_cast<const uint8_t*>(panels.data_ptr());
  return p;
}

}  // namespace int8_activations

using namespace int8_activations;

bool int8_activations_supported(int64_t in_features, int64_t group_size) {
  return in_features % kBlock == 0 && group_size % kBlock == 0;
}

bool int8_activations_output_major() {
#ifdef HAVE_AVX512_VNNI
  return true;
#else
  return false;
#endif
}

// scales [N] (int8) or [N, G] and zeros [N, G] or none -> [ceil(N / 8), G, 2, 8]: for each run of
// 8 weight rows and each group, the rows' 8 scales then their 8 zeros (0 for int8) side by side,
// the rows past N repeating the last. What the AVX-512 kernels read: one aligned load per group
// for 8 outputs, where the row-major values would take a gather.
at::Tensor int8_activation_group_columns(at::Tensor scales, std::optional<at::Tensor> zeros) {
  TORCH_CHECK(scales.dtype() == at::kFloat && (scales.dim() == 1 || scales.dim() == 2), "scales: float32 [N] or [N, G]");
  scales = scales.contiguous();
  const int64_t out_features = scales.size(0), num_groups = scales.dim() == 2 ? scales.size(1) : 1;
  at::Tensor z;
  if (zeros) {
    z = zeros->contiguous();
    TORCH_CHECK(z.dtype() == at::kFloat && z.numel() == scales.numel(), "zeros: float32, shaped as scales");
  }
  at::Tensor columns = scales.new_empty({(out_features + kColumnRows - 1) / kColumnRows, num_groups, 2, kColumnRows});
  const float* s = scales.data_ptr<float>();
  const float* zp = z.defined() ? z.data_ptr<float>() : nullptr;
  float* c = columns.data_ptr<float>();
  for (int64_t pair = 0; pair < columns.size(0); ++pair)
    for (int64_t g = 0; g < num_groups; ++g)
      for (int64_t j = 0; j < kColumnRows; ++j) {
        const int64_t n = std::min(pair * kColumnRows + j, out_features - 1);
        float* at = c + (pair * num_groups + g) * 2 * kColumnRows + j;
        at[0] = s[n * num_groups + g];
        at[kColumnRows] = zp ? zp[n * num_groups + g] : 0.f;
      }
  return columns;
}

#ifdef HAVE_AVX512_VNNI
namespace {
// The group columns of a call's scales: `scales` itself where the caller holds them so (4-D),
// else made for this call (`storage`) from scales [N] (num_groups 1) or [N, num_groups].
const float* group_columns_of(const at::Tensor& scales, const at::Tensor* zeros, int64_t out_features,
                              int64_t num_groups, at::Tensor& storage) {
  if (scales.dim() == 4) {
    TORCH_CHECK(scales.size(0) == (out_features + kColumnRows - 1) / kColumnRows && scales.size(1) == num_groups &&
                scales.size(2) == 2 && scales.size(3) == kColumnRows,
                "group columns: [ceil(N / 8), groups, 2, 8] (int8_activation_group_columns)");
    return scales.data_ptr<float>();
  }
  TORCH_CHECK(scales.size(0) == out_features &&
              (scales.dim() == 1 ? num_groups == 1 : scales.dim() == 2 && scales.size(1) == num_groups),
              "scales: [N] for int8 weights, [N, K / group_size] for int4");
  storage = int8_activation_group_columns(scales, zeros ? std::optional<at::Tensor>(*zeros) : std::nullopt);
  return storage.data_ptr<float>();
}
}  // namespace
#endif

// x [M, K] float32, the int8 weight in -127..127 as panels, scales [N] float32 (or their group
// columns, with the AVX-512 kernels) -> out [M, N].
void linear_int8_weights_int8_activations(at::Tensor x, at::Tensor panels, at::Tensor scales, at::Tensor out) {
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = out.size(1);
  check_args(x, scales, out, out_features);
  const WeightPanels weights = panels_of(panels, true, out_features, in_features, in_features);
  if (rows == 0) return;
#ifdef HAVE_AVX512_VNNI
  at::Tensor storage;
  const float* columns = group_columns_of(scales, nullptr, out_features, 1, storage);
  const QuantizedActivations q = quantize_activations(x.data_ptr<float>(), rows, in_features, false);
  return int8_activations_avx512<true>(q, weights, columns, nullptr, rows, in_features, out_features, in_features,
                                       out.data_ptr<float>());
#endif
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == out_features, "scales: [N]");
  const float* s = scales.data_ptr<float>();
  const QuantizedActivations a = quantize_activations(x.data_ptr<float>(), rows, in_features, true);
  int8_activation_tiles<true>(a, weights, rows, in_features, out_features, in_features, out.data_ptr<float>(),
                              [&](int64_t, int64_t n, int64_t, float dot) { return s[n] * dot; });
}

// x [M, K] float32, the int4 weight (nibbles) as panels, scales and zeros [N, K/G] float32 (or,
// with the AVX-512 kernels, the scales' and zeros' group columns in place of the scales), G a
// multiple of 32 -> out [M, N].
void linear_int4_weights_int8_activations(at::Tensor x, at::Tensor panels, at::Tensor scales, at::Tensor zeros,
                                          int64_t group_size, at::Tensor out) {
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = out.size(1);
  TORCH_CHECK(group_size % kBlock == 0 && in_features % group_size == 0,
              "the group size must be a multiple of 32 that tiles K for int8 activations");
  TORCH_CHECK(zeros.dtype() == at::kFloat && zeros.is_contiguous(), "zeros: contiguous float32");
  check_args(x, scales, out, out_features);
  const WeightPanels weights = panels_of(panels, false, out_features, in_features, group_size);
  const float* x_ptr = x.data_ptr<float>();
  const int64_t num_groups = in_features / group_size;
  TORCH_CHECK(zeros.dim() == 2 && zeros.size(0) == out_features && zeros.size(1) == num_groups &&
              (scales.dim() == 4 || zeros.sizes() == scales.sizes()),
              "scales and zeros: [N, K / group_size]");
  if (rows == 0) return;
  const QuantizedActivations a = quantize_activations(x_ptr, rows, in_features, false);
  // sum(x_g) of the rounded x, for the zero-point term: the result is then the rounded x against
  // the dequantized weight, whose error has no bias (an exact sum against the rounded dots would
  // leave the rounding times the weights' offset from their zero point).
  std::vector<float> x_sums(rows * num_groups, 0.f);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t b = 0; b < a.blocks_per_row; ++b) {
      int32_t sum = 0;
      for (int64_t l = 0; l < kBlock; ++l) sum += a.q[m * in_features + b * kBlock + l];
      x_sums[m * num_groups + b * kBlock / group_size] += static_cast<float>(sum) * a.scales[m * a.blocks_per_row + b];
    }
#ifdef HAVE_AVX512_VNNI
  at::Tensor storage;  // the columns, where neither the panels nor `scales` hold them
  const float* columns =
      weights.columns_inside ? nullptr : group_columns_of(scales, &zeros, out_features, num_groups, storage);
  return int8_activations_avx512<false>(a, weights, columns, x_sums.data(), rows, in_features, out_features,
                                        group_size, out.data_ptr<float>());
#endif
  TORCH_CHECK(scales.dim() == 2, "scales: [N, K / group_size]");
  const float* s = scales.data_ptr<float>();
  const float* z = zeros.data_ptr<float>();
  int8_activation_tiles<false>(a, weights, rows, in_features, out_features, group_size, out.data_ptr<float>(),
                               [&](int64_t m, int64_t n, int64_t g, float dot) {
                                 return group_output(s[n * num_groups + g], dot, z[n * num_groups + g],
                                                     x_sums[m * num_groups + g]);
                               });
}
