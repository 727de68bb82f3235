// What the processor can do, read once (cpuid through the compiler's builtins), and the one
// decision of which SIMD path each kernel family runs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

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

// ---- SIMD dispatch ----
// Every kernel with a SIMD version asks simd_path() once for its family and keeps the answer;
// none reads cpu_features() itself. The scalar path is always built and gives the same bits (each
// family's tests compare the two), so MANTISSA_SIMD=scalar runs a whole program on the portable
// loops.

enum class SimdPath : uint8_t { kScalar, kAvx2 };

std::string_view simd_path_name(SimdPath p);
// Whether this build has the path and this processor can run it (AVX2: AVX2, FMA and F16C).
bool simd_path_supported(SimdPath p);
// The process's path: the best supported one, chosen once; MANTISSA_SIMD=scalar|avx2 in the
// environment overrides it (an unsupported request falls back to scalar).
SimdPath active_simd_path();

// The kernel families with a SIMD version: (enumerator, name, where).
#define MANTISSA_SIMD_FAMILIES(X)                                                            \
  X(kConvert, "convert", "core/convert.cc: bulk conversion tables")                          \
  X(kGemm, "gemm", "kernels/gemm.cc: the 6 x 16 micro-kernels and packing transposes")       \
  X(kVectorRows, "vector rows",                                                              \
    "kernels/vector_kernels.cc: convolution rows, FMA rows, lane-split dot products, axpy, " \
    "Winograd transforms")                                                                   \
  X(kPooling, "pooling", "kernels/vector_kernels.cc: 2x2 stride-2 max pooling rows")         \
  X(kOptimizer, "optimizer", "optim/optim.cc: the Adam/AdamW update and the sum of squares") \
  X(kFmaProbe, "fma probe", "core/cpu_features.cc: fma_chains, the FMA ceiling's probe")

enum class SimdFamily : uint8_t {
#define MANTISSA_SIMD_FAMILY_ENUM(e, name, where) e,
  MANTISSA_SIMD_FAMILIES(MANTISSA_SIMD_FAMILY_ENUM)
#undef MANTISSA_SIMD_FAMILY_ENUM
};
inline constexpr int kSimdFamilyCount = 6;
static_assert(static_cast<int>(SimdFamily::kFmaProbe) + 1 == kSimdFamilyCount,
              "a new SIMD family: update kSimdFamilyCount");

std::string_view simd_family_name(SimdFamily f);
// The path family f runs: active_simd_path() (every family's AVX2 version needs AVX2, FMA and
// F16C at most). Records that f asked, so a test can check that every family dispatches here.
SimdPath simd_path(SimdFamily f);
// Whether family f has asked simd_path() in this process (it asks on its first call).
bool simd_family_dispatched(SimdFamily f);

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
