// The narrow floating-point storage formats (FP16, BF16, FP8 E4M3 and E5M2): their parameters, the
// 1- and 2-byte value types, and exact scalar conversions to and from FP32.
//
// Storage precision only: arithmetic always happens in FP32 registers. The scalar functions here
// are the portable reference path; src/mantissa/core/convert.h has the bulk (SIMD) conversions,
// which produce bit-identical results and are tested against these and against hardware oracles.
//
// Conversion from FP32 (docs/numerics.md has the details):
//   - round to nearest, ties to even; subnormals exact; the sign of zero kept;
//   - a value that rounds above the largest finite value overflows: to infinity, or to NaN for
//     E4M3 (no infinity), or to the largest finite value when `saturate` is set (infinities too);
//   - NaN stays NaN: quiet, with the top payload bits kept (what x86 F16C does for FP16);
//   - decoding is exact; BF16 decodes by a 16-bit shift (see decode());
//   - stochastic rounding picks the neighbour above |x| with probability (|x| - lo) / (hi - lo),
//     from 32 random bits, so E[result] = x; finite inputs up to the largest finite value never
//     become infinity; inputs beyond it (and NaN, inf) are rounded to nearest.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

namespace mantissa {

// Parameters of a binary floating-point format narrower than FP32 (sign + exponent + mantissa).
struct FloatFormat {
  int exp_bits;
  int man_bits;
  int bias;
  bool has_inf;   // IEEE style: exponent all ones + mantissa zero is infinity
  bool ieee_nan;  // IEEE style: exponent all ones + mantissa nonzero is NaN; else only S.1111.111

  constexpr int total_bits() const { return 1 + exp_bits + man_bits; }
  constexpr int emin() const { return 1 - bias; }  // exponent of the smallest normal
  constexpr uint32_t exp_mask() const { return ((1u << exp_bits) - 1u) << man_bits; }
  constexpr uint32_t magnitude_mask() const { return (1u << (total_bits() - 1)) - 1u; }
  constexpr uint32_t max_finite_bits() const {
    return ieee_nan ? exp_mask() - 1u : magnitude_mask() - 1u;
  }
  // What a value that rounds past the largest finite one becomes (without saturation).
  constexpr uint32_t overflow_bits() const { return has_inf ? exp_mask() : magnitude_mask(); }
  // The quiet NaN for FP32 magnitude bits `a` (a NaN): payload's top bits kept where possible.
  constexpr uint32_t nan_bits(uint32_t a) const {
    if (!ieee_nan) return magnitude_mask();
    return exp_mask() | (1u << (man_bits - 1)) | ((a & 0x7fffffu) >> (23 - man_bits));
  }
};

inline constexpr FloatFormat kF16Format{5, 10, 15, true, true};
inline constexpr FloatFormat kBF16Format{8, 7, 127, true, true};
inline constexpr FloatFormat kE4M3Format{4, 3, 7, false, false};  // OCP FP8 E4M3 (FN: no infinity)
inline constexpr FloatFormat kE5M2Format{5, 2, 15, true, true};   // OCP FP8 E5M2

namespace detail {
// Logical right shift that yields 0 for counts of 32 or more, as AVX2's vpsrlvd does.
constexpr uint32_t shr(uint32_t x, int n) { return n >= 32 ? 0u : x >> n; }

// FP32 magnitude bits split into a significand with its implicit bit and an unbiased exponent;
// FP32 subnormals get exponent -126 and no implicit bit.
struct Unpacked {
  uint32_t m;  // < 2^24
  int e;
};
constexpr Unpacked unpack(uint32_t a) {
  const int expf = static_cast<int>(a >> 23);
  return {(a & 0x7fffffu) | (expf != 0 ? 0x800000u : 0u), (expf != 0 ? expf : 1) - 127};
}
// How many low bits of the significand fall below the format's unit in the last place for a value
// with exponent e (more in the format's subnormal range). >= 13 for every format here.
template <FloatFormat F>
constexpr int dropped_bits(int e) {
  return 23 - F.man_bits + (F.emin() > e ? F.emin() - e : 0);
}
// The format's encoding of a magnitude whose significand, in units of the format's ulp at
// exponent e, is q. A carry out of the mantissa moves into the exponent field by itself.
template <FloatFormat F>
constexpr uint32_t assemble(int e, uint32_t q) {
  const int eoff = e > F.emin() ? e - F.emin() : 0;
  return (static_cast<uint32_t>(eoff) << F.man_bits) + q;
}
}  // namespace detail

// FP32 bits -> format bits, round to nearest even. The reference algorithm of the engine.
template <FloatFormat F>
constexpr uint32_t encode_rne(uint32_t b, bool saturate = false) {
  static_assert(F.man_bits >= 2 && F.man_bits <= 10,
                "the rounding shifts assume 2..10 mantissa bits");
  const uint32_t sign = (b >> 31) << (F.total_bits() - 1);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | F.nan_bits(a);
  const detail::Unpacked u = detail::unpack(a);
  int d = detail::dropped_bits<F>(u.e);
  if (d > 31) d = 31;  // everything rounds to zero from here on; keeps the shifts defined
  // Round half to even: add half an ulp minus one, plus the lowest kept bit.
  const uint32_t q = (u.m + ((1u << (d - 1)) - 1u) + ((u.m >> d) & 1u)) >> d;
  const uint32_t enc = detail::assemble<F>(u.e, q);
  if (enc > F.max_finite_bits()) return sign | (saturate ? F.max_finite_bits() : F.overflow_bits());
  return sign | enc;
}

// Format bits -> FP32 value. Exact. BF16 is the top half of FP32, so it decodes by a shift that
// keeps every bit, NaN payloads and the signalling bit included; the other formats' NaNs decode as
// quiet NaNs with the payload kept (what F16C does for FP16).
template <FloatFormat F>
constexpr float decode(uint32_t v) {
  if constexpr (F.exp_bits == 8 && F.man_bits == 7) return std::bit_cast<float>(v << 16);
  const uint32_t sign = ((v >> (F.total_bits() - 1)) & 1u) << 31;
  const uint32_t mag = v & F.magnitude_mask();
  const uint32_t exp = mag >> F.man_bits;
  const uint32_t man = mag & ((1u << F.man_bits) - 1u);
  const uint32_t exp_all_ones = (1u << F.exp_bits) - 1u;
  if (F.ieee_nan ? exp == exp_all_ones : mag == F.magnitude_mask()) {
    if (man == 0 && F.has_inf) return std::bit_cast<float>(sign | 0x7f800000u);
    const uint32_t payload = F.ieee_nan ? man << (23 - F.man_bits) : 0u;
    return std::bit_cast<float>(sign | 0x7fc00000u | payload);
  }
  if (exp != 0) {
    const uint32_t e32 = exp - static_cast<uint32_t>(F.bias) + 127u;
    return std::bit_cast<float>(sign | (e32 << 23) | (man << (23 - F.man_bits)));
  }
  // Subnormal (or zero): man * 2^(emin - man_bits), an exact product of two FP32 values.
  constexpr int p = F.emin() - F.man_bits;
  constexpr uint32_t scale_bits =
      p >= -126 ? static_cast<uint32_t>(p + 127) << 23 : 1u << (p + 149);
  const float mag_f = static_cast<float>(man) * std::bit_cast<float>(scale_bits);
  return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(mag_f));
}

