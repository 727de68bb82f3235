// What the processor can do, read once (cpuid through the compiler's builtins).
#pragma once

#include <cstdint>
#include <string>

namespace mantissa {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
};

const CpuFeatures& cpu_features();
// "avx2 fma f16c" style summary for reports.
std::string cpu_features_string();

// ---- FP32 multiply-add throughput: the ceiling that training speed is compared with ----

// Lanes of the probe: 12 independent chains of 8 lanes, enough to hide an FMA's latency on two
// pipes. Chain c, lane l starts at x0 + (8c + l) * dx and runs x = fma(x, a, b) `rounds` times;
// the result is the sum of the 96 lanes in order (so the work cannot be skipped, and a scalar
// loop gives the same bits). AVX2+FMA when the CPU has them, a portable loop otherwise.
inline constexpr int kFmaProbeLanes = 96;
float fma_chains(int64_t rounds, float x0, float dx, float a, float b);
// The scalar reference of fma_chains (the tests' oracle).
float fma_chains_reference(int64_t rounds, float x0, float dx, float a, float b);

// GFLOP/s (2 per FMA) of `threads` threads of its own, released together, each running
// fma_chains for about `seconds`, the best of `repeats` runs.
double fma_peak_gflops(int threads, double seconds, int repeats = 3);

}  // namespace mantissa
