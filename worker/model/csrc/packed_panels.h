// The packed-panel float32 linear's tiles (linear_packed in linear.cpp, weight-only INT8 held as
// panels, and the weight-only quantized calls of many rows that widen their row-major weights
// into float32 panels): the panel layout,
// the register tiles for AVX-512, AVX2 and no vector extensions, and the loop of row tiles over
// a panel and of panels over threads.
#pragma once

#include "vector_math.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Packed-panel linear: y = x W^T with W stored as panels of kPanel output features,
// packed [ceil(N / kPanel), K, kPanel] (zero padded), so that for each k the panel's kPanel
// weights are one contiguous row (64 bytes in float32, 32 in bfloat16 or float16, 16 in int8). A register
// tile of up to kPanelRows rows of x times one panel keeps 2 x kPanelRows AVX2 accumulators over the whole
// of K: each step loads two weight vectors (bf16 and fp16 widened to float32 in registers, so the
// arithmetic is float32 either way), broadcasts one x value per row and issues two FMAs per
// row (an int8 panel row is widened the same way, its scales applied to the sums). The panel
// stays in L1/L2 while every row tile of x passes over it, so the weight is read
// from memory once per call whatever the rows. Threads split the panels.
// With AVX-512 a panel row is one 512-bit vector and a tile takes up to 12 rows of x against two
// adjacent panels: cores with two full-width FMA units (Zen 5, Intel's server cores) do twice
// the float32 arithmetic a cycle that 256-bit FMAs do, need 8 or more independent chains to keep
// both busy, and with two panels each broadcast of x feeds two FMAs (the loads, not the FMAs,
// bounded one-panel tiles). Each output lane sums the same products in the same order either
// way, so the results are the same.
constexpr int64_t kPanel = 16;
#ifdef __AVX512F__
#define HAVE_AVX512_PANELS 1
constexpr int kPanelRows = 12;  // 2 x 12 accumulators + 2 weight vectors + a broadcast, of 32 registers
constexpr int kPanelPair = 2;   // panels a tile takes: each broadcast of x feeds both
#else
constexpr int kPanelRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
constexpr int kPanelPair = 1;
#endif
// Float32 calls of fewer rows take one panel a tile (AVX-512), or (AVX2) four for one row, two
// for 2-3 rows, one for 4-6 and, beyond a tile's rows, pairs in whole tiles (whole_tiles_over_pair).
constexpr int64_t kFloatPairsFromRows = 12;
constexpr int64_t kPrefetchMaxRows = 64;
// A single row of float32 or half (bfloat16, float16) panels on AVX2 builds streams faster on the hardware
// prefetchers alone (little arithmetic a byte to hide a prefetch's load slot behind), and so do
// 2-3 rows of float32 panels (much faster where the weight is in L2 or L3, the same from memory):
// docs/benchmarks.md has the measurement. Beyond those rows (2-3 rows of half panels
// streamed from memory lose 15% without it), for int8 panels (no faster without it), and on
// AVX-512 builds, the prefetch stays.
#ifdef HAVE_AVX512_PANELS
constexpr bool kPrefetchFewFloatRows = true;
#else
constexpr bool kPrefetchFewFloatRows = false;
#endif
// Half panels are widened once into float32 above this many rows: on AVX2 widening in registers,
// per 6-row tile, bounds the tile; a 12-row AVX-512 tile widens 16 weights in 2 instructions for
// 12 FMAs, and was no slower than the widened copy at any row count measured.
#ifdef HAVE_AVX512_PANELS
constexpr int64_t kWidenFromRows = INT64_MAX;
#else
constexpr int64_t kWidenFromRows = 18;
#endif
constexpr int64_t kCacheLine = 64;

#ifdef HAVE_AVX2_FMA
// One panel row (kPanel weights at row k) as two float32 vectors.
inline void load_panel_row(const float* row, __m256& lo, __m256& hi) {
  lo = _mm256_load_ps(row);
  hi = _mm256_load_ps(row + 8);
}

inline void load_panel_row(const at::BFloat16* row, __m256& lo, __m256& hi) {
  const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(row));
  lo = widen_bf16(_mm256_castsi256_si128(bits));
  hi = widen_bf16(_mm256_extracti128_si256(bits, 1));
}

inline void load_panel_row(const at::Half* row, __m256& lo, __m256& hi) {
#ifdef __F16C__
  lo = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(row)));
  hi = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(row + 8)));