// FP32 value of the format's largest finite number, as FP32 bits.
template <FloatFormat F>
constexpr uint32_t max_finite_f32_bits() {
  return std::bit_cast<uint32_t>(decode<F>(F.max_finite_bits()));
}

// FP32 bits -> format bits with stochastic rounding driven by the uniform 32-bit random r.
// P(round away from zero) = (|x| - lo) / ulp exactly when the dropped part has at most 32 bits
// (every input within 2^-32 ulp of the format's subnormal range or above); for tinier inputs the
// probability is truncated to a multiple of 2^-32.
template <FloatFormat F>
constexpr uint32_t encode_stochastic(uint32_t b, uint32_t r, bool saturate = false) {
  const uint32_t a = b & 0x7fffffffu;
  if (a > max_finite_f32_bits<F>()) return encode_rne<F>(b, saturate);  // NaN, inf, beyond range
  const uint32_t sign = (b >> 31) << (F.total_bits() - 1);
  const detail::Unpacked u = detail::unpack(a);
  const int d = detail::dropped_bits<F>(u.e);
  const uint32_t q = detail::shr(u.m, d);
  const uint32_t rem = u.m - (d >= 32 ? 0u : q << d);
  const uint32_t up = d <= 32 ? (detail::shr(r, 32 - d) < rem) : (r < detail::shr(u.m, d - 32));
  return sign | detail::assemble<F>(u.e, q + up);
}

// ---- Value types -------------------------------------------------------------------------------
// Plain structs holding the bits; conversions go through FP32. Arithmetic on them converts to
// float.
#define MANTISSA_DEFINE_NARROW_FLOAT(NAME, STORAGE, FORMAT)                             \
  struct alignas(sizeof(STORAGE)) NAME {                                                \
    STORAGE bits;                                                                       \
    static constexpr FloatFormat format = FORMAT;                                       \
    NAME() = default;                                                                   \
    /* Round to nearest even. */                                                        \
    constexpr explicit NAME(float f)                                                    \
        : bits(static_cast<STORAGE>(encode_rne<FORMAT>(std::bit_cast<uint32_t>(f)))) {} \
    static constexpr NAME from_bits(STORAGE b) {                                        \
      NAME v{};                                                                         \
      v.bits = b;                                                                       \
      return v;                                                                         \
    }                                                                                   \
    constexpr operator float() const { return decode<FORMAT>(bits); }                   \
  };                                                                                    \
  static_assert(sizeof(NAME) == sizeof(STORAGE) && std::is_trivially_copyable_v<NAME>)

MANTISSA_DEFINE_NARROW_FLOAT(f16, uint16_t, kF16Format);
MANTISSA_DEFINE_NARROW_FLOAT(bf16, uint16_t, kBF16Format);
MANTISSA_DEFINE_NARROW_FLOAT(e4m3, uint8_t, kE4M3Format);
MANTISSA_DEFINE_NARROW_FLOAT(e5m2, uint8_t, kE5M2Format);
#undef MANTISSA_DEFINE_NARROW_FLOAT
}  // namespace mantissa
