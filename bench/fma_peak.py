"""The host's float32 FMA peak, measured: every thread runs independent fused multiply-adds on
the widest vectors the compiler targets here (-march=native), so no latency, memory or
scheduling limits them. It is the ceiling any float32 matmul reaches on this host, ours or
llama.cpp's, and what bench.vs_llama_cpp turns into the batched run's compute bound (the
workload's FLOPs over this rate). Compiled once per process as a plain shared library loaded
with ctypes: it needs nothing of torch, whose headers took the compiler most of a minute.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

SOURCE = r"""
#include <omp.h>

#include <chrono>
#include <cstdint>

// One vector register's floats where AVX-512 is built (32 registers), else 32 bytes: one AVX2
// register (16 of them) or two NEON ones. kChains of them cover the FMA latency times the FMA
// ports of any current core and still fit its registers with b and c: a chain spilled to memory
// measures the stores, not the FMAs (64-byte vectors on an AVX2 host ran at a fifth of its peak).
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
constexpr int kChains = 16;
#else
typedef float vec __attribute__((vector_size(32)));
constexpr int kChains = 10;
#endif
constexpr int kLanes = sizeof(vec) / sizeof(float);

// GFLOP/s of `threads` threads, each doing `iterations` x kChains vector FMAs.
extern "C" double fma_gflops(int64_t threads, int64_t iterations) {
  double sink = 0.0;
  const auto started = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    vec acc[kChains], b, c;
    for (int l = 0; l < kLanes; ++l) b[l] = 0.999f, c[l] = 1e-3f;
    for (int i = 0; i < kChains; ++i)
      for (int l = 0; l < kLanes; ++l) acc[i][l] = static_cast<float>(i + omp_get_thread_num());
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * b + c;  // unrolled: the chains live in registers
    }
    for (int i = 0; i < kChains; ++i)
      for (int l = 0; l < kLanes; ++l) sink += acc[i][l];
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  static volatile double kept;
  kept = sink;  // the sums are used, so the loop stays
  return 2.0 * kLanes * kChains * iterations * threads / seconds / 1e9;
}
"""


@lru_cache(maxsize=1)
def _module():
    # The loaded library stays mapped once its file is gone, so nothing is left in the temporary folder.
    with tempfile.TemporaryDirectory(prefix="fma_peak_") as name:
        folder = Path(name)
        (folder / "fma_peak.cpp").write_text(SOURCE)
        built = subprocess.run([os.environ.get("CXX", "c++"), "-O3", "-march=native", "-ffp-contract=fast",
                                "-fopenmp", "-shared", "-fPIC", "fma_peak.cpp", "-o", "fma_peak.so"], cwd=folder,
                               capture_output=True, text=True, timeout=300)
        if built.returncode:
            raise RuntimeError(f"building the FMA peak probe failed:\n{built.stderr}")
        library = ctypes.CDLL(str(folder / "fma_peak.so"))
    library.fma_gflops.argtypes, library.fma_gflops.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_double
    return library


def measure_fma_gflops(threads: int, iterations: int = 20_000_000, repeats: int = 5) -> float:
    """The best of `repeats` runs (a peak: a run a neighbour slowed says nothing about the host)."""
    module = _module()
    module.fma_gflops(threads, iterations // 20)  # wake the threads and the clocks
    return max(module.fma_gflops(threads, iterations) for _ in range(repeats))