#else
  alignas(32) float lanes[kPanel];
  for (int64_t j = 0; j < kPanel; ++j) lanes[j] = static_cast<float>(row[j]);
  lo = _mm256_load_ps(lanes);
  hi = _mm256_load_ps(lanes + 8);
#endif
}

inline void load_panel_row(const int8_t* row, __m256& lo, __m256& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
}
#endif

#ifdef HAVE_AVX512_PANELS
// One panel row as one float32 vector (bf16: its bits are a float32's upper half).
inline __m512 load_panel_row(const float* row) { return _mm512_loadu_ps(row); }

inline __m512 load_panel_row(const at::BFloat16* row) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load_panel_row(const at::Half* row) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
}

inline __m512 load_panel_row(const int8_t* row) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
}
#endif

// Elements from panel 0 to panel p of weights held in groups of kGroup panels interleaved by
// input feature ([G, K, kGroup, 16]; kGroup 1 is plain [P, K, 16] panels).
template <int kGroup>
constexpr int64_t grouped_panel_offset(int64_t p, int64_t in_features) {
  return (p / kGroup * in_features * kGroup + p % kGroup) * kPanel;
}

// With kPrefetch, `next` is the panel this thread takes next. Its cache lines are prefetched
// (into L2: the panel in use keeps L1) by the row tile with k % num_tiles == tile, one line per
// kLinesPerRow rows, so the next panel streams in from memory evenly over all of this panel's
// compute rather than after it (or in a burst that fills the core's miss buffers and stalls
// the FMAs). An int8 panel, read at four times float32's bytes per FMA, also asks for its own
// line kInt8AheadBytes ahead into L1 (docs/benchmarks.md has the measurement).
constexpr int64_t kInt8AheadBytes = 1024;
template <int MR, bool kPrefetch, typename W, int kPanels = 1, int kGroup = 1>
inline void panel_tile(const float* x, int64_t in_features, const W* panel, float* out,
                       int64_t out_features, int64_t n_count, const W* next, int64_t tile, int64_t num_tiles) {
  constexpr int64_t kRowStride = kPanel * kGroup;
  constexpr int64_t kRowsPerLine = kCacheLine / (kRowStride * static_cast<int64_t>(sizeof(W)));
  // Panel q of the run (which starts a group or lies in one); a group's panels share their
  // lines, so one prefetch a line per group brings all of them.
  auto panel_offset = [in_features](int q) { return grouped_panel_offset<kGroup>(q, in_features); };
#ifdef HAVE_AVX512_PANELS
  // kPanels adjacent panels (the last n_count wide; `next` the next run of as many), each
  // broadcast of x feeding one FMA per panel.
  __m512 acc[kPanels][MR];
#pragma GCC unroll 4
  for (int q = 0; q < kPanels; ++q)
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) acc[q][i] = _mm512_setzero_ps();
  int64_t prefetch_k = next != nullptr ? tile * kRowsPerLine : in_features;
  for (int64_t k = 0; k < in_features; ++k) {
    if (kPrefetch && k == prefetch_k) {
#pragma GCC unroll 4
      for (int q = 0; q < kPanels; q += kGroup) {
        _mm_prefetch(reinterpret_cast<const char*>(next + panel_offset(q) + k * kRowStride), _MM_HINT_T1);
        if constexpr (std::is_same_v<W, int8_t>)
          _mm_prefetch(reinterpret_cast<const char*>(panel + panel_offset(q) + k * kRowStride) + kInt8AheadBytes,
                       _MM_HINT_T0);
      }
      prefetch_k += num_tiles * kRowsPerLine;
    }
    __m512 w[kPanels];
#pragma GCC unroll 4
    for (int q = 0; q < kPanels; ++q) w[q] = load_panel_row(panel + panel_offset(q) + k * kRowStride);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * in_features + k]);
#pragma GCC unroll 4
      for (int q = 0; q < kPanels; ++q) acc[q][i] = _mm512_fmadd_ps(a, w[q], acc[q][i]);
    }
  }
  alignas(64) float row[kPanel];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int q = 0; q + 1 < kPanels; ++q) _mm512_storeu_ps(out + i * out_features + q * kPanel, acc[q][i]);
    _mm512_store_ps(row, acc[kPanels - 1][i]);
    std::memcpy(out + i * out_features + (kPanels - 1) * kPanel, row, n_count * sizeof(float));
  }
