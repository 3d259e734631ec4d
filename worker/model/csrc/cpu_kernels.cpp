// Our CPU kernels, float32 only (the Python side falls back to torch for anything else):
// - paged decode attention: one new query token per sequence, K/V read in place through
//   the block table (no gathered copy);
// - packed-panel linear: y = x W^T with W pre-packed in 16-feature panels, register-tiled
//   over rows of x, at any number of rows (faster than BLAS from 1 to ~512 rows here);
// - small-batch linear with int8 or packed int4 weights widened in registers (weight-only
//   quantization);
// - RMSNorm and SiLU-and-multiply in one pass each, where torch takes several small ops
//   whose fixed cost dominates at decode sizes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_FMA 1
#endif

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

// Blocks sit anywhere in the pool, so the hardware prefetcher stops at every block boundary:
// while slot i of a block is read, slot i of the next block in the table is fetched.
inline void prefetch_slot(const float* next_block, int64_t slot, int64_t slot_stride) {
#ifdef HAVE_AVX2_FMA
  if (next_block == nullptr) return;
  const char* line = reinterpret_cast<const char*>(next_block + slot * slot_stride);
  for (int64_t offset = 0; offset < slot_stride * int64_t(sizeof(float)); offset += 64)
    _mm_prefetch(line + offset, _MM_HINT_T0);
#endif
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
  // adjacent), and the query heads of a group share every K/V row they read. Sequences differ
  // in length by 10x or more, so tasks go longest first to whichever thread is free (dynamic),
  // not in equal contiguous shares.
  std::vector<int64_t> order(num_seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_seqs)))
  {
    std::vector<float> scores;  // [H, len]
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs; ++task) {
      const int64_t b = order[task];
      const int64_t len = lens[b];
      const int64_t* table = tables + b * table_width;
      const float* q_seq = q_ptr + b * num_heads * head_dim;
      float* out_seq = out_ptr + b * num_heads * head_dim;
      scores.resize(num_heads * len);
      // The block holding this sequence's token `token`, in the K or V pool.
      auto block_at = [&](const float* pool, int64_t token) {
        return pool + table[token / block_size] * block_size * slot_stride;
      };
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const float* k_block = block_at(k_ptr, start);
        const float* k_next = start + block_size < len ? block_at(k_ptr, start + block_size) : nullptr;
        for (int64_t i = 0; i < n; ++i) {
          const float* k_slot = k_block + i * slot_stride;
          prefetch_slot(k_next, i, slot_stride);
          for (int64_t h = 0; h < num_heads; ++h)
            scores[h * len + start + i] = dot(q_seq + h * head_dim, k_slot + (h / group) * head_dim, head_dim) * scale;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {  // softmax, max-subtracted
        float* sc = scores.data() + h * len;
        const float max_score = *std::max_element(sc, sc + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) total += (sc[t] = std::exp(sc[t] - max_score));
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
      }
      std::fill(out_seq, out_seq + num_heads * head_dim, 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const float* v_block = block_at(v_ptr, start);
        const float* v_next = start + block_size < len ? block_at(v_ptr, start + block_size) : nullptr;
        for (int64_t i = 0; i < n; ++i) {
          const float* v_slot = v_block + i * slot_stride;
          prefetch_slot(v_next, i, slot_stride);
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
  }
  return out;
}

// Packed-panel linear: y = x W^T with W stored as panels of kPanel output features,
// packed [ceil(N / kPanel), K, kPanel] (zero padded), so that for each k the panel's kPanel
// weights are one contiguous 64-byte row. A register tile of up to kPanelRows rows of x times
// one panel keeps 2 x kPanelRows AVX2 accumulators over the whole of K: each step loads two
// weight vectors, broadcasts one x value per row and issues two FMAs per row. The panel
// (K x 64 bytes) stays in L1/L2 while every row tile of x passes over it, so the weight is
// read from memory once per call whatever the rows. Threads split the panels.
constexpr int64_t kPanel = 16;
constexpr int kPanelRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
constexpr int64_t kPrefetchMaxRows = 64;

// With kPrefetch, `next` is the panel this thread takes next. Its k-th 64-byte line is
// prefetched (into L2: the panel in use keeps L1) by the row tile with k % num_tiles == tile,
// so the next panel streams in from memory evenly over all of this panel's compute rather
// than after it (or in a burst that fills the core's miss buffers and stalls the FMAs).
template <int MR, bool kPrefetch>
inline void panel_tile(const float* x, int64_t in_features, const float* panel, float* out,
                       int64_t out_features, int64_t n_count, const float* next, int64_t tile, int64_t num_tiles) {
#ifdef HAVE_AVX2_FMA
  // Every loop over MR is unrolled before register allocation (GCC otherwise keeps the
  // accumulator arrays on the stack and stores them back on every step).
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  int64_t prefetch_k = next != nullptr ? tile : in_features;
  for (int64_t k = 0; k < in_features; ++k) {
    if (kPrefetch && k == prefetch_k) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
      prefetch_k += num_tiles;
    }
    const __m256 w_lo = _mm256_load_ps(panel + k * kPanel), w_hi = _mm256_load_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * in_features + k);
      lo[i] = _mm256_fmadd_ps(a, w_lo, lo[i]);
      hi[i] = _mm256_fmadd_ps(a, w_hi, hi[i]);
    }
  }
  alignas(32) float row[kPanel];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(row, lo[i]);
    _mm256_store_ps(row + 8, hi[i]);
    std::memcpy(out + i * out_features, row, n_count * sizeof(float));
  }
