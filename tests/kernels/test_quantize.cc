// FP8 quantization with a scale (kernels/quantize.h) against an oracle of its own: the nearest of
// the format's 256 codes found by search in FP64 (ties to the even code, saturation past the
// largest finite value), over every input class, every 16-bit input pattern and random FP32
// inputs with scales that are not powers of two; the AVX2 path against the reference bit for
// bit, the stats counted independently, dequantization exact, and the matrix-product epilogue.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/quantize.h"
#include "mantissa/mantissa.h"

namespace mantissa {
namespace {

using kernels::QuantizeStats;

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<SimdPath> paths() {
  std::vector<SimdPath> p{SimdPath::kScalar};
  if (simd_path_supported(SimdPath::kAvx2)) p.push_back(SimdPath::kAvx2);
  return p;
}

float decode8(DType f, uint8_t c) {
  return f == DType::e4m3 ? static_cast<float>(e4m3::from_bits(c))
                          : static_cast<float>(e5m2::from_bits(c));
}

// The oracle: the code of y's nearest finite value of the format (FP64 distances; a tie goes to
// the code with an even last bit), +-max for |y| at or past the largest finite value, NaN for
// NaN. Sign kept (a value that rounds to zero keeps its sign).
uint8_t oracle(DType f, float y) {
  const uint8_t nan = f == DType::e4m3 ? 0x7f : 0x7e;
  const uint8_t sign = std::signbit(y) ? 0x80 : 0x00;
  if (std::isnan(y)) return sign | nan;
  const double a = std::fabs(static_cast<double>(y));
  const double max = kernels::fp8_max(f);
  if (a >= max) return sign | (f == DType::e4m3 ? 0x7e : 0x7b);
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < 0x80; ++c) {
    const float v = decode8(f, static_cast<uint8_t>(c));
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(static_cast<double>(v) - a);
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) best = c, best_d = d;
  }
  return sign | static_cast<uint8_t>(best);
}

// Whether RNE without saturation would overflow: past the midpoint of max and the next value the
// exponent would give (max + one ulp), or on it when max's code is odd.
bool oracle_saturates(DType f, float y) {
  if (std::isnan(y)) return false;
  const double a = std::fabs(static_cast<double>(y));
  const double max = kernels::fp8_max(f);
  const double ulp = f == DType::e4m3 ? 32.0 : 8192.0;  // at the top binade: 2^8 / 8, 2^15 / 4
  const bool max_odd = f == DType::e5m2;                // 0x7b is odd, 0x7e even
  return a > max + ulp / 2 || (a == max + ulp / 2 && max_odd);
}

bool same_code(DType f, uint8_t a, uint8_t b) {
  const bool nan_a = std::isnan(decode8(f, a)), nan_b = std::isnan(decode8(f, b));
  return nan_a || nan_b ? nan_a && nan_b && (a & 0x80) == (b & 0x80) : a == b;
}

// The oracle over an array, with the stats counted from their definitions.
QuantizeStats oracle_quantize(DType f, const std::vector<float>& x, float scale,
                              std::vector<uint8_t>& q) {
  QuantizeStats s;
  s.count = static_cast<int64_t>(x.size());
  q.resize(x.size());
  bool nonfinite = false;
  for (size_t i = 0; i < x.size(); ++i) {
    const float y = x[i] * scale;
    q[i] = oracle(f, y);
    if (std::isfinite(x[i]))
      s.amax = std::max(s.amax, std::fabs(x[i]));
    else
      nonfinite = true;
    s.nan += std::isnan(x[i]);
    s.saturated += oracle_saturates(f, y);
    s.flushed += std::isfinite(x[i]) && x[i] != 0 && decode8(f, q[i]) == 0;
  }
  if (nonfinite) s.amax = kInf;
  return s;
}

