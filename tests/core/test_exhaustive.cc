// Exhaustive tests of the conversions: every FP32 pattern into FP16 and BF16 on both paths, every
// 16- and 8-bit pattern back to FP32 and round trip, and FP8 rounding over a dense sweep.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <mutex>
#include <vector>

#include "mantissa/mantissa.h"
#include "support/references.h"

namespace mantissa {
namespace {

using testing::exhaustive_stride;
using testing::hex32;

std::vector<SimdPath> paths() {
  std::vector<SimdPath> p{SimdPath::kScalar};
  if (simd_path_supported(SimdPath::kAvx2)) p.push_back(SimdPath::kAvx2);
  if (simd_path_supported(SimdPath::kAvx512)) p.push_back(SimdPath::kAvx512);
  return p;
}

// Runs check(first_pattern, inputs[65536]) over the 2^16 blocks of FP32 patterns on all threads,
// and collects mismatch counts with the first mismatch per path.
struct Mismatches {
  std::atomic<uint64_t> count{0};
  std::mutex mu;
  std::string first;
  void add(uint64_t n, const std::string& what) {
    if (n == 0) return;
    if (count.fetch_add(n) == 0) {
      std::lock_guard<std::mutex> lock(mu);
      first = what;
    }
  }
};

template <typename Fn>
uint64_t for_all_f32_blocks(Fn&& fn) {
  const uint32_t stride = exhaustive_stride();
  std::atomic<uint64_t> visited{0};
  parallel_for(65536, 1, default_num_threads(), [&](size_t begin, size_t end) {
    std::vector<float> in(65536);
    for (size_t blk = begin; blk < end; ++blk) {
      if (blk % stride != 0) continue;
      for (uint32_t lo = 0; lo < 65536; ++lo)
        in[lo] = std::bit_cast<float>(static_cast<uint32_t>(blk << 16) | lo);
      fn(static_cast<uint32_t>(blk << 16), in);
      visited += 65536;
    }
  });
  return visited;
}

// Fails for each path with mismatches and prints the counts (quoted in the closing notes).
void report(const char* what, uint64_t visited, const std::vector<SimdPath>& ps,
            std::vector<Mismatches>& mism) {
  for (size_t p = 0; p < ps.size(); ++p)
    EXPECT_EQ(mism[p].count.load(), 0u)
        << simd_path_name(ps[p]) << ": first mismatch " << mism[p].first;
  std::printf("[ %s ] %llu patterns per path, mismatches:", what,
              static_cast<unsigned long long>(visited));
  for (size_t p = 0; p < ps.size(); ++p)
    std::printf(" %s=%llu", std::string(simd_path_name(ps[p])).c_str(),
                static_cast<unsigned long long>(mism[p].count.load()));
  std::printf("\n");
}

// The oracle is F16C where the processor has it, else FP16's definition (references.h; checked
// against F16C by the next test where both exist).
TEST(Exhaustive, AllFloat32ToF16MatchTheOracle) {
  const std::vector<SimdPath> ps = paths();
  std::vector<Mismatches> mism(ps.size());
  const uint64_t visited = for_all_f32_blocks([&](uint32_t first, const std::vector<float>& in) {
    std::vector<uint16_t> oracle(in.size()), got(in.size());
    testing::f16_oracle_encode(in.data(), oracle.data(), in.size());
    for (size_t p = 0; p < ps.size(); ++p) {
      convert(in.data(), DType::f32, got.data(), DType::f16, in.size(), {}, ps[p]);
      uint64_t bad = 0;
      size_t where = 0;
      for (size_t i = 0; i < in.size(); ++i)
        if (got[i] != oracle[i] && bad++ == 0) where = i;
      if (bad)
        mism[p].add(bad, hex32(first + static_cast<uint32_t>(where)) + " -> " + hex32(got[where]) +
                             ", the oracle gives " + hex32(oracle[where]));
    }
  });
  report("f32->f16", visited, ps, mism);
}

// FP16's definition, the oracle of processors without F16C, agrees with F16C: decoding every
// pattern, and encoding every FP16 value, the midpoints between neighbours (ties) and the FP32
// values on either side of each midpoint, the overflow threshold, NaNs and a sweep of 2^20 FP32
// patterns across the whole range.
TEST(Exhaustive, Fp16DefinitionAgreesWithF16C) {
#if MANTISSA_TEST_HAVE_F16C_CODE
  if (!testing::have_f16c()) GTEST_SKIP() << "no F16C on this processor";
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = testing::f16c_decode(static_cast<uint16_t>(h));
    const float got = testing::f16_reference_decode(static_cast<uint16_t>(h));
    ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << hex32(h);
  }
  std::vector<float> in;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    for (uint32_t s : {0u, 0x8000u}) {
      const double v = testing::f16_reference_decode(static_cast<uint16_t>(h | s));
      const double next = testing::f16_reference_decode(static_cast<uint16_t>((h + 1) | s));
      const float mid = static_cast<float>((v + next) / 2);  // exact: FP16 ties are FP32 values
      in.insert(in.end(), {static_cast<float>(v), mid, std::nextafter(mid, 0.0f),
                           std::nextafter(mid, INFINITY), std::nextafter(mid, -INFINITY)});
    }
  }
  for (float x : {65504.0f, 65519.99f, 65520.0f, 1e30f, INFINITY, -INFINITY, NAN, -NAN,
                  std::bit_cast<float>(0x7f800001u), std::bit_cast<float>(0xffa5a5a5u)})
    in.push_back(x);
  for (uint32_t i = 0; i < (1u << 20); ++i)
    in.push_back(std::bit_cast<float>(i * 4096u + i % 4096));
  std::vector<uint16_t> want(in.size());
  testing::f16c_encode(in.data(), want.data(), in.size());
  size_t bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t got = testing::f16_reference_encode(in[i]);
    if (got != want[i] && bad++ < 5)
      ADD_FAILURE() << hex32(std::bit_cast<uint32_t>(in[i])) << " -> " << hex32(got)
                    << ", F16C gives " << hex32(want[i]);
  }
  EXPECT_EQ(bad, 0u) << "of " << in.size() << " inputs";