#else
  for (int i = 0; i < MR; ++i) {
    float row[kPanel] = {};
    for (int64_t k = 0; k < in_features; ++k)
      for (int64_t j = 0; j < kPanel; ++j) row[j] += x[i * in_features + k] * panel[k * kPanel + j];
    std::memcpy(out + i * out_features, row, n_count * sizeof(float));
  }
#endif
}

template <int MR, bool kPrefetch>
inline void panel_rows(const float* x, int64_t in_features, const float* panel, float* out,
                       int64_t out_features, int64_t n_count, int64_t rows, const float* next, int64_t tile,
                       int64_t num_tiles) {
  if constexpr (MR > 0) {
    if (rows == MR)
      return panel_tile<MR, kPrefetch>(x, in_features, panel, out, out_features, n_count, next, tile, num_tiles);
    panel_rows<MR - 1, kPrefetch>(x, in_features, panel, out, out_features, n_count, rows, next, tile, num_tiles);
  }
}

// x [M, K], packed [P, K, kPanel] (pack_panels in worker/model/layers.py) -> out [M, N].
void linear_packed(torch::Tensor x, torch::Tensor packed, torch::Tensor out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && packed.dtype() == torch::kFloat32, "float32 only");
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
              packed.is_contiguous(), "packed must be a contiguous [P, K, 16] tensor matching x [M, K]");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = out.size(1);
  TORCH_CHECK(out.is_contiguous() && out.dtype() == torch::kFloat32 && out.size(0) == rows &&
              (out_features + kPanel - 1) / kPanel == packed.size(0),
              "out must be a contiguous float32 [M, N] tensor with ceil(N / 16) panels");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr<float>()) % 32 == 0, "packed must be 32-byte aligned");
  const float* x_ptr = x.data_ptr<float>();
  const float* p_ptr = packed.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  // Prefetching pays while the weight stream dominates (decode sizes); at prefill sizes every
  // panel is reused by many row tiles and the compute-bound loop does better without it.
  const bool prefetch = rows <= kPrefetchMaxRows;
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = p_ptr + p * in_features * kPanel;
      const int64_t n0 = p * kPanel, n_count = std::min(kPanel, out_features - n0);
      const float* next = p + 1 < end ? panel + in_features * kPanel : nullptr;
      // Row tiles as even as possible (20 rows: 5+5+5+5, not 6+6+6+2): a short tile has too few
      // independent FMA chains to hide the FMA latency.
      const int64_t tiles = (rows + kPanelRows - 1) / kPanelRows, base = rows / tiles, extra = rows % tiles;
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
        const int64_t tile_rows = base + (t < extra ? 1 : 0);
        if (prefetch)
          panel_rows<kPanelRows, true>(x_ptr + m0 * in_features, in_features, panel, out_ptr + m0 * out_features + n0,
                                       out_features, n_count, tile_rows, next, t, tiles);
        else
          panel_rows<kPanelRows, false>(x_ptr + m0 * in_features, in_features, panel,
                                        out_ptr + m0 * out_features + n0, out_features, n_count, tile_rows, nullptr,
                                        t, tiles);
        m0 += tile_rows;
      }
    }
  });
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
inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

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
        const __m256 w = load_vector(n0 + j, k);
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
#endif

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

template <typename LoadWeights, typename LoadVector, typename Finish>
void quantized_tiles(const float* x_ptr, int64_t rows, int64_t in_features, int64_t out_features,
                     int64_t group_size, float* out_ptr, LoadWeights load_weights, LoadVector load_vector,
                     Finish finish) {
  at::parallel_for(0, (out_features + kTileN - 1) / kTileN, 4, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kTileN, n_count = std::min(kTileN, out_features - n0);
      for (int64_t m0 = 0; m0 < rows; m0 += kTileM) {
        const int64_t m_count = std::min(kTileM, rows - m0);
        float total[kTileM][kTileN] = {};
#ifdef HAVE_AVX2_FMA
        if (n_count == kTileN) {
          static_assert(kTileM == 3, "one case per row count below");
          if (m_count == 3)
            quantized_tile_avx2<3>(x_ptr, in_features, group_size, m0, n0, total, load_vector, finish);
          else if (m_count == 2)
            quantized_tile_avx2<2>(x_ptr, in_features, group_size, m0, n0, total, load_vector, finish);
          else
            quantized_tile_avx2<1>(x_ptr, in_features, group_size, m0, n0, total, load_vector, finish);
        } else
#else
        if (m_count == kTileM && n_count == kTileN)
          quantized_tile<true>(x_ptr, in_features, group_size, m0, m_count, n0, n_count, total, load_weights, finish);
        else
#endif
          quantized_tile<false>(x_ptr, in_features, group_size, m0, m_count, n0, n_count, total, load_weights,
                                finish);
        for (int64_t i = 0; i < m_count; ++i)
          for (int64_t j = 0; j < n_count; ++j) out_ptr[(m0 + i) * out_features + n0 + j] = total[i][j];
      }
    }
  });
}

