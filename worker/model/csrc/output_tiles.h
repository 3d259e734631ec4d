// The loop every small-batch quantized linear shares: out [rows, out_features] cut into tiles of
// kRows x kCols, threads splitting the column tiles (each thread a contiguous run of them).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

// tile(column_tile, end, m0, m_count, n0, n_count, total) fills total[kRows][kCols] for rows
// m0.. and outputs n0..; `end` is where this thread's run of column tiles stops (what it may
// prefetch ahead). The totals are then written to out.
template <int64_t kRows, int64_t kCols, typename Tile>
void for_each_output_tile(int64_t rows, int64_t out_features, float* out, Tile tile) {
  at::parallel_for(0, (out_features + kCols - 1) / kCols, 4, [&](int64_t begin, int64_t end) {
    for (int64_t column_tile = begin; column_tile < end; ++column_tile) {
      const int64_t n0 = column_tile * kCols, n_count = std::min(kCols, out_features - n0);
      for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
        const int64_t m_count = std::min(kRows, rows - m0);
        float total[kRows][kCols] = {};
        tile(column_tile, end, m0, m_count, n0, n_count, total);
        for (int64_t i = 0; i < m_count; ++i)
          for (int64_t j = 0; j < n_count; ++j) out[(m0 + i) * out_features + n0 + j] = total[i][j];
      }
    }
  });
}
