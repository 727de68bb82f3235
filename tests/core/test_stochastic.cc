// Stochastic rounding: the generator, exact unbiasedness, statistics, reproducibility.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "mantissa/mantissa.h"

namespace mantissa {
namespace {

// Known-answer vectors of Random123's kat_vectors for philox4x32_10.
TEST(Philox, KnownAnswers) {
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(
      philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
      (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(
      philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
      (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Philox, ElementMapping) {
  // Element i takes word i%4 of block i/4; streams and seeds give different sequences.
  const PhiloxCounter b = philox_block(7, 3, 5);
  for (uint64_t w = 0; w < 4; ++w) EXPECT_EQ(philox_bits(7, 3, 20 + w), b[w]);
  EXPECT_NE(philox_bits(7, 3, 20), philox_bits(8, 3, 20));
  EXPECT_NE(philox_bits(7, 3, 20), philox_bits(7, 4, 20));
}

// For one input, the number of 32-bit random words that round it away from zero, found by
// bisection (the rule is monotone in r); the expectation of the result is then exact arithmetic.
template <FloatFormat F>
void expect_exact_expectation(float x, int* checked) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const uint32_t down = encode_stochastic<F>(b, 0xffffffffu);
  const uint64_t all = uint64_t{1} << 32;
  uint64_t lo = 0, hi = all;  // invariant: r < lo rounds up, r >= hi rounds down
  while (lo < hi) {
    const uint64_t mid = (lo + hi) / 2;
    if (encode_stochastic<F>(b, static_cast<uint32_t>(mid)) != down)
      lo = mid + 1;
    else
      hi = mid;
  }
  const double v_down = decode<F>(down);
  const double v_up = lo == 0 ? v_down : static_cast<double>(decode<F>(encode_stochastic<F>(b, 0)));
  // Every r below the threshold gives the same neighbour, every r above the other.
  if (lo > 0) {
    ASSERT_EQ(encode_stochastic<F>(b, static_cast<uint32_t>(lo - 1)), encode_stochastic<F>(b, 0));
  }
  const double expectation =
      v_down + (v_up - v_down) * (static_cast<double>(lo) / static_cast<double>(all));
  const double ulp = std::fabs(v_up - v_down);
  // Exact when the dropped bits fit in 32; for far-subnormal inputs the probability is truncated to
  // a multiple of 2^-32, so E may fall short by less than 2^-32 ulp.
  const double tol = std::ldexp(1.0, -32) * (ulp > 0 ? ulp : decode<F>(1u));
  ASSERT_NEAR(expectation, static_cast<double>(x), tol) << "x=" << x << " bits=" << std::hex << b;
  if (std::fabs(x) >= std::ldexp(static_cast<double>(decode<F>(1u)), -8)) {
    ASSERT_EQ(expectation, static_cast<double>(x)) << "x=" << x << " bits=" << std::hex << b;
  }
  ++*checked;
}

template <FloatFormat F>
void sweep_exact_expectation() {
  int checked = 0;
  const uint32_t max_bits = max_finite_f32_bits<F>();
  for (uint64_t b = 0; b <= max_bits; b += 8191) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(b));
    expect_exact_expectation<F>(x, &checked);
    expect_exact_expectation<F>(-x, &checked);
    if (::testing::Test::HasFatalFailure()) return;
  }
  expect_exact_expectation<F>(std::bit_cast<float>(max_bits), &checked);
  EXPECT_GT(checked, 1000);
}

TEST(StochasticRounding, ExpectationEqualsInputF16) { sweep_exact_expectation<kF16Format>(); }
TEST(StochasticRounding, ExpectationEqualsInputBF16) { sweep_exact_expectation<kBF16Format>(); }
TEST(StochasticRounding, ExpectationEqualsInputE4M3) { sweep_exact_expectation<kE4M3Format>(); }
TEST(StochasticRounding, ExpectationEqualsInputE5M2) { sweep_exact_expectation<kE5M2Format>(); }

// The statistical check: many draws of the same value through the bulk path (fresh random words
// per element index) average to the value, within 5 standard errors.
struct Case {
  DType type;
  float x;
  const char* where;
};

TEST(StochasticRounding, SampleMeanIsUnbiased) {
  const Case cases[] = {
      {DType::f16, 1.0f + 0.3f * 0x1p-10f, "f16 binade [1,2)"},
      {DType::f16, -1000.7f, "f16 binade [512,1024), negative"},
      {DType::f16, 3.25f * 0x1p-24f, "f16 subnormal"},
      {DType::f16, 0x1p-26f, "f16 below the smallest subnormal"},
      {DType::f16, 0x1p-40f, "f16 far below the smallest subnormal"},
      {DType::f16, 65500.0f, "f16 top binade"},
      {DType::bf16, 1.0f + 0.77f * 0x1p-7f, "bf16 binade [1,2)"},
      {DType::bf16, 3.3e38f, "bf16 top binade"},
      {DType::bf16, 2.3e-39f, "bf16 subnormal"},
      {DType::e4m3, 0.3f, "e4m3 binade [0.25,0.5)"},
      {DType::e4m3, -0.4f * 0x1p-9f, "e4m3 below the smallest subnormal"},
      {DType::e4m3, 5.3f * 0x1p-9f, "e4m3 subnormal"},
      {DType::e5m2, 1000.0f, "e5m2 binade [512,1024)"},
      {DType::e5m2, 1.6f * 0x1p-16f, "e5m2 subnormal"},
  };
  constexpr size_t kN = 1 << 20;
  std::vector<float> in(kN), out(kN);
  std::vector<uint16_t> stored(kN);
  for (const Case& c : cases) {
    std::fill(in.begin(), in.end(), c.x);
    CastOptions opt;
    opt.rounding = Rounding::kStochastic;
    opt.seed = 1234;
    convert(in.data(), DType::f32, stored.data(), c.type, kN, opt);
    convert(stored.data(), c.type, out.data(), DType::f32, kN);
    // The two neighbours, and the fraction of draws that took the upper one.
    double lo = out[0], hi = out[0];
    double sum = 0;
    for (float v : out) {
      lo = std::min<double>(lo, v);
      hi = std::max<double>(hi, v);
      sum += v;
    }
    const double mean = sum / kN;
    const double p =
        (std::fabs(static_cast<double>(c.x)) - std::min(std::fabs(lo), std::fabs(hi))) /
        std::fabs(hi - lo);
    const double se = std::fabs(hi - lo) * std::sqrt(std::max(p * (1 - p), 1e-300) / kN);
    EXPECT_LE(std::fabs(mean - c.x), 5 * se + 1e-12 * std::fabs(c.x))
        << c.where << ": mean " << mean << " for x " << c.x << " (neighbours " << lo << ", " << hi
        << ")";
    // At most two distinct results, bracketing x.
    for (float v : out) ASSERT_TRUE(v == lo || v == hi) << c.where;
    EXPECT_LE(std::min(lo, hi), c.x) << c.where;
    EXPECT_GE(std::max(lo, hi), c.x) << c.where;
  }
}

TEST(StochasticRounding, NoSpuriousInfinityAtTopOfRange) {
  struct Top {
    DType type;
    float max;
  };
  const Top tops[] = {{DType::f16, 65504.0f},
                      {DType::bf16, decode<kBF16Format>(0x7f7f)},
                      {DType::e4m3, 448.0f},
                      {DType::e5m2, 57344.0f}};
  constexpr size_t kN = 1 << 16;
  std::vector<float> in(kN), out(kN);
  std::vector<uint16_t> stored(kN);
  for (const Top& t : tops) {
    // Every FP32 value from just below the largest finite value up to it, and its negation.
    const uint32_t top = std::bit_cast<uint32_t>(t.max);
    for (size_t i = 0; i < kN; ++i) {
      const float v = std::bit_cast<float>(top - static_cast<uint32_t>(i % 4096));
      in[i] = (i & 1) ? -v : v;
    }
    CastOptions opt;
    opt.rounding = Rounding::kStochastic;
    for (uint64_t seed = 0; seed < 8; ++seed) {
      opt.seed = seed;
      convert(in.data(), DType::f32, stored.data(), t.type, kN, opt);
      convert(stored.data(), t.type, out.data(), DType::f32, kN);
      for (size_t i = 0; i < kN; ++i)
        ASSERT_TRUE(std::isfinite(out[i]) && std::fabs(out[i]) <= t.max)
            << dtype_name(t.type) << ": " << in[i] << " became " << out[i];
    }
  }
}

TEST(StochasticRounding, BeyondRangeRoundsToNearest) {
  // Inputs past the largest finite value have no upper neighbour: they round to nearest even.
  const float xs[] = {65510.0f, 65519.0f, 65520.0f, 1e6f, INFINITY, NAN};
  for (float x : xs)
    for (uint32_t r : {0u, 0x80000000u, 0xffffffffu})
      EXPECT_EQ(encode_stochastic<kF16Format>(std::bit_cast<uint32_t>(x), r),
                encode_rne<kF16Format>(std::bit_cast<uint32_t>(x)))
          << x;
  EXPECT_EQ(encode_stochastic<kE4M3Format>(std::bit_cast<uint32_t>(1000.0f), 0, true), 0x7eu);
}

TEST(StochasticRounding, ExactValuesAreNeverMoved) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float v = decode<kF16Format>(h);
    if (std::isnan(v) || std::isinf(v)) continue;
    for (uint32_t r : {0u, 1u, 0x7fffffffu, 0xffffffffu})
      ASSERT_EQ(encode_stochastic<kF16Format>(std::bit_cast<uint32_t>(v), r), h) << std::hex << h;
  }
}

std::vector<float> random_inputs(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<float> v(n);
  std::uniform_int_distribution<int> expo(-60, 20);
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  for (size_t i = 0; i < n; ++i) v[i] = std::ldexp(mant(gen), expo(gen));
  v[0] = 0.0f;
  v[1] = -0.0f;
  v[2] = INFINITY;
  v[3] = NAN;
  v[4] = 70000.0f;
  return v;
}

// The SIMD path is bit-identical to the scalar one for every offset, length and format.
TEST(StochasticRounding, SimdMatchesScalar) {
  if (!simd_path_supported(SimdPath::kAvx2)) GTEST_SKIP() << "no AVX2 path on this processor";
  const std::vector<float> in = random_inputs(4099, 7);
  std::vector<uint16_t> a(in.size()), b(in.size());
  for (DType t : {DType::f16, DType::bf16, DType::e4m3, DType::e5m2}) {
    for (uint64_t index :
         {uint64_t{0}, uint64_t{1}, uint64_t{3}, uint64_t{4 * 0xFFFFFFF0ull + 2}}) {
      for (size_t n : {size_t{0}, size_t{5}, size_t{33}, in.size()}) {
        for (bool sat : {false, true}) {
          CastOptions opt;
          opt.rounding = Rounding::kStochastic;
          opt.seed = 0xDEADBEEFCAFEull;
          opt.stream = 9;
          opt.index = index;
          opt.saturate = sat;
          convert(in.data(), DType::f32, a.data(), t, n, opt, SimdPath::kScalar);
          convert(in.data(), DType::f32, b.data(), t, n, opt, SimdPath::kAvx2);
          const size_t bytes = n * dtype_size(t);
          ASSERT_EQ(std::memcmp(a.data(), b.data(), bytes), 0)
              << dtype_name(t) << " index " << index << " n " << n << " saturate " << sat;
        }
      }
    }
  }
}

TEST(StochasticRounding, ReproducibleForASeedAndIndependentOfThreads) {
  const std::vector<float> in = random_inputs(300007, 11);
  CastOptions opt;
  opt.rounding = Rounding::kStochastic;
  opt.seed = 42;
  opt.index = 17;
  std::vector<uint16_t> ref(in.size()), got(in.size());
  convert(in.data(), DType::f32, ref.data(), DType::bf16, in.size(), opt);
  for (int threads : {1, 2, 3, 7}) {
    std::fill(got.begin(), got.end(), 0);
    convert_parallel(in.data(), DType::f32, got.data(), DType::bf16, in.size(), opt, threads);
    EXPECT_EQ(got, ref) << threads << " threads";
  }
  // In pieces, each with its global index, equals one call.
  std::fill(got.begin(), got.end(), 0);
  for (size_t off = 0; off < in.size(); off += 1001) {
    CastOptions o = opt;
    o.index = opt.index + off;
    convert(in.data() + off, DType::f32, got.data() + off, DType::bf16,
            std::min<size_t>(1001, in.size() - off), o);
  }
  EXPECT_EQ(got, ref);
  // A different seed or stream draws differently.
  CastOptions other = opt;
  other.seed = 43;
  convert(in.data(), DType::f32, got.data(), DType::bf16, in.size(), other);
  EXPECT_NE(got, ref);
  other = opt;
  other.stream = 1;
  convert(in.data(), DType::f32, got.data(), DType::bf16, in.size(), other);
  EXPECT_NE(got, ref);
}

// Many tiny updates survive: a sum of increments smaller than half an ulp never moves under round
// to nearest, and tracks the true sum under stochastic rounding (why the optimizer wants it).
TEST(StochasticRounding, TinyUpdatesAccumulate) {
  const float inc = 0.2f * 0x1p-10f;  // a fifth of an f16 ulp at 1.0
  f16 nearest(1.0f);
  std::vector<float> acc(4096, 1.0f);
  std::vector<uint16_t> bits(acc.size());
  CastOptions opt;
  opt.rounding = Rounding::kStochastic;
  for (int step = 0; step < 500; ++step) {
    nearest = f16(static_cast<float>(nearest) + inc);
    for (float& a : acc) a += inc;
    opt.stream = static_cast<uint64_t>(step);
    convert(acc.data(), DType::f32, bits.data(), DType::f16, acc.size(), opt);
    convert(bits.data(), DType::f16, acc.data(), DType::f32, acc.size());
  }
  EXPECT_EQ(static_cast<float>(nearest), 1.0f);
  double mean = 0;
  for (float a : acc) mean += a;
  mean /= static_cast<double>(acc.size());
  EXPECT_NEAR(mean, 1.0 + 500 * inc, 0.002);
}

}  // namespace
}  // namespace mantissa
