// Paged decode attention: one new query token per sequence, K/V read in place through the
// block table (no gathered copy). A decode step is bound by how fast K/V stream in from memory
// (every live token of every sequence, every layer), so the kernel reads each slot's row (all
// KV heads, contiguous) once per pass, front to back, with the row a few slots ahead
// prefetched: slots sit in blocks scattered over the pool, where the hardware prefetcher
// stops at every block boundary. A half pool (float16, bfloat16) is widened to float32 in
// registers as it is read, so it streams half the bytes.
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

// KV: the pools' element type (float, c10::Half or c10::BFloat16).
template <typename KV>
struct PoolView {
  const KV* k;
  const KV* v;
  int64_t block_size, slot_stride, num_heads, group, head_dim;

  const KV* slot(const KV* pool, const int64_t* table, int64_t token) const {
    return pool + (table[token / block_size] * block_size + token % block_size) * slot_stride;
  }

  // Bytes of a slot's row this view reads: its KV heads only (all of them unless split).
  int64_t row_bytes() const { return num_heads / group * head_dim * int64_t(sizeof(KV)); }
};

#ifdef HAVE_AVX2_FMA
inline void prefetch_row(const void* row, int64_t num_bytes) {
  const char* bytes = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < num_bytes; offset += 64) _mm_prefetch(bytes + offset, _MM_HINT_T1);
}

// Lane i: q_head[i] . k_head[i] over head_dim (a multiple of 8), for the first `active` (at most
// kMax) of them, unrolled where active is kMax; lanes past those are 0.
template <int kMax, typename KV>
inline __m256 head_dots(const float* const* q_head, const KV* const* k_head, int64_t head_dim, int64_t active = kMax) {
  __m256 acc[kLanes];
#pragma GCC unroll 8
  for (int i = 0; i < kLanes; ++i) acc[i] = _mm256_setzero_ps();
  if (active == kMax) {
    for (int64_t d = 0; d < head_dim; d += kLanes) {
#pragma GCC unroll 8
      for (int i = 0; i < kMax; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q_head[i] + d), load8(k_head[i] + d), acc[i]);
    }
  } else {
    for (int64_t d = 0; d < head_dim; d += kLanes)
      for (int64_t i = 0; i < active; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q_head[i] + d), load8(k_head[i] + d), acc[i]);
  }
  return sums_of_eight(acc);
}

// head_dim a multiple of 8. Scores are laid out [len, heads rounded up to 8], so the softmax
// runs across 8 heads per vector with no horizontal step.
template <typename KV>
void attend_avx2(const SequenceView& seq, const PoolView<KV>& pool, float scale, std::vector<float>& scores) {
  const int64_t num_heads = pool.num_heads, head_dim = pool.head_dim, len = seq.len;
  const int64_t padded_heads = (num_heads + kLanes - 1) / kLanes * kLanes;
  scores.resize(len * padded_heads + padded_heads);  // the scores, then 1 / sum per head
  float* inverse = scores.data() + len * padded_heads;
  const __m256 scale_v = _mm256_set1_ps(scale);
  // q . k for 8 heads of one slot at a time, as 8 accumulators summed in one step; heads past
  // the last (padding) repeat it and are never read.
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchSlots < len) prefetch_row(pool.slot(pool.k, seq.table, t + kPrefetchSlots), pool.row_bytes());
    const KV* k_row = pool.slot(pool.k, seq.table, t);
    for (int64_t h0 = 0; h0 < padded_heads; h0 += kLanes) {
      const float* q_head[kLanes];
      const KV* k_head[kLanes];
      const int64_t active = std::min(kLanes, num_heads - h0);
      for (int64_t i = 0; i < active; ++i) {
        q_head[i] = seq.q + (h0 + i) * head_dim;
        k_head[i] = k_row + ((h0 + i) / pool.group) * head_dim;
      }
      // Padding lanes (heads past the last) score 0 and are never read: a task of 4 or 2 heads
      // (a single stream's KV heads split between threads) computes only those.
      __m256 dots;
      if (active == kLanes)
        dots = head_dots<kLanes>(q_head, k_head, head_dim);
      else if (active == 4)
        dots = head_dots<4>(q_head, k_head, head_dim);
      else if (active == 2)
        dots = head_dots<2>(q_head, k_head, head_dim);
      else
        dots = head_dots<kLanes>(q_head, k_head, head_dim, active);
      _mm256_storeu_ps(scores.data() + t * padded_heads + h0, _mm256_mul_ps(dots, scale_v));
    }
  }
  // Softmax numerators in place (max-subtracted); the 1 / sum is applied to the output.
  for (int64_t h0 = 0; h0 < padded_heads; h0 += kLanes) {
    __m256 max_v = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < len; ++t) max_v = _mm256_max_ps(max_v, _mm256_loadu_ps(scores.data() + t * padded_heads + h0));
    __m256 total = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      float* s = scores.data() + t * padded_heads + h0;
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s), max_v));
      _mm256_storeu_ps(s, e);
      total = _mm256_add_ps(total, e);
    }
    _mm256_storeu_ps(inverse + h0, _mm256_div_ps(_mm256_set1_ps(1.f), total));
  }
  // out[h] = sum over slots of p[t, h] * v[t, h / group]; out stays in L1 across the slots.
  std::fill(seq.out, seq.out + num_heads * head_dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchSlots < len) prefetch_row(pool.slot(pool.v, seq.table, t + kPrefetchSlots), pool.row_bytes());
    const KV* v_row = pool.slot(pool.v, seq.table, t);
    const float* p = scores.data() + t * padded_heads;
    for (int64_t h = 0; h < num_heads; ++h) {
      const __m256 weight = _mm256_broadcast_ss(p + h);
      const KV* v_head = v_row + (h / pool.group) * head_dim;
      float* o = seq.out + h * head_dim;
      for (int64_t d = 0; d < head_dim; d += kLanes)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(weight, load8(v_head + d), _mm256_loadu_ps(o + d)));
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    const __m256 inv = _mm256_set1_ps(inverse[h]);
    float* o = seq.out + h * head_dim;
    for (int64_t d = 0; d < head_dim; d += kLanes) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
  }
}
#endif

// Any head_dim, no vector extensions: the same two passes, one head at a time.
template <typename KV>
void attend_portable(const SequenceView& seq, const PoolView<KV>& pool, float scale, std::vector<float>& scores) {
  const int64_t num_heads = pool.num_heads, head_dim = pool.head_dim, len = seq.len;
  scores.resize(num_heads * len);
  for (int64_t t = 0; t < len; ++t) {
    const KV* k_row = pool.slot(pool.k, seq.table, t);
    for (int64_t h = 0; h < num_heads; ++h)
      scores[h * len + t] = dot(seq.q + h * head_dim, k_row + (h / pool.group) * head_dim, head_dim) * scale;
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores.data() + h * len;
    const float max_score = *std::max_element(s, s + len);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - max_score));
    for (int64_t t = 0; t < len; ++t) s[t] /= total;
  }
  std::fill(seq.out, seq.out + num_heads * head_dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const KV* v_row = pool.slot(pool.v, seq.table, t);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float p = scores[h * len + t];
      const KV* v_head = v_row + (h / pool.group) * head_dim;
      float* o = seq.out + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * static_cast<float>(v_head[d]);
    }
  }
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