void expect_stats_eq(const QuantizeStats& got, const QuantizeStats& want, const std::string& what) {
  EXPECT_EQ(std::bit_cast<uint32_t>(got.amax), std::bit_cast<uint32_t>(want.amax)) << what;
  EXPECT_EQ(got.count, want.count) << what;
  EXPECT_EQ(got.saturated, want.saturated) << what;
  EXPECT_EQ(got.flushed, want.flushed) << what;
  EXPECT_EQ(got.nan, want.nan) << what;
}

// Quantizes x on every path and compares codes and stats with the oracle.
void check_against_oracle(DType f, const std::vector<float>& x, float scale,
                          const std::string& what) {
  std::vector<uint8_t> want;
  const QuantizeStats ws = oracle_quantize(f, x, scale, want);
  for (SimdPath p : paths()) {
    std::vector<uint8_t> got(x.size(), 0xaa);
    const QuantizeStats gs =
        kernels::quantize_fp8(x.data(), DType::f32, got.data(), f, x.size(), scale, p);
    const std::string where = what + " on " + std::string(simd_path_name(p)) + " to " +
                              std::string(dtype_name(f)) + " scale " + std::to_string(scale);
    int bad = 0;
    for (size_t i = 0; i < x.size() && bad < 5; ++i)
      if (!same_code(f, got[i], want[i])) {
        ++bad;
        ADD_FAILURE() << where << ": x = " << x[i] << " (0x" << std::hex
                      << std::bit_cast<uint32_t>(x[i]) << ") gives 0x" << int(got[i]) << ", want 0x"
                      << int(want[i]) << std::dec;
      }
    expect_stats_eq(gs, ws, where);
  }
}

TEST(Quantize, ThresholdsOfEachFormat) {
  EXPECT_EQ(kernels::fp8_max(DType::e4m3), 448.0f);
  EXPECT_EQ(kernels::fp8_max(DType::e5m2), 57344.0f);
  EXPECT_EQ(kernels::fp8_overflow_threshold(DType::e4m3), std::nextafter(464.0f, kInf));
  EXPECT_EQ(kernels::fp8_overflow_threshold(DType::e5m2), 61440.0f);
  EXPECT_EQ(kernels::fp8_zero_threshold(DType::e4m3), std::nextafter(0x1p-10f, kInf));
  EXPECT_EQ(kernels::fp8_zero_threshold(DType::e5m2), std::nextafter(0x1p-17f, kInf));
}