#elif defined(HAVE_AVX2_FMA)
  // kPanels adjacent panels (the last n_count wide): one FMA chain per panel half and row, so a
  // one-row tile of four panels has the eight chains two FMA units of four cycles' latency need.
  static_assert(kPanels * MR <= 6, "two accumulators per panel and row, of 16 registers");
  // Every loop over MR is unrolled before register allocation (GCC otherwise keeps the
  // accumulator arrays on the stack and stores them back on every step).
  __m256 lo[kPanels][MR], hi[kPanels][MR];
#pragma GCC unroll 4
  for (int q = 0; q < kPanels; ++q)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) lo[q][i] = hi[q][i] = _mm256_setzero_ps();
  int64_t prefetch_k = next != nullptr ? tile * kRowsPerLine : in_features;
  for (int64_t k = 0; k < in_features; ++k) {
    if (kPrefetch && k == prefetch_k) {
#pragma GCC unroll 4
      for (int q = 0; q < kPanels; q += kGroup)
        _mm_prefetch(reinterpret_cast<const char*>(next + panel_offset(q) + k * kRowStride), _MM_HINT_T1);
      prefetch_k += num_tiles * kRowsPerLine;
    }
#pragma GCC unroll 4
    for (int q = 0; q < kPanels; ++q) {
      __m256 w_lo, w_hi;
      load_panel_row(panel + panel_offset(q) + k * kRowStride, w_lo, w_hi);
      // One broadcast live at a time: a 6-row tile's 12 accumulators and 2 weight vectors leave
      // room for no more (holding all 6 spilled the tile); a one-row tile's repeats fold into one.
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 a = _mm256_broadcast_ss(x + i * in_features + k);
        lo[q][i] = _mm256_fmadd_ps(a, w_lo, lo[q][i]);
        hi[q][i] = _mm256_fmadd_ps(a, w_hi, hi[q][i]);
      }
    }
  }
  alignas(32) float row[kPanel];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int q = 0; q + 1 < kPanels; ++q) {
      _mm256_storeu_ps(out + i * out_features + q * kPanel, lo[q][i]);
      _mm256_storeu_ps(out + i * out_features + q * kPanel + 8, hi[q][i]);
    }
    float* last = out + i * out_features + (kPanels - 1) * kPanel;
    // A whole panel is stored directly: through `row`, a call with n_count known to be kPanel (GCC
    // clones the tile per constant) kept the accumulators on the stack for the whole loop.
    if (n_count == kPanel) {
      _mm256_storeu_ps(last, lo[kPanels - 1][i]);
      _mm256_storeu_ps(last + 8, hi[kPanels - 1][i]);
      continue;
    }
    _mm256_store_ps(row, lo[kPanels - 1][i]);
    _mm256_store_ps(row + 8, hi[kPanels - 1][i]);
    std::memcpy(last, row, n_count * sizeof(float));
  }
#else
  (void)panel_offset;
  for (int i = 0; i < MR; ++i) {
    float row[kPanel] = {};
    for (int64_t k = 0; k < in_features; ++k)
      for (int64_t j = 0; j < kPanel; ++j)
        row[j] += x[i * in_features + k] * static_cast<float>(panel[k * kRowStride + j]);
    std::memcpy(out + i * out_features, row, n_count * sizeof(float));
  }
#endif
}

// kPanels: 1, 2 (kPanelPair on AVX-512; on AVX2 tiles of up to kSmallPairMaxRows rows) or
// kPanelQuad adjacent panels (the last n_count wide).
template <int MR, bool kPrefetch, int kPanels, typename W, int kGroup = 1>
inline void panel_rows(const float* x, int64_t in_features, const W* panel, float* out,
                       int64_t out_features, int64_t n_count, int64_t rows, const W* next, int64_t tile,
                       int64_t num_tiles) {
  if constexpr (MR > 0) {
    if (rows == MR)
      return panel_tile<MR, kPrefetch, W, kPanels, kGroup>(x, in_features, panel, out, out_features, n_count, next,
                                                           tile, num_tiles);
    panel_rows<MR - 1, kPrefetch, kPanels, W, kGroup>(x, in_features, panel, out, out_features, n_count, rows, next,
                                                      tile, num_tiles);
  }
}