void check_quantized_args(const torch::Tensor& x, const torch::Tensor& scales, const torch::Tensor& out,
                          int64_t out_features) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) % kLanes == 0, "in_features must be a multiple of 8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous(), "scales: contiguous float32");
  TORCH_CHECK(out.is_contiguous() && out.dtype() == torch::kFloat32 && out.size(0) == x.size(0) &&
              out.size(1) == out_features, "out must be a contiguous float32 [M, N] tensor");
}

// x [M, K] float32, qweight [N, K] int8, scales [N] float32 -> out [M, N].
void linear_small_batch_int8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor out) {
  TORCH_CHECK(qweight.dtype() == torch::kInt8 && qweight.is_contiguous() && qweight.size(1) == x.size(1),
              "qweight: contiguous int8 [N, K]");
  const int64_t in_features = x.size(1), out_features = qweight.size(0);
  check_quantized_args(x, scales, out, out_features);
  const int8_t* q = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  quantized_tiles(
      x.data_ptr<float>(), x.size(0), in_features, out_features, in_features, out.data_ptr<float>(),
      [&](int64_t n, int64_t k, float* w) {
        const int8_t* row = q + n * in_features + k;
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) w[l] = static_cast<float>(row[l]);
      },
#ifdef HAVE_AVX2_FMA
      [&](int64_t n, int64_t k) { return widen_int8(q + n * in_features + k); },
#else
      nullptr,
#endif
      [&](int64_t, int64_t n, int64_t, float dot_q) { return s[n] * dot_q; });
}

// x [M, K] float32, qweight [N, K/2] uint8 (column 2j in the low nibble of byte j, 2j+1 in the
// high one), scales and zeros [N, K/G] float32 -> out [M, N].
void linear_small_batch_int4(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                             int64_t group_size, torch::Tensor out) {
  const int64_t in_features = x.size(1), out_features = qweight.size(0);
  TORCH_CHECK(qweight.dtype() == torch::kUInt8 && qweight.is_contiguous() && qweight.size(1) * 2 == in_features,
              "qweight: contiguous uint8 [N, K/2]");
  TORCH_CHECK(group_size % kLanes == 0 && in_features % group_size == 0, "group size must tile K in 8s");
  TORCH_CHECK(zeros.dtype() == torch::kFloat32 && zeros.is_contiguous(), "zeros: contiguous float32");
  check_quantized_args(x, scales, out, out_features);
  const int64_t rows = x.size(0), num_groups = in_features / group_size;
  const float* x_ptr = x.data_ptr<float>();
  // sum(x_g) per row and group, for the zero-point term.
  std::vector<float> x_sums(rows * num_groups);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) sum += x_ptr[m * in_features + k];
      x_sums[m * num_groups + g] = sum;
    }
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* z = zeros.data_ptr<float>();
  quantized_tiles(
      x_ptr, rows, in_features, out_features, group_size, out.data_ptr<float>(),
      [&](int64_t n, int64_t k, float* w) {
        const uint8_t* bytes = q + n * (in_features / 2) + k / 2;
        for (int64_t b = 0; b < kLanes / 2; ++b) {
          w[2 * b] = static_cast<float>(bytes[b] & 0x0F);
          w[2 * b + 1] = static_cast<float>(bytes[b] >> 4);
        }
      },
#ifdef HAVE_AVX2_FMA
      [&](int64_t n, int64_t k) { return widen_int4(q + n * (in_features / 2) + k / 2); },
#else
      nullptr,
#endif
      [&](int64_t m, int64_t n, int64_t g, float dot_q) {
        return s[n * num_groups + g] * dot_q + z[n * num_groups + g] * x_sums[m * num_groups + g];
      });
}

// out = weight * x / sqrt(mean(x^2) + eps), row by row; x, out [M, D] contiguous.
// Greedy sampling's argmax over each row of logits [B, V]: the first index of the largest
// value (NaN never wins), 8 lanes at a time, rows split over threads. torch's CPU argmax
// takes ~40 us per 32k-vocabulary row on one thread; a 32-row decode step paid 1.2 ms.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2, "float32 [B, V] only");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab >= 1, "empty rows");
  auto out = torch::empty({rows}, torch::kInt64);
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
  m.def("argmax_rows", &argmax_rows, "first index of each row's largest value (CPU, float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm into out (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up into out (CPU, float32)");
  m.def("linear_packed", &linear_packed, "out = x @ weight.T with the weight in 16-feature panels (CPU, float32)");
  m.def("linear_small_batch_int8", &linear_small_batch_int8, "out = x @ dequant(int8 weight).T for few rows");
  m.def("linear_small_batch_int4", &linear_small_batch_int4, "out = x @ dequant(int4 weight).T for few rows");
}
