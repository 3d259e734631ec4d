// The AVX-512 register tiles of the weight-only INT8 / INT4 small-batch linears (linear.cpp says
// what they compute): 16 input features per 512-bit register, up to kRows rows of x by kCols
// weight rows per tile, each weight widened to float32 once per tile and the arithmetic float32
// FMAs as in the AVX2 tiles. Widening 16 weights into one register takes as many instructions as
// 8 into a 256-bit one, and the 32 registers hold 8 weight rows' accumulators for 3 rows of x,
// enough independent FMA chains for a single row. Empty unless the compiler targets AVX-512 F,
// BW, DQ and VL.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512_WEIGHT_ONLY 1

namespace weight_only_avx512 {

constexpr int64_t kLanes = 16;  // float32 per register
constexpr int64_t kRows = 3;    // rows of x per tile
constexpr int64_t kCols = 8;    // weight rows per tile
constexpr int64_t kStep = 2 * kLanes;  // features per step: K and the groups are whole steps

// Each tile reads 8 weight rows as 8 streams, more than the hardware prefetchers keep ahead of
// (measured: INT4 weights streamed from memory at 16 GB/s without this, 25 with it), so each
// step asks for the line kPrefetchBytes further along its row; past a row's end that is the
// next row, which a later tile reads.
constexpr int64_t kPrefetchBytes = 256;
inline void prefetch_ahead(const void* weights) {
  _mm_prefetch(static_cast<const char*>(weights) + kPrefetchBytes, _MM_HINT_T0);
}

// A single row of x reads a tile's kCols weight rows side by side; those rows lie end to end in
// memory, and the next tile's right after them. Each step of the tile fetches its share of the
// next tile's bytes as one forward stream (spread evenly over the tile's steps), so that tile
// starts warm: per-row prefetches a fixed distance ahead left kCols rows to start cold at every
// tile (docs/benchmarks.md has the measurement). A tile whose arithmetic is light enough to
// outrun that (the int8 one-row tile) also asks for the tile after the next one into L2: the
// requests to L1 alone keep too few lines in flight to stream at the memory's rate.
// Prefetches the compiler keeps: GCC deletes a loop whose only work is _mm_prefetch (it counts
// the builtin as free of side effects), which a loop over computed line bounds became.
inline void prefetch_to_l1(const char* at) { asm volatile("prefetcht0 %0" : : "m"(*at)); }
inline void prefetch_to_l2(const char* at) { asm volatile("prefetcht1 %0" : : "m"(*at)); }

class NextTilePrefetch {
 public:
  // `next`: where the next tile's bytes start; `step_bytes`: how many of them each step of this
  // tile asks for (its steps cover the next tile once); `after`: where nonzero, the distance to
  // the tile after the next, whose bytes each step also asks for, to L2.
  NextTilePrefetch(const void* next, int64_t step_bytes, int64_t after = 0)
      : next_(static_cast<const char*>(next)), step_bytes_(step_bytes), after_(after) {}
  void step(int64_t index) const {
    // The lines that start within this step's share of the bytes (shares need not be whole lines).
    const int64_t end = ((index + 1) * step_bytes_ + 63) / 64;
    for (int64_t line = (index * step_bytes_ + 63) / 64; line < end; ++line) {
      const char* at = next_ + line * 64;
      prefetch_to_l1(at);
      if (after_) prefetch_to_l2(at + after_);
    }
  }

