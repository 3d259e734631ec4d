// Paged prefill attention: the prompt chunks of one step, each attending causally to its
// cached context and to itself, with K/V read through the block tables (the step's own K/V
// are already in the cache). Two register-tiled products per (sequence, KV head) and tile of
// 6 query rows (a row = one query position x one query head of the group):
//   S = Q K^T  over key panels of 16, K packed once per (sequence, KV head) as [keys/16, D, 16];
//   O = P V    over the keys, V read in place (16 head dims at a time) through the block table.
// Key panels wholly past a tile's last position are skipped, so the causal half costs nothing.
// A half pool (float16, bfloat16) is widened to float32 as K is packed and as V is read.
#include "kernels.h"
#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#ifdef HAVE_AVX2_FMA
namespace {

constexpr int64_t kKeys = 16;   // keys per K panel; also head dims per V column block
constexpr int kTileRows = 6;    // 12 accumulators + 2 loads + 1 broadcast of 16 registers
constexpr int64_t kPrefetchKeys = 8;  // V rows sit 1 slot row apart, blocks scattered: fetch ahead

struct Sequence {
  int64_t q_start, q_len, ctx;    // rows of q/out, new tokens, tokens cached before them
  const float* k_panels;          // [ceil(L / 16), D, 16] per KV head, heads one after another
  const int64_t* slots;           // [L] flat slot of each key
  int64_t len() const { return ctx + q_len; }
};

struct Shapes {
  int64_t num_heads, group, head_dim, slot_stride, q_row_stride, out_row_stride;
  float scale;
};

// Row r of a tile -> its query position and head: rows run position-major over the group.
struct TileRows {
  const float* q[kTileRows];
  float* out[kTileRows];
  int64_t limit[kTileRows];  // keys visible to the row: position + 1
  int count;
  int64_t max_limit;
};

// S[r][key] for one panel of 16 keys: acc over the head dims.
template <int MR>
inline void score_panel(const TileRows& rows, const float* panel, int64_t head_dim, float scale, float* s,
                        int64_t s_stride, int64_t key0) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m256 w_lo = _mm256_load_ps(panel + d * kKeys), w_hi = _mm256_load_ps(panel + d * kKeys + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(rows.q[i] + d);
      lo[i] = _mm256_fmadd_ps(a, w_lo, lo[i]);
      hi[i] = _mm256_fmadd_ps(a, w_hi, hi[i]);
    }
  }
  const __m256 scale_v = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(s + i * s_stride + key0, _mm256_mul_ps(lo[i], scale_v));
    _mm256_storeu_ps(s + i * s_stride + key0 + 8, _mm256_mul_ps(hi[i], scale_v));
  }
}

