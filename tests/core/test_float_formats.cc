// The formats' constants, the value types, and the conversions' documented corner cases.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "mantissa/mantissa.h"

namespace mantissa {
namespace {

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

// REFERENCE.md's table of formats.
TEST(FloatFormats, ConstantsMatchTheReferenceTable) {
  EXPECT_EQ(decode<kF16Format>(kF16Format.max_finite_bits()), 65504.0f);
  EXPECT_EQ(decode<kF16Format>(0x0400), 0x1p-14f);
  EXPECT_EQ(decode<kF16Format>(0x0001), 0x1p-24f);
  EXPECT_EQ(decode<kBF16Format>(kBF16Format.max_finite_bits()), 3.38953139e38f);
  EXPECT_EQ(decode<kBF16Format>(0x0080), std::numeric_limits<float>::min());
  EXPECT_EQ(decode<kBF16Format>(0x0001), 0x1p-133f);
  EXPECT_EQ(decode<kE4M3Format>(kE4M3Format.max_finite_bits()), 448.0f);
  EXPECT_EQ(decode<kE4M3Format>(0x08), 0x1p-6f);
  EXPECT_EQ(decode<kE4M3Format>(0x01), 0x1p-9f);
  EXPECT_EQ(decode<kE5M2Format>(kE5M2Format.max_finite_bits()), 57344.0f);
  EXPECT_EQ(decode<kE5M2Format>(0x04), 0x1p-14f);
  EXPECT_EQ(decode<kE5M2Format>(0x01), 0x1p-16f);
  EXPECT_EQ(kE4M3Format.max_finite_bits(), 0x7eu);
  EXPECT_EQ(kE5M2Format.overflow_bits(), 0x7cu);
  EXPECT_EQ(kE4M3Format.overflow_bits(), 0x7fu);  // NaN: E4M3 has no infinity
}

TEST(FloatFormats, ValueTypesArePlainStructs) {
  static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2 && sizeof(e4m3) == 1 && sizeof(e5m2) == 1);
  static_assert(std::is_trivially_copyable_v<f16> && std::is_standard_layout_v<bf16>);
  static_assert(alignof(f16) == 2);
  constexpr f16 one(1.0f);  // conversions are constexpr
  static_assert(one.bits == 0x3c00);
  static_assert(static_cast<float>(bf16::from_bits(0x3fc0)) == 1.5f);
  EXPECT_EQ(f16::from_bits(0x3c00), 1.0f);
  EXPECT_EQ(static_cast<float>(f16(0.1f)), 0.0999755859375f);
  EXPECT_EQ(bf16(0.1f).bits, 0x3dcd);
  EXPECT_EQ(e4m3(-2.0f).bits, 0xc0);
  EXPECT_EQ(e5m2(-2.0f).bits, 0xc0);
  // Arithmetic happens in FP32.
  const float sum = f16(1.5f) + f16(0.25f);
  EXPECT_EQ(sum, 1.75f);
}

TEST(FloatFormats, RoundsHalfToEven) {
  // f16 around 1: ulp 2^-10; the midpoints go to the even neighbour.
  EXPECT_EQ(f16(1.0f + 0x1p-11f).bits, 0x3c00);             // tie, 1.0 is even
  EXPECT_EQ(f16(1.0f + 3 * 0x1p-11f).bits, 0x3c02);         // tie, up to even
  EXPECT_EQ(f16(1.0f + 0x1p-11f + 0x1p-23f).bits, 0x3c01);  // just above the tie
  // REFERENCE.md's BF16 cases, where truncation (Highway's AVX2 DemoteTo) gets them wrong.
  EXPECT_EQ(encode_rne<kBF16Format>(0x3f808001u), 0x3f81u);
  EXPECT_EQ(encode_rne<kBF16Format>(0x3f818000u), 0x3f82u);
  EXPECT_EQ(encode_rne<kBF16Format>(0x7f7fffffu), 0x7f80u);  // FLT_MAX -> inf
  // Subnormal ties: half the smallest f16 subnormal goes to zero, 1.5x goes to 2.
  EXPECT_EQ(f16(0x1p-25f).bits, 0x0000);
  EXPECT_EQ(f16(1.5f * 0x1p-24f).bits, 0x0002);
  EXPECT_EQ(f16(0x1p-25f + 0x1p-40f).bits, 0x0001);
}

TEST(FloatFormats, OverflowSignedZeroAndNaN) {
  EXPECT_EQ(f16(65519.996f).bits, 0x7bff);
  EXPECT_EQ(f16(65520.0f).bits, 0x7c00);
  EXPECT_EQ(f16(-1e30f).bits, 0xfc00);
  EXPECT_EQ(f16(-0.0f).bits, 0x8000);
  EXPECT_EQ(bf16(-0.0f).bits, 0x8000);
  EXPECT_EQ(e4m3(-0.0f).bits, 0x80);
  EXPECT_EQ(f16(-1e-10f).bits, 0x8000);  // underflow keeps the sign
  // E4M3: 464 is the tie between 448 (even) and the NaN pattern, 465 overflows to NaN.
  EXPECT_EQ(e4m3(464.0f).bits, 0x7e);
  EXPECT_EQ(e4m3(465.0f).bits, 0x7f);
  EXPECT_EQ(e4m3(INFINITY).bits, 0x7f);
  EXPECT_EQ(encode_rne<kE4M3Format>(bits(465.0f), true), 0x7eu);
  EXPECT_EQ(encode_rne<kE4M3Format>(bits(-INFINITY), true), 0xfeu);
  EXPECT_EQ(encode_rne<kE5M2Format>(bits(61440.0f)), 0x7cu);  // tie past the max: to inf
  EXPECT_EQ(encode_rne<kE5M2Format>(bits(61440.0f), true), 0x7bu);
  // NaN stays a quiet NaN, payload's top bits kept.
  EXPECT_EQ(encode_rne<kF16Format>(0x7f800001u), 0x7e00u);  // signalling -> quiet
  EXPECT_EQ(encode_rne<kF16Format>(0xffffe000u), 0xffffu);
  EXPECT_EQ(encode_rne<kBF16Format>(0x7f800001u), 0x7fc0u);
  EXPECT_EQ(encode_rne<kE5M2Format>(0x7fa00000u), 0x7fu);
  EXPECT_EQ(encode_rne<kE4M3Format>(0xffc00000u), 0xffu);
  EXPECT_TRUE(std::isnan(static_cast<float>(e4m3::from_bits(0x7f))));
  EXPECT_TRUE(std::isnan(static_cast<float>(e5m2::from_bits(0x7e))));
  EXPECT_TRUE(std::isinf(static_cast<float>(e5m2::from_bits(0xfc))));
}

TEST(Convert, Float64ToNarrowIsCorrectlyRounded) {
  // Just above an f16 midpoint: FP64 -> FP32 (nearest) lands on the midpoint and FP32 -> FP16 then
  // rounds it down to even; the correct answer is up. Round-to-odd keeps the difference.
  const double x = 1.0 + 0x1p-11 + 0x1p-40;
  ASSERT_EQ(static_cast<float>(x), 1.0f + 0x1p-11f);
  uint16_t h;
  convert(&x, DType::f64, &h, DType::f16, 1);
  EXPECT_EQ(h, 0x3c01);
  const double y = 1.0 + 0x1p-11 - 0x1p-40;
  convert(&y, DType::f64, &h, DType::f16, 1);
  EXPECT_EQ(h, 0x3c00);
  const double big = 1e300;
  convert(&big, DType::f64, &h, DType::bf16, 1);
  EXPECT_EQ(h, 0x7f80);
  EXPECT_EQ(f64_to_f32_round_to_odd(1.0), 1.0f);
  EXPECT_EQ(bits(f64_to_f32_round_to_odd(1.0 + 0x1p-30)), bits(1.0f) | 1u);
  EXPECT_EQ(bits(f64_to_f32_round_to_odd(-(1.0 + 0x1p-30))), bits(-1.0f) | 1u);
}

TEST(Convert, BetweenAllDtypes) {
  // Integers truncate toward zero and saturate; NaN gives 0; bool is "not zero".
  const float src[] = {1.7f, -2.9f, 1e20f, -1e20f, NAN, 0.0f, 255.5f, 300.0f};
  int32_t i32[8];
  convert(src, DType::f32, i32, DType::i32, 8);
  EXPECT_EQ(i32[0], 1);
  EXPECT_EQ(i32[1], -2);
  EXPECT_EQ(i32[2], std::numeric_limits<int32_t>::max());
  EXPECT_EQ(i32[3], std::numeric_limits<int32_t>::min());
  EXPECT_EQ(i32[4], 0);
  uint8_t u8[8];
  convert(src, DType::f32, u8, DType::u8, 8);
  EXPECT_EQ(u8[1], 0);
  EXPECT_EQ(u8[6], 255);
  EXPECT_EQ(u8[7], 255);
  bool b[8];
  convert(src, DType::f32, b, DType::boolean, 8);
  EXPECT_TRUE(b[0] && b[4] && !b[5]);
  // Every dtype to every other and back through f64 keeps small integers exactly.
  const double vals[] = {0, 1, 2, 3, 4, 5, 6, 7};
  for (DType a : kAllDTypes) {
    if (a == DType::boolean) continue;
    for (DType c : kAllDTypes) {
      if (c == DType::boolean) continue;
      alignas(8) unsigned char ba[64], bc[64];
      double back[8];
      convert(vals, DType::f64, ba, a, 8);
      convert(ba, a, bc, c, 8);
      convert(bc, c, back, DType::f64, 8);
      for (int i = 0; i < 8; ++i)
        EXPECT_EQ(back[i], vals[i]) << dtype_name(a) << " -> " << dtype_name(c);
    }
  }
  // Narrow to narrow goes through FP32 exactly: f16 -> e5m2 is the top byte when it rounds so.
  const uint16_t h[] = {0x3c00, 0x4100, 0xc500};
  uint8_t e[3];
  convert(h, DType::f16, e, DType::e5m2, 3);
  EXPECT_EQ(e[0], 0x3c);
  EXPECT_EQ(e[1], 0x41);
  EXPECT_EQ(e[2], 0xc5);
}

// Every length from 0 to 40 at every start within a 32-value block: each SIMD path's full blocks
// and its last partial block (a kernel's short rows: padded on the AVX2 path, masked on the
// AVX-512 one) give the scalar path's bits, to and from FP16 and BF16, with and without
// saturation, on values that take every branch of the rounding (ties, overflow, subnormals,
// infinities, NaNs) and nothing past the last element is written.
TEST(Convert, SimdPathAgreesWithScalarAtEveryLengthAndStart) {
  if (!simd_path_supported(SimdPath::kAvx2)) GTEST_SKIP() << "no AVX2 path on this processor";
  std::vector<SimdPath> paths = {SimdPath::kAvx2};
  if (simd_path_supported(SimdPath::kAvx512)) paths.push_back(SimdPath::kAvx512);
  std::vector<float> in;
  for (uint32_t b : {0x3f801000u, 0x3f803000u, 0x477ff000u, 0x477fefffu, 0x7f7fffffu, 0x7f800000u,
                     0xff800000u, 0x7fc00001u, 0xffa00000u, 0x33000000u, 0x33000001u, 0x00000001u,
                     0x80000000u, 0x387fc000u, 0xc2f6e979u, 0x3eaaaaabu})
    in.push_back(std::bit_cast<float>(b));
  for (int i = 0; in.size() < 72; ++i) in.push_back(std::ldexp(1.0f + 0.37f * i, i % 40 - 20));
  CastOptions sat;
  sat.saturate = true;
  for (const SimdPath path : paths)
    for (DType t : {DType::f16, DType::bf16})
      for (const CastOptions& o : {CastOptions{}, sat})
        for (size_t start = 0; start < 32; ++start)
          for (size_t n = 0; n <= 40; ++n) {
            const std::string at = std::string(simd_path_name(path)) + " " +
                                   std::string(dtype_name(t)) + ", start " + std::to_string(start) +
                                   ", n " + std::to_string(n) + (o.saturate ? ", saturating" : "");
            std::vector<uint16_t> want(48, 0xabcd), got(48, 0xabcd);
            convert(in.data() + start, DType::f32, want.data(), t, n, o, SimdPath::kScalar);
            convert(in.data() + start, DType::f32, got.data(), t, n, o, path);
            ASSERT_EQ(got, want) << "from f32, " << at;
            std::vector<float> back_want(48, -7.0f), back_got(48, -7.0f);
            convert(want.data(), t, back_want.data(), DType::f32, n, {}, SimdPath::kScalar);
            convert(want.data(), t, back_got.data(), DType::f32, n, {}, path);
            for (size_t j = 0; j < back_want.size(); ++j)
              ASSERT_EQ(bits(back_got[j]), bits(back_want[j]))
                  << "to f32, " << at << ", element " << j;
          }
}

TEST(Convert, SimdPathsAreReported) {
  EXPECT_TRUE(simd_path_supported(SimdPath::kScalar));
  EXPECT_EQ(simd_path_name(SimdPath::kScalar), "scalar");
  EXPECT_TRUE(simd_path_supported(active_simd_path()));
}

}  // namespace
}  // namespace mantissa