#else
  GTEST_SKIP() << "not an x86 processor: no F16C";
#endif
}

TEST(Exhaustive, AllFloat32ToBF16MatchIntegerReference) {
  const std::vector<SimdPath> ps = paths();
  std::vector<Mismatches> mism(ps.size());
  const uint64_t visited = for_all_f32_blocks([&](uint32_t first, const std::vector<float>& in) {
    std::vector<uint16_t> got(in.size());
    for (size_t p = 0; p < ps.size(); ++p) {
      convert(in.data(), DType::f32, got.data(), DType::bf16, in.size(), {}, ps[p]);
      uint64_t bad = 0;
      size_t where = 0;
      for (size_t i = 0; i < in.size(); ++i)
        if (got[i] != testing::bf16_reference(first + static_cast<uint32_t>(i)) && bad++ == 0)
          where = i;
      if (bad) {
        const uint32_t b = first + static_cast<uint32_t>(where);
        mism[p].add(bad, hex32(b) + " -> " + hex32(got[where]) + ", reference " +
                             hex32(testing::bf16_reference(b)));
      }
    }
  });
  report("f32->bf16", visited, ps, mism);
}

// Saturating conversion: identical to nearest-even except that overflow (inf included) gives the
// largest finite value. Checked on every 16th block of patterns (2^28 inputs) per format.
TEST(Exhaustive, SaturatingF16AndBF16) {
  const std::vector<SimdPath> ps = paths();
  Mismatches mism;
  CastOptions sat;
  sat.saturate = true;
  for_all_f32_blocks([&](uint32_t first, const std::vector<float>& in) {
    if ((first >> 16) % 16 != 0) return;
    std::vector<uint16_t> plain(in.size()), got(in.size());
    for (DType t : {DType::f16, DType::bf16}) {
      const uint16_t inf = t == DType::f16 ? 0x7c00 : 0x7f80;
      const uint16_t max = inf - 1;
      convert(in.data(), DType::f32, plain.data(), t, in.size(), {}, SimdPath::kScalar);
      for (SimdPath p : ps) {
        convert(in.data(), DType::f32, got.data(), t, in.size(), sat, p);
        for (size_t i = 0; i < in.size(); ++i) {
          const uint16_t mag = plain[i] & 0x7fff;
          const uint16_t want =
              mag == inf ? static_cast<uint16_t>((plain[i] & 0x8000) | max) : plain[i];
          if (got[i] != want)
            mism.add(1, std::string(dtype_name(t)) + " " + std::string(simd_path_name(p)) + " " +
                            hex32(first + static_cast<uint32_t>(i)) + " -> " + hex32(got[i]) +
                            ", want " + hex32(want));
        }
      }
    }
  });
  EXPECT_EQ(mism.count.load(), 0u) << "first mismatch " << mism.first;
}

