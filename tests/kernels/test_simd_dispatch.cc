// One SIMD dispatch (core/cpu_features.h): every kernel family with a SIMD version asks
// simd_path() for its path, and the path follows MANTISSA_SIMD, capped at the family's widest.
// CTest runs this suite again with MANTISSA_SIMD=scalar (kernels.simd_scalar), where every family
// must report the scalar path, and with MANTISSA_SIMD=avx2 (kernels.simd_avx2); the families' own
// suites run on those paths too (kernels.conv_scalar, kernels.gemm_scalar, kernels.gemm_avx2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "mantissa/kernels/gemm.h"
#include "mantissa/kernels/pool.h"
#include "mantissa/kernels/quantize.h"
#include "mantissa/kernels/vector_kernels.h"
#include "mantissa/mantissa.h"
#include "mantissa/optim/optim_kernels.h"

namespace mantissa {
namespace {

// One call into every family, so that each has asked for its path whatever ran before.
void call_every_family() {
  // convert
  const std::vector<float> x(64, 1.5f);
  std::vector<uint16_t> h(x.size());
  convert(x.data(), DType::f32, h.data(), DType::f16, x.size());
  // gemm: 8 x 16 x 8
  std::vector<float> a(64, 0.5f), b(128, 0.25f), c(128, 0.0f);
  kernels::gemm(8, 16, 8, 1.0f, {a.data(), DType::f32, 8, 1}, {b.data(), DType::f32, 16, 1}, 0.0f,
                {c.data(), DType::f32, 16, 1});
  EXPECT_EQ(c[0], 1.0f);
  // vector rows
  std::vector<float> y(16, 1.0f);
  kernels::detail::axpy_f32(y.data(), x.data(), 1, 2.0f, 16);
  EXPECT_EQ(y[0], 4.0f);
  // pooling: a 2x2 stride-2 max pool over a row of 16 outputs
  const Tensor img = Tensor::full({1, 1, 2, 32}, 3.0, DType::f32);
  EXPECT_EQ(kernels::max_pool2d(img, kernels::Pool2dParams{}, DType::f32).first.size(3), 16);
  // optimizer: one Adam element update
  optim::detail::AdamScalars s{0.9f, 0.999f, 0.1f, 0.001f, 1e-3f, 1.0f, 1e-8f, 0.0f, 1.0f, false};
  float p = 1.0f, g = 0.5f, m = 0.0f, v = 0.0f;
  optim::detail::adam_update(&p, &g, &m, &v, 1, s);
  EXPECT_LT(p, 1.0f);
  // the FMA probe
  EXPECT_EQ(fma_chains(1, 1.0f, 0.0f, 1.0f, 0.0f), static_cast<float>(kFmaProbeLanes));
  // quantize: 64 values to E4M3 with a scale
  std::vector<uint8_t> q(x.size());
  EXPECT_EQ(kernels::quantize_fp8(x.data(), DType::f32, q.data(), DType::e4m3, x.size(), 2.0f).amax,
            1.5f);
  EXPECT_EQ(q[0], 0x44);  // 3.0 = 1.1b x 2^1: exponent 1 + 7, mantissa 100
}

TEST(SimdDispatch, EveryFamilyAsksForThePathOfTheProcess) {
#if !MANTISSA_HAVE_X86_SIMD
  GTEST_SKIP() << "this build has no SIMD path: every family runs its scalar loops";
#endif
  call_every_family();
  const char* env = std::getenv("MANTISSA_SIMD");
  const bool forced_scalar = env && std::string(env) == "scalar";
  if (forced_scalar) {
    EXPECT_EQ(active_simd_path(), SimdPath::kScalar);
  }
  for (int i = 0; i < kSimdFamilyCount; ++i) {
    const SimdFamily f = static_cast<SimdFamily>(i);
    // Checked before simd_path(f) is called here, which would record the test's own question.
    EXPECT_TRUE(simd_family_dispatched(f)) << simd_family_name(f) << " never asked simd_path()";
    EXPECT_EQ(simd_path_name(simd_path(f)),
              simd_path_name(forced_scalar ? SimdPath::kScalar
                                           : std::min(active_simd_path(), simd_family_widest(f))))
        << simd_family_name(f);
  }
}

// The AVX-512 kernels round to BF16 with the processor's instruction exactly where it has one,
// the process runs AVX-512, and MANTISSA_BF16_INSN=0 (core.integer_bf16, kernels.integer_bf16)
// does not turn it off.
TEST(SimdDispatch, Bf16InstructionsFollowTheProcessorAndTheEnvironment) {
  const char* env = std::getenv("MANTISSA_BF16_INSN");
  const bool off = env && std::string(env) == "0";
  EXPECT_EQ(kBf16Instructions,
            cpu_features().avx512bf16 && active_simd_path() == SimdPath::kAvx512 && !off);
  if (off) {
    EXPECT_FALSE(kBf16Instructions);
  }
}

// The family list is the enum: names are distinct and none is left unnamed.
TEST(SimdDispatch, FamiliesAreNamed) {
  std::vector<std::string> names;
  for (int i = 0; i < kSimdFamilyCount; ++i) {
    const std::string n(simd_family_name(static_cast<SimdFamily>(i)));
    EXPECT_NE(n, "?");
    for (const std::string& seen : names) EXPECT_NE(n, seen);
    names.push_back(n);
  }
}

}  // namespace
}  // namespace mantissa
