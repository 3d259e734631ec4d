// The int8-activation kernels' route for calls of many rows (a batched decode step, a prefill
// chunk) with AVX-512 VNNI: output-major panels of integer weights, one 32-bit lane per output.
// The dot-product tiles (int8_activations_avx512.h) spend a conversion and a scaling FMA on every
// 64 products, since each lane holds a partial block; here each lane is one output's whole
// block, so per block of 32 features one VNNI instruction per 4 features and 16 outputs (x's 4
// bytes broadcast) and then one conversion and one FMA per 16 outputs: about 1.3 instructions per
// 64 products where the tiles take about 4.5. Each run of 16 weight rows is laid out once per
// call (a 16 x 16 transpose of 4-byte words per slot of 64 features) into a panel in L2 that
// every row tile of x passes over. The arithmetic is the tiles' (linear_int8_activations.cpp):
// exact integer block dots scaled by x's block scale, then by the weight's group scale, plus the
// int4 zero-point term; only the order of the float sums differs.
#pragma once

#include "int8_activations.h"
#include "int8_activations_avx512.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace int8_activations {

#ifdef HAVE_AVX512_VNNI
constexpr int64_t kPanelOutputs = 16;         // outputs per panel: one int32 lane each
constexpr int64_t kPanelTiles = kPanelOutputs / kCols;  // weight tiles (of kCols rows) per panel
constexpr int64_t kQuads = kSlot / 4;         // 4-byte words per slot
constexpr int64_t kManyRowsTile = 4;          // rows of x per register tile: 3 x 2 x 4 accumulators
constexpr int64_t kPanelBytesPerSlot = kQuads * kPanelOutputs * 4;
static_assert(kPanelOutputs == 2 * kColumnRows, "a panel's scales are two runs of the group columns");

// r[j] (row j: 16 words) -> r[c] (word c of rows 0..15).
inline void transpose_words(__m512i r[16]) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {  // lane L: words 4L + (0, 1) and (2, 3) of rows 2k, 2k + 1
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // r[4k + e], lane L: word 4L + e of rows 4k..4k + 3
    r[4 * k + 0] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // word 4L + e of all rows: lane L of r[e], r[4 + e], r[8 + e], r[12 + e]
    const __m512i u01 = _mm512_shuffle_i32x4(r[e], r[4 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i u23 = _mm512_shuffle_i32x4(r[e], r[4 + e], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i v01 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i v23 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], _MM_SHUFFLE(3, 2, 3, 2));
    t[e] = _mm512_shuffle_i32x4(u01, v01, _MM_SHUFFLE(2, 0, 2, 0));
    t[4 + e] = _mm512_shuffle_i32x4(u01, v01, _MM_SHUFFLE(3, 1, 3, 1));
    t[8 + e] = _mm512_shuffle_i32x4(u23, v23, _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + e] = _mm512_shuffle_i32x4(u23, v23, _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int c = 0; c < 16; ++c) r[c] = t[c];
}

// Panel `panel` (weight tiles kPanelTiles x panel..; those past num_tiles zero) as slots_per_row
// runs of kQuads x 16 outputs x 4 bytes: int8 bytes as stored (weight + 128), int4 a unit's first
// slot as its low nibbles and its second as its high ones in place (16 x the weight, as the tiles
// read them: x's lane scales carry the 1/16).
inline void fill_panel(const WeightPanels& panels, bool int8, int64_t panel, int64_t num_tiles, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int64_t slot = 0; slot < panels.slots_per_row; ++slot) {
    const int64_t u = int8 ? slot : slot / 2;
    __m512i r[16];
    for (int64_t j = 0; j < kPanelOutputs; ++j) {
      const int64_t tile = panel * kPanelTiles + j / kCols;
      if (tile >= num_tiles) {
        r[j] = _mm512_setzero_si512();
        continue;
      }
      const __m512i unit = _mm512_loadu_si512(panels.unit(tile, u, j % kCols));
      r[j] = int8 ? unit : _mm512_and_si512(unit, slot % 2 ? high : low);
    }
    transpose_words(r);
    for (int c = 0; c < 16; ++c) _mm512_store_si512(out + slot * kPanelBytesPerSlot + c * 64, r[c]);
  }
}

// What the row tiles read of x: the slotted bytes, one scale per block (lane scales' first of
// each 8) and, for int8 weights, one offset per block (-128 x the block's sum of xq).
struct BlockActivations {
  const SlottedActivations* slotted;
  std::vector<float> scales;
  std::vector<int32_t> offsets;
  int64_t blocks_per_row;
};

