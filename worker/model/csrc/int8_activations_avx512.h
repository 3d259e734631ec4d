// The AVX-512 VNNI kernels of the int8-activation linears (linear_int8_activations.cpp says what
// they compute), over the weights held output-major (int8_activations.h): one 32-bit lane per
// output, so each lane accumulates one output's whole block dot and a block of 32 features costs
// one VNNI instruction per 4 features and 16 outputs (x's 4 bytes broadcast), then one
// conversion and one FMA per 16 outputs. Tile layouts, whose lanes hold partial blocks, need a
// reduction across lanes per block as well. Every call, of one row or many, runs the same
// per-row arithmetic (exact integer block dots, scaled by x's block scale into the group's sum,
// the group's sum scaled by the weight's group scale, then the int4 zero-point term), so a
// row's result never depends on how many rows its call had. Empty where the compiler does not
// target AVX-512 F, BW, VL and VNNI.
#pragma once

#include "int8_activations.h"
#include "vector_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>


namespace int8_activations {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_AVX512_VNNI 1
constexpr int64_t kRowTile = 4;  // rows of x per register tile (4 x 2 panels of accumulators)
// How far ahead in its panel a pass of one or two rows asks for INT4 weights: the hardware
// prefetchers alone leave a single row's INT4 stream well short of the copy bandwidth (they
// keep INT8's, twice the bytes per instruction, at it, where asking too costs more than it
// gains; so does asking further ahead into L1). docs/benchmarks.md has the measurements.
constexpr int64_t kInt4PrefetchBytes = 2048;
// And how far ahead it asks for them into L2, as a held weight-only INT4 tile does: the L1
// requests alone leave the stream waiting on DRAM.
constexpr int64_t kInt4FarPrefetchBytes = 16384;
static_assert(kPanelOutputs == 2 * kColumnRows, "a panel's scales are two runs of the group columns");

// What the kernel reads of x: per row, the weights' slots in order, 64 bytes of xq each (a group's
// odd last block zeros); one scale per block of those slots (an int4 unit's second slot is read
// as its high nibbles in place, 16 x the weight, so its scales carry the 1/16, exactly, as a
// power of two) and, for int8 weights, one offset per block: -128 x the block's sum of xq, what
// the weights' + 128 adds to the integer dot.
struct BlockActivations {
  std::vector<int8_t> bytes;
  std::vector<float> scales;
  std::vector<int32_t> offsets;
  int64_t slots_per_row = 0, blocks_per_row = 0;  // the panels' slots, and for int4 one more where odd
};

inline BlockActivations block_activations(const QuantizedActivations& a, const WeightPanels& panels, int64_t rows,
                                          int64_t in_features, int64_t group_size, bool int8_weights) {
  BlockActivations b;
  const int64_t slots_per_group = panels.slots_per_group;
  const int64_t blocks_per_group = group_size / kBlock;
  // A pass over an int4 unit reads both its slots of x: a row's last unit may hold one.
  b.slots_per_row = int8_weights ? panels.slots_per_row : 2 * panels.units_per_row;
  b.blocks_per_row = 2 * b.slots_per_row;
  b.bytes.assign(rows * b.slots_per_row * kSlot, 0);
  b.scales.assign(rows * b.blocks_per_row, 0.f);
  if (int8_weights) b.offsets.assign(rows * b.blocks_per_row, 0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < in_features / group_size; ++g)
      for (int64_t local = 0; local < blocks_per_group; ++local) {
        const int64_t slot = g * slots_per_group + local / 2;
        const int64_t block = m * b.blocks_per_row + 2 * slot + local % 2;
        const int64_t source = g * blocks_per_group + local;
        const int8_t* q = a.q.data() + m * in_features + source * kBlock;
        std::copy(q, q + kBlock, b.bytes.data() + block * kBlock);
        b.scales[block] = a.scales[m * a.blocks_per_row + source] * (!int8_weights && slot % 2 ? 1.f / 16 : 1.f);
        if (int8_weights) {
          int32_t sum = 0;
          for (int64_t l = 0; l < kBlock; ++l) sum += q[l];
          b.offsets[block] = -128 * sum;
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

// R rows of x from m0 by the P panels from `panel` (side by side in memory): out[m][n] for the
// panels' outputs below out_features. `columns`: the scales' (and int4 zeros') group columns
// (unread where the panels hold them inside); `x_sums` [rows, num_groups] for the zero-point term
// (null for int8). One or two rows keep both blocks of a slot in flight, and one row with int4
// weights both slots of a unit, whose bytes are then loaded once for the two; integer sums, so
// how they are split changes no bit, and the float sums go in the same order at every R: a
// slot's first block, its second, the next slot's.
template <int R, int P, bool kInt8>
inline void rows_by_panels(const BlockActivations& a, const WeightPanels& panels, int64_t panel, const float* columns,
                           const float* x_sums, int64_t num_groups, int64_t m0, float* out, int64_t out_features) {
  constexpr bool kFew = R <= 2;
  constexpr int S = R == 1 && !kInt8 ? 2 : 1;  // slots per pass over a unit (two only with H = 2: the float order)
  constexpr int H = kFew ? 2 : 1;             // blocks of each slot per pass
  const int64_t x_stride = a.slots_per_row * kSlot;
  const int64_t last_run = (out_features - 1) / kColumnRows;
  // With the columns inside the panels, each panel is walked as one stream: the next unit starts
  // after the column blocks of the groups the last one ended.
  const bool inside = !kInt8 && panels.columns_inside;
  const float* runs[2 * P] = {};
  const uint8_t* unit_at[P] = {};
  const float* column_at[P] = {};
  for (int r = 0; r < 2 * P && !inside; ++r)
    runs[r] = columns + std::min(2 * panel + r, last_run) * num_groups * 2 * kColumnRows;
  for (int p = 0; p < P && inside; ++p) unit_at[p] = panels.panel_start(panel + p);
  // What a unit's stream holds at most: the unit and, with groups of one slot, two column blocks.
  const int64_t unit_stream_bytes =
      kPanelUnitBytes + (inside ? (panels.slots_per_group == 1 ? 2 : 1) * kColumnBlockFloats * 4 : 0);
  __m512 total[R][P], group_sum[R][P];
  for (int i = 0; i < R; ++i)
    for (int p = 0; p < P; ++p) total[i][p] = group_sum[i][p] = _mm512_setzero_ps();
  const __m512i nibbles[2] = {_mm512_set1_epi8(0x0F), _mm512_set1_epi8(static_cast<char>(0xF0))};
  for (int64_t slot0 = 0; slot0 < panels.slots_per_row; slot0 += S) {
    const uint8_t* unit[P];
    for (int p = 0; p < P; ++p) {
      unit[p] = inside ? unit_at[p] : panels.panel_unit(panel + p, kInt8 ? slot0 : slot0 / 2);
      if (inside && slot0 % 2 == 0) column_at[p] = reinterpret_cast<const float*>(unit[p] + kPanelUnitBytes);
    }
    if constexpr (!kInt8)  // once per unit; the row tiles after the first find the panels in L2
      if ((kFew || (inside && m0 == 0)) && slot0 % 2 == 0)
        for (int p = 0; p < P; ++p)
          for (int64_t line = 0; line < unit_stream_bytes; line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(unit[p]) + kInt4PrefetchBytes + line, _MM_HINT_T0);
            if (kFew)
              _mm_prefetch(reinterpret_cast<const char*>(unit[p]) + kInt4FarPrefetchBytes + line, _MM_HINT_T1);
          }
    for (int half0 = 0; half0 < 2; half0 += H) {
      __m512i acc[S][H][R][P];
      for (int s = 0; s < S; ++s)
        for (int h = 0; h < H; ++h)
          for (int i = 0; i < R; ++i)
            for (int p = 0; p < P; ++p)
              acc[s][h][i][p] = kInt8 ? _mm512_set1_epi32(a.offsets[(m0 + i) * a.blocks_per_row + 2 * slot0 + half0 + h])
                                      : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < kQuads / 2; ++c)
        for (int h = 0; h < H; ++h) {
          const int64_t word = (half0 + h) * (kQuads / 2) + c;
          __m512i bytes[P];
          for (int p = 0; p < P; ++p) bytes[p] = _mm512_loadu_si512(unit[p] + word * 64);
          for (int s = 0; s < S; ++s) {
            __m512i w[P];
            for (int p = 0; p < P; ++p)
              w[p] = kInt8 ? bytes[p] : _mm512_and_si512(bytes[p], nibbles[S == 2 ? s : slot0 % 2]);
            for (int i = 0; i < R; ++i) {
              int32_t quad;
              std::memcpy(&quad, a.bytes.data() + (m0 + i) * x_stride + (slot0 + s) * kSlot + 4 * word, 4);
              const __m512i broadcast = _mm512_set1_epi32(quad);
              for (int p = 0; p < P; ++p) acc[s][h][i][p] = _mm512_dpbusd_epi32(acc[s][h][i][p], w[p], broadcast);
            }
          }
        }
      for (int s = 0; s < S; ++s) {
        const int64_t slot = slot0 + s;
        if (slot >= panels.slots_per_row) break;  // a row's last int4 unit holding one slot
        for (int h = 0; h < H; ++h) {
          const int64_t block = 2 * slot + half0 + h;
          for (int i = 0; i < R; ++i) {
            const __m512 scale = _mm512_set1_ps(a.scales[(m0 + i) * a.blocks_per_row + block]);
            for (int p = 0; p < P; ++p)
              group_sum[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[s][h][i][p]), scale, group_sum[i][p]);
          }
          if (block % 2 == 0 || (slot + 1) % panels.slots_per_group) continue;
          const int64_t g = slot / panels.slots_per_group;  // the group ends here
          for (int p = 0; p < P; ++p) {
            const __m512 group_scale =
                inside ? _mm512_loadu_ps(column_at[p]) : panel_values(runs[2 * p], runs[2 * p + 1], g, 0);
            for (int i = 0; i < R; ++i) total[i][p] = _mm512_fmadd_ps(group_sum[i][p], group_scale, total[i][p]);
            if constexpr (!kInt8) {
              const __m512 zero = inside ? _mm512_loadu_ps(column_at[p] + kPanelOutputs)
                                         : panel_values(runs[2 * p], runs[2 * p + 1], g, kColumnRows);
              for (int i = 0; i < R; ++i)
                total[i][p] = _mm512_fmadd_ps(zero, _mm512_set1_ps(x_sums[(m0 + i) * num_groups + g]), total[i][p]);
              if (inside) column_at[p] += kColumnBlockFloats;
            }
            for (int i = 0; i < R; ++i) group_sum[i][p] = _mm512_setzero_ps();
          }
        }
      }
    }
    if (inside && ((slot0 + S) % 2 == 0 || slot0 + S >= panels.slots_per_row))  // the unit is done
      for (int p = 0; p < P; ++p) unit_at[p] = reinterpret_cast<const uint8_t*>(column_at[p]);
  }
  for (int p = 0; p < P; ++p) {
    const int64_t n0 = (panel + p) * kPanelOutputs;
    const int64_t count = std::min<int64_t>(kPanelOutputs, out_features - n0);
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(out + (m0 + i) * out_features + n0, live, total[i][p]);
  }
}

// Every row tile of x by P panels from `panel`: the first tile streams the panels from memory,
// the later ones find them in L2.
template <int P, bool kInt8>
inline void all_rows_by_panels(int64_t rows, const BlockActivations& a, const WeightPanels& panels, int64_t panel,
                               const float* columns, const float* x_sums, int64_t num_groups, float* out,
                               int64_t out_features) {
  static_assert(kRowTile == 4, "one case per row count below");
  for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
    const int64_t r = std::min(kRowTile, rows - m0);
    if (r == 4) rows_by_panels<4, P, kInt8>(a, panels, panel, columns, x_sums, num_groups, m0, out, out_features);
    else if (r == 3) rows_by_panels<3, P, kInt8>(a, panels, panel, columns, x_sums, num_groups, m0, out, out_features);
    else if (r == 2) rows_by_panels<2, P, kInt8>(a, panels, panel, columns, x_sums, num_groups, m0, out, out_features);
    else rows_by_panels<1, P, kInt8>(a, panels, panel, columns, x_sums, num_groups, m0, out, out_features);
  }
}

