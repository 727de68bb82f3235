// The fast GEMM against the scalar reference, bit for bit (both follow the arithmetic in gemm.h),
// for every storage combination, layout, edge size and thread count; and against exact results.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "mantissa/kernels/gemm.h"
#include "mantissa/mantissa.h"

namespace mantissa::kernels {
namespace {

// A matrix of random values stored in `dtype`, row-major or transposed (column-major).
struct Stored {
  std::vector<unsigned char> bytes;
  DType dtype;
  int64_t rows, cols;
  bool transposed;
  ConstMatrix view() const {
    return {bytes.data(), dtype, transposed ? 1 : cols, transposed ? rows : 1};
  }
  Matrix mut() { return {bytes.data(), dtype, transposed ? 1 : cols, transposed ? rows : 1}; }
};

Stored random_matrix(int64_t rows, int64_t cols, DType dtype, bool transposed, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = dist(gen);
  Stored s{std::vector<unsigned char>(v.size() * dtype_size(dtype)), dtype, rows, cols, transposed};
  convert(v.data(), DType::f32, s.bytes.data(), dtype, v.size());
  return s;
}

struct Case {
  int64_t M, N, K;
};

void expect_same(int64_t M, int64_t N, int64_t K, DType ta, DType tb, DType tc, bool trans_a,
                 bool trans_b, bool trans_c, float alpha, float beta, Partials p, int threads) {
  const Stored A = random_matrix(M, K, ta, trans_a, 1);
  const Stored B = random_matrix(K, N, tb, trans_b, 2);
  Stored C1 = random_matrix(M, N, tc, trans_c, 3);
  Stored C2 = C1;
  gemm_reference(M, N, K, alpha, A.view(), B.view(), beta, C1.mut(), p);
  GemmOptions opt;
  opt.partials = p;
  opt.threads = threads;
  gemm(M, N, K, alpha, A.view(), B.view(), beta, C2.mut(), opt);
  if (C1.bytes != C2.bytes) {
    std::vector<float> r(static_cast<size_t>(M * N)), f(r.size());
    convert(C1.bytes.data(), tc, r.data(), DType::f32, r.size());
    convert(C2.bytes.data(), tc, f.data(), DType::f32, f.size());
    size_t i = 0;
    while (i < r.size() && std::memcmp(&r[i], &f[i], 4) == 0) ++i;
    FAIL() << "M=" << M << " N=" << N << " K=" << K << " A " << dtype_name(ta)
           << (trans_a ? "^T" : "") << " B " << dtype_name(tb) << (trans_b ? "^T" : "") << " C "
           << dtype_name(tc) << (trans_c ? "^T" : "") << " alpha " << alpha << " beta " << beta
           << " partials " << (p == Partials::kF16 ? "f16" : "f32") << " threads " << threads
           << ": first difference at storage element " << i << ": reference " << r[i] << ", fast "
           << f[i];
  }
}

TEST(Gemm, EveryStorageCombinationMatchesTheReference) {
  const DType types[] = {DType::f32, DType::f16, DType::bf16};
  for (DType ta : types)
    for (DType tb : types)
      for (DType tc : types)
        for (Partials p : {Partials::kF32, Partials::kF16})
          expect_same(13, 35, 300, ta, tb, tc, false, false, false, 1.0f, 0.0f, p, 2);
}

TEST(Gemm, LayoutsEdgesAndScalingMatchTheReference) {
  const Case cases[] = {{1, 1, 1},      {6, 16, 16},   {7, 17, 5},   {5, 3, 0},
                        {12, 100, 513}, {97, 40, 257}, {130, 33, 33}};
  for (const Case& c : cases)
    for (int layout = 0; layout < 8; ++layout)
      for (auto [alpha, beta] :
           {std::pair{1.0f, 0.0f}, std::pair{0.5f, 1.0f}, std::pair{2.0f, -0.75f}})
        expect_same(c.M, c.N, c.K, DType::f32, DType::f16, DType::f32, layout & 1, layout & 2,
                    layout & 4, alpha, beta, Partials::kF32, 2);
}

TEST(Gemm, SixteenBitOutputStagedInBlocks) {
  // M x N large enough that a 16-bit C is staged in several column blocks.
  expect_same(600, 2100, 40, DType::bf16, DType::bf16, DType::bf16, false, true, false, 1.0f, 1.0f,
              Partials::kF32, 2);
  expect_same(600, 2100, 40, DType::f16, DType::f16, DType::f16, false, false, true, 1.0f, 0.5f,
              Partials::kF16, 2);
}

TEST(Gemm, ResultDoesNotDependOnThreads) {
  for (int threads : {1, 2, 3, 8})
    expect_same(150, 260, 300, DType::f32, DType::f32, DType::f32, false, true, false, 1.0f, 0.0f,
                Partials::kF32, threads);
}

TEST(Gemm, ExactOnSmallIntegers) {
  // Products and sums of small integers are exact in FP32 and in FP16 partials (below 2048).
  const int64_t M = 20, N = 30, K = 40;
  std::vector<float> a(M * K), b(K * N), c(M * N, NAN);
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>((i * 7) % 5 - 2);
  for (int64_t i = 0; i < K * N; ++i) b[i] = static_cast<float>((i * 3) % 7 - 3);
  for (Partials p : {Partials::kF32, Partials::kF16}) {
    GemmOptions opt;
    opt.partials = p;
    gemm(M, N, K, 1.0f, {a.data(), DType::f32, K, 1}, {b.data(), DType::f32, N, 1}, 0.0f,
         {c.data(), DType::f32, N, 1}, opt);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double want = 0;
        for (int64_t k = 0; k < K; ++k) want += static_cast<double>(a[m * K + k]) * b[k * N + n];
        ASSERT_EQ(c[m * N + n], want) << m << "," << n;  // beta = 0: the NaN in C never leaks
      }
  }
}

TEST(Gemm, F16PartialsLoseWhatFp16Loses) {
  // C starts at 4096 (FP16 ulp 4); each chunk of 16 products of 0.1 adds 1.6, less than half an
  // ulp, so FP16 partials never move while FP32 partials reach 4096 + 409.6.
  const int64_t K = 4096;
  std::vector<float> a(K, 0.1f), b(K, 1.0f);
  float c = 4096.0f;
  gemm(1, 1, K, 1.0f, {a.data(), DType::f32, K, 1}, {b.data(), DType::f32, 1, 1}, 1.0f,
       {&c, DType::f32, 1, 1});
  EXPECT_NEAR(c, 4505.6f, 1.0f);  // FP32 rounds too (ulp 2^-11 at 4096), 4096 times
  c = 4096.0f;
  GemmOptions opt;
  opt.partials = Partials::kF16;
  gemm(1, 1, K, 1.0f, {a.data(), DType::f32, K, 1}, {b.data(), DType::f32, 1, 1}, 1.0f,
       {&c, DType::f32, 1, 1}, opt);
  EXPECT_EQ(c, 4096.0f);
  // The same chunk with 2.0 per product (32 per chunk) is representable and is kept.
  std::fill(a.begin(), a.end(), 2.0f);
  c = 0.0f;
  gemm(1, 1, K, 1.0f, {a.data(), DType::f32, K, 1}, {b.data(), DType::f32, 1, 1}, 0.0f,
       {&c, DType::f32, 1, 1}, opt);
  EXPECT_EQ(c, 8192.0f);
}

TEST(Gemm, RejectsUnsupportedDtypes) {
  int32_t x = 0;
  float y = 0;
  EXPECT_THROW(gemm(1, 1, 1, 1.0f, {&x, DType::i32, 1, 1}, {&y, DType::f32, 1, 1}, 0.0f,
                    {&y, DType::f32, 1, 1}),
               Error);
  EXPECT_THROW(gemm(1, 1, 1, 1.0f, {&y, DType::f32, 1, 1}, {&y, DType::f32, 1, 1}, 0.0f,
                    {&x, DType::i32, 1, 1}),
               Error);
}

}  // namespace
}  // namespace mantissa::kernels
