// Independent references for the number-format tests. None of them shares code with the engine's
// conversions: FP16 by its textbook definition (scale, round to nearest even in FP64, assemble the
// bits) and, on x86 processors that have it, the F16C instruction as a hardware oracle; BF16 by the
// classic integer formula; FP8 by searching the sorted table of all finite values.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MANTISSA_TEST_HAVE_F16C_CODE 1
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "mantissa/core/cpu_features.h"

namespace mantissa::testing {

// FP32 -> FP16 bits by the definition: |x| as an integer multiple of the spacing of its binade
// (2^-24 below the normals), rounded to nearest even in FP64 (exact: FP32 values and powers of
// two), overflowing at 65520 (the midpoint above 65504); NaN quieted, keeping its top payload bits.
inline uint16_t f16_reference_encode(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  if (std::isnan(x)) return static_cast<uint16_t>(sign | 0x7e00u | ((b >> 13) & 0x3ffu));
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 65520.0) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a == 0) return sign;
  int e = 0;
  std::frexp(a, &e);
  const int binade = std::max(e - 1, -14);                      // exponent of its spacing
  const double q = std::nearbyint(std::ldexp(a, 10 - binade));  // units of 2^(binade-10)
  if (binade == -14 && q < 1024) return static_cast<uint16_t>(sign | static_cast<uint16_t>(q));
  // A normal (or a subnormal that rounded up to the smallest normal, q == 1024).
  const int biased = binade + 15 + (q == 2048 ? 1 : 0);
  const uint16_t mantissa = static_cast<uint16_t>(q == 2048 ? 0 : static_cast<int>(q) - 1024);
  return static_cast<uint16_t>(sign | (biased << 10) | mantissa);
}

// FP16 bits -> FP32 by the definition: m 2^-24 for subnormals, (1 + m/1024) 2^(e-15) for normals;
// NaN quieted with its payload in the top mantissa bits.
inline float f16_reference_decode(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const bool negative = (h & 0x8000u) != 0;
  if (e == 31 && m != 0)
    return std::bit_cast<float>((negative ? 0x80000000u : 0u) | 0x7fc00000u |
                                (static_cast<uint32_t>(m) << 13));
  const double magnitude = e == 31  ? INFINITY
                           : e == 0 ? std::ldexp(static_cast<double>(m), -24)
                                    : std::ldexp(1.0 + m / 1024.0, e - 15);
  return static_cast<float>(negative ? -magnitude : magnitude);
}

#if MANTISSA_TEST_HAVE_F16C_CODE
#define MANTISSA_TEST_F16C __attribute__((target("avx2,f16c")))

inline bool have_f16c() { return cpu_features().f16c && cpu_features().avx2; }

// FP32 -> FP16 by the F16C instruction (round to nearest even), 8 at a time plus a tail.
MANTISSA_TEST_F16C inline void f16c_encode(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}
MANTISSA_TEST_F16C inline float f16c_decode(uint16_t h) { return _cvtsh_ss(h); }
#else
inline bool have_f16c() { return false; }  // not an x86 processor
#endif

// The FP16 oracle of this processor: F16C where it has it (the definitions above are checked
// against it there), else the definitions.
inline void f16_oracle_encode(const float* src, uint16_t* dst, size_t n) {
#if MANTISSA_TEST_HAVE_F16C_CODE
  if (have_f16c()) {
    f16c_encode(src, dst, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i) dst[i] = f16_reference_encode(src[i]);
}
inline float f16_oracle_decode(uint16_t h) {
#if MANTISSA_TEST_HAVE_F16C_CODE
  if (have_f16c()) return f16c_decode(h);
#endif
  return f16_reference_decode(h);
}

// FP32 bits -> BF16 bits: NaN quieted with its top payload bits, else add 0x7fff + lsb, truncate.
inline uint16_t bf16_reference(uint32_t b) {
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// An FP8 format described from scratch: its value table built by the textbook formula.
struct Fp8Reference {
  int exp_bits, man_bits, bias;
  bool ieee;                  // E5M2: IEEE-style inf/NaN; E4M3: NaN only at S.1111.111, no inf
  std::vector<double> value;  // value of each magnitude encoding 0..127 (NaN where NaN)
  std::vector<int>
      sorted_finite;  // finite magnitude encodings by value, plus one "virtual" above max

  Fp8Reference(int e, int m, int b, bool ieee_) : exp_bits(e), man_bits(m), bias(b), ieee(ieee_) {
    value.resize(128);
    for (int enc = 0; enc < 128; ++enc) {
      const int ef = enc >> m, mf = enc & ((1 << m) - 1);
      const bool special = ieee ? ef == (1 << e) - 1 : enc == 127;
      if (special) {
        value[enc] = (ieee && mf == 0) ? INFINITY : NAN;
      } else if (ef == 0) {
        value[enc] = std::ldexp(static_cast<double>(mf), 1 - b - m);
      } else {
        value[enc] = std::ldexp(1.0 + std::ldexp(mf, -m), ef - b);
      }
      if (std::isfinite(value[enc])) sorted_finite.push_back(enc);
    }
    std::sort(sorted_finite.begin(), sorted_finite.end(),
              [&](int a, int c) { return value[a] < value[c]; });
  }
  int max_enc() const { return sorted_finite.back(); }
  double max_value() const { return value[max_enc()]; }
  // The value one ulp above the largest finite one, as if the exponent range were unbounded.
  double virtual_above_max() const {
    return max_value() + std::ldexp(1.0, (max_enc() >> man_bits) - bias - man_bits);
  }

  // Expected bits for an FP32 input. NaN inputs give -1 (any NaN of the right sign is accepted).
  int encode(float x, bool saturate) const {
    if (std::isnan(x)) return -1;
    const int sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs(static_cast<double>(x));
    const int overflow = saturate ? max_enc() : (ieee ? (((1 << exp_bits) - 1) << man_bits) : 0x7f);
    if (std::isinf(a)) return sign | overflow;
    // Bracket a between consecutive representable values (the virtual one above max included).
    auto it = std::upper_bound(sorted_finite.begin(), sorted_finite.end(), a,
                               [&](double v, int enc) { return v < value[enc]; });
    const int lo = *(it - 1);
    const double lo_v = value[lo];
    const bool hi_virtual = it == sorted_finite.end();
    const double hi_v = hi_virtual ? virtual_above_max() : value[*it];
    const int hi = hi_virtual ? -2 : *it;
    int pick;
    if (a == lo_v)
      pick = lo;
    else if (a - lo_v < hi_v - a)
      pick = lo;
    else if (a - lo_v > hi_v - a)
      pick = hi;
    else
      pick = (lo & 1) == 0 ? lo : hi;  // tie: even encoding (the virtual one is even)
    if (pick == -2) return sign | overflow;
    return sign | pick;
  }
};

// Blocks of 2^16 FP32 patterns to visit in the exhaustive tests: every block normally;
// MANTISSA_EXHAUSTIVE_STRIDE=k visits every k-th (for slow sanitizer builds).
inline uint32_t exhaustive_stride() {
  if (const char* env = std::getenv("MANTISSA_EXHAUSTIVE_STRIDE")) {
    const long k = std::strtol(env, nullptr, 10);
    if (k > 1) return static_cast<uint32_t>(k);
  }
  return 1;
}

inline std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

}  // namespace mantissa::testing
