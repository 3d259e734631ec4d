// Our CPU kernels, float32 only (the Python side falls back to torch for anything else):
// - paged decode attention: one new query token per sequence, K/V read in place through
//   the block table (no gathered copy);
// - small-batch linear: y = x W^T for a few rows of x, streaming each weight row once and
//   splitting the output features over all threads (a decode step is bound by reading W);
// - RMSNorm and SiLU-and-multiply in one pass each, where torch takes several small ops
//   whose fixed cost dominates at decode sizes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // one AVX2 register of float32
constexpr int64_t kTileM = 3;  // rows of x per register tile
constexpr int64_t kTileN = 4;  // rows of W per register tile

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [N, S, Hkv, D]; block_tables [B, W] int64; seq_lens [B] int64.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV pools must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t slot_stride = num_kv_heads * head_dim;  // floats between consecutive slots

  // One task per sequence: each block is read front to back (all KV heads of a slot are
  // adjacent), and the query heads of a group share every K/V row they read.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [H, len]
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t* table = tables + b * table_width;
      const float* q_seq = q_ptr + b * num_heads * head_dim;
      float* out_seq = out_ptr + b * num_heads * head_dim;
      scores.resize(num_heads * len);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const float* k_block = k_ptr + table[start / block_size] * block_size * slot_stride;
        for (int64_t i = 0; i < n; ++i) {
          const float* k_slot = k_block + i * slot_stride;
          for (int64_t h = 0; h < num_heads; ++h)
            scores[h * len + start + i] = dot(q_seq + h * head_dim, k_slot + (h / group) * head_dim, head_dim) * scale;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {  // softmax, max-subtracted
        float* s = scores.data() + h * len;
        const float max_score = *std::max_element(s, s + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - max_score));
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(out_seq, out_seq + num_heads * head_dim, 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const float* v_block = v_ptr + table[start / block_size] * block_size * slot_stride;
        for (int64_t i = 0; i < n; ++i) {
          const float* v_slot = v_block + i * slot_stride;
          for (int64_t h = 0; h < num_heads; ++h) {
            const float p = scores[h * len + start + i];
            const float* v_row = v_slot + (h / group) * head_dim;
            float* o = out_seq + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) o[d] += p * v_row[d];
          }
        }
      }
    }
  });
  return out;
}

// x [M, K], weight [N, K] -> [M, N]. Meant for small M (decode), where reading the weight
// dominates: each row of W is loaded once and dotted with every row of x.
// Writes into `out` [M, N] (contiguous float32), so callers can keep a preallocated buffer.
void linear_small_batch(torch::Tensor x, torch::Tensor weight, torch::Tensor out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shape mismatch");
  x = x.contiguous();
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = weight.size(0);
  TORCH_CHECK(out.is_contiguous() && out.dtype() == torch::kFloat32 && out.size(0) == rows &&
              out.size(1) == out_features, "out must be a contiguous float32 [M, N] tensor");
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const bool tiled = in_features % kLanes == 0;
  // Tiles of kTileN weight rows: each W row is streamed once per tile of kTileM x rows, with
  // the kTileM x kTileN partial dot products held in registers (the compiler keeps the
  // fixed-size accumulator array in vector registers).
  at::parallel_for(0, (out_features + kTileN - 1) / kTileN, 4, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kTileN, n_count = std::min(kTileN, out_features - n0);
      for (int64_t m0 = 0; m0 < rows; m0 += kTileM) {
        const int64_t m_count = std::min(kTileM, rows - m0);
        if (!tiled || n_count < kTileN || m_count < kTileM) {
          for (int64_t n = n0; n < n0 + n_count; ++n)
            for (int64_t m = m0; m < m0 + m_count; ++m)
              out_ptr[m * out_features + n] = dot(x_ptr + m * in_features, w_ptr + n * in_features, in_features);
          continue;
        }
        float acc[kTileM][kTileN][kLanes] = {};
        for (int64_t k = 0; k < in_features; k += kLanes)
          for (int64_t i = 0; i < kTileM; ++i)
            for (int64_t j = 0; j < kTileN; ++j) {
              const float* xr = x_ptr + (m0 + i) * in_features + k;
              const float* wr = w_ptr + (n0 + j) * in_features + k;
#pragma omp simd
              for (int64_t l = 0; l < kLanes; ++l) acc[i][j][l] += xr[l] * wr[l];
            }
        for (int64_t i = 0; i < kTileM; ++i)
          for (int64_t j = 0; j < kTileN; ++j) {
            float total = 0.f;
            for (int64_t l = 0; l < kLanes; ++l) total += acc[i][j][l];
            out_ptr[(m0 + i) * out_features + n0 + j] = total;
          }
      }
    }
  });
}

// out = weight * x / sqrt(mean(x^2) + eps), row by row; x, out [M, D] contiguous.
void rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "contiguous tensors only");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x_ptr + r * dim;
      float* o = out_ptr + r * dim;
      const float inv = 1.f / std::sqrt(dot(row, row, dim) / dim + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] = w_ptr[d] * (row[d] * inv);
    }
  });
}

// gate_up [M, 2I] (gate then up) -> out [M, I] = silu(gate) * up.
void silu_and_mul(torch::Tensor gate_up, torch::Tensor out) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.is_contiguous() && out.is_contiguous(),
              "contiguous float32 only");
  const int64_t width = out.size(-1), rows = out.numel() / width;
  const float* in_ptr = gate_up.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in_ptr + r * 2 * width;
      const float* up = gate + width;
      float* o = out_ptr + r * width;
      for (int64_t i = 0; i < width; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm into out (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up into out (CPU, float32)");
  m.def("linear_small_batch", &linear_small_batch, "out = x @ weight.T for few rows (CPU, float32)");
}