// Every input class, one by one, with what each must give and count.
TEST(Quantize, EveryInputClass) {
  struct Case {
    DType f;
    float x, scale;
    float want;  // the code's value (NaN: a NaN code)
    int saturated, flushed, nan;
  };
  const Case cases[] = {
      {DType::e4m3, 1.0f, 1.0f, 1.0f, 0, 0, 0},
      {DType::e4m3, -3.25f, 1.0f, -3.25f, 0, 0, 0},    // exact: 1.101b x 2
      {DType::e4m3, 1.0625f, 1.0f, 1.0f, 0, 0, 0},     // tie between 1 and 1.125 -> even (1)
      {DType::e4m3, 1.1875f, 1.0f, 1.25f, 0, 0, 0},    // tie between 1.125 and 1.25 -> even
      {DType::e4m3, 0x1p-9f, 1.0f, 0x1p-9f, 0, 0, 0},  // smallest subnormal
      {DType::e4m3, 3 * 0x1p-9f, 1.0f, 3 * 0x1p-9f, 0, 0, 0},  // a subnormal
      {DType::e4m3, 0x1p-10f, 1.0f, 0.0f, 0, 1, 0},  // half the smallest subnormal: ties to 0
      {DType::e4m3, std::nextafter(0x1p-10f, 1.0f), 1.0f, 0x1p-9f, 0, 0, 0},
      {DType::e4m3, -1e-30f, 1.0f, -0.0f, 0, 1, 0},  // flushed, sign kept
      {DType::e4m3, 0.0f, 1.0f, 0.0f, 0, 0, 0},      // zero is not flushed
      {DType::e4m3, -0.0f, 1.0f, -0.0f, 0, 0, 0},
      {DType::e4m3, 448.0f, 1.0f, 448.0f, 0, 0, 0},
      {DType::e4m3, 464.0f, 1.0f, 448.0f, 0, 0, 0},  // ties to 448 (even): not saturated
      {DType::e4m3, std::nextafter(464.0f, 1e9f), 1.0f, 448.0f, 1, 0, 0},
      {DType::e4m3, -1e6f, 1.0f, -448.0f, 1, 0, 0},
      {DType::e4m3, kInf, 1.0f, 448.0f, 1, 0, 0},  // no infinity in E4M3: saturates
      {DType::e4m3, -kInf, 1.0f, -448.0f, 1, 0, 0},
      {DType::e4m3, kNaN, 1.0f, kNaN, 0, 0, 1},
      {DType::e4m3, 1000.0f, 0.25f, 256.0f, 0, 0, 0},  // 250 rounds to 256 (240 and 256)
      {DType::e4m3, 1e-3f, 1024.0f, 1.0f, 0, 0, 0},    // 1.024 -> 1: a scale brings it in range
      {DType::e4m3, 1e-3f, 1.0f, 0x1p-9f, 0, 0, 0},    // 1e-3 = 0.512 x 2^-9 -> 2^-9
      {DType::e4m3, 3e38f, 4.0f, 448.0f, 1, 0, 0},     // x * s overflows FP32: saturated
      {DType::e5m2, 57344.0f, 1.0f, 57344.0f, 0, 0, 0},
      {DType::e5m2, std::nextafter(61440.0f, 0.0f), 1.0f, 57344.0f, 0, 0, 0},
      {DType::e5m2, 61440.0f, 1.0f, 57344.0f, 1, 0, 0},  // ties to 65536 (odd max): saturated
      {DType::e5m2, kInf, 1.0f, 57344.0f, 1, 0, 0},
      {DType::e5m2, -kInf, 1.0f, -57344.0f, 1, 0, 0},
      {DType::e5m2, 0x1p-16f, 1.0f, 0x1p-16f, 0, 0, 0},  // smallest subnormal
      {DType::e5m2, 0x1p-17f, 1.0f, 0.0f, 0, 1, 0},
      {DType::e5m2, 1.375f, 1.0f, 1.5f, 0, 0, 0},  // tie between 1.25 and 1.5 -> even (1.5)
      {DType::e5m2, kNaN, 1.0f, kNaN, 0, 0, 1},
      {DType::e5m2, 1e-7f, 1024.0f, 0.0001068115234375f, 0, 0, 0},  // 1.024e-4 -> 7 x 2^-16
  };
  for (const Case& c : cases) {
    for (SimdPath p : paths()) {
      uint8_t q = 0xaa;
      const QuantizeStats s = kernels::quantize_fp8(&c.x, DType::f32, &q, c.f, 1, c.scale, p);
      const float v = decode8(c.f, q);
      const std::string what = std::string(dtype_name(c.f)) + " x = " + std::to_string(c.x) +
                               " scale " + std::to_string(c.scale) + " on " +
                               std::string(simd_path_name(p));
      if (std::isnan(c.want)) {
        EXPECT_TRUE(std::isnan(v)) << what;
      } else {
        EXPECT_EQ(v, c.want) << what;
        EXPECT_EQ(std::signbit(v), std::signbit(c.want)) << what;
      }
      EXPECT_EQ(s.saturated, c.saturated) << what;
      EXPECT_EQ(s.flushed, c.flushed) << what;
      EXPECT_EQ(s.nan, c.nan) << what;
      EXPECT_EQ(s.amax, std::isfinite(c.x) ? std::fabs(c.x) : kInf) << what;
    }
  }
}