// FP8 rounding against the table search: every FP16 value (which includes every FP8 value, every
// midpoint between neighbours and the overflow thresholds) with its FP32 neighbours, plus every
// 509th FP32 pattern.
TEST(Exhaustive, Float32ToFp8MatchesNearestSearch) {
  const testing::Fp8Reference e4m3_ref(4, 3, 7, false), e5m2_ref(5, 2, 15, true);
  std::vector<float> in;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float v = decode<kF16Format>(h);
    const uint32_t b = std::bit_cast<uint32_t>(v);
    in.push_back(v);
    in.push_back(std::bit_cast<float>(b + 1));
    if (b & 0x7fffffffu) in.push_back(std::bit_cast<float>(b - 1));
  }
  const uint32_t step = 509 * exhaustive_stride();
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += step)
    in.push_back(std::bit_cast<float>(static_cast<uint32_t>(b)));
  for (float v : {448.0f, 464.0f, 480.0f, 57344.0f, 61440.0f, 65536.0f, INFINITY, -INFINITY})
    in.push_back(v);

  std::vector<uint8_t> got(in.size());
  uint64_t checked = 0;
  for (bool saturate : {false, true}) {
    for (DType t : {DType::e4m3, DType::e5m2}) {
      const testing::Fp8Reference& ref = t == DType::e4m3 ? e4m3_ref : e5m2_ref;
      CastOptions opt;
      opt.saturate = saturate;
      for (SimdPath p : paths()) {
        convert(in.data(), DType::f32, got.data(), t, in.size(), opt, p);
        uint64_t bad = 0;
        for (size_t i = 0; i < in.size(); ++i) {
          const int want = ref.encode(in[i], saturate);
          const bool ok =
              want < 0
                  ? (std::isnan(decode<kE4M3Format>(0x7f)) &&
                     std::isnan(t == DType::e4m3 ? static_cast<float>(e4m3::from_bits(got[i]))
                                                 : static_cast<float>(e5m2::from_bits(got[i]))) &&
                     (got[i] >> 7) == (std::bit_cast<uint32_t>(in[i]) >> 31))
                  : got[i] == want;
          if (!ok && bad++ < 3)
            ADD_FAILURE() << dtype_name(t) << (saturate ? " saturating " : " ") << simd_path_name(p)
                          << ": " << hex32(std::bit_cast<uint32_t>(in[i])) << " (" << in[i]
                          << ") -> " << hex32(got[i]) << ", want "
                          << hex32(static_cast<uint32_t>(want));
        }
        EXPECT_EQ(bad, 0u);
        checked += in.size();
      }
    }
  }
  std::printf("[ f32->fp8 ] %llu conversions checked against the nearest-value search\n",
              static_cast<unsigned long long>(checked));
}