inline BlockActivations block_activations(const SlottedActivations& s, int64_t rows, int64_t slots_per_row,
                                          bool int8) {
  BlockActivations b{&s, {}, {}, 2 * slots_per_row};
  b.scales.resize(rows * b.blocks_per_row);
  if (int8) b.offsets.resize(rows * b.blocks_per_row);
  for (int64_t i = 0; i < rows * b.blocks_per_row; ++i) {
    b.scales[i] = s.lane_scales[i * 8];
    if (int8) {
      int32_t sum = 0;
      for (int l = 0; l < 8; ++l) sum += s.lane_offsets[i * 8 + l];
      b.offsets[i] = sum;
    }
  }
  return b;
}

// Group g's 16 values of a panel from its two runs of the group columns (int8_activation_group_columns):
// its scales at offset 0, its zeros at kColumnRows.
inline __m512 panel_values(const float* low_run, const float* high_run, int64_t g, int64_t offset) {
  const int64_t at = g * 2 * kColumnRows + offset;
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(low_run + at))),
                                             _mm256_castps_pd(_mm256_loadu_ps(high_run + at)), 1));
}

// R rows of x from m0 by P panels (filled, side by side in `filled`), every group: out[m][n] for
// the panels' n_count outputs. `runs[2p]`, `runs[2p + 1]`: panel p's two runs of the group
// columns; `x_sums` [rows, num_groups] for the zero-point term (null for int8).
// `prefetch(slot)`, called once per slot, asks for what the next panels' fill will read of it.
template <int R, int P, bool kInt8, typename Prefetch>
inline void many_rows_tile(const BlockActivations& a, const uint8_t* filled, int64_t filled_stride,
                           const float* const* runs, const float* x_sums, int64_t slots_per_row,
                           int64_t slots_per_group, int64_t m0, float* out, int64_t out_features, int64_t n0,
                           int64_t n_count, Prefetch& prefetch) {
  const int64_t num_groups = slots_per_row / slots_per_group;
  const int8_t* x = a.slotted->bytes.data();
  const int64_t x_stride = slots_per_row * kSlot;
  __m512 total[R][P], group_sum[R][P];
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < P; ++p) total[i][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int i = 0; i < R; ++i)
      for (int p = 0; p < P; ++p) group_sum[i][p] = _mm512_setzero_ps();
    for (int64_t slot = g * slots_per_group; slot < (g + 1) * slots_per_group; ++slot) {
      prefetch(slot);
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t block = 2 * slot + half;
        __m512i acc[R][P];
        for (int i = 0; i < R; ++i)
          for (int p = 0; p < P; ++p)
            acc[i][p] = kInt8 ? _mm512_set1_epi32(a.offsets[(m0 + i) * a.blocks_per_row + block])
                              : _mm512_setzero_si512();
        const uint8_t* words = filled + slot * kPanelBytesPerSlot + half * (kQuads / 2) * 64;
        const int8_t* xs = x + m0 * x_stride + slot * kSlot + half * kBlock;
#pragma GCC unroll 8
        for (int c = 0; c < kQuads / 2; ++c) {
          __m512i w[P];
          for (int p = 0; p < P; ++p) w[p] = _mm512_load_si512(words + p * filled_stride + c * 64);
          for (int i = 0; i < R; ++i) {
            int32_t word;
            std::memcpy(&word, xs + i * x_stride + 4 * c, 4);
            const __m512i broadcast = _mm512_set1_epi32(word);
            for (int p = 0; p < P; ++p) acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], w[p], broadcast);
          }
        }
        for (int i = 0; i < R; ++i) {
          const __m512 scale = _mm512_set1_ps(a.scales[(m0 + i) * a.blocks_per_row + block]);
          for (int p = 0; p < P; ++p)
            group_sum[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][p]), scale, group_sum[i][p]);
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      const __m512 scale = panel_values(runs[2 * p], runs[2 * p + 1], g, 0);
      for (int i = 0; i < R; ++i) total[i][p] = _mm512_fmadd_ps(group_sum[i][p], scale, total[i][p]);
      if constexpr (!kInt8) {
        const __m512 zero = panel_values(runs[2 * p], runs[2 * p + 1], g, kColumnRows);
        for (int i = 0; i < R; ++i)
          total[i][p] = _mm512_fmadd_ps(zero, _mm512_set1_ps(x_sums[(m0 + i) * num_groups + g]), total[i][p]);
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t count = std::min<int64_t>(kPanelOutputs, n_count - p * kPanelOutputs);
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(out + (m0 + i) * out_features + n0 + p * kPanelOutputs, live, total[i][p]);
  }
}

