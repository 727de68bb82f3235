// The optimizers' inner loops against their FP32 formulas, bit for bit, where it matters most.
// The SIMD Adam/AdamW loop (sixteen lanes on a processor with AVX-512, eight under
// MANTISSA_SIMD=avx2, the CTest entry kernels.adam_avx2) against adam_element: state and
// gradients near and inside the subnormal range, where the loop sends vectors to its exact lanes
// (FP64, each operation rounded to FP32) instead of FP32 arithmetic that would take microcode
// assists. Every storage combination the precision modes use and two generic
// ones; clustered vectors of one value class (zeros, subnormals, tiny and ordinary normals,
// infinities, NaNs) and mixed ones; the scalar settings of AdamW under loss scaling, Adam with L2,
// clipping, beta1 = 0, a zero step, an early bias correction and eps = 0.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mantissa/core/cpu_features.h"
#include "mantissa/core/float_formats.h"
#include "mantissa/optim/optim_kernels.h"

namespace mantissa::optim::detail {
namespace {

// A value of one class, as FP32 bits.
uint32_t value_of_class(int cls, std::mt19937& rng) {
  std::uniform_int_distribution<uint32_t> frac(0, 0x7fffff), sign(0, 1);
  const uint32_t s = sign(rng) << 31;
  switch (cls) {
    case 0:  // zero
      return s;
    case 1:  // subnormal, often a few units in the last place (a decayed moment)
      return s | (sign(rng) ? std::uniform_int_distribution<uint32_t>(1, 6)(rng) : frac(rng) | 1);
    case 2:  // tiny normal: exponents 2^-126 .. 2^-90
      return s | (std::uniform_int_distribution<uint32_t>(1, 37)(rng) << 23) | frac(rng);
    case 3:  // ordinary: 2^-40 .. 2^2
      return s | (std::uniform_int_distribution<uint32_t>(87, 129)(rng) << 23) | frac(rng);
    case 4:  // small ordinary: 2^-70 .. 2^-40 (gradients whose squares are tiny)
      return s | (std::uniform_int_distribution<uint32_t>(57, 87)(rng) << 23) | frac(rng);
    case 5:  // infinity
      return s | 0x7f800000u;
    default:  // NaN
      return s | 0x7f800000u | frac(rng) | 1;
  }
}

float from_bits(uint32_t b) { return std::bit_cast<float>(b); }

// n values in storage type t (16-bit ones: the FP32 value rounded), in runs of 8 that share a class
// (most runs) or mix classes; v (the second moment) holds no negative values, as in training.
std::vector<uint32_t> make_values(int64_t n, bool non_negative, std::mt19937& rng) {
  std::vector<uint32_t> out(static_cast<size_t>(n));
  std::discrete_distribution<int> classes({20, 25, 15, 25, 8, 2, 2});
  for (int64_t j = 0; j < n; j += 8) {
    const bool mixed = std::uniform_int_distribution<int>(0, 3)(rng) == 0;
    const int run = classes(rng);
    for (int64_t k = j; k < std::min(n, j + 8); ++k) {
      uint32_t b = value_of_class(mixed ? classes(rng) : run, rng);
      if (non_negative) b &= 0x7fffffffu;
      out[static_cast<size_t>(k)] = b;
    }
  }
  return out;
}

// Storage of FP32 values in type t, and back.
struct Stored {
  DType t;
  std::vector<uint32_t> f32;
  std::vector<uint16_t> h;
  void* data() { return t == DType::f32 ? static_cast<void*>(f32.data()) : h.data(); }
  float get(size_t i) const {
    if (t == DType::f16) return static_cast<float>(f16::from_bits(h[i]));
    if (t == DType::bf16) return static_cast<float>(bf16::from_bits(h[i]));
    return from_bits(f32[i]);
  }
};

Stored store(const std::vector<uint32_t>& bits, DType t) {
  Stored s{t, {}, {}};
  if (t == DType::f32) {
    s.f32 = bits;
  } else {
    for (uint32_t b : bits)
      s.h.push_back(t == DType::f16 ? f16(from_bits(b)).bits : bf16(from_bits(b)).bits);
  }
  return s;
}

// x rounded as the kernel stores it in type t, as FP32 bits (NaN: a canonical pattern).
uint32_t stored_bits(float x, DType t) {
  if (std::isnan(x)) return 0x7fc00000u;
  if (t == DType::f16) x = static_cast<float>(f16(x));
  if (t == DType::bf16) x = static_cast<float>(bf16(x));
  return std::bit_cast<uint32_t>(x);
}
uint32_t canonical(float x) { return std::isnan(x) ? 0x7fc00000u : std::bit_cast<uint32_t>(x); }

struct Types {
  DType p, g, m, v;
  bool master;
  const char* name;
};
const Types kTypes[] = {
    {DType::f32, DType::f32, DType::f32, DType::f32, false, "32-true and the mixed modes"},
    {DType::f32, DType::f16, DType::f32, DType::f32, false, "16-mixed's gradient in parts"},
    {DType::f32, DType::bf16, DType::f32, DType::f32, false, "bf16-mixed's gradient in parts"},
    {DType::f16, DType::f16, DType::f16, DType::bf16, false, "16-true"},
    {DType::bf16, DType::bf16, DType::bf16, DType::bf16, false, "bf16-true"},
    {DType::f16, DType::f16, DType::f32, DType::f32, true, "f16 with a master (O2 --half-modules)"},
    {DType::bf16, DType::f32, DType::f16, DType::f32, false, "generic"},
    {DType::bf16, DType::bf16, DType::bf16, DType::f32, true, "generic with a master"},
};

struct Case {
  AdamScalars s;
  const char* name;
};
std::vector<Case> scalar_cases() {
  // b1, b2, 1-b1, 1-b2, step, sqrt(bias correction 2), eps, wd, decay, decoupled, unscale, clip
  std::vector<Case> c;
  c.push_back(
      {{0.9f, 0.999f, 0.1f, 0.001f, 1e-3f, 0.9f, 1e-8f, 0.01f, 0.99999f, true, 1.0f / 131072, 1.0f},
       "AdamW under loss scaling"});
  c.push_back({{0.9f, 0.999f, 0.1f, 0.001f, 1e-3f, 0.9f, 1e-8f, 0.05f, 1.0f, false, 1.0f, 0.37f},
               "Adam with L2 and clipping"});
  c.push_back(
      {{0.0f, 0.99f, 1.0f, 0.01f, 0.3f, 1.0f, 1e-8f, 0.0f, 1.0f, true, 1.0f, 1.0f}, "beta1 = 0"});
  c.push_back(
      {{0.9f, 0.999f, 0.1f, 0.001f, 0.0f, 0.9f, 1e-8f, 0.0f, 1.0f, true, 1.0f, 1.0f}, "zero step"});
  c.push_back({{0.9f, 0.999f, 0.1f, 0.001f, 1e-2f, 0.0316f, 0.0f, 0.0f, 1.0f, false, 0.5f, 1.0f},
               "early bias correction, eps = 0"});
  return c;
}

TEST(AdamLanes, SimdEqualsTheElementFormulaNearAndInTheSubnormalRange) {
  if (!simd_path_supported(SimdPath::kAvx2)) GTEST_SKIP() << "no AVX2 on this processor";
  if (simd_path(SimdFamily::kOptimizer) == SimdPath::kScalar)
    GTEST_SKIP() << "the optimizer runs its scalar path in this process (MANTISSA_SIMD=scalar)";
  std::mt19937 rng(2026);
  // Every vector kind, and a tail: 350 AVX-512 vectors, then one AVX2 vector and five elements
  // (on AVX2: 701 vectors and five).
  const int64_t n = 16 * 350 + 13;
  int64_t subnormal_moments = 0;
  for (const Case& sc : scalar_cases()) {
    for (const Types& ty : kTypes) {
      SCOPED_TRACE(std::string(sc.name) + ", " + ty.name);
      const std::vector<uint32_t> p0 = make_values(n, false, rng), g0 = make_values(n, false, rng),
                                  m0 = make_values(n, false, rng), v0 = make_values(n, true, rng);
      Stored p = store(p0, ty.p), g = store(g0, ty.g), m = store(m0, ty.m), v = store(v0, ty.v);
      std::vector<float> master(static_cast<size_t>(n));
      for (size_t i = 0; i < master.size(); ++i) master[i] = from_bits(p0[i]);
      // The reference: each element from the values as stored, through adam_element.
      std::vector<float> rp(master.size()), rm(master.size()), rv(master.size());
      for (size_t i = 0; i < master.size(); ++i) {
        float pi = ty.master ? master[i] : p.get(i), mi = m.get(i), vi = v.get(i);
        subnormal_moments += std::fpclassify(mi) == FP_SUBNORMAL;
        adam_element(pi, g.get(i), mi, vi, sc.s);
        rp[i] = pi, rm[i] = mi, rv[i] = vi;
      }
      const DirectChunk c{p.data(), ty.p,     g.data(),
                          ty.g,     m.data(), ty.m,
                          v.data(), ty.v,     ty.master ? master.data() : nullptr};
      // The process's path (AVX-512 where the processor has it; kernels.adam_avx2 runs AVX2).
      if (ty.p == DType::f32 && ty.g == DType::f32 && !ty.master)
        adam_update(static_cast<float*>(p.data()), static_cast<const float*>(g.data()),
                    static_cast<float*>(m.data()), static_cast<float*>(v.data()), n, sc.s);
      else
        ASSERT_TRUE(adam_update_direct(c, n, sc.s));
      int64_t wrong = 0;
      for (size_t i = 0; i < master.size() && wrong < 5; ++i) {
        const bool ok = canonical(p.get(i)) == stored_bits(rp[i], ty.p) &&
                        canonical(m.get(i)) == stored_bits(rm[i], ty.m) &&
                        canonical(v.get(i)) == stored_bits(rv[i], ty.v) &&
                        (!ty.master || canonical(master[i]) == canonical(rp[i]));
        if (!ok) {
          ++wrong;
          ADD_FAILURE() << "element " << i << ": g " << g.get(i) << " p " << from_bits(p0[i])
                        << " m " << from_bits(m0[i]) << " v " << from_bits(v0[i]) << " -> p "
                        << p.get(i) << " (want " << rp[i] << ") m " << m.get(i) << " (want "
                        << rm[i] << ") v " << v.get(i) << " (want " << rv[i] << ")";
        }
      }
    }
  }
  // The inputs reach the exact lanes: many moments start subnormal.
  EXPECT_GT(subnormal_moments, 10000);
}

// SGD's elements near the subnormal range take FP64 values rounded to FP32 after each operation
// (ExactFloat): the same bits as the FP32 formula, for every kind of value, with momentum or
// without, on the step that creates the buffer, with Nesterov, dampening, L2, unscaling and
// clipping. (Fails when ExactFloat skips a rounding.)
TEST(SgdElements, NearTheSubnormalRangeEqualTheFp32Formula) {
  std::mt19937 rng(7);
  const int64_t n = 8 * 700 + 3;
  struct Case {
    SgdScalars s;
    const char* name;
  };
  // lr, momentum, 1 - dampening, wd, use momentum, first, nesterov, unscale, clip
  const Case cases[] = {
      {{0.1f, 0.9f, 1.0f, 5e-4f, true, false, false, 1.0f / 65536, 1.0f}, "momentum, L2, unscaled"},
      {{0.05f, 0.9f, 1.0f, 0.0f, true, false, true, 1.0f, 0.37f}, "Nesterov, clipped"},
      {{0.1f, 0.8f, 0.7f, 1e-3f, true, false, false, 1.0f, 1.0f}, "dampening"},
      {{0.1f, 0.9f, 1.0f, 0.0f, true, true, false, 1.0f, 1.0f}, "the buffer's first step"},
      {{1e-3f, 0.0f, 1.0f, 1e-2f, false, false, false, 2.0f, 1.0f}, "no momentum"},
  };
  int64_t small = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<uint32_t> p0 = make_values(n, false, rng), g0 = make_values(n, false, rng),
                                b0 = make_values(n, false, rng);
    std::vector<float> p(static_cast<size_t>(n)), g(p.size()), b(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] = from_bits(p0[i]), g[i] = from_bits(g0[i]), b[i] = from_bits(b0[i]);
      small += std::fpclassify(b[i]) == FP_SUBNORMAL;
    }
    std::vector<float> rp = p, rb = b;
    for (size_t i = 0; i < p.size(); ++i) sgd_formula<float>(rp[i], g[i], rb[i], c.s);
    sgd_update(p.data(), g.data(), c.s.use_momentum ? b.data() : nullptr, n, c.s);
    int64_t wrong = 0;
    for (size_t i = 0; i < p.size() && wrong < 5; ++i) {
      const bool buffer_ok = !c.s.use_momentum || canonical(b[i]) == canonical(rb[i]);
      if (canonical(p[i]) != canonical(rp[i]) || !buffer_ok) {
        ++wrong;
        ADD_FAILURE() << "element " << i << ": g " << g[i] << " p " << from_bits(p0[i]) << " buf "
                      << from_bits(b0[i]) << " -> p " << p[i] << " (want " << rp[i] << ") buf "
                      << b[i] << " (want " << rb[i] << ")";
      }
    }
  }
  EXPECT_GT(small, 3000);  // the inputs reach the exact path
}

}  // namespace
}  // namespace mantissa::optim::detail