// Every 16-bit pattern back to FP32 (against F16C and the shift for BF16) on both paths, and
// round trip: decoding then encoding gives the same bits (NaN stays NaN with its sign).
TEST(Exhaustive, All16BitPatternsDecodeAndRoundTrip) {
  std::vector<uint16_t> all(65536), back(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> f(65536);
  for (DType t : {DType::f16, DType::bf16}) {
    for (SimdPath p : paths()) {
      convert(all.data(), t, f.data(), DType::f32, all.size(), {}, p);
      convert(f.data(), DType::f32, back.data(), t, f.size(), {}, p);
      uint64_t bad_decode = 0, bad_trip = 0;
      for (uint32_t i = 0; i < 65536; ++i) {
        const float want = t == DType::bf16 ? std::bit_cast<float>(i << 16)
                                            : testing::f16_oracle_decode(static_cast<uint16_t>(i));
        const uint32_t got_bits = std::bit_cast<uint32_t>(f[i]);
        const uint32_t want_bits = std::bit_cast<uint32_t>(want);
        if (got_bits != want_bits && bad_decode++ < 3)
          ADD_FAILURE() << dtype_name(t) << " " << simd_path_name(p) << " decode " << hex32(i)
                        << " -> " << hex32(got_bits) << ", want " << hex32(want_bits);
        const bool nan = std::isnan(f[i]);
        const uint16_t mag_mask = 0x7fff;
        const uint16_t exp_mask = t == DType::f16 ? 0x7c00 : 0x7f80;
        const bool trip_ok =
            nan ? ((back[i] & exp_mask) == exp_mask && (back[i] & mag_mask & ~exp_mask) != 0 &&
                   (back[i] >> 15) == (i >> 15))
                : back[i] == i;
        if (!trip_ok && bad_trip++ < 3)
          ADD_FAILURE() << dtype_name(t) << " " << simd_path_name(p) << " round trip " << hex32(i)
                        << " -> " << hex32(back[i]);
      }
      EXPECT_EQ(bad_decode, 0u);
      EXPECT_EQ(bad_trip, 0u);
    }
  }
}

TEST(Exhaustive, All8BitPatternsDecodeAndRoundTrip) {
  const testing::Fp8Reference e4m3_ref(4, 3, 7, false), e5m2_ref(5, 2, 15, true);
  std::vector<uint8_t> all(256), back(256);
  for (int i = 0; i < 256; ++i) all[i] = static_cast<uint8_t>(i);
  std::vector<float> f(256);
  for (DType t : {DType::e4m3, DType::e5m2}) {
    const testing::Fp8Reference& ref = t == DType::e4m3 ? e4m3_ref : e5m2_ref;
    for (SimdPath p : paths()) {
      convert(all.data(), t, f.data(), DType::f32, 256, {}, p);
      convert(f.data(), DType::f32, back.data(), t, 256, {}, p);
      for (int i = 0; i < 256; ++i) {
        const double mag = ref.value[i & 0x7f];
        const double want = (i & 0x80) ? -mag : mag;
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(f[i])) << dtype_name(t) << " " << simd_path_name(p) << " " << i;
          EXPECT_EQ(std::signbit(f[i]), (i & 0x80) != 0) << dtype_name(t) << " pattern " << i;
          EXPECT_TRUE(std::isnan(ref.value[back[i] & 0x7f]))
              << dtype_name(t) << " NaN round trip " << i;
        } else {
          EXPECT_EQ(static_cast<double>(f[i]), want)
              << dtype_name(t) << " " << simd_path_name(p) << " " << i;
          EXPECT_EQ(std::signbit(f[i]), (i & 0x80) != 0)
              << dtype_name(t) << " sign of pattern " << i;
          EXPECT_EQ(back[i], i) << dtype_name(t) << " " << simd_path_name(p) << " round trip " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace mantissa