// The whole call: pairs of panels (each broadcast of x feeds both; a single INT4 row takes
// them one at a time) to the threads in chunks of neighbouring pairs, so a thread a neighbour
// process slows does fewer of them. `columns`: the scales' (and int4 zeros') group columns
// (int8_activation_group_columns), or null where the panels hold them inside; `x_sums` [rows,
// num_groups] or null (int8).
template <bool kInt8>
void int8_activations_avx512(const QuantizedActivations& q, const WeightPanels& panels, const float* columns,
                             const float* x_sums, int64_t rows, int64_t in_features, int64_t out_features,
                             int64_t group_size, float* out) {
  const BlockActivations a = block_activations(q, panels, rows, in_features, group_size, kInt8);
  const int64_t num_groups = in_features / group_size;
  const int64_t num_panels = (out_features + kPanelOutputs - 1) / kPanelOutputs;
  const int64_t num_pairs = (num_panels + 1) / 2;
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, num_pairs / (8 * threads));
  const int64_t num_chunks = (num_pairs + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max<int64_t>(1, std::min(threads, num_chunks)))
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t pair = c * chunk; pair < std::min(num_pairs, (c + 1) * chunk); ++pair) {
      if (!kInt8 && rows == 1) {  // one panel at a time: measured faster for a single INT4 row
        for (int64_t panel = 2 * pair; panel < std::min(2 * pair + 2, num_panels); ++panel)
          all_rows_by_panels<1, kInt8>(rows, a, panels, panel, columns, x_sums, num_groups, out, out_features);
      } else if (2 * pair + 1 < num_panels) {
        all_rows_by_panels<2, kInt8>(rows, a, panels, 2 * pair, columns, x_sums, num_groups, out, out_features);
      } else {
        all_rows_by_panels<1, kInt8>(rows, a, panels, 2 * pair, columns, x_sums, num_groups, out, out_features);
      }
    }
}
#endif

}  // namespace int8_activations