// out[r][c0 .. c0 + 16) = sum over keys of P[r][key] * V[key][c0 ..], keys up to the tile's limit.
template <int MR, typename KV>
inline void value_block(const TileRows& rows, const float* p, int64_t p_stride, const KV* v_pool,
                        const int64_t* slots, int64_t slot_stride, int64_t head_offset, int64_t c0) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < rows.max_limit; ++t) {
    const KV* v = v_pool + slots[t] * slot_stride + head_offset + c0;
    if (t + kPrefetchKeys < rows.max_limit)
      _mm_prefetch(reinterpret_cast<const char*>(v_pool + slots[t + kPrefetchKeys] * slot_stride + head_offset + c0),
                   _MM_HINT_T0);
    const __m256 w_lo = load8(v), w_hi = load8(v + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(p + i * p_stride + t);
      lo[i] = _mm256_fmadd_ps(a, w_lo, lo[i]);
      hi[i] = _mm256_fmadd_ps(a, w_hi, hi[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(rows.out[i] + c0, lo[i]);
    _mm256_storeu_ps(rows.out[i] + c0 + 8, hi[i]);
  }
}

template <int MR, typename KV>
void attend_tile(const TileRows& rows, const Sequence& seq, const Shapes& shapes, int64_t kv_head,
                 const KV* v_pool, std::vector<float>& scores) {
  const int64_t len = seq.len(), panels = (rows.max_limit + kKeys - 1) / kKeys;
  const int64_t s_stride = panels * kKeys;
  scores.resize(MR * s_stride);
  const int64_t panel_floats = shapes.head_dim * kKeys;
  const float* k_panels = seq.k_panels + kv_head * ((len + kKeys - 1) / kKeys) * panel_floats;
  for (int64_t p = 0; p < panels; ++p)
    score_panel<MR>(rows, k_panels + p * panel_floats, shapes.head_dim, shapes.scale, scores.data(), s_stride,
                    p * kKeys);
  // Each row over its visible keys; zeros from there to the tile's limit.
  for (int i = 0; i < MR; ++i) {
    float* s = scores.data() + i * s_stride;
    softmax_in_place(s, rows.limit[i]);
    std::fill(s + rows.limit[i], s + rows.max_limit, 0.f);
  }
  for (int64_t c0 = 0; c0 < shapes.head_dim; c0 += kKeys)
    value_block<MR>(rows, scores.data(), s_stride, v_pool, seq.slots, shapes.slot_stride,
                    kv_head * shapes.head_dim, c0);
}

template <int MR, typename KV>
void attend_rows(int count, const TileRows& rows, const Sequence& seq, const Shapes& shapes, int64_t kv_head,
                 const KV* v_pool, std::vector<float>& scores) {
  if constexpr (MR > 0) {
    if (count == MR) return attend_tile<MR>(rows, seq, shapes, kv_head, v_pool, scores);
    attend_rows<MR - 1>(count, rows, seq, shapes, kv_head, v_pool, scores);
  }
}

// K of one sequence's KV head as its panels: panel p holds keys 16p .. 16p + 15 side by side for
// each head dim, keys past the sequence zero. Eight keys' rows at a time, eight head dims at a
// time, go through one 8 x 8 transpose: a scalar copy wrote each float on its own, 16 floats apart.
template <typename KV>
void pack_k(const KV* k_pool, const Sequence& seq, int64_t slot_stride, int64_t head_offset, int64_t head_dim,
            float* dst) {
  const int64_t len = seq.len(), panels = (len + kKeys - 1) / kKeys;
  for (int64_t p = 0; p < panels; ++p) {
    float* panel = dst + p * head_dim * kKeys;
    for (int64_t lane0 = 0; lane0 < kKeys; lane0 += kLanes) {
      const int64_t t0 = p * kKeys + lane0, valid = std::clamp<int64_t>(len - t0, 0, kLanes);
      const KV* rows[kLanes];
      for (int64_t j = 0; j < valid; ++j) rows[j] = k_pool + seq.slots[t0 + j] * slot_stride + head_offset;
      for (int64_t d0 = 0; d0 < head_dim; d0 += kLanes) {
        __m256 r[kLanes];
        if (valid == kLanes) {
#pragma GCC unroll 8
          for (int j = 0; j < kLanes; ++j) r[j] = load8(rows[j] + d0);
        } else {
          for (int64_t j = 0; j < kLanes; ++j) r[j] = j < valid ? load8(rows[j] + d0) : _mm256_setzero_ps();
        }
        transpose8x8(r);
#pragma GCC unroll 8
        for (int i = 0; i < kLanes; ++i) _mm256_storeu_ps(panel + (d0 + i) * kKeys + lane0, r[i]);
      }
    }
  }
}

}  // namespace
#endif

bool prefill_attention_supported(int64_t head_dim) {
#ifdef HAVE_AVX2_FMA
  return head_dim % 16 == 0;
#else
  return false;
#endif
}

// q [T, H, D] float32 (rows may be strided; heads and dims contiguous), the prompt-chunk tokens
// of the step, sequence after sequence; out [T, H, D] float32 contiguous rows, written. k_cache,
// v_cache [N, S, Hkv, D] float32, float16 or bfloat16 (both the same). block_tables [S, W],
// seq_lens [S] (cached + new), query_starts [S + 1] (row offsets into q and out).
void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                             at::Tensor seq_lens, at::Tensor query_starts, double scale, at::Tensor out) {
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat,
              "paged_prefill_attention: q and out must be float32, got ", q.scalar_type(), " and ", out.scalar_type());
  check_kv_pools(k_cache, v_cache, "paged_prefill_attention");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(prefill_attention_supported(head_dim), "head_dim must be a multiple of 16 (and AVX2 available)");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim && out.stride(2) == 1 && out.stride(1) == head_dim,
              "heads and dims of q and out must be contiguous");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == num_heads && out.size(2) == head_dim, "out shaped like q");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  query_starts = query_starts.contiguous();
  const int64_t num_seqs = seq_lens.size(0), block_size = k_cache.size(1), table_width = block_tables.size(1);
  TORCH_CHECK(seq_lens.dtype() == at::kLong && query_starts.dtype() == at::kLong && block_tables.dtype() == at::kLong,
              "seq_lens, query_starts and block_tables: int64");
  TORCH_CHECK(query_starts.size(0) == num_seqs + 1 && query_starts.data_ptr<int64_t>()[num_seqs] == q.size(0),
              "query_starts: S + 1 offsets ending at q's row count");