 private:
  const char* next_;
  int64_t step_bytes_, after_;
};

// Where a tile's kCols INT4 weight rows lie, as the INT4 tiles read them: row j's packed bytes
// from feature k (a multiple of 32: `bytes(j, k)`), its scale of group g, the group's zeros of
// all kCols rows (`zeros_of_group`), and the prefetch of the next tile for steps of `step_features`.
// Row-major ([N, K/2] bytes, [N, num_groups] scales and zeros): a pointer per row; the rows of a
// tile lie end to end, and the next tile's right after them.
static_assert(kCols == 8, "a group's zeros of a tile are one 256-bit register");
struct Int4RowPointers {
  const uint8_t* rows[kCols];
  const float* scales[kCols];
  const float* zeros[kCols];
  int64_t row_bytes;
  const uint8_t* bytes(int64_t j, int64_t k) const { return rows[j] + k / 2; }
  float scale(int64_t j, int64_t g) const { return scales[j][g]; }
  __m256 zeros_of_group(int64_t g) const {
    return _mm256_setr_ps(zeros[0][g], zeros[1][g], zeros[2][g], zeros[3][g], zeros[4][g], zeros[5][g], zeros[6][g],
                          zeros[7][g]);
  }
  NextTilePrefetch next_tile(int64_t step_features, bool and_the_one_after = false) const {
    return NextTilePrefetch(rows[kCols - 1] + row_bytes, kCols * step_features / 2,
                            and_the_one_after ? kCols * row_bytes : 0);
  }
};

// A held INT4 tile (worker/model/int4_weight_tiles.py; groups of kHeldGroup features): per
// group, each of the tile's rows' 64 bytes, then the rows' kCols scales and kCols zeros, so that
// a tile is one forward stream with its scales and zeros inside it, and tiles lie end to end.
constexpr int64_t kHeldGroup = 128;
constexpr int64_t kHeldGroupBytes = (kCols + 1) * 64;
struct Int4HeldTile {
  const uint8_t* tile;
  int64_t tile_bytes;
  const uint8_t* bytes(int64_t j, int64_t k) const {
    return tile + k / kHeldGroup * kHeldGroupBytes + j * 64 + k % kHeldGroup / 2;
  }
  const float* columns(int64_t g) const {
    return reinterpret_cast<const float*>(tile + g * kHeldGroupBytes + kCols * 64);
  }
  float scale(int64_t j, int64_t g) const { return columns(g)[j]; }
  __m256 zeros_of_group(int64_t g) const { return _mm256_loadu_ps(columns(g) + kCols); }
  NextTilePrefetch next_tile(int64_t step_features, bool and_the_one_after = false) const {
    return NextTilePrefetch(tile + tile_bytes, step_features * kHeldGroupBytes / kHeldGroup,
                            and_the_one_after ? tile_bytes : 0);
  }
};

// The zero-point term of a tile's kCols rows for one row of x, added to its sums: sums[j] += the
// sum over groups g of zero(j, g) * sum(x_g) (`x_sums`), all rows in one register a group.
template <typename Rows>
inline void add_zero_terms(const Rows& rows, const float* x_sums, int64_t num_groups, float sums[kCols]) {
  __m256 terms = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g)
    terms = _mm256_fmadd_ps(rows.zeros_of_group(g), _mm256_set1_ps(x_sums[g]), terms);
  _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_loadu_ps(sums), terms));
}

