// Row-wise kernels: greedy argmax over logits, RMSNorm, SiLU-and-multiply. Each is one pass
// where torch takes several small ops whose fixed cost dominates at decode sizes.
#include "kernels.h"
#include "vector_math.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

// Each row's chosen token id as a list, 0 where the row's logit at its token is not finite (NaN
// or inf: the token means nothing). One call where torch takes a gather, a finiteness test of
// several ops and a masked fill, every step, before the list the step's bookkeeping reads.
std::vector<int64_t> finite_choices(at::Tensor logits, at::Tensor tokens) {
  TORCH_CHECK(logits.device().is_cpu() && tokens.device().is_cpu(), "finite_choices: CPU tensors");
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "finite_choices: float32 [R, V] logits with contiguous rows");
  TORCH_CHECK(tokens.dtype() == at::kLong && tokens.dim() == 1 && tokens.size(0) == logits.size(0),
              "finite_choices: int64 tokens [R], one per row of logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1), row_stride = logits.stride(0),
                token_stride = tokens.stride(0);
  const float* values = logits.data_ptr<float>();
  const int64_t* chosen = tokens.data_ptr<int64_t>();
  std::vector<int64_t> out(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = chosen[r * token_stride];
    TORCH_CHECK(token >= 0 && token < vocab, "finite_choices: token ", token, " of row ", r, " outside [0, ", vocab,
                ")");
    out[r] = std::isfinite(values[r * row_stride + token]) ? token : 0;
  }
  return out;
}

// Greedy sampling's argmax over each row of logits [B, V]: the first index of the largest
// value (NaN never wins), 8 lanes at a time, rows split over threads. torch's CPU argmax is
// slow per vocabulary-sized row, a cost every greedy decode step paid (docs/benchmarks.md).
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.dim() == 2, "float32 [B, V] only");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab >= 1, "empty rows");
  auto out = logits.new_empty({rows}, at::kLong);
  const float* in_ptr = logits.data_ptr<float>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in_ptr + r * vocab;
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_index = 0, i = 0;
#ifdef HAVE_AVX2_FMA
      if (vocab >= kLanes && vocab < (int64_t{1} << 31)) {
        __m256 lane_best = _mm256_set1_ps(best);
        __m256i lane_index = _mm256_setzero_si256(), index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32(kLanes);
        for (; i + kLanes <= vocab; i += kLanes) {
          const __m256 v = _mm256_loadu_ps(row + i);
          const __m256 greater = _mm256_cmp_ps(v, lane_best, _CMP_GT_OQ);  // strict: each lane keeps its first
          lane_best = _mm256_blendv_ps(lane_best, v, greater);
          lane_index = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(lane_index),
                                                            _mm256_castsi256_ps(index), greater));
          index = _mm256_add_epi32(index, step);
        }
        alignas(32) float values[kLanes];
        alignas(32) int32_t indices[kLanes];
        _mm256_store_ps(values, lane_best);
        _mm256_store_si256(reinterpret_cast<__m256i*>(indices), lane_index);
        for (int64_t l = 0; l < kLanes; ++l)
          if (values[l] > best || (values[l] == best && indices[l] < best_index)) {
            best = values[l];
            best_index = indices[l];
          }
      }
#endif
      for (; i < vocab; ++i)
        if (row[i] > best) {
          best = row[i];
          best_index = i;
        }
      out_ptr[r] = best_index;
    }
  });
  return out;
}

namespace {

inline void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(x.dtype() == at::kFloat && weight.dtype() == at::kFloat && out.dtype() == at::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.numel() == x.size(-1), "out like x, weight [D]");
}

// One row: o = w * row / sqrt(mean(row^2) + eps).
inline void normalise_row(const float* row, const float* w, float* o, int64_t dim, float eps) {
  const float inv = 1.f / std::sqrt(dot(row, row, dim) / dim + eps);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) o[d] = w[d] * (row[d] * inv);
}

}  // namespace

// out = weight * x / sqrt(mean(x^2) + eps), row by row; x, out [M, D] contiguous.
void rms_norm(at::Tensor x, at::Tensor weight, double eps, at::Tensor out) {
  check_norm_args(x, weight, out);
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(2 * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalise_row(x_ptr + r * dim, w_ptr, out_ptr + r * dim, dim, static_cast<float>(eps));
  });
}

// The decoder's residual step: x += delta in place, then out = RMSNorm(x), in one pass over
// each row (torch reads and writes x twice).
void add_rms_norm(at::Tensor x, at::Tensor delta, at::Tensor weight, double eps, at::Tensor out) {
  check_norm_args(x, weight, out);
  TORCH_CHECK(delta.dtype() == at::kFloat && delta.is_contiguous() && delta.sizes() == x.sizes(),
              "delta: contiguous float32, shaped like x");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  float* x_ptr = x.data_ptr<float>();
  const float* d_ptr = delta.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(3 * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = x_ptr + r * dim;
      const float* add = d_ptr + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) row[d] += add[d];
      normalise_row(row, w_ptr, out_ptr + r * dim, dim, static_cast<float>(eps));
    }
  });
}

// Qwen3's per-head q/k norms, in place inside the fused projection: qkv [T, (H + 2 Hkv) D] has
// each token's H query heads, then Hkv key heads, then Hkv value heads; every query head is
// normalised with q_weight [D] and every key head with k_weight [D], values left alone.
void head_rms_norm(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t num_heads,
                   int64_t num_kv_heads, double eps) {
  TORCH_CHECK(qkv.dtype() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous float32 [T, N]");
  const int64_t dim = q_weight.numel(), tokens = qkv.size(0), width = qkv.size(1);
  TORCH_CHECK(q_weight.dtype() == at::kFloat && k_weight.dtype() == at::kFloat && q_weight.is_contiguous() &&
              k_weight.is_contiguous() && k_weight.numel() == dim, "q_weight, k_weight: contiguous float32 [D]");
  TORCH_CHECK(width == (num_heads + 2 * num_kv_heads) * dim, "qkv holds (H + 2 Hkv) heads of head_dim");
  const int64_t normed_heads = num_heads + num_kv_heads;
  float* base = qkv.data_ptr<float>();
  const float* q_w = q_weight.data_ptr<float>();
  const float* k_w = k_weight.data_ptr<float>();
  at::parallel_for(0, tokens * normed_heads, grain_for(2 * dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / normed_heads, h = i % normed_heads;
      float* row = base + t * width + h * dim;
      normalise_row(row, h < num_heads ? q_w : k_w, row, dim, static_cast<float>(eps));
    }
  });
}

// gate_up [M, 2I] (gate then up) -> out [M, I] = silu(gate) * up.
void silu_and_mul(at::Tensor gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dtype() == at::kFloat && gate_up.is_contiguous() && out.is_contiguous(),
              "contiguous float32 only");
  const int64_t width = out.size(-1), rows = out.numel() / width;
  const float* in_ptr = gate_up.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(8 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in_ptr + r * 2 * width;
      const float* up = gate + width;
      float* o = out_ptr + r * width;
      int64_t i = 0;
#ifdef HAVE_AVX2_FMA
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      for (; i + kLanes <= width; i += kLanes) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 sigmoid = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < width; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}