// Every finite code comes back from its own value times 1/scale, for power-of-two scales (where
// x * scale is exact): quantization inverts the exact widening.
TEST(Quantize, EveryCodeRoundTripsThroughItsValue) {
  for (DType f : {DType::e4m3, DType::e5m2}) {
    for (float scale : {1.0f, 0.125f, 64.0f}) {
      std::vector<float> x;
      std::vector<uint8_t> codes;
      for (int c = 0; c < 256; ++c) {
        const float v = decode8(f, static_cast<uint8_t>(c));
        if (!std::isfinite(v)) continue;
        x.push_back(v / scale);
        codes.push_back(static_cast<uint8_t>(c));
      }
      for (SimdPath p : paths()) {
        std::vector<uint8_t> q(x.size());
        const QuantizeStats s =
            kernels::quantize_fp8(x.data(), DType::f32, q.data(), f, x.size(), scale, p);
        EXPECT_EQ(q, codes) << dtype_name(f) << " scale " << scale;
        EXPECT_EQ(s.saturated + s.flushed + s.nan, 0);
      }
    }
  }
}

// Every f16 and bf16 pattern as input (f32 through their exact widening is the oracle's input),
// with scales that are not powers of two.
TEST(Quantize, Every16BitPatternMatchesTheOracle) {
  for (DType from : {DType::f16, DType::bf16}) {
    std::vector<uint16_t> bits(65536);
    std::vector<float> wide(65536);
    for (uint32_t b = 0; b < 65536; ++b) {
      bits[b] = static_cast<uint16_t>(b);
      wide[b] = from == DType::f16 ? static_cast<float>(f16::from_bits(bits[b]))
                                   : static_cast<float>(bf16::from_bits(bits[b]));
    }
    for (DType f : {DType::e4m3, DType::e5m2}) {
      for (float scale : {1.0f, 0.37f, 1234.5f}) {
        std::vector<uint8_t> want;
        const QuantizeStats ws = oracle_quantize(f, wide, scale, want);
        for (SimdPath p : paths()) {
          std::vector<uint8_t> got(65536);
          const QuantizeStats gs =
              kernels::quantize_fp8(bits.data(), from, got.data(), f, 65536, scale, p);
          const std::string what = std::string(dtype_name(from)) + " -> " +
                                   std::string(dtype_name(f)) + " scale " + std::to_string(scale) +
                                   " " + std::string(simd_path_name(p));
          int bad = 0;
          for (size_t i = 0; i < got.size(); ++i) bad += !same_code(f, got[i], want[i]);
          EXPECT_EQ(bad, 0) << what;
          expect_stats_eq(gs, ws, what);
        }
      }
    }
  }
}

// Random FP32 inputs over the whole exponent range and around each format's range, with the
// special values among them, at random scales; lengths that leave tails.
TEST(Quantize, RandomFp32MatchesTheOracle) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> log2_scale(-20.0f, 20.0f);
  for (DType f : {DType::e4m3, DType::e5m2}) {
    for (int round = 0; round < 6; ++round) {
      const size_t n = 1000 + static_cast<size_t>(round) * 37;
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) {
        if (i % 3 == 0) {
          x[i] = std::bit_cast<float>(bits(rng));  // anything, NaN and inf included
        } else {
          // near the format's range: 2^-20 .. 2^18, both signs
          const float m = 1.0f + static_cast<float>(bits(rng) % 4096) / 4096.0f;
          x[i] = std::ldexp(m, static_cast<int>(bits(rng) % 39) - 20) * (i % 2 ? -1.0f : 1.0f);
        }
      }
      x[5] = kInf;
      x[6] = -0.0f;
      x[7] = kNaN;
      const float scale = std::exp2(log2_scale(rng));
      check_against_oracle(f, x, scale, "random round " + std::to_string(round));
    }
  }
}