// `count` floats of `storage` (resized to hold them), 64-byte aligned for the panels' aligned
// loads and stores (a 512-bit aligned store needs 64).
inline float* aligned_floats(std::vector<float>& storage, int64_t count) {
  storage.resize(count + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
}

// A half (bfloat16, float16) or int8 panel (one of a group of kGroup) widened to float32 into `buffer` (32-byte
// aligned, in_features * kPanel floats).
template <int kGroup, typename W>
inline void widen_panel(const W* panel, int64_t in_features, float* buffer) {
  for (int64_t k = 0; k < in_features; ++k) {
    const W* row = panel + k * kPanel * kGroup;
#ifdef HAVE_AVX2_FMA
    __m256 lo, hi;
    load_panel_row(row, lo, hi);
    _mm256_store_ps(buffer + k * kPanel, lo);
    _mm256_store_ps(buffer + k * kPanel + 8, hi);
#else
    for (int64_t j = 0; j < kPanel; ++j) buffer[k * kPanel + j] = static_cast<float>(row[j]);
#endif
  }
}

// Every row of x against one panel (output features n0.. of `out`, n_count of them), in row
// tiles as even as possible (20 rows: 5+5+5+5, not 6+6+6+2): a short tile has too few
// independent FMA chains to hide the FMA latency. `next` is prefetched where `prefetch`.
template <int kPanels = 1, int kGroup = 1, int kMaxRows = kPanelRows, typename W>
inline void panel_over_rows(const float* x_ptr, int64_t rows, int64_t in_features, const W* panel, float* out_ptr,
                            int64_t out_features, int64_t n_count, bool prefetch, const W* next) {
  if (rows <= 0) return;
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows, base = rows / tiles, extra = rows % tiles;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t tile_rows = base + (t < extra ? 1 : 0);
    if (prefetch)
      panel_rows<kMaxRows, true, kPanels, W, kGroup>(x_ptr + m0 * in_features, in_features, panel,
                                                   out_ptr + m0 * out_features, out_features, n_count, tile_rows,
                                                   next, t, tiles);
    else
      panel_rows<kMaxRows, false, kPanels, W, kGroup>(x_ptr + m0 * in_features, in_features, panel,
                                                    out_ptr + m0 * out_features, out_features, n_count, tile_rows,
                                                    nullptr, t, tiles);
    m0 += tile_rows;
  }
}

// The panels a tile takes from panel p on: up to `wanted` (1, kPanelPair or kPanelQuad) where
// built and all in this thread's range [p, end); `last_width` is the last one's output features
// (a ragged last panel of the weight).
struct PanelRun {
  int64_t count, last_width;
};

// Int8 calls (and half and float32 ones on AVX2) of up to kQuadMaxRows rows take four panels
// a tile: a row's tile has one FMA chain per panel (AVX-512; two on AVX2), and the latency of so
// few chains bounds the tile once the weight is in cache or memory is fast (on AVX2 even a float32
// stream from memory: docs/benchmarks.md). Each output lane still sums its products in k order,
// so the result is the one-panel tile's.
constexpr int64_t kPanelQuad = 4;
#ifdef HAVE_AVX512_PANELS
constexpr int kQuadMaxRows = 2;
#elif defined(HAVE_AVX2_FMA)
constexpr int kQuadMaxRows = 1;
#else
constexpr int kQuadMaxRows = 0;
#endif

// AVX2 calls of 2-3 rows take two panels a tile, for the same reason: 8-12 FMA chains where one
// panel's 4-6 bound the stream (3 rows x 2 panels x 2 accumulators: 12 of the 16 registers).
// AVX-512 builds pair panels at every row count already.
#if defined(HAVE_AVX2_FMA) && !defined(HAVE_AVX512_PANELS)
constexpr int kSmallPairMaxRows = 3;
#else
constexpr int kSmallPairMaxRows = 0;
#endif
// The panels of a pair run where the build takes pairs (1: it never does), and the rows of its tiles.
constexpr int kPairPanels = kPanelPair == 2 || kSmallPairMaxRows > 0 ? 2 : 1;
constexpr int kPairTileRows = kSmallPairMaxRows > 0 ? kSmallPairMaxRows : kPanelRows;

// AVX2 float32 pair runs of more rows than a tile holds: whole_tiles_over_pair.
template <typename W>
constexpr bool kWholeTilesOverPairs = kSmallPairMaxRows > 0 && std::is_same_v<W, float>;

template <typename W>
constexpr bool kQuadFor = std::is_same_v<W, int8_t>
#ifndef HAVE_AVX512_PANELS
                          || std::is_same_v<W, at::BFloat16> || std::is_same_v<W, at::Half>
                          || std::is_same_v<W, float>
#endif
    ;

