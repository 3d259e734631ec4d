// The AVX-512 VNNI tiles of the int8-activation kernels (linear_int8_activations.cpp says what
// they compute): one slot of two blocks of 32 per 512-bit register. Empty where the compiler
// does not target AVX-512 F, BW, VL and VNNI.
#pragma once

#include "int8_activations.h"
#include "output_tiles.h"
#include "vector_math.h"

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

// R rows of x by C weight rows from column tile `tile` on (C up to two tiles' rows: row j is row
// j % kCols of tile tile + j / kCols), every group of K: out before the int4 zero term, into
// total[i * total_stride + j]. `ahead`: this thread's panels kPrefetchTiles later, prefetched a
// unit at a time as these are read, so they stream in from memory during this compute.
template <int64_t R, int64_t C, bool kInt8>
inline void tile_avx512(const SlottedActivations& a, const WeightPanels& panels, const float* weight_scales,
                        int64_t num_groups, int64_t m0, int64_t tile, bool ahead, float* total, int64_t total_stride) {
  const int64_t n0 = tile * kCols;
  __m512 sum[R][C], acc[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) sum[i][j] = acc[i][j] = _mm512_setzero_ps();
  int64_t group = 0, slots_left = panels.slots_per_group;  // the group being summed; its slots to go
  // Adds slot `slot` of x against the weights' bytes w[j], and closes its group where it ends.
  auto add_slot = [&](int64_t slot, const __m512i* w) {
    for (int64_t i = 0; i < R; ++i) {
      const int64_t at = (m0 + i) * panels.slots_per_row + slot;
      const __m512i x = _mm512_loadu_si512(a.bytes.data() + at * kSlot);
      const __m512 scales = _mm512_loadu_ps(a.lane_scales.data() + at * 16);
      const __m512i start = kInt8 ? _mm512_loadu_si512(a.lane_offsets.data() + at * 16) : _mm512_setzero_si512();
      for (int64_t j = 0; j < C; ++j)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w[j], x)), scales, acc[i][j]);
    }
    if (--slots_left == 0) {
      for (int64_t j = 0; j < C; ++j) {
        const __m512 scale = _mm512_set1_ps(weight_scales[(n0 + j) * num_groups + group]);
        for (int64_t i = 0; i < R; ++i) {
          sum[i][j] = _mm512_fmadd_ps(acc[i][j], scale, sum[i][j]);
          acc[i][j] = _mm512_setzero_ps();
        }
      }
      ++group;
      slots_left = panels.slots_per_group;
    }
  };
  auto unit = [&](int64_t first_tile, int64_t u, int64_t j) {
    return reinterpret_cast<const char*>(panels.unit(first_tile + j / kCols, u, j % kCols));
  };
  for (int64_t u = 0; u < panels.units_per_row; ++u) {
    if (ahead) {
      for (int64_t j = 0; j < C; ++j) _mm_prefetch(unit(tile + kPrefetchTiles, u, j), _MM_HINT_T0);
    }
    __m512i w[C];
    if constexpr (kInt8) {
      for (int64_t j = 0; j < C; ++j) w[j] = _mm512_loadu_si512(unit(tile, u, j));
      add_slot(u, w);
    } else {
      // Each slot loads the unit again (from L1) rather than keep it: with 3 rows of x, 4 more
      // registers held across both slots would spill the accumulators.
      for (int64_t j = 0; j < C; ++j) w[j] = _mm512_and_si512(_mm512_loadu_si512(unit(tile, u, j)),
                                                              _mm512_set1_epi8(0x0F));
      add_slot(2 * u, w);
      if (2 * u + 1 < panels.slots_per_row) {
        // 16 x the high nibbles (at most 240 x 127 x 4 per lane): no shift; the slot's scales hold the 1/16.
        for (int64_t j = 0; j < C; ++j) w[j] = _mm512_and_si512(_mm512_loadu_si512(unit(tile, u, j)),
                                                                _mm512_set1_epi8(static_cast<char>(0xF0)));
        add_slot(2 * u + 1, w);
      }
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) total[i * total_stride + j] = _mm512_reduce_add_ps(sum[i][j]);
}