// 16 int8 weights -> 16 floats.
inline __m512 widen_int8(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

// The nibble-split order of INT4 weights for 16 lanes: 16 bytes hold 32 features, and lane i of
// the low half (k % 32 == 0) is feature 2i (the low nibble of byte i), lane i of the high half
// (k % 32 == 16) feature 2i + 1; x is put in the same order (split_features<kSplitRun>).
constexpr int64_t kSplitRun = 2 * kLanes;

// sums[j] = the sum of acc[j]'s 16 lanes, for the 8 accumulators of one row of a tile: halving
// all 8 together takes about 3 instructions per accumulator where one reduction each takes 8.
inline void sum_each(const __m512 acc[kCols], float sums[kCols]) {
  __m256 half[kCols];
  for (int j = 0; j < kCols; ++j)
    half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
  // hadd pairs neighbours within each 128-bit lane: after two rounds lane l of quarter[h] holds
  // a partial sum of accumulator 4h + l (its low 128 bits) and another (its high 128 bits).
  const __m256 h01 = _mm256_hadd_ps(half[0], half[1]), h23 = _mm256_hadd_ps(half[2], half[3]);
  const __m256 h45 = _mm256_hadd_ps(half[4], half[5]), h67 = _mm256_hadd_ps(half[6], half[7]);
  const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
  const __m256 low = _mm256_permute2f128_ps(q0, q1, 0x20), high = _mm256_permute2f128_ps(q0, q1, 0x31);
  _mm256_storeu_ps(sums, _mm256_add_ps(low, high));
}

// A tile of kR (<= kRows) rows of x from m0 by kCols weight rows from n0 (`row(j)` the weight
// row its column j reads: past the last row the caller repeats it, and drops those outputs):
// total[i][j] = finish(row(j), x . w) over all of K. `load(n, k, g)` widens the 16 weights of
// row n from feature k, in group g of group_size features (dequantized as far as the caller
// wants: a per-row scale can wait for finish, a per-group one cannot).
template <int64_t kR, typename Row, typename Load, typename Finish>
inline void tile(const float* x, int64_t in_features, int64_t group_size, int64_t m0, Row& row,
                 float total[kRows][kCols], Load& load, Finish& finish) {
  int64_t rows_of[kCols];
  for (int64_t j = 0; j < kCols; ++j) rows_of[j] = row(j);
  __m512 acc[kR][kCols];
  for (int64_t i = 0; i < kR; ++i)
    for (int64_t j = 0; j < kCols; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < in_features / group_size; ++g)
    // Two registers of features a step: an INT4 run's low and high nibbles come from one load
    // of its bytes, with one broadcast of the group's scale and zero. x is read from L1 by the
    // FMAs themselves, leaving the registers to the accumulators.
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kStep)
      for (int64_t j = 0; j < kCols; ++j) {
        const __m512 w0 = load(rows_of[j], k, g), w1 = load(rows_of[j], k + kLanes, g);
        for (int64_t i = 0; i < kR; ++i) {
          const float* xr = x + (m0 + i) * in_features + k;
          acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + kLanes), w1,
                                      _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[i][j]));
        }
      }
  for (int64_t i = 0; i < kR; ++i) {
    float sums[kCols];
    sum_each(acc[i], sums);
    for (int64_t j = 0; j < kCols; ++j) total[i][j] = finish(rows_of[j], sums[j]);
  }
}

// A nibble as a float by a table lookup: vpermps reads only the low four bits of each lane's
// index, so one instruction both masks and converts (a mask and a convert otherwise), and the
// high nibble takes a shift first. Lanes hold one byte each (zero-extended).
inline __m512 nibble_table() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline __m512 low_nibbles(__m512i bytes, __m512 table) { return _mm512_permutexvar_ps(bytes, table); }
inline __m512 high_nibbles(__m512i bytes, __m512 table) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

// One row of x (in the nibble-split order) by kCols INT4 weight rows (`rows`: where they lie,
// Int4RowPointers or Int4HeldTile): sums[j] = sum over groups g of scale(j, g) * x_g . q_jg. A
// single row shares no widened weight with another row, so each group's x_g . q_g accumulates on
// the raw nibbles and one FMA per group and row scales it, where dequantizing every weight first
// takes an FMA per 16 weights, as many as the products. Each row's low and high nibbles
// accumulate apart, so that no FMA waits on the one before; one prefetch per 64-byte line of a
// row (a step reads 16 bytes) leaves the load ports to the weights.
template <typename Rows>
inline void int4_row_tile(const float* x, const Rows& rows, int64_t in_features, int64_t group_size,
                          float sums[kCols]) {
  const __m512 nibble_values = nibble_table();
  const NextTilePrefetch next_tile = rows.next_tile(kStep);
  __m512 sum[kCols];
  for (int64_t j = 0; j < kCols; ++j) sum[j] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < in_features; g0 += group_size) {
    __m512 low[kCols], high[kCols];
    for (int64_t j = 0; j < kCols; ++j) low[j] = high[j] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group_size; k += kStep) {
      const __m512 x_low = _mm512_loadu_ps(x + k), x_high = _mm512_loadu_ps(x + k + kLanes);
      next_tile.step(k / kStep);
      for (int64_t j = 0; j < kCols; ++j) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.bytes(j, k))));
        low[j] = _mm512_fmadd_ps(x_low, low_nibbles(bytes, nibble_values), low[j]);
        high[j] = _mm512_fmadd_ps(x_high, high_nibbles(bytes, nibble_values), high[j]);
      }
    }
    const int64_t g = g0 / group_size;
    for (int64_t j = 0; j < kCols; ++j)
      sum[j] = _mm512_fmadd_ps(_mm512_add_ps(low[j], high[j]), _mm512_set1_ps(rows.scale(j, g)), sum[j]);
  }
  sum_each(sum, sums);
}