inline PanelRun panel_run(int64_t p, int64_t end, int64_t out_features, int64_t wanted) {
  int64_t count = 1;
  if (wanted >= 4 && kQuadMaxRows > 0 && p + 3 < end)
    count = 4;
  else if (wanted >= 2 && kPairPanels == 2 && p + 1 < end)
    count = 2;
  return {count, std::min(kPanel, out_features - (p + count - 1) * kPanel)};
}

// A pair run of plain panels (AVX2, float32) over more rows than a tile holds: the rows in whole
// kPanelRows tiles of one panel each (12 FMA chains, each weight row loaded once for six
// broadcasts), then the rows left over as one tile over both panels where a pair tile holds them
// (up to kSmallPairMaxRows), else one a panel. So 9 rows run as 6 + 3, not as the 5 + 4 of
// panel_over_rows, whose 8-10 chains a tile fall short of hiding the FMA latency once the weight
// is in cache (docs/benchmarks.md has the measurement). Each output still sums in k order. Every
// tile prefetches its share (tile t of `tiles`) of the lines of the next run's panel it stands for.
template <bool kPrefetch, typename W>
inline void whole_tiles_over_pair(const PanelRun& run, const float* x_ptr, int64_t rows, int64_t in_features,
                                  const W* panel, float* out_ptr, int64_t out_features, const W* next) {
  const W* second = panel + in_features * kPanel;
  const W* second_next = next != nullptr ? next + in_features * kPanel : nullptr;
  const int64_t whole = rows / kPanelRows, rest = rows % kPanelRows, tiles = whole + (rest > 0 ? 1 : 0);
  for (int64_t t = 0; t < whole; ++t) {
    const float* x = x_ptr + t * kPanelRows * in_features;
    float* out = out_ptr + t * kPanelRows * out_features;
    panel_tile<kPanelRows, kPrefetch, W>(x, in_features, panel, out, out_features, kPanel, next, t, tiles);
    panel_tile<kPanelRows, kPrefetch, W>(x, in_features, second, out + kPanel, out_features, run.last_width,
                                         second_next, t, tiles);
  }
  if (rest == 0) return;
  const float* x = x_ptr + whole * kPanelRows * in_features;
  float* out = out_ptr + whole * kPanelRows * out_features;
  if (rest <= kSmallPairMaxRows)
    return panel_rows<kSmallPairMaxRows, kPrefetch, 2, W>(x, in_features, panel, out, out_features, run.last_width,
                                                          rest, next, whole, tiles);
  panel_rows<kPanelRows, kPrefetch, 1, W>(x, in_features, panel, out, out_features, kPanel, rest, next, whole, tiles);
  panel_rows<kPanelRows, kPrefetch, 1, W>(x, in_features, second, out + kPanel, out_features, run.last_width, rest,
                                          second_next, whole, tiles);
}

// panel_over_rows for the run's panels from `panel` (output features from out_ptr on).
template <typename W, int kGroup = 1>
inline void run_over_rows(const PanelRun& run, const float* x_ptr, int64_t rows, int64_t in_features, const W* panel,
                          float* out_ptr, int64_t out_features, bool prefetch, const W* next) {
#if defined(HAVE_AVX512_PANELS) || defined(HAVE_AVX2_FMA)
  if (run.count == kPanelQuad) {  // rows <= kQuadMaxRows: one tile
    if (prefetch)
      return panel_rows<kQuadMaxRows, true, kPanelQuad, W, kGroup>(x_ptr, in_features, panel, out_ptr, out_features,
                                                                   run.last_width, rows, next, 0, 1);
    return panel_rows<kQuadMaxRows, false, kPanelQuad, W, kGroup>(x_ptr, in_features, panel, out_ptr, out_features,
                                                                  run.last_width, rows, nullptr, 0, 1);
  }
#endif
  if constexpr (kWholeTilesOverPairs<W> && kGroup == 1) {
    if (run.count == 2 && rows > kPanelRows) {
      if (prefetch)
        return whole_tiles_over_pair<true, W>(run, x_ptr, rows, in_features, panel, out_ptr, out_features, next);
      return whole_tiles_over_pair<false, W>(run, x_ptr, rows, in_features, panel, out_ptr, out_features, nullptr);
    }
  }
  if (run.count == 2)
    panel_over_rows<kPairPanels, kGroup, kPairTileRows>(x_ptr, rows, in_features, panel, out_ptr, out_features,
                                                        run.last_width, prefetch, next);
  else
    panel_over_rows<1, kGroup>(x_ptr, rows, in_features, panel, out_ptr, out_features, run.last_width, prefetch,
                               next);
}