// total: R rows of kCols.
template <int64_t R, bool kInt8>
inline void tile_avx512_columns(const SlottedActivations& a, const WeightPanels& panels, const float* weight_scales,
                                int64_t num_groups, int64_t m0, int64_t tile, int64_t n_count, bool ahead,
                                float* t) {
  static_assert(kCols == 4, "one case per column count below");
  switch (n_count) {
    case 4: return tile_avx512<R, 4, kInt8>(a, panels, weight_scales, num_groups, m0, tile, ahead, t, kCols);
    case 3: return tile_avx512<R, 3, kInt8>(a, panels, weight_scales, num_groups, m0, tile, ahead, t, kCols);
    case 2: return tile_avx512<R, 2, kInt8>(a, panels, weight_scales, num_groups, m0, tile, ahead, t, kCols);
    default: return tile_avx512<R, 1, kInt8>(a, panels, weight_scales, num_groups, m0, tile, ahead, t, kCols);
  }
}

// One row of x (a single stream's decode step): two column tiles at a time, so each slot of x and
// its scales are loaded once for 8 weight rows and 8 row streams are in flight from memory, where
// one tile's 4 rows of INT4 at K = 2048 are a single 4 KiB page. A thread's odd last tile, and the
// last partial one, go alone.
template <bool kInt8, typename FinishZero>
void one_row_tiles_avx512(const SlottedActivations& a, const WeightPanels& panels, const float* weight_scales,
                          int64_t out_features, int64_t num_groups, float* out, FinishZero& finish_zero) {
  constexpr int64_t kPair = 2 * kCols;
  const int64_t num_tiles = (out_features + kCols - 1) / kCols;
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(8, (num_tiles / (8 * threads)) & ~int64_t(1));
  const int64_t num_chunks = (num_tiles + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max<int64_t>(1, std::min(threads, num_chunks)))
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * chunk, end = std::min(num_tiles, begin + chunk);
    int64_t tile = begin;
    for (; tile + 1 < end && (tile + 2) * kCols <= out_features; tile += 2) {
      float total[kPair];
      tile_avx512<1, kPair, kInt8>(a, panels, weight_scales, num_groups, 0, tile, tile + kPrefetchTiles + 1 < end,
                                   total, kPair);
      for (int64_t j = 0; j < kPair; ++j) out[tile * kCols + j] = total[j] + finish_zero(0, tile * kCols + j);
    }
    for (; tile < end; ++tile) {
      const int64_t n0 = tile * kCols, n_count = std::min(kCols, out_features - n0);
      float total[kRows][kCols] = {};
      tile_avx512_columns<1, kInt8>(a, panels, weight_scales, num_groups, 0, tile, n_count, false, &total[0][0]);
      for (int64_t j = 0; j < n_count; ++j) out[n0 + j] = total[0][j] + finish_zero(0, n0 + j);
    }
  }
}

// `finish_zero(m, n)`: the int4 zero-point term (0 for int8).
template <bool kInt8, typename FinishZero>
void int8_activation_tiles_avx512(const QuantizedActivations& q, const WeightPanels& panels, const float* weight_scales,
                                  int64_t rows, int64_t in_features, int64_t out_features, int64_t group_size,
                                  float* out_ptr, FinishZero finish_zero) {
  const SlottedActivations a = slot_activations(q, panels, rows, in_features, group_size, kInt8);
  const int64_t num_groups = in_features / group_size;
  if (rows == 1) return one_row_tiles_avx512<kInt8>(a, panels, weight_scales, out_features, num_groups, out_ptr,
                                                    finish_zero);
  // INT4 tiles take 2 rows of x, not 3: a group's scale is applied as the group closes, so each
  // (row, weight row) holds two accumulators, and 3 x 4 of them with the weights spill registers.
  constexpr int64_t kTileRows = kInt8 ? kRows : 2;
  for_each_output_tile<kTileRows, kCols>(rows, out_features, out_ptr, [&](int64_t column_tile, int64_t end, int64_t m0,
                                                                         int64_t m_count, int64_t, int64_t n_count,
                                                                         float total[kTileRows][kCols]) {
    // Prefetched once, by the first row tile: later ones find the panel in cache.
    const bool ahead = m0 == 0 && column_tile + kPrefetchTiles < end;
    static_assert(kTileRows <= 3, "one case per row count below");
    float* t = &total[0][0];
    if (m_count == kTileRows)
      tile_avx512_columns<kTileRows, kInt8>(a, panels, weight_scales, num_groups, m0, column_tile, n_count, ahead, t);
    else if (m_count == 2)
      tile_avx512_columns<2, kInt8>(a, panels, weight_scales, num_groups, m0, column_tile, n_count, ahead, t);
    else
      tile_avx512_columns<1, kInt8>(a, panels, weight_scales, num_groups, m0, column_tile, n_count, ahead, t);
    for (int64_t i = 0; i < m_count; ++i)
      for (int64_t j = 0; j < n_count; ++j) total[i][j] += finish_zero(m0 + i, column_tile * kCols + j);
  });
}
#endif

}  // namespace int8_activations