// int4_row_tile's sums for kR rows of x (2 or 3, in the nibble-split order, `x_stride` apart):
// sums[i][j] = sum over groups g of scale(j, g) * x_ig . q_jg. Each widened nibble feeds all
// kR rows, and no weight is dequantized (the scale waits for the group's end). The per-group
// totals live in memory, touched once a group, which leaves the registers to kR x kCols
// accumulators.
template <int64_t kR, typename Rows>
inline void int4_rows_tile(const float* x, int64_t x_stride, const Rows& rows, int64_t in_features,
                           int64_t group_size, float sums[kRows][kCols]) {
  static_assert(kR >= 2 && kR <= kRows, "one row takes int4_row_tile");
  const __m512 nibble_values = nibble_table();
  const NextTilePrefetch next_tile = rows.next_tile(kStep);
  alignas(64) float totals[kR][kCols][kLanes] = {};
  for (int64_t g0 = 0; g0 < in_features; g0 += group_size) {
    __m512 acc[kR][kCols];
    for (int64_t i = 0; i < kR; ++i)
      for (int64_t j = 0; j < kCols; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group_size; k += kStep) {
      next_tile.step(k / kStep);
      for (int64_t j = 0; j < kCols; ++j) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.bytes(j, k))));
        const __m512 low = low_nibbles(bytes, nibble_values), high = high_nibbles(bytes, nibble_values);
        for (int64_t i = 0; i < kR; ++i) {
          const float* xr = x + i * x_stride + k;
          acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + kLanes), high,
                                      _mm512_fmadd_ps(_mm512_loadu_ps(xr), low, acc[i][j]));
        }
      }
    }
    const int64_t g = g0 / group_size;
    for (int64_t j = 0; j < kCols; ++j) {
      const __m512 scale = _mm512_set1_ps(rows.scale(j, g));
      for (int64_t i = 0; i < kR; ++i)
        _mm512_store_ps(totals[i][j], _mm512_fmadd_ps(acc[i][j], scale, _mm512_load_ps(totals[i][j])));
    }
  }
  for (int64_t i = 0; i < kR; ++i) {
    __m512 row_totals[kCols];
    for (int64_t j = 0; j < kCols; ++j) row_totals[j] = _mm512_load_ps(totals[i][j]);
    sum_each(row_totals, sums[i]);
  }
}

#if defined(__AVX512BF16__)
#define HAVE_AVX512_BF16_NIBBLES 1
// A single row of x by INT4 weights through bf16 dot products (vdpbf16ps: 32 products a
// register, summed in pairs into 16 float lanes), for hosts with AVX512_BF16. A nibble q becomes
// the bf16 value 128 + q, exact (0x4300 is 128.0, whose last mantissa bit is worth 1), by one
// mask-and-OR, where widening it to float32 takes a mask and a convert; and each instruction
// multiplies 32 weights where an FMA multiplies 16: about 4 instructions per 32 weights against
// 7. x enters as two bf16 parts (upper + residual, 16 of float32's 24 mantissa bits), every
// product is exact in float32, and the 128 comes off once per group (128 times the group's sum
// of those parts): the result is a float32 product of x to 16 bits and the INT4 weights, about
// 1e-5 of the output's scale from float64, the 128 riding in the sums costing most of it (the
// FMA tile: 3e-7; x rounded once to bf16: 1e-3; the INT4 rounding itself: 1e-2). Placing q
// higher in the mantissa (1 + q / 16) halves that error but takes a second shift a step,
// measured 10-20% slower in cache.
constexpr int64_t kNibbleRun = 64;  // features per step: 32 weight bytes, one register of each nibble
constexpr uint16_t kBf16NibbleBase = 0x4300;
constexpr float kNibbleBase = 128.f;

