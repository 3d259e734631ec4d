// Paged decode attention: one new query token per sequence, K/V read in place through the
// block table (no gathered copy). A decode step is bound by how fast K/V stream in from memory
// (every live token of every sequence, every layer), so the kernel walks each sequence's blocks
// front to back once per pass, a block's rows (all KV heads, contiguous) in L1 while every query
// head takes them, with rows a few slots ahead and the next block's first ones prefetched: slots
// sit in blocks scattered over the pool, where the hardware prefetcher stops at every block
// boundary. A half pool (float16, bfloat16) is widened to float32 in registers as it is read, so
// it streams half the bytes.
#include "kernels.h"
#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// Slots ahead to prefetch, into L2 (the slot in use keeps L1). A wide range of distances does
// as well on the bench shape (python -m bench.kernels; figures in docs/benchmarks.md).
constexpr int64_t kPrefetchSlots = 8;

struct SequenceView {
  const float* q;       // [H, D]
  float* out;           // [H, D]
  const int64_t* table;  // block ids
  int64_t len;
};

inline void prefetch_row([[maybe_unused]] const void* row, [[maybe_unused]] int64_t num_bytes) {
#ifdef HAVE_AVX2_FMA
  const char* bytes = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < num_bytes; offset += 64) _mm_prefetch(bytes + offset, _MM_HINT_T1);
#endif
}

// KV: the pools' element type (float, c10::Half or c10::BFloat16).
template <typename KV>
struct PoolView {
  const KV* k;
  const KV* v;
  int64_t block_size, slot_stride, num_heads, group, head_dim;

  // f(t0, base, count, next) for each block of the sequence: its first token, its first slot's row
  // in `pool`, its tokens (< len) and the next block's first row (nullptr after the last). Block by
  // block because the block size is only known at run time: a division and a remainder per token
  // cost more than the token's FMAs.
  template <typename F>
  void for_each_block(const KV* pool, const int64_t* table, int64_t len, F&& f) const {
    const int64_t block_floats = block_size * slot_stride;
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b)
      f(t0, pool + table[b] * block_floats, std::min(block_size, len - t0),
        t0 + block_size < len ? pool + table[b + 1] * block_floats : nullptr);
  }

  // The first min(count, kPrefetchSlots) rows of a block from `first` on, asked for into L2: blocks
  // lie scattered over the pool, where the hardware prefetcher stops.
  void prefetch_block(const KV* first, int64_t count) const {
    for (int64_t s = 0; s < std::min(count, kPrefetchSlots); ++s) prefetch_row(first + s * slot_stride, row_bytes());
  }

  // f(t, row) for each token t < len with its slot's row in `pool`.
  template <typename F>
  void for_each_row(const KV* pool, const int64_t* table, int64_t len, F&& f) const {
    for_each_block(pool, table, len, [&](int64_t t0, const KV* base, int64_t count, const KV*) {
      for (int64_t s = 0; s < count; ++s) f(t0 + s, base + s * slot_stride);
    });
  }

  // Bytes of a slot's row this view reads: its KV heads only (all of them unless split).
  int64_t row_bytes() const { return num_heads / group * head_dim * int64_t(sizeof(KV)); }
};

#ifdef HAVE_AVX2_FMA

// Lane j: q . rows[j][0 .. head_dim) for eight rows of keys, the eight dot products finished in
// one reduction (a reduction per key would cost more than the key's FMAs).
template <typename KV>
inline __m256 eight_dots(const float* q, const KV* const rows[kLanes], int64_t head_dim) {
  __m256 acc[kLanes];
#pragma GCC unroll 8
  for (int j = 0; j < kLanes; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int j = 0; j < kLanes; ++j) acc[j] = _mm256_fmadd_ps(qd, load8(rows[j] + d), acc[j]);
  }
  return sums_of_eight(acc);
}

