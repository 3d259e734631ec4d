// The AVX-512 VNNI single-row kernel of the int8-activation linears (linear_int8_activations.cpp
// says what they compute; calls of more rows take int8_activations_many_rows_avx512.h, in the
// same arithmetic order) and x laid out in the weights' slots for both: one slot of two blocks
// of 32 per 512-bit register. Empty where the compiler does not target AVX-512 F, BW, VL and VNNI.
#pragma once

#include "int8_activations.h"
#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace int8_activations {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_AVX512_VNNI 1
constexpr int64_t kPrefetchTiles = 2;  // how far ahead (in tiles of kCols weight rows) panels are prefetched

// x [M, K] for the 512-bit tiles: per row, the weights' slots (int8_activations.h) in order, each
// 64 bytes of xq (a group's odd last block zeros), with 16 lane scales per slot (the lanes of the
// int32 products each block's sums land in: 8 per block) and, for int8 weights, 16 lane offsets:
// -128 x each lane's sum of 4 xq, what the weights' + 128 adds to the products.
struct SlottedActivations {
  std::vector<int8_t> bytes;
  std::vector<float> lane_scales;
  std::vector<int32_t> lane_offsets;
};

// x in the slots of `panels` (their slot counts), whose groups are group_size features.
SlottedActivations slot_activations(const QuantizedActivations& a, const WeightPanels& panels, int64_t rows,
                                    int64_t in_features, int64_t group_size, bool int8_weights) {
  SlottedActivations s;
  const int64_t slots_per_group = panels.slots_per_group, slots_per_row = panels.slots_per_row;
  const int64_t blocks_per_group = group_size / kBlock;
  s.bytes.assign(rows * slots_per_row * kSlot, 0);
  s.lane_scales.assign(rows * slots_per_row * 16, 0.f);
  if (int8_weights) s.lane_offsets.assign(rows * slots_per_row * 16, 0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < in_features / group_size; ++g)
      for (int64_t local = 0; local < blocks_per_group; ++local) {
        const int64_t b = g * blocks_per_group + local, half = local % 2;
        const int64_t slot = m * slots_per_row + g * slots_per_group + local / 2;
        const int8_t* q = a.q.data() + m * in_features + b * kBlock;
        std::copy(q, q + kBlock, s.bytes.data() + slot * kSlot + half * kBlock);
        // An int4 unit's second slot is read as its high nibbles in place (16 x the weight): its
        // scales carry the 1/16, exactly, as a power of two.
        const float unit_scale = !int8_weights && (g * slots_per_group + local / 2) % 2 ? 1.f / 16 : 1.f;
        std::fill_n(s.lane_scales.data() + slot * 16 + half * 8, 8, a.scales[m * a.blocks_per_row + b] * unit_scale);
        if (int8_weights)
          for (int l = 0; l < 8; ++l)
            s.lane_offsets[slot * 16 + half * 8 + l] = -128 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
      }
  return s;
}

// The 16 int32 block sums of 8 weight rows' accumulators against one slot of x (lanes 0-7 of
// acc[j] the partial sums of the slot's first block, 8-15 of its second): an exact integer
// transpose-and-add in 21 instructions, where 16 separate reductions would take about 100. Lanes
// of the result: rows 0-3 block 0, rows 0-3 block 1, rows 4-7 block 0, rows 4-7 block 1.
inline __m512i block_sums(const __m512i acc[8]) {
  __m512i pairs[4], quads[2];
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: row 2k's two partials at 0 and 2, row 2k + 1's at 1 and 3
    pairs[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2 * k], acc[2 * k + 1]),
                                _mm512_unpackhi_epi32(acc[2 * k], acc[2 * k + 1]));
  for (int k = 0; k < 2; ++k)  // per 128-bit lane L: rows 4k..4k + 3, each the sum of its lanes 4L..4L + 3
    quads[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * k], pairs[2 * k + 1]),
                                _mm512_unpackhi_epi64(pairs[2 * k], pairs[2 * k + 1]));
  // Block 0 is 128-bit lanes 0 and 1, block 1 lanes 2 and 3.
  return _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// R rows of x (1-3) against weight rows n0..n0 + 7 (tiles `tile` and tile + 1; C = 4: the first