// One row of x for int4_row_tile_bf16: each run of 64 features in the nibble-split order over 64
// (features 2i at i, 2i + 1 at 32 + i), as bf16 upper and residual parts, and per group
// 128 * sum(upper + residual) / 16: what the base of each weight adds to each of the 16 lanes.
struct NibbleRowX {
  std::vector<uint16_t> upper, residual;
  std::vector<float> offset_terms;
};

inline NibbleRowX split_x_bf16(const float* x, int64_t in_features, int64_t group_size) {
  NibbleRowX out{std::vector<uint16_t>(in_features), std::vector<uint16_t>(in_features),
                 std::vector<float>(in_features / group_size)};
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  auto widen = [](__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); };
  auto put = [&](int64_t at, __m512 v, __m512& sum) {
    const __m256i upper = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    const __m512 upper_value = widen(upper);
    const __m256i residual = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(v, upper_value)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.upper.data() + at), upper);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.residual.data() + at), residual);
    sum = _mm512_add_ps(sum, _mm512_add_ps(upper_value, widen(residual)));
  };
  for (int64_t g0 = 0; g0 < in_features; g0 += group_size) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group_size; k += kNibbleRun)
      for (int64_t half = 0; half < 2; ++half) {
        const __m512 a = _mm512_loadu_ps(x + k + 32 * half), b = _mm512_loadu_ps(x + k + 32 * half + 16);
        put(k + 16 * half, _mm512_permutex2var_ps(a, evens, b), sum);
        put(k + 32 + 16 * half, _mm512_permutex2var_ps(a, odds, b), sum);
      }
    out.offset_terms[g0 / group_size] = kNibbleBase * _mm512_reduce_add_ps(sum) / kLanes;
  }
  return out;
}

// int4_row_tile's sums (sums[j] = sum over groups g of scale(j, g) * x_g . q_jg) through bf16
// dot products, x as split_x_bf16 gives it. Each row's even and odd nibbles accumulate apart,
// each taking x's upper then residual part.
template <typename Rows>
inline void int4_row_tile_bf16(const NibbleRowX& x, const Rows& rows, int64_t in_features, int64_t group_size,
                               float sums[kCols]) {
  const __m512i nibble = _mm512_set1_epi16(0x0F), base = _mm512_set1_epi16(kBf16NibbleBase);
  __m512 sum[kCols];
  for (int64_t j = 0; j < kCols; ++j) sum[j] = _mm512_setzero_ps();
  const NextTilePrefetch next_tile = rows.next_tile(kNibbleRun);
  auto load_x = [](const std::vector<uint16_t>& part, int64_t at) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(part.data() + at));
  };
  for (int64_t g0 = 0; g0 < in_features; g0 += group_size) {
    __m512 even[kCols], odd[kCols];
    for (int64_t j = 0; j < kCols; ++j) even[j] = odd[j] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g0 + group_size; k += kNibbleRun) {
      next_tile.step(k / kNibbleRun);
      const __m512bh upper_even = load_x(x.upper, k), upper_odd = load_x(x.upper, k + 32);
      const __m512bh residual_even = load_x(x.residual, k), residual_odd = load_x(x.residual, k + 32);
      for (int64_t j = 0; j < kCols; ++j) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.bytes(j, k))));
        // (bytes & 0x0F) | 128.0 in one instruction (ternary truth table 0xEA: A & B | C).
        const __m512bh w_even = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(bytes, nibble, base, 0xEA));
        const __m512bh w_odd = reinterpret_cast<__m512bh>(_mm512_or_si512(_mm512_srli_epi16(bytes, 4), base));
        even[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(even[j], w_even, upper_even), w_even, residual_even);
        odd[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(odd[j], w_odd, upper_odd), w_odd, residual_odd);
      }
    }
    const int64_t g = g0 / group_size;
    const __m512 offset_term = _mm512_set1_ps(x.offset_terms[g]);
    for (int64_t j = 0; j < kCols; ++j)
      sum[j] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_add_ps(even[j], odd[j]), offset_term),
                               _mm512_set1_ps(rows.scale(j, g)), sum[j]);
  }
  sum_each(sum, sums);
}
#endif