// out[0 .. 8N) (+)= sum over the block's `count` slots of p[s] * v[s][0 .. 8N): N accumulators held
// in registers over the block, the output read and written once per block, not once per slot.
template <int N, typename KV>
inline void value_chunk(const float* p, const KV* v, int64_t slot_stride, int64_t count, float* out, bool first) {
  __m256 acc[N];
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) acc[i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + i * kLanes);
  for (int64_t s = 0; s < count; ++s) {
    const __m256 weight = _mm256_broadcast_ss(p + s);
    const KV* row = v + s * slot_stride;
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) acc[i] = _mm256_fmadd_ps(weight, load8(row + i * kLanes), acc[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(out + i * kLanes, acc[i]);
}

template <int N, typename KV>
inline void value_chunks(int64_t vectors, const float* p, const KV* v, int64_t slot_stride, int64_t count, float* out,
                         bool first) {
  if constexpr (N > 0) {
    if (vectors == N) return value_chunk<N>(p, v, slot_stride, count, out, first);
    value_chunks<N - 1>(vectors, p, v, slot_stride, count, out, first);
  }
}

// head_dim a multiple of 8. Scores are laid out [head, len rounded up to 8]: each query head's
// dots come eight keys at a time, the keys' rows in L1 while the group's heads take them.
template <typename KV>
void attend_avx2(const SequenceView& seq, const PoolView<KV>& pool, float scale, std::vector<float>& scores) {
  const int64_t num_heads = pool.num_heads, head_dim = pool.head_dim, len = seq.len, group = pool.group;
  const int64_t padded_len = (len + kLanes - 1) / kLanes * kLanes;
  scores.resize(num_heads * padded_len);
  const __m256 scale_v = _mm256_set1_ps(scale);
  // Eight keys at a time, across blocks: their rows, then every head's eight dots.
  const KV* rows[kLanes];
  int64_t filled = 0, first_key = 0;
  auto score_keys = [&] {
    for (int64_t j = filled; j < kLanes; ++j) rows[j] = rows[filled - 1];  // padding: read, never kept
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t head_offset = (h / group) * head_dim;
      const KV* head_rows[kLanes];
#pragma GCC unroll 8
      for (int j = 0; j < kLanes; ++j) head_rows[j] = rows[j] + head_offset;
      _mm256_storeu_ps(scores.data() + h * padded_len + first_key,
                       _mm256_mul_ps(eight_dots(seq.q + h * head_dim, head_rows, head_dim), scale_v));
    }
    first_key += kLanes;
    filled = 0;
  };
  pool.for_each_block(pool.k, seq.table, len, [&](int64_t, const KV* base, int64_t count, const KV* next) {
    if (next != nullptr) pool.prefetch_block(next, count);  // while this block is scored
    for (int64_t s = 0; s < count; ++s) {
      if (s + kPrefetchSlots < count) prefetch_row(base + (s + kPrefetchSlots) * pool.slot_stride, pool.row_bytes());
      rows[filled++] = base + s * pool.slot_stride;
      if (filled == kLanes) score_keys();
    }
  });
  if (filled > 0) score_keys();
  for (int64_t h = 0; h < num_heads; ++h) softmax_in_place(scores.data() + h * padded_len, len);
  // out[h] = sum over slots of p[h, t] * v[t, h / group], block by block, 64 dims at a time.
  constexpr int64_t kChunk = 8 * kLanes;
  pool.for_each_block(pool.v, seq.table, len, [&](int64_t t0, const KV* base, int64_t count, const KV* next) {
    if (next != nullptr) pool.prefetch_block(next, count);
    for (int64_t h = 0; h < num_heads; ++h) {
      const KV* v_head = base + (h / group) * head_dim;
      const float* p = scores.data() + h * padded_len + t0;
      for (int64_t c0 = 0; c0 < head_dim; c0 += kChunk)
        value_chunks<8>(std::min(kChunk, head_dim - c0) / kLanes, p, v_head + c0, pool.slot_stride, count,
                        seq.out + h * head_dim + c0, t0 == 0);
    }
  });
}
#endif

// Any head_dim, no vector extensions: the same two passes, one head at a time.
template <typename KV>
void attend_portable(const SequenceView& seq, const PoolView<KV>& pool, float scale, std::vector<float>& scores) {
  const int64_t num_heads = pool.num_heads, head_dim = pool.head_dim, len = seq.len;
  scores.resize(num_heads * len);
  pool.for_each_row(pool.k, seq.table, len, [&](int64_t t, const KV* k_row) {
    for (int64_t h = 0; h < num_heads; ++h)
      scores[h * len + t] = dot(seq.q + h * head_dim, k_row + (h / pool.group) * head_dim, head_dim) * scale;
  });
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores.data() + h * len;
    const float max_score = *std::max_element(s, s + len);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - max_score));
    for (int64_t t = 0; t < len; ++t) s[t] /= total;
  }
  std::fill(seq.out, seq.out + num_heads * head_dim, 0.f);
  pool.for_each_row(pool.v, seq.table, len, [&](int64_t t, const KV* v_row) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const float p = scores[h * len + t];
      const KV* v_head = v_row + (h / pool.group) * head_dim;
      float* o = seq.out + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * static_cast<float>(v_head[d]);
    }
  });
}

}  // namespace

