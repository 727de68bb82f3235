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
  bool avx512bw = false;
  bool avx512dq = false;
  bool avx512vl = false;
  bool avx512bf16 = false;  // AVX512_BF16: vcvtneps2bf16 and the BF16 dot products
};

const CpuFeatures& cpu_features();
// "avx2 fma f16c" style summary for reports.
std::string cpu_features_string();

// ---- SIMD dispatch ----
// Every kernel with a SIMD version asks simd_path() once for its family and keeps the answer;
// none reads cpu_features() itself. The scalar path is always built and gives the same bits (each
// family's tests compare the two), so MANTISSA_SIMD=scalar runs a whole program on the portable
// loops.

// Ordered: a path includes the instructions of the ones before it.
enum class SimdPath : uint8_t { kScalar, kAvx2, kAvx512 };

std::string_view simd_path_name(SimdPath p);
// Whether this build has the path and this processor can run it (AVX2: AVX2, FMA and F16C;
// AVX-512: those and AVX-512 F, BW, DQ and VL).
bool simd_path_supported(SimdPath p);
// The process's path: the best supported one, chosen once; MANTISSA_SIMD=scalar|avx2|avx512 in
// the environment overrides it (an unsupported request falls back to the best supported path
// below it).
SimdPath active_simd_path();
// Whether the AVX-512 kernels round FP32 to BF16 with the processor's instruction (AVX512_BF16's
// vcvtneps2bf16; a vector holding an FP32 subnormal, which the instruction reads as zero, takes
// the integer rule): the same bits as the integer rule. True where the processor has it and the
// process's path is AVX-512, unless MANTISSA_BF16_INSN=0 is in the environment (how the tests
// run the integer rule on such a processor). Set before main(); false until then (the integer
// rule, as exact).
extern const bool kBf16Instructions;

// The kernel families with a SIMD version: (enumerator, name, widest path it has, where). A family
// runs the process's path, or its widest one when that is narrower (a family without AVX-512
// kernels runs its AVX2 ones on an AVX-512 processor).
#define MANTISSA_SIMD_FAMILIES(X)                                                                 \
  X(kConvert, "convert", kAvx512, "core/convert.cc: bulk conversion tables")                      \
  X(kGemm, "gemm", kAvx512,                                                                       \
    "kernels/gemm.cc: the 6 x 16 and 6 x 32 micro-kernels and packing transposes")                \
  X(kVectorRows, "vector rows", kAvx512,                                                          \
    "kernels/vector_kernels.cc: convolution rows, FMA rows, lane-split dot products (AVX-512: "   \
    "their tiles), axpy, Winograd transforms, normalization rows, ReLU rows")                     \
  X(kPooling, "pooling", kAvx2, "kernels/vector_kernels.cc: 2x2 stride-2 max pooling rows")       \
  X(kOptimizer, "optimizer", kAvx512,                                                             \
    "optim/optim.cc: the Adam/AdamW (AVX-512: its exact lanes) and SGD updates, the sum of "      \
    "squares")                                                                                    \
  X(kFmaProbe, "fma probe", kAvx512, "core/cpu_features.cc: fma_chains, the FMA ceiling's probe") \
  X(kQuantize, "quantize", kAvx2, "kernels/quantize.cc: FP8 quantization with a scale, and amax")

enum class SimdFamily : uint8_t {
#define MANTISSA_SIMD_FAMILY_ENUM(e, name, widest, where) e,
  MANTISSA_SIMD_FAMILIES(MANTISSA_SIMD_FAMILY_ENUM)
#undef MANTISSA_SIMD_FAMILY_ENUM
};
inline constexpr int kSimdFamilyCount = 7;
static_assert(static_cast<int>(SimdFamily::kQuantize) + 1 == kSimdFamilyCount,
              "a new SIMD family: update kSimdFamilyCount");

std::string_view simd_family_name(SimdFamily f);
// The widest path family f has kernels for.
SimdPath simd_family_widest(SimdFamily f);
// The path family f runs: active_simd_path(), or the family's widest path when that is narrower.
// Records that f asked, so a test can check that every family dispatches here.
SimdPath simd_path(SimdFamily f);
// Whether family f has asked simd_path() in this process (it asks on its first call).
bool simd_family_dispatched(SimdFamily f);

// ---- FP32 multiply-add throughput: the ceiling that training speed is compared with ----

// Lanes of the probe: 12 independent chains of 16 lanes (AVX-512), enough to hide an FMA's
// latency on two pipes; the AVX2 path runs them as two halves of 12 chains of 8 lanes. Lane i
// starts at x0 + i * dx and runs x = fma(x, a, b) `rounds` times; the result is the sum of the
// 192 lanes in order (so the work cannot be skipped, and a scalar loop gives the same bits). The
// widest path the CPU has, a portable loop otherwise.
inline constexpr int kFmaProbeLanes = 192;
float fma_chains(int64_t rounds, float x0, float dx, float a, float b);
// The scalar reference of fma_chains (the tests' oracle).
float fma_chains_reference(int64_t rounds, float x0, float dx, float a, float b);

// GFLOP/s (2 per FMA) of `threads` threads of its own, released together, each running
// fma_chains for about `seconds`, the best of `repeats` runs.
double fma_peak_gflops(int threads, double seconds, int repeats = 3);

}  // namespace mantissa
