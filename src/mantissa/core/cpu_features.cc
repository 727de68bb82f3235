#include "mantissa/core/cpu_features.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if MANTISSA_HAVE_X86_SIMD
#include <immintrin.h>
#endif

namespace mantissa {

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    // F16C from CPUID leaf 1 (clang's __builtin_cpu_supports does not know it), usable when AVX
    // state is (what the builtin checks for "avx").
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    f.f16c = __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) &&
             (ecx & bit_F16C) != 0;
    f.avx512f = __builtin_cpu_supports("avx512f");
    f.avx512bw = __builtin_cpu_supports("avx512bw");
    f.avx512dq = __builtin_cpu_supports("avx512dq");
    f.avx512vl = __builtin_cpu_supports("avx512vl");
    // AVX512_BF16: CPUID leaf 7, sub-leaf 1, EAX bit 5.
    f.avx512bf16 =
        f.avx512f && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
#endif
    return f;
  }();
  return features;
}

std::string cpu_features_string() {
  const CpuFeatures& f = cpu_features();
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512dq, "avx512dq");
  add(f.avx512vl, "avx512vl");
  add(f.avx512bf16, "avx512bf16");
  return s.empty() ? "none" : s;
}

std::string_view simd_path_name(SimdPath p) {
  switch (p) {
    case SimdPath::kScalar:
      return "scalar";
    case SimdPath::kAvx2:
      return "avx2+f16c";
    case SimdPath::kAvx512:
      return "avx512";
  }
  return "?";
}

bool simd_path_supported(SimdPath p) {
#if defined(MANTISSA_HAVE_X86_SIMD)
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.f16c && f.fma;
#endif
  switch (p) {
    case SimdPath::kScalar:
      return true;
    case SimdPath::kAvx2:
#if defined(MANTISSA_HAVE_X86_SIMD)
      return avx2;
#else
      return false;
#endif
    case SimdPath::kAvx512:
#if defined(MANTISSA_HAVE_X86_SIMD)
      return avx2 && f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl;
#else
      return false;
#endif
  }
  return false;
}

const bool kBf16Instructions = [] {
  const char* env = std::getenv("MANTISSA_BF16_INSN");
  return cpu_features().avx512bf16 && active_simd_path() == SimdPath::kAvx512 &&
         !(env && std::string(env) == "0");
}();

SimdPath active_simd_path() {
  static const SimdPath path = [] {
    SimdPath want = SimdPath::kAvx512;
    if (const char* env = std::getenv("MANTISSA_SIMD")) {
      const std::string w(env);
      if (w == "scalar") want = SimdPath::kScalar;
      if (w == "avx2") want = SimdPath::kAvx2;
    }
    while (want != SimdPath::kScalar && !simd_path_supported(want))
      want = static_cast<SimdPath>(static_cast<int>(want) - 1);
    return want;
  }();
  return path;
}

namespace {
std::atomic<bool> g_dispatched[kSimdFamilyCount];
}  // namespace

std::string_view simd_family_name(SimdFamily f) {
  switch (f) {
#define MANTISSA_SIMD_FAMILY_NAME(e, name, widest, where) \
  case SimdFamily::e:                                     \
    return name;
    MANTISSA_SIMD_FAMILIES(MANTISSA_SIMD_FAMILY_NAME)
#undef MANTISSA_SIMD_FAMILY_NAME
  }
  return "?";
}

SimdPath simd_family_widest(SimdFamily f) {
  switch (f) {
#define MANTISSA_SIMD_FAMILY_WIDEST(e, name, widest, where) \
  case SimdFamily::e:                                       \
    return SimdPath::widest;
    MANTISSA_SIMD_FAMILIES(MANTISSA_SIMD_FAMILY_WIDEST)
#undef MANTISSA_SIMD_FAMILY_WIDEST
  }
  return SimdPath::kScalar;
}

SimdPath simd_path(SimdFamily f) {
  g_dispatched[static_cast<int>(f)].store(true, std::memory_order_relaxed);
  return std::min(active_simd_path(), simd_family_widest(f));
}

bool simd_family_dispatched(SimdFamily f) {
  return g_dispatched[static_cast<int>(f)].load(std::memory_order_relaxed);
}