// Every row tile over the filled panels; the first also prefetches (`prefetch`), so the next
// panels' weights stream in from memory over this compute rather than in a burst at their fill.
template <int P, bool kInt8, typename Prefetch>
inline void many_rows_tiles(int64_t rows, const BlockActivations& a, const uint8_t* filled, int64_t filled_stride,
                            const float* const* runs, const float* x_sums, int64_t slots_per_row,
                            int64_t slots_per_group, float* out, int64_t out_features, int64_t n0, int64_t n_count,
                            Prefetch& prefetch) {
  auto none = [](int64_t) {};
  for (int64_t m0 = 0; m0 < rows; m0 += kManyRowsTile) {
    const int64_t r = std::min(kManyRowsTile, rows - m0);
    static_assert(kManyRowsTile == 4, "one case per row count below");
    auto run = [&](auto rows_constant) {
      constexpr int kR = decltype(rows_constant)::value;
      if (m0 == 0)
        many_rows_tile<kR, P, kInt8>(a, filled, filled_stride, runs, x_sums, slots_per_row, slots_per_group, m0, out,
                                     out_features, n0, n_count, prefetch);
      else
        many_rows_tile<kR, P, kInt8>(a, filled, filled_stride, runs, x_sums, slots_per_row, slots_per_group, m0, out,
                                     out_features, n0, n_count, none);
    };
    if (r == 4) run(std::integral_constant<int, 4>{});
    else if (r == 3) run(std::integral_constant<int, 3>{});
    else if (r == 2) run(std::integral_constant<int, 2>{});
    else run(std::integral_constant<int, 1>{});
  }
}

// The whole call: panels over threads, two at a time (each broadcast of x feeds both), each
// filled once and passed over by every row tile. `columns`: the scales' (and int4 zeros') group
// columns (int8_activation_group_columns); `x_sums` [rows, num_groups] or null (int8).
template <bool kInt8>
void many_rows_avx512(const QuantizedActivations& q, const WeightPanels& panels, const float* columns,
                      const float* x_sums, int64_t rows, int64_t in_features, int64_t out_features,
                      int64_t group_size, float* out) {
  const SlottedActivations slotted = slot_activations(q, panels, rows, in_features, group_size, kInt8);
  const BlockActivations a = block_activations(slotted, rows, panels.slots_per_row, kInt8);
  const int64_t num_groups = in_features / group_size, num_tiles = (out_features + kCols - 1) / kCols;
  const int64_t num_panels = (out_features + kPanelOutputs - 1) / kPanelOutputs;
  const int64_t num_pairs = (num_panels + 1) / 2;
  const int64_t panel_bytes = panels.slots_per_row * kPanelBytesPerSlot;
  const int64_t last_run = (out_features - 1) / kColumnRows;
  at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> bytes(2 * panel_bytes + 64);
    uint8_t* filled = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t{63});
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t first = 2 * pair, count = std::min<int64_t>(2, num_panels - first);
      for (int64_t p = 0; p < count; ++p) fill_panel(panels, kInt8, first + p, num_tiles, filled + p * panel_bytes);
      // The pair's four runs of the columns (those past the weight's end read its last).
      const float* runs[2 * 2];
      for (int64_t r = 0; r < 2 * 2; ++r)
        runs[r] = columns + std::min(2 * first + r, last_run) * num_groups * 2 * kColumnRows;
      const int64_t n0 = first * kPanelOutputs, n_count = std::min(count * kPanelOutputs, out_features - n0);
      // The next pair's tiles in this thread's range: the lines of their units that slot `slot` reads.
      const int64_t next_tile = (first + 2) * kPanelTiles;
      const int64_t next_end = std::min(std::min(2 * end, num_panels) * kPanelTiles, num_tiles);
      auto prefetch = [&](int64_t slot) {
        if (!kInt8 && slot % 2) return;  // an int4 unit holds two slots
        for (int64_t tile = next_tile; tile < std::min(next_tile + 2 * kPanelTiles, next_end); ++tile)
          for (int64_t j = 0; j < kCols; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(panels.unit(tile, kInt8 ? slot : slot / 2, j)), _MM_HINT_T0);
      };
      if (count == 2)
        many_rows_tiles<2, kInt8>(rows, a, filled, panel_bytes, runs, x_sums, panels.slots_per_row,
                                  panels.slots_per_group, out, out_features, n0, n_count, prefetch);
      else
        many_rows_tiles<1, kInt8>(rows, a, filled, panel_bytes, runs, x_sums, panels.slots_per_row,
                                  panels.slots_per_group, out, out_features, n0, n_count, prefetch);
    }
  });
}
#endif

}  // namespace int8_activations