#if defined(__AVX512VNNI__)
#define HAVE_AVX512_VNNI_NIBBLES 1
// A single row of x by INT4 weights through int8 dot products (vpdpbusd: 64 unsigned bytes by 64
// signed ones, summed in fours into 16 int32 lanes), for hosts with AVX512_VNNI. The weight bytes
// go in as they lie, masked to their low or shifted to their high nibbles, 128 weights a step in
// about 7 instructions where the FMA tile takes about 24. x enters as two int8 parts on a grid:
// x ~ unit * (256 * upper + lower), upper = x rounded to 1/127 of the largest |x| it shares a
// unit with, lower its residual in 1/256 of that step, so each element keeps 2^-16 of that
// largest; the integer dots are exact, and the result is the float32 product of that x and the
// INT4 weights. A step's 64 bytes put each 32 features' products in 4 lanes of their own (lanes
// 4q..4q+3 sum features 32q..32q+31 of the step's 128), and each step's dots are scaled as they
// end, so a unit is per 32 features, as q8_0's scales: an outlier coarsens only its own 32. The
// zero-point term must take the same x (NibbleRowParts::sums), so the error is the sum of
// centred weights times the residuals.
constexpr int64_t kVnniRun = 128;  // features per step: 64 weight bytes, low nibbles the even features

// One row of x for int4_row_tile_vnni: per run of 128 features, 256 bytes (the upper part of the
// 64 even features, of the 64 odd ones, then the lower part of each) and 16 units (each 32
// features' unit, for the 4 lanes it scales); per group, the sum of x as the parts give it.
struct NibbleRowParts {
  std::vector<int8_t> bytes;
  std::vector<float> lane_units, sums;
};

inline NibbleRowParts split_x_int8(const float* x, int64_t in_features, int64_t group_size) {
  NibbleRowParts out{std::vector<int8_t>(2 * in_features), std::vector<float>(in_features / kVnniRun * kLanes),
                     std::vector<float>(in_features / group_size)};
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  const __m512 low_limit = _mm512_set1_ps(-128.f), high_limit = _mm512_set1_ps(127.f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t k = 0; k < in_features; k += kVnniRun) {
    int8_t* run = out.bytes.data() + 2 * k;
    float* units = out.lane_units.data() + k / kVnniRun * kLanes;
    for (int64_t quarter = 0; quarter < 4; ++quarter) {
      const float* block = x + k + 32 * quarter;
      const __m512 a = _mm512_loadu_ps(block), b = _mm512_loadu_ps(block + kLanes);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      // A NaN or infinity in x makes the unit NaN, so every output is NaN as the float product's
      // would not be finite either (the parts alone would turn it into some finite value).
      constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // quiet NaN, +inf, -inf, signalling NaN
      const bool finite = (_mm512_fpclass_ps_mask(a, kNotFinite) | _mm512_fpclass_ps_mask(b, kNotFinite)) == 0;
      const float unit = finite ? top / 127.f / 256.f : std::numeric_limits<float>::quiet_NaN();
      std::fill_n(units + 4 * quarter, 4, unit);
      if (top == 0.f || !finite) continue;  // parts stay zero
      const __m512 to_upper = _mm512_set1_ps(127.f / top);
      __m512i total = _mm512_setzero_si512();
      for (int64_t parity = 0; parity < 2; ++parity) {
        const __m512 scaled = _mm512_mul_ps(_mm512_permutex2var_ps(a, parity ? odds : evens, b), to_upper);
        const __m512 upper = _mm512_roundscale_ps(scaled, kNearest);
        const __m512 lower = _mm512_min_ps(high_limit, _mm512_max_ps(low_limit, _mm512_roundscale_ps(
                                 _mm512_mul_ps(_mm512_sub_ps(scaled, upper), _mm512_set1_ps(256.f)), kNearest)));
        const __m512i upper_i = _mm512_cvtps_epi32(upper), lower_i = _mm512_cvtps_epi32(lower);
        total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(upper_i, 8), lower_i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(run + 64 * parity + 16 * quarter), _mm512_cvtepi32_epi8(upper_i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(run + 128 + 64 * parity + 16 * quarter),
                         _mm512_cvtepi32_epi8(lower_i));
      }
      out.sums[(k + 32 * quarter) / group_size] += unit * static_cast<float>(_mm512_reduce_add_epi32(total));
    }
  }
  return out;
}