namespace {

void fma_probe_start(float x0, float dx, float* x) {
  for (int i = 0; i < kFmaProbeLanes; ++i) x[i] = x0 + static_cast<float>(i) * dx;
}

float fma_probe_sum(const float* x) {
  float s = 0;
  for (int i = 0; i < kFmaProbeLanes; ++i) s += x[i];
  return s;
}

#if MANTISSA_HAVE_X86_SIMD
// Lanes [0, 96) and then [96, 192): 12 chains of 8 lanes at a time (16 registers hold no more).
__attribute__((target("avx2,fma"))) void fma_chains_avx2(int64_t rounds, float* x, float a,
                                                         float b) {
  constexpr int kChains = 12;
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  for (int half = 0; half < kFmaProbeLanes; half += 8 * kChains) {
    __m256 v[kChains];
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) v[c] = _mm256_loadu_ps(x + half + 8 * c);
    for (int64_t r = 0; r < rounds; ++r) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) v[c] = _mm256_fmadd_ps(v[c], va, vb);
    }
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) _mm256_storeu_ps(x + half + 8 * c, v[c]);
  }
}

__attribute__((target("avx512f"))) void fma_chains_avx512(int64_t rounds, float* x, float a,
                                                          float b) {
  constexpr int kChains = kFmaProbeLanes / 16;
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
  __m512 v[kChains];
#pragma GCC unroll 12
  for (int c = 0; c < kChains; ++c) v[c] = _mm512_loadu_ps(x + 16 * c);
  for (int64_t r = 0; r < rounds; ++r) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) v[c] = _mm512_fmadd_ps(v[c], va, vb);
  }
#pragma GCC unroll 12
  for (int c = 0; c < kChains; ++c) _mm512_storeu_ps(x + 16 * c, v[c]);
}
#endif

}  // namespace

float fma_chains_reference(int64_t rounds, float x0, float dx, float a, float b) {
  float x[kFmaProbeLanes];
  fma_probe_start(x0, dx, x);
  for (int64_t r = 0; r < rounds; ++r)
    for (float& v : x) v = std::fma(v, a, b);
  return fma_probe_sum(x);
}

float fma_chains(int64_t rounds, float x0, float dx, float a, float b) {
#if MANTISSA_HAVE_X86_SIMD
  static const SimdPath path = simd_path(SimdFamily::kFmaProbe);
  if (path != SimdPath::kScalar) {
    float x[kFmaProbeLanes];
    fma_probe_start(x0, dx, x);
    if (path == SimdPath::kAvx512)
      fma_chains_avx512(rounds, x, a, b);
    else
      fma_chains_avx2(rounds, x, a, b);
    return fma_probe_sum(x);
  }
#endif
  return fma_chains_reference(rounds, x0, dx, a, b);
}

double fma_peak_gflops(int threads, double seconds, int repeats) {
  using Clock = std::chrono::steady_clock;
  threads = std::max(threads, 1);
  // The result is kept (volatile), so the chains cannot be dropped as unused.
  auto run = [](int64_t rounds, float x0) {
    volatile float sink = fma_chains(rounds, x0, 1e-3f, 0.999f, 1e-3f);
    (void)sink;
  };
  // Rounds for about `seconds` on one thread, from a short calibration.
  int64_t rounds = 1 << 16;
  for (;;) {
    const auto t0 = Clock::now();
    run(rounds, 1.0f);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s >= 0.01 || rounds >= (int64_t{1} << 40)) {
      rounds = std::max<int64_t>(
          1, static_cast<int64_t>(static_cast<double>(rounds) * seconds / std::max(s, 1e-9)));
      break;
    }
    rounds *= 4;
  }
  double best = 0;
  for (int rep = 0; rep < std::max(repeats, 1); ++rep) {
    // Threads of their own (not the pool's dynamic tasks: every thread must run its share at
    // the same time), released together; the rate is over the wall time of the slowest.
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    auto body = [&](int t) {
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      run(rounds, 1.0f + static_cast<float>(t));
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
    while (ready.load() < threads - 1) std::this_thread::yield();
    const auto t0 = Clock::now();
    go.store(true);
    body(0);
    for (std::thread& th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    const double flops = 2.0 * kFmaProbeLanes * static_cast<double>(rounds) * threads;
    if (s > 0) best = std::max(best, flops / s * 1e-9);
  }
  return best;
}

}  // namespace mantissa