// only), written to out[i * out_features + n0..n0 + n_count). The arithmetic of many_rows_avx512,
// in the same order (each block's exact integer dot, converted and scaled by x's block scale
// into its group's sum, the group's sum scaled by the weight's group scale, then the int4
// zero-point term), so a row's result does not depend on how many rows its call had; the
// weights are read once for the R rows. `columns`: the scales' group columns
// (int8_activation_group_columns), whose run tile / 2 is these rows'. `ahead`: prefetch the
// panels kPrefetchTiles tiles on, so they stream in from memory during this compute.
template <int R, int C, bool kInt8>
inline void few_rows_avx512(const SlottedActivations& a, const WeightPanels& panels, const float* columns,
                            const float* x_sums, int64_t num_groups, int64_t tile, bool ahead, float* out,
                            int64_t out_features, int64_t n_count) {
  static_assert(C == 4 || C == 8, "one tile or two");
  static_assert(2 * kCols == kColumnRows, "a run of the columns is two tiles");
  const int64_t n0 = tile * kCols;
  const float* run = columns + (tile / 2) * num_groups * 2 * kColumnRows;
  __m256 total[R], group_sum[R];
  for (int i = 0; i < R; ++i) total[i] = group_sum[i] = _mm256_setzero_ps();
  int64_t group = 0, slots_left = panels.slots_per_group;
  auto unit = [&](int64_t first_tile, int64_t u, int64_t j) {
    return reinterpret_cast<const char*>(panels.unit(first_tile + j / kCols, u, j % kCols));
  };
  auto add_slot = [&](int64_t slot, const __m512i* w) {
    for (int i = 0; i < R; ++i) {
      const int64_t at = i * panels.slots_per_row + slot;  // row i's slot
      const __m512i x = _mm512_loadu_si512(a.bytes.data() + at * kSlot);
      const __m512i start = kInt8 ? _mm512_loadu_si512(a.lane_offsets.data() + at * 16) : _mm512_setzero_si512();
      __m512i acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = j < C ? _mm512_dpbusd_epi32(start, w[j], x) : _mm512_setzero_si512();
      const __m512 sums = _mm512_cvtepi32_ps(block_sums(acc));
      const __m256 low = _mm512_castps512_ps256(sums);
      const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1));
      group_sum[i] = _mm256_fmadd_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                     _mm256_set1_ps(a.lane_scales[at * 16]), group_sum[i]);
      group_sum[i] = _mm256_fmadd_ps(_mm256_permute2f128_ps(low, high, 0x31),
                                     _mm256_set1_ps(a.lane_scales[at * 16 + 8]), group_sum[i]);
    }
    if (--slots_left == 0) {
      const __m256 scale = _mm256_loadu_ps(run + group * 2 * kColumnRows);
      for (int i = 0; i < R; ++i) {
        total[i] = _mm256_fmadd_ps(group_sum[i], scale, total[i]);
        if constexpr (!kInt8)
          total[i] = _mm256_fmadd_ps(_mm256_loadu_ps(run + group * 2 * kColumnRows + kColumnRows),
                                     _mm256_set1_ps(x_sums[i * num_groups + group]), total[i]);
        group_sum[i] = _mm256_setzero_ps();
      }
      ++group;
      slots_left = panels.slots_per_group;
    }
  };
  for (int64_t u = 0; u < panels.units_per_row; ++u) {
    if (ahead)
      for (int64_t j = 0; j < C; ++j) _mm_prefetch(unit(tile + kPrefetchTiles, u, j), _MM_HINT_T0);
    __m512i w[8];
    if constexpr (kInt8) {
      for (int64_t j = 0; j < C; ++j) w[j] = _mm512_loadu_si512(unit(tile, u, j));
      add_slot(u, w);
    } else {
      for (int64_t j = 0; j < C; ++j) w[j] = _mm512_and_si512(_mm512_loadu_si512(unit(tile, u, j)), _mm512_set1_epi8(0x0F));
      add_slot(2 * u, w);
      if (2 * u + 1 < panels.slots_per_row) {
        // 16 x the high nibbles (at most 240 x 127 x 4 per lane): no shift; the slot's scales hold the 1/16.
        for (int64_t j = 0; j < C; ++j)
          w[j] = _mm512_and_si512(_mm512_loadu_si512(unit(tile, u, j)), _mm512_set1_epi8(static_cast<char>(0xF0)));
        add_slot(2 * u + 1, w);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float values[8];
    _mm256_store_ps(values, total[i]);
    for (int64_t j = 0; j < std::min<int64_t>(n_count, C); ++j) out[i * out_features + n0 + j] = values[j];
  }
}

// Calls of at most this many rows take few_rows_avx512 (the weights read once for all rows, in
// their stored layout); more take many_rows_avx512, whose per-call panel layout then pays.
constexpr int64_t kFewRows = 3;

// R rows of x (a single stream's decode step, or a few): two tiles at a time, so each slot of x
// and its scales are loaded once for 8 weight rows and 8 row streams are in flight from memory,
// where one tile's 4 rows of INT4 at K = 2048 are a single 4 KiB page. Tiles go to the threads in
// chunks, so a thread a neighbour process slows does fewer of them; a thread's odd last tile goes
// alone. `x_sums` ([R, num_groups]) is null for int8 weights.
template <int R, bool kInt8>
void few_rows_tiles_avx512(const SlottedActivations& a, const WeightPanels& panels, const float* columns,
                           const float* x_sums, int64_t out_features, int64_t num_groups, float* out) {
  const int64_t num_tiles = (out_features + kCols - 1) / kCols;
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(8, (num_tiles / (8 * threads)) & ~int64_t(1));
  const int64_t num_chunks = (num_tiles + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max<int64_t>(1, std::min(threads, num_chunks)))
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * chunk, end = std::min(num_tiles, begin + chunk);
    int64_t tile = begin;  // even: chunks are
    for (; tile + 1 < end; tile += 2)
      few_rows_avx512<R, 8, kInt8>(a, panels, columns, x_sums, num_groups, tile, tile + kPrefetchTiles + 1 < end, out,
                                   out_features, out_features - tile * kCols);
    if (tile < end)
      few_rows_avx512<R, 4, kInt8>(a, panels, columns, x_sums, num_groups, tile, false, out, out_features,
                                   out_features - tile * kCols);
  }
}

template <bool kInt8>
void few_rows_avx512_call(int64_t rows, const SlottedActivations& a, const WeightPanels& panels, const float* columns,
                          const float* x_sums, int64_t out_features, int64_t num_groups, float* out) {
  static_assert(kFewRows == 3, "one case per row count below");
  if (rows == 1) return few_rows_tiles_avx512<1, kInt8>(a, panels, columns, x_sums, out_features, num_groups, out);
  if (rows == 2) return few_rows_tiles_avx512<2, kInt8>(a, panels, columns, x_sums, out_features, num_groups, out);
  few_rows_tiles_avx512<3, kInt8>(a, panels, columns, x_sums, out_features, num_groups, out);
}
#endif

}  // namespace int8_activations