// The order and split of a step's tasks, shared by its layers: one task per sequence, or, when
// there are fewer sequences than threads (a single stream, the last few requests of a batch), per
// sequence and range of KV heads, so every thread streams part of the K/V. Sequences differ in
// length by 10x or more, so tasks go longest first to whichever thread is free (dynamic), not in
// equal contiguous shares.
DecodeAttentionPlan plan_decode_attention(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                          int64_t num_kv_heads) {
  TORCH_CHECK(block_tables.dtype() == at::kLong && seq_lens.dtype() == at::kLong && block_tables.dim() == 2 &&
              block_tables.is_contiguous() && seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0),
              "paged_decode_attention: contiguous int64 block_tables [B, W] and seq_lens [B]");
  DecodeAttentionPlan plan;
  plan.num_seqs = seq_lens.size(0);
  plan.table_width = block_tables.size(1);
  plan.tables = block_tables.data_ptr<int64_t>();
  plan.lens = seq_lens.data_ptr<int64_t>();
  const int64_t threads = at::get_num_threads();
  plan.splits = plan.num_seqs == 0 || plan.num_seqs >= threads ? 1 : std::min(num_kv_heads, (threads + plan.num_seqs - 1) / plan.num_seqs);
  plan.order.resize(plan.num_seqs);
  std::iota(plan.order.begin(), plan.order.end(), 0);
  const int64_t* lens = plan.lens;
  for (int64_t b = 0; b < plan.num_seqs; ++b)
    TORCH_CHECK(lens[b] >= 1, "paged_decode_attention: every sequence holds at least its new token");
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  return plan;
}

// One layer: q rows `q_seq_stride` floats apart (heads and dims contiguous), out [B, H, D]
// contiguous. Nothing here goes through the dispatcher: called once per layer inside the step,
// where the weights just streamed through have evicted whatever a tensor op would touch.
void decode_attention_layer(const DecodeAttentionPlan& plan, const float* q, int64_t q_seq_stride,
                            const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t num_heads, int64_t head_dim,
                            double scale, float* out) {
  const int64_t num_kv_heads = k_cache.size(2), splits = plan.splits, num_tasks = plan.num_seqs * plan.splits;
  [[maybe_unused]] bool vectorised = false;
#ifdef HAVE_AVX2_FMA
  vectorised = head_dim % kLanes == 0;
#endif
  with_kv_type(k_cache, v_cache, "paged_decode_attention", [&](auto zero) {
    using KV = decltype(zero);
    const PoolView<KV> pool{static_cast<const KV*>(k_cache.data_ptr()), static_cast<const KV*>(v_cache.data_ptr()),
                            k_cache.size(1), num_kv_heads * head_dim, num_heads, num_heads / num_kv_heads, head_dim};
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks)))
    {
      // Kept per thread across calls: a step calls this once per layer.
      thread_local std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < num_tasks; ++task) {
        const int64_t b = plan.order[task / splits], split = task % splits;
        // KV heads [kv0, kv1) and their query heads [kv0 * group, kv1 * group): the same pool with
        // its rows read from the first of those heads on.
        const int64_t kv0 = split * num_kv_heads / splits, kv1 = (split + 1) * num_kv_heads / splits;
        const int64_t h0 = kv0 * pool.group;
        const PoolView<KV> part{pool.k + kv0 * head_dim, pool.v + kv0 * head_dim, pool.block_size, pool.slot_stride,
                                (kv1 - kv0) * pool.group, pool.group, head_dim};
        const SequenceView seq{q + b * q_seq_stride + h0 * head_dim, out + (b * num_heads + h0) * head_dim,
                               plan.tables + b * plan.table_width, plan.lens[b]};
#ifdef HAVE_AVX2_FMA
        if (vectorised) {
          attend_avx2(seq, part, static_cast<float>(scale), scores);
          continue;
        }
#endif
        attend_portable(seq, part, static_cast<float>(scale), scores);
      }
    }
  });
}

// q [B, H, D] float32; k_cache, v_cache [N, S, Hkv, D] float32, float16 or bfloat16 (both the
// same); block_tables [B, W] int64; seq_lens [B] int64. Returns [B, H, D] float32.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == at::kFloat, "paged_decode_attention: q must be float32, got ", q.scalar_type());
  check_kv_pools(k_cache, v_cache, "paged_decode_attention");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const DecodeAttentionPlan plan = plan_decode_attention(block_tables, seq_lens, k_cache.size(2));
  TORCH_CHECK(q.dim() == 3 && q.size(0) == plan.num_seqs, "paged_decode_attention: q [B, H, D], one row per sequence");
  auto out = q.new_empty(q.sizes());
  decode_attention_layer(plan, q.data_ptr<float>(), q.size(1) * q.size(2), k_cache, v_cache, q.size(1), q.size(2),
                         scale, out.data_ptr<float>());
  return out;
}