TEST(Quantize, Avx2MatchesTheReferenceBitForBit) {
  if (!simd_path_supported(SimdPath::kAvx2)) GTEST_SKIP() << "no AVX2 path on this machine";
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  for (DType from : {DType::f32, DType::f16, DType::bf16}) {
    for (DType f : {DType::e4m3, DType::e5m2}) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{255}, size_t{256},
                       size_t{257}, size_t{4099}}) {
        std::vector<uint32_t> raw(n);
        for (auto& r : raw) r = bits(rng);
        std::vector<uint16_t> half(n);
        for (size_t i = 0; i < n; ++i) half[i] = static_cast<uint16_t>(raw[i]);
        const void* src = from == DType::f32 ? static_cast<const void*>(raw.data()) : half.data();
        std::vector<uint8_t> a(n), b(n);
        const float scale = 0.0173f;
        const QuantizeStats sa =
            kernels::quantize_fp8(src, from, a.data(), f, n, scale, SimdPath::kAvx2);
        const QuantizeStats sb = kernels::quantize_fp8_reference(src, from, b.data(), f, n, scale);
        EXPECT_EQ(a, b) << dtype_name(from) << " -> " << dtype_name(f) << " n " << n;
        expect_stats_eq(sa, sb, "avx2 vs reference n " + std::to_string(n));
        EXPECT_EQ(std::bit_cast<uint32_t>(kernels::amax(src, from, n, SimdPath::kAvx2)),
                  std::bit_cast<uint32_t>(kernels::amax(src, from, n, SimdPath::kScalar)));
        EXPECT_EQ(std::bit_cast<uint32_t>(kernels::amax(src, from, n, SimdPath::kAvx2)),
                  std::bit_cast<uint32_t>(sb.amax));
      }
    }
  }
}

TEST(Quantize, AmaxIgnoresSignsAndMarksNonFiniteAsInfinity) {
  for (SimdPath p : paths()) {
    std::vector<float> x(100, 0.5f);
    x[17] = -3.0f;
    EXPECT_EQ(kernels::amax(x.data(), DType::f32, x.size(), p), 3.0f);
    x[99] = kNaN;  // in the tail on the AVX2 path, in a lane at 91
    EXPECT_EQ(kernels::amax(x.data(), DType::f32, x.size(), p), kInf);
    x[99] = 0.5f;
    x[40] = -kInf;
    EXPECT_EQ(kernels::amax(x.data(), DType::f32, x.size(), p), kInf);
    const std::vector<float> zeros(9, -0.0f);
    EXPECT_EQ(std::bit_cast<uint32_t>(kernels::amax(zeros.data(), DType::f32, 9, p)), 0u);
    EXPECT_EQ(kernels::amax(zeros.data(), DType::f32, 0, p), 0.0f);
  }
}

// The tensor forms split the work across threads; the result is one call's.
TEST(Quantize, TensorFormsMatchOneCall) {
  const int64_t n = 3 * (int64_t{1} << 16) + 123;
  std::vector<float> v(static_cast<size_t>(n));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 30.0f);
  for (float& x : v) x = normal(rng);
  v[70000] = 1e-9f;  // flushed
  v[5] = 50000.0f;   // saturated
  const Tensor t = Tensor::from_floats(v, {n}).to(DType::bf16);
  for (DType f : {DType::e4m3, DType::e5m2}) {
    QuantizeStats s;
    const Tensor q = kernels::quantize(t, f, 3.5f, &s);
    EXPECT_EQ(q.dtype(), f);
    EXPECT_EQ(q.shape(), t.shape());
    std::vector<uint8_t> want(static_cast<size_t>(n));
    const QuantizeStats ws = kernels::quantize_fp8_reference(t.data_ptr(), DType::bf16, want.data(),
                                                             f, want.size(), 3.5f);
    const uint8_t* got = static_cast<const uint8_t*>(q.data_ptr());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), got)) << dtype_name(f);
    expect_stats_eq(s, ws, "tensor form");
    EXPECT_GT(s.saturated, 0);
    EXPECT_GT(s.flushed, 0);
    EXPECT_EQ(kernels::amax(t), ws.amax);
  }
  // A strided view is quantized by value.
  const Tensor m = Tensor::from_floats({1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f}, {2, 3});
  const Tensor qt = kernels::quantize(m.transpose(0, 1), DType::e4m3, 1.0f, nullptr);
  EXPECT_EQ(kernels::cast(qt, DType::f32).to_float_vector(),
            (std::vector<float>{1, 4, 2, 5, 3, 6}));
}