#ifdef HAVE_AVX2_FMA
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const Shapes shapes{num_heads, num_heads / num_kv_heads, head_dim, num_kv_heads * head_dim, q.stride(0),
                      out.stride(0), static_cast<float>(scale)};
  // Per sequence: every key's slot, and K packed per KV head.
  std::vector<Sequence> seqs(num_seqs);
  std::vector<int64_t> slot_offset(num_seqs + 1, 0), panel_offset(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 1 && lens[s] >= q_len, "each sequence brings at least one token, within its length");
    slot_offset[s + 1] = slot_offset[s] + lens[s];
    panel_offset[s + 1] = panel_offset[s] + num_kv_heads * ((lens[s] + kKeys - 1) / kKeys) * head_dim * kKeys;
  }
  std::vector<int64_t> slots(slot_offset[num_seqs]);
  auto packed = k_cache.new_empty({panel_offset[num_seqs]}, at::kFloat);
  float* packed_ptr = packed.data_ptr<float>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t* table = tables + s * table_width;
    for (int64_t t = 0; t < lens[s]; ++t) slots[slot_offset[s] + t] = table[t / block_size] * block_size + t % block_size;
    seqs[s] = Sequence{starts[s], starts[s + 1] - starts[s], lens[s] - (starts[s + 1] - starts[s]),
                       packed_ptr + panel_offset[s], slots.data() + slot_offset[s]};
  }
  // Groups: (sequence, KV head), each packed once.
  const int64_t num_groups = num_seqs * num_kv_heads;
  // The tiles' float operations, per sequence's group and in all: a step too small to wake the
  // other threads for runs on this one.
  int64_t work = 0, largest = 0, num_tiles = 0;
  for (const Sequence& seq : seqs) {
    const int64_t group_work = seq.q_len * shapes.group * seq.len() * 4 * head_dim;
    work += group_work * num_kv_heads;
    largest = std::max(largest, group_work);
    num_tiles += num_kv_heads * ((seq.q_len * shapes.group + kTileRows - 1) / kTileRows);
  }
  const int64_t threads =
      work < kMinParallelWork ? 1 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tiles));
  // Where the groups share out evenly (a whole number each, none much larger than the rest: one
  // chunk's KV heads), a thread packs a group's K and attends all its tiles, so the panels never
  // move between cores' caches; otherwise every thread packs, then takes tiles as they come.
  const bool by_group = num_groups % threads == 0 && largest * num_groups * 5 <= work * 6;
  // Work items: (group, tile of rows), longest rows first (a late tile sees the most keys).
  struct Item { int64_t seq, kv_head, row0; };
  std::vector<Item> items;
  if (!by_group) {
    for (int64_t s = 0; s < num_seqs; ++s)
      for (int64_t g = 0; g < num_kv_heads; ++g)
        for (int64_t r = 0; r < seqs[s].q_len * shapes.group; r += kTileRows) items.push_back({s, g, r});
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
      return seqs[a.seq].ctx + a.row0 / shapes.group > seqs[b.seq].ctx + b.row0 / shapes.group;
    });
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  with_kv_type(k_cache, v_cache, "paged_prefill_attention", [&](auto zero) {
    using KV = decltype(zero);
    const KV* k_pool = k_cache.data_ptr<KV>();
    const KV* v_pool = v_cache.data_ptr<KV>();
    auto pack = [&](int64_t group) {
      const Sequence& seq = seqs[group / num_kv_heads];
      const int64_t g = group % num_kv_heads, panels = (seq.len() + kKeys - 1) / kKeys;
      pack_k(k_pool, seq, shapes.slot_stride, g * head_dim, head_dim,
             const_cast<float*>(seq.k_panels) + g * panels * head_dim * kKeys);
    };
    auto attend = [&](int64_t s, int64_t kv_head, int64_t row0, std::vector<float>& scores) {
      const Sequence& seq = seqs[s];
      TileRows rows;
      rows.count = static_cast<int>(std::min<int64_t>(kTileRows, seq.q_len * shapes.group - row0));
      rows.max_limit = 0;
      for (int i = 0; i < rows.count; ++i) {
        const int64_t r = row0 + i, position = r / shapes.group;
        const int64_t head = kv_head * shapes.group + r % shapes.group;
        rows.q[i] = q_ptr + (seq.q_start + position) * shapes.q_row_stride + head * head_dim;
        rows.out[i] = out_ptr + (seq.q_start + position) * shapes.out_row_stride + head * head_dim;
        rows.limit[i] = seq.ctx + position + 1;
        rows.max_limit = std::max(rows.max_limit, rows.limit[i]);
      }
      attend_rows<kTileRows>(rows.count, rows, seq, shapes, kv_head, v_pool, scores);
    };
#pragma omp parallel num_threads(threads)
    {
      std::vector<float> scores;
      if (by_group) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < num_groups; ++n) {
          const int64_t s = n / num_kv_heads, g = n % num_kv_heads;
          pack(n);
          // Latest rows first, as the items below.
          const int64_t last = (seqs[s].q_len * shapes.group - 1) / kTileRows * kTileRows;
          for (int64_t row0 = last; row0 >= 0; row0 -= kTileRows) attend(s, g, row0, scores);
        }
      } else {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < num_groups; ++n) pack(n);
        // The loop's closing barrier: every panel is packed before any tile reads it.
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < num_items; ++n) attend(items[n].seq, items[n].kv_head, items[n].row0, scores);
      }
    }
  });
#endif
}