// int4_row_tile's sums (sums[j] = sum over groups g of scale(j, g) * x_g . q_jg) through int8 dot
// products, x as split_x_int8 gives it: each step, each row's upper and lower dots meet as
// 256 * upper + lower and are scaled lane by lane by x's units times the weight's group scale.
template <typename Rows>
inline void int4_row_tile_vnni(const NibbleRowParts& x, const Rows& rows, int64_t in_features, int64_t group_size,
                               float sums[kCols]) {
  const __m512i low_nibble = _mm512_set1_epi8(0x0F);
  const NextTilePrefetch next_tile = rows.next_tile(kVnniRun, /*and_the_one_after=*/true);
  __m512 sum[kCols];
  for (int64_t j = 0; j < kCols; ++j) sum[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in_features; k += kVnniRun) {
    next_tile.step(k / kVnniRun);
    const int8_t* run = x.bytes.data() + 2 * k;
    const __m512i upper_even = _mm512_loadu_si512(run), upper_odd = _mm512_loadu_si512(run + 64);
    const __m512i lower_even = _mm512_loadu_si512(run + 128), lower_odd = _mm512_loadu_si512(run + 192);
    const __m512 units = _mm512_loadu_ps(x.lane_units.data() + k / kVnniRun * kLanes);
    const int64_t g = k / group_size;
    for (int64_t j = 0; j < kCols; ++j) {
      const __m512i bytes = _mm512_loadu_si512(rows.bytes(j, k));
      const __m512i even = _mm512_and_si512(bytes, low_nibble);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibble);
      const __m512i upper = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even, upper_even), odd,
                                                upper_odd);
      const __m512i lower = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even, lower_even), odd,
                                                lower_odd);
      sum[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(upper, 8), lower)),
                               _mm512_mul_ps(units, _mm512_set1_ps(rows.scale(j, g))), sum[j]);
    }
  }
  sum_each(sum, sums);
}
#endif

// One row of x by kCols INT8 weight rows (`rows[j]`: row j's weights): sums[j] = x . q_j, laid
// out as int4_row_tile for the same reasons.
inline void int8_row_tile(const float* x, const int8_t* const rows[kCols], int64_t in_features, float sums[kCols]) {
  __m512 low[kCols], high[kCols];
  for (int64_t j = 0; j < kCols; ++j) low[j] = high[j] = _mm512_setzero_ps();
  const NextTilePrefetch next_tile(rows[kCols - 1] + in_features, kCols * kStep);
  for (int64_t k = 0; k < in_features; k += kStep) {
    const __m512 x_low = _mm512_loadu_ps(x + k), x_high = _mm512_loadu_ps(x + k + kLanes);
    next_tile.step(k / kStep);
    for (int64_t j = 0; j < kCols; ++j) {
      low[j] = _mm512_fmadd_ps(x_low, widen_int8(rows[j] + k), low[j]);
      high[j] = _mm512_fmadd_ps(x_high, widen_int8(rows[j] + k + kLanes), high[j]);
    }
  }
  for (int64_t j = 0; j < kCols; ++j) low[j] = _mm512_add_ps(low[j], high[j]);
  sum_each(low, sums);
}

}  // namespace weight_only_avx512
#endif