// Dequantization is the exact widening: every code's value in f32, f16 and bf16.
TEST(Quantize, DequantizationIsExact) {
  for (DType f : {DType::e4m3, DType::e5m2}) {
    Tensor q = Tensor::empty({256}, f);
    for (int c = 0; c < 256; ++c) static_cast<uint8_t*>(q.data_ptr())[c] = static_cast<uint8_t>(c);
    for (DType to : {DType::f32, DType::f16, DType::bf16}) {
      const std::vector<float> got = kernels::cast(q, to).to_float_vector();
      for (int c = 0; c < 256; ++c) {
        const float v = decode8(f, static_cast<uint8_t>(c));
        if (std::isnan(v)) {
          EXPECT_TRUE(std::isnan(got[static_cast<size_t>(c)]));
        } else {
          EXPECT_EQ(got[static_cast<size_t>(c)], v)
              << dtype_name(f) << " code " << c << " in " << dtype_name(to);
          EXPECT_EQ(std::signbit(got[static_cast<size_t>(c)]), std::signbit(v));
        }
      }
    }
  }
}

// The epilogue: fl(acc * s) + bias[c], rounded once into the output type; no bias adds nothing.
TEST(Quantize, EpilogueScalesThenAddsTheChannelBias) {
  std::vector<float> acc(2 * 3 * 5);
  for (size_t i = 0; i < acc.size(); ++i) acc[i] = static_cast<float>(i) * 1.37f - 11.0f;
  acc[0] = -0.0f;
  const std::vector<float> bias = {0.5f, -1.25f, 3.0f};
  const float s = 0.0123f;
  const Tensor a = Tensor::from_floats(acc, {2, 3, 5});
  const Tensor b = Tensor::from_floats(bias, {3});
  for (DType out : {DType::f32, DType::bf16}) {
    // convolution layout: (N, C, inner)
    const std::vector<float> conv = kernels::fp8_epilogue(a, s, b, 1, out).to_float_vector();
    // linear layout: (rows, C)
    const Tensor a2 =
        Tensor::from_floats(std::vector<float>(acc.begin(), acc.begin() + 12), {4, 3});
    const std::vector<float> lin = kernels::fp8_epilogue(a2, s, b, 1, out).to_float_vector();
    const std::vector<float> none =
        kernels::fp8_epilogue(a, s, Tensor(), -1, out).to_float_vector();
    auto round = [&](float v) { return kernels::cast(Tensor::from_floats({v}, {1}), out).item(); };
    for (size_t i = 0; i < acc.size(); ++i) {
      const float t = acc[i] * s;
      EXPECT_EQ(conv[i], round(t + bias[(i / 5) % 3])) << i;
      EXPECT_EQ(std::bit_cast<uint32_t>(none[i]),
                std::bit_cast<uint32_t>(static_cast<float>(round(t))))
          << i;
    }
    for (size_t i = 0; i < 12; ++i) {
      const float t = acc[i] * s;
      EXPECT_EQ(lin[i], round(t + bias[i % 3])) << i;
    }
    EXPECT_TRUE(std::signbit(none[0]));
  }
  // In place (FP32, no bias): the same bits, in the accumulator's own buffer.
  Tensor in_place = Tensor::from_floats(acc, {2, 3, 5});
  const void* buffer = in_place.data_ptr();
  kernels::fp8_epilogue_in_place(in_place, s);
  EXPECT_EQ(in_place.data_ptr(), buffer);
  const std::vector<float> want =
      kernels::fp8_epilogue(a, s, Tensor(), -1, DType::f32).to_float_vector();
  const std::vector<float> got = in_place.to_float_vector();
  for (size_t i = 0; i < acc.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << i;
}

}  // namespace
}  // namespace mantissa