// out[m, n0..n0 + width) *= column_scales[n0..] for every row m.
inline void scale_columns(float* out_ptr, int64_t rows, int64_t out_features, int64_t n0, int64_t width,
                          const float* column_scales) {
  for (int64_t m = 0; m < rows; ++m) {
    float* row = out_ptr + m * out_features + n0;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) row[j] *= column_scales[n0 + j];
  }
}

// p_ptr holds num_panels panels, in groups of kGroup interleaved by input feature ([G, K,
// kGroup, 16], the last group padded with zero panels). A pair of int8 panels held as one group
// is one forward stream, each 64-byte line two k of both, where plain panels are two streams
// of 16 bytes a k: a tile of two panels (3 or more rows) reads one stream, and a tile of four
// (1-2 rows) two instead of four.
template <typename W, int kGroup = 1>
void linear_panels(const float* x_ptr, const W* p_ptr, float* out_ptr, int64_t rows, int64_t in_features,
                   int64_t out_features, int64_t num_panels, const float* column_scales = nullptr) {
  if (rows <= 0) return;
  // Prefetching pays while the weight stream dominates (decode sizes); at prefill sizes every
  // panel is reused by many row tiles and the compute-bound loop does better without it.
  constexpr int64_t kUnfetchedRows = kPrefetchFewFloatRows     ? 0
                                     : std::is_same_v<W, float> ? kSmallPairMaxRows
                                     : std::is_same_v<W, int8_t> ? 0
                                                                 : 1;
  const bool prefetch = rows > kUnfetchedRows && rows <= kPrefetchMaxRows;
  // A half or int8 panel that several row tiles pass over is widened once into a float32
  // copy that stays in L2, rather than once per row tile in registers: the widening, not the
  // FMAs, bounds a tile on AVX2. The float32 copy holds the same values, so the result is the same.
  constexpr bool kWidenable = !std::is_same_v<W, float>;
  const bool widen = kWidenable && rows > kWidenFromRows;
  // Float32 panels of a call of few rows stream from memory, where one panel at a time does better
  // on AVX-512; on AVX2, whose one-panel tile has only two FMA chains a row, one row takes four
  // panels and 2-3 rows two, and more than a tile's rows go over pairs in whole tiles.
  const bool quad = kQuadFor<W> && rows <= kQuadMaxRows, small_pair = rows <= kSmallPairMaxRows;
  const bool two = small_pair || (kWholeTilesOverPairs<W> && rows > kPanelRows);
  const bool pairs = !widen && (!std::is_same_v<W, float> || rows >= kFloatPairsFromRows || quad || two);
  const int64_t wanted = !pairs ? 1 : quad ? kPanelQuad : two ? 2 : kPanelPair;
  const int64_t num_groups = (num_panels + kGroup - 1) / kGroup;
  auto panel_at = [&](int64_t p) { return p_ptr + grouped_panel_offset<kGroup>(p, in_features); };
  at::parallel_for(0, num_groups, grain_for(2 * rows * in_features * kPanel * kGroup), [&](int64_t begin, int64_t end) {
    std::vector<float> storage;
    float* widened = widen ? aligned_floats(storage, in_features * kPanel) : nullptr;
    const int64_t panels_end = std::min(num_panels, end * kGroup);
    for (int64_t p = begin * kGroup; p < panels_end;) {
      const W* panel = panel_at(p);
      // A run of up to kGroup panels stays in its group (a quad takes two whole groups of two).
      const int64_t group_end = kGroup >= wanted ? std::min(panels_end, (p / kGroup + 1) * kGroup) : panels_end;
      const PanelRun run = panel_run(p, group_end, out_features, wanted);
      float* out = out_ptr + p * kPanel;
      bool widened_run = false;
      if constexpr (kWidenable) {
        if (widen) {
          widen_panel<kGroup>(panel, in_features, widened);
          run_over_rows<float>(run, x_ptr, rows, in_features, widened, out, out_features, false, nullptr);
          widened_run = true;
        }
      }
      if (!widened_run) {
        // The next run's panels; a prefetch past this thread's range or the tensor never faults.
        const W* next = p + run.count < panels_end ? panel_at(p + run.count) : nullptr;
        run_over_rows<W, kGroup>(run, x_ptr, rows, in_features, panel, out, out_features, prefetch, next);
      }
      if (column_scales != nullptr)
        scale_columns(out_ptr, rows, out_features, p * kPanel, (run.count - 1) * kPanel + run.last_width,
                      column_scales);
      p += run.count;
    }
  });
}
