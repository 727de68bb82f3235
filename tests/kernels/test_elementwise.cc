// ReLU's forward and backward over 16-bit rows (widened and rounded in registers) against the
// staged definition: every operand converted to FP32 by convert(), the formula in a scalar loop,
// the result converted back. Every FP16 and BF16 bit pattern (NaNs with payloads, infinities,
// signed zeros, subnormals), rows of odd lengths (each tail length), and every mix of f32, f16 and
// bf16 operands.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "mantissa/core/convert.h"
#include "mantissa/core/cpu_features.h"
#include "mantissa/core/tensor.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/norm.h"
#include "mantissa/kernels/vector_kernels.h"
#include "support/tensors.h"

namespace mantissa::kernels {
namespace {

// Every 16-bit pattern, then 11 more (a 65,547-value tensor in rows of 13: every row's tail).
std::vector<uint16_t> every_pattern() {
  std::vector<uint16_t> v(65536 + 11);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(i * 40503u);
  return v;
}

Tensor tensor_of(const void* bits, DType t, int64_t n) {
  Tensor x = Tensor::empty({n / 13, 13}, t);
  std::memcpy(x.data_ptr(), bits, static_cast<size_t>(n) * dtype_size(t));
  return x;
}

std::vector<float> as_f32(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  convert(t.data_ptr(), t.dtype(), v.data(), DType::f32, v.size());
  return v;
}

// The first index where two rows of 16-bit values (storage t) differ, NaNs' payloads aside (which
// of two NaNs an operation passes on depends on the order of its operands, which a compiler may
// swap), or -1; the rows have one length.
int64_t first_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, DType t) {
  const uint16_t exp_mask = t == DType::f16 ? 0x7c00 : 0x7f80;
  const auto is_nan = [&](uint16_t v) {
    return (v & exp_mask) == exp_mask && (v & static_cast<uint16_t>(~exp_mask & 0x7fff)) != 0;
  };
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && !(is_nan(a[i]) && is_nan(b[i]))) return static_cast<int64_t>(i);
  return -1;
}

std::vector<char> bytes_of(const Tensor& t) {
  const char* p = static_cast<const char*>(t.data_ptr());
  return {p, p + t.nbytes()};
}

std::vector<char> stored_as(const std::vector<float>& v, DType t) {
  std::vector<char> out(v.size() * dtype_size(t));
  convert(v.data(), DType::f32, out.data(), t, v.size());
  return out;
}

// The normalization rows and sums (vector_kernels.h) against their definitions, bit for bit, on
// this process's path (kernels.gemm_avx2 runs them on AVX2 too): lengths with every tail of the 8-
// and 16-wide loops, values spread over many binades with infinities, NaNs, subnormals and zeros
// among them, whose sums meet NaNs and infinities too.
TEST(NormRows, MatchTheirDefinitionsBitForBit) {
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-30, 30);
  auto values = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = std::ldexp(u(gen), e(gen));
    const float special[] = {INFINITY, -INFINITY, NAN, 1e-40f, -0.0f, 0.0f, 3e38f};
    for (size_t i = 0; i < v.size(); i += 11) v[i] = special[(i / 11) % 7];
    return v;
  };
  // Every value's bits, a NaN's payload aside (which of two NaNs an addition passes on depends on
  // the order of its operands, which a compiler may swap).
  auto same = [](const float* a, const float* b, size_t n) {
    for (size_t i = 0; i < n; ++i)
      if (!(std::isnan(a[i]) && std::isnan(b[i])) &&
          std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]))
        return false;
    return true;
  };
  const float mu = 0.3125f, rs = 1.7f, scale = -0.77f, shift = 0.011f, slope = 2.5f;
  for (const int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1027}) {
    const std::vector<float> d = values(n), x = values(n);
    std::vector<float> out(static_cast<size_t>(n)), want(out.size());
    detail::norm_dx_row(d.data(), x.data(), n, mu, rs, scale, shift, slope, out.data());
    for (size_t i = 0; i < want.size(); ++i) {
      const float g = d[i] * scale - shift, xhat = (x[i] - mu) * rs;
      want[i] = g - xhat * slope;
    }
    EXPECT_TRUE(same(out.data(), want.data(), out.size())) << "dx, " << n << " values";
    detail::norm_affine_row(x.data(), n, scale, shift, out.data());
    for (size_t i = 0; i < want.size(); ++i) {
      const float y = x[i] * scale;
      want[i] = y + shift;
    }
    EXPECT_TRUE(same(out.data(), want.data(), out.size())) << "affine, " << n << " values";
    const int64_t n8 = n / 8 * 8;
    float a[8], b[8], wa[8], wb[8];
    for (int l = 0; l < 8; ++l) a[l] = wa[l] = 0.5f * static_cast<float>(l), b[l] = wb[l] = -1.0f;
    detail::norm_sums8(d.data(), x.data(), n8, mu, rs, a, b);
    for (int64_t i = 0; i < n8; ++i) {
      const float xhat = (x[static_cast<size_t>(i)] - mu) * rs,
                  p = d[static_cast<size_t>(i)] * xhat;
      wa[i % 8] += d[static_cast<size_t>(i)];
      wb[i % 8] += p;
    }
    EXPECT_TRUE(same(a, wa, 8) && same(b, wb, 8)) << "sums, " << n8 << " values";
    for (const bool squares : {false, true}) {
      for (int l = 0; l < 8; ++l) a[l] = wa[l] = 0.25f * static_cast<float>(l);
      detail::norm_stat_sums8(x.data(), n8, mu, squares, a);
      for (int64_t i = 0; i < n8; ++i) {
        const float v = x[static_cast<size_t>(i)], dv = v - mu, sq = dv * dv;
        wa[i % 8] += squares ? sq : v;
      }
      EXPECT_TRUE(same(a, wa, 8)) << (squares ? "squares, " : "sums, ") << n8 << " values";
    }
  }
}

// The 16-bit normalization rows: the statistics' sums of a row stored in f16 or bf16 (widened
// values written out as they are summed) and the affine stored in f16 or bf16 from the registers,
// against the FP32 definitions on the widened values, bit for bit (a NaN's payload aside, see
// first_difference): every 16-bit pattern (NaNs, infinities, subnormals) in rows of every tail
// length.
TEST(NormRows, SixteenBitRowsMatchTheirDefinitionsBitForBit) {
  const std::vector<uint16_t> bits = every_pattern();
  const auto same_bits = [](float a, float b) {
    return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
  };
  const float scale = -0.77f, shift = 0.011f;
  for (const DType t : {DType::f16, DType::bf16}) {
    for (const int64_t n :
         {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{17}, int64_t{31},
          int64_t{33}, int64_t{1027}, static_cast<int64_t>(bits.size())}) {
      std::vector<float> x(static_cast<size_t>(n)), got(x.size());
      convert(bits.data(), t, x.data(), DType::f32, x.size());
      const int64_t n8 = n / 8 * 8;
      float acc[8], want[8];
      for (int l = 0; l < 8; ++l) acc[l] = want[l] = 0.25f * static_cast<float>(l);
      detail::norm_sum_widen8(bits.data(), t, n8, got.data(), acc);
      for (int64_t i = 0; i < n8; ++i) want[i % 8] += x[static_cast<size_t>(i)];
      for (int l = 0; l < 8; ++l) {
        if (!std::isnan(acc[l]) || !std::isnan(want[l])) {
          EXPECT_EQ(std::bit_cast<uint32_t>(acc[l]), std::bit_cast<uint32_t>(want[l]))
              << dtype_name(t) << ", " << n8 << " values, lane " << l;
        }
      }
      EXPECT_TRUE(std::equal(got.begin(), got.begin() + n8, x.begin(), same_bits))
          << dtype_name(t) << ": the widened values";
      std::vector<uint16_t> out(static_cast<size_t>(n)), expect(out.size());
      detail::norm_affine_row_to(x.data(), n, scale, shift, out.data(), t);
      std::vector<float> y(x.size());
      for (size_t i = 0; i < y.size(); ++i) {
        const float p = x[i] * scale;
        y[i] = p + shift;
      }
      convert(y.data(), DType::f32, expect.data(), t, y.size());
      int64_t at = first_difference(out, expect, t);
      EXPECT_EQ(at, -1) << dtype_name(t) << " affine, " << n
                        << " values: x = " << (at < 0 ? 0.0f : x[static_cast<size_t>(at)]);

      // The backward's sums with d in each storage (FP32 d: 16-mixed's FP32 gradient against a
      // 16-bit x) and its dx stored in t.
      const float mu = 0.3125f, rs = 1.7f, slope = 2.5f;
      std::vector<float> d(x.size());
      for (size_t i = 0; i < d.size(); ++i) d[i] = x[(i * 7 + 3) % d.size()];
      std::vector<uint16_t> dbits(d.size());
      convert(d.data(), DType::f32, dbits.data(), t, d.size());
      convert(dbits.data(), t, d.data(), DType::f32, d.size());  // d holds t's values
      for (const DType dt : {DType::f32, t}) {
        const void* dp = dt == DType::f32 ? static_cast<const void*>(d.data()) : dbits.data();
        std::vector<float> dw(d.size(), -1.0f), xw(x.size(), -1.0f);
        float a[8], b[8], wa[8], wb[8];
        for (int l = 0; l < 8; ++l) a[l] = wa[l] = 0.5f * static_cast<float>(l), b[l] = wb[l] = -1;
        detail::norm_sums8_widen(dp, dt, bits.data(), t, n8, mu, rs,
                                 dt == DType::f32 ? nullptr : dw.data(), xw.data(), a, b);
        for (int64_t i = 0; i < n8; ++i) {
          const size_t k = static_cast<size_t>(i);
          const float xhat = (x[k] - mu) * rs, p = d[k] * xhat;
          wa[i % 8] += d[k];
          wb[i % 8] += p;
        }
        for (int l = 0; l < 8; ++l) {
          if (!std::isnan(a[l]) || !std::isnan(wa[l])) {
            EXPECT_EQ(std::bit_cast<uint32_t>(a[l]), std::bit_cast<uint32_t>(wa[l])) << l;
          }
          if (!std::isnan(b[l]) || !std::isnan(wb[l])) {
            EXPECT_EQ(std::bit_cast<uint32_t>(b[l]), std::bit_cast<uint32_t>(wb[l])) << l;
          }
        }
        EXPECT_TRUE(std::equal(xw.begin(), xw.begin() + n8, x.begin(), same_bits));
        if (dt != DType::f32) {
          EXPECT_TRUE(std::equal(dw.begin(), dw.begin() + n8, d.begin(), same_bits));
        }
      }
      detail::norm_dx_row_to(d.data(), x.data(), n, mu, rs, scale, shift, slope, out.data(), t);
      for (size_t i = 0; i < y.size(); ++i) {
        const float g = d[i] * scale - shift, xhat = (x[i] - mu) * rs;
        y[i] = g - xhat * slope;
      }
      convert(y.data(), DType::f32, expect.data(), t, y.size());
      at = first_difference(out, expect, t);
      const size_t k = at < 0 ? 0 : static_cast<size_t>(at);
      EXPECT_EQ(at, -1) << dtype_name(t) << " dx, " << n << " values: d = " << d[k]
                        << ", x = " << x[k] << ", got bits " << out[k] << ", want " << expect[k]
                        << " (processor: " << cpu_features_string() << ")";
    }
  }
}

// Group, layer and batch norm of a 16-bit tensor (and group norm's backward) give the bits of the
// same norm of its FP32 widening with the output rounded into the 16-bit type (the kernels widen
// rows as they sum them and round outputs from the registers): rows longer than a 4096-value chunk
// with a tail, and shorter ones.
TEST(NormRows, SixteenBitTensorsGiveTheBitsOfTheirFp32Widening) {
  std::mt19937 gen(9);
  std::normal_distribution<float> normal(0.5f, 2.0f);
  auto filled = [&](const Shape& s) { return testing::tensor_of(s, [&] { return normal(gen); }); };
  const Tensor w = filled({6}), b = filled({6});
  for (const DType t : {DType::f16, DType::bf16}) {
    for (const Shape& shape : {Shape{3, 6, 37, 41}, Shape{2, 6, 5, 3}}) {
      const Tensor x = filled(shape).to(t), x32 = x.to(DType::f32);
      auto check = [&](const std::tuple<Tensor, Tensor, Tensor>& got,
                       const std::tuple<Tensor, Tensor, Tensor>& want, const char* what) {
        EXPECT_EQ(std::get<0>(got).dtype(), t);
        EXPECT_EQ(std::get<0>(got).to_float_vector(), std::get<0>(want).to(t).to_float_vector())
            << what << " " << dtype_name(t);
        EXPECT_EQ(std::get<1>(got).to_float_vector(), std::get<1>(want).to_float_vector()) << what;
        EXPECT_EQ(std::get<2>(got).to_float_vector(), std::get<2>(want).to_float_vector()) << what;
      };
      check(group_norm(x, 2, w, b, 1e-5, t), group_norm(x32, 2, w, b, 1e-5, DType::f32),
            "group_norm");
      // The backward: dy in t (the 16-bit modes) and in FP32 (16-mixed's), dx in t.
      const auto [y32, mean, rstd] = group_norm(x32, 2, w, b, 1e-5, DType::f32);
      const Tensor dy = filled(shape).to(t);
      for (const Tensor& g : {dy, dy.to(DType::f32)}) {
        const auto got = group_norm_backward(g, x, 2, w, mean, rstd, t);
        const auto want = group_norm_backward(dy.to(DType::f32), x32, 2, w, mean, rstd, DType::f32);
        EXPECT_EQ(std::get<0>(got).to_float_vector(), std::get<0>(want).to(t).to_float_vector())
            << "group_norm_backward dx, dy " << dtype_name(g.dtype());
        EXPECT_EQ(std::get<1>(got).to_float_vector(), std::get<1>(want).to_float_vector());
        EXPECT_EQ(std::get<2>(got).to_float_vector(), std::get<2>(want).to_float_vector());
      }
      check(layer_norm(x, 3, Tensor(), Tensor(), 1e-5, t),
            layer_norm(x32, 3, Tensor(), Tensor(), 1e-5, DType::f32), "layer_norm");
      Tensor rm = Tensor::zeros({6}, DType::f32), rv = Tensor::zeros({6}, DType::f32);
      Tensor rm32 = rm.clone(), rv32 = rv.clone();
      check(batch_norm(x, w, b, rm, rv, true, 0.1, 1e-5, t),
            batch_norm(x32, w, b, rm32, rv32, true, 0.1, 1e-5, DType::f32), "batch_norm");
    }
  }
}

// Group norm's backward against its arithmetic written out here, bit for bit: per row (a stat
// group) and channel run, eight float lanes of dy and dy * xhat within chunks of 4096 (the last
// values of a chunk into lane 0), each chunk's lanes added in a fixed tree and the chunks in
// FP64; then dx = (dy * scale - shift) - xhat * slope with FP32 coefficients from those sums.
// Channel runs of 1517 values (a tail in every run) and of 4551 (past a chunk).
TEST(NormRows, GroupNormBackwardIsItsArithmeticBitForBit) {
  std::mt19937 gen(13);
  std::normal_distribution<float> normal(0.25f, 1.5f);
  for (const Shape& shape : {Shape{2, 6, 37, 41}, Shape{2, 2, 3, 1517}}) {
    const int64_t C = shape[1], inner_c = shape[2] * shape[3], groups = 2;
    const int64_t N = shape[0], n = N * C * inner_c, per_group = C / groups * inner_c;
    std::vector<float> xv(static_cast<size_t>(n)), dv(xv.size()), wv(static_cast<size_t>(C));
    for (float& v : xv) v = normal(gen);
    for (float& v : dv) v = normal(gen);
    for (float& v : wv) v = normal(gen);
    const Tensor x = Tensor::from_floats(xv, shape), dy = Tensor::from_floats(dv, shape),
                 w = Tensor::from_floats(wv, {C}), b = Tensor::zeros({C}, DType::f32);
    const auto [y, mean, rstd] = group_norm(x, groups, w, b, 1e-5, DType::f32);
    const auto [dx, dw, db] = group_norm_backward(dy, x, groups, w, mean, rstd, DType::f32);
    const std::vector<float> mu = mean.to_float_vector(), rs = rstd.to_float_vector();
    const std::vector<float> got = dx.to_float_vector();
    for (int64_t r = 0; r < N * groups; ++r) {
      const float m = mu[static_cast<size_t>(r)], s = rs[static_cast<size_t>(r)];
      double sum_g = 0, sum_gx = 0;
      for (int64_t c0 = 0; c0 < per_group; c0 += inner_c) {  // the row's channel runs
        const int64_t ch = (r % groups) * (C / groups) + c0 / inner_c;
        const float* d = dv.data() + r * per_group + c0;
        const float* xr = xv.data() + r * per_group + c0;
        double sd = 0, sdx = 0;
        for (int64_t k = 0; k < inner_c; k += 4096) {
          const int64_t len = std::min<int64_t>(4096, inner_c - k);
          float a[8] = {}, bb[8] = {};
          for (int64_t i = 0; i < len; ++i) {
            const int l = i < len / 8 * 8 ? static_cast<int>(i % 8) : 0;
            const float xhat = (xr[k + i] - m) * s, p = d[k + i] * xhat;
            a[l] += d[k + i];
            bb[l] += p;
          }
          sd += ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
          sdx += ((bb[0] + bb[1]) + (bb[2] + bb[3])) + ((bb[4] + bb[5]) + (bb[6] + bb[7]));
        }
        sum_g += static_cast<double>(wv[static_cast<size_t>(ch)]) * sd;
        sum_gx += static_cast<double>(wv[static_cast<size_t>(ch)]) * sdx;
      }
      const double count = static_cast<double>(per_group);
      for (int64_t e = 0; e < per_group; ++e) {
        const int64_t ch = (r % groups) * (C / groups) + e / inner_c;
        const float scale =
            static_cast<float>(s * static_cast<double>(wv[static_cast<size_t>(ch)]));
        const float shift = static_cast<float>(s * (sum_g / count));
        const float slope = static_cast<float>(s * (sum_gx / count));
        const size_t at = static_cast<size_t>(r * per_group + e);
        const float g = dv[at] * scale - shift, xhat = (xv[at] - m) * s, q = xhat * slope;
        const float want = g - q;
        ASSERT_EQ(std::bit_cast<uint32_t>(got[at]), std::bit_cast<uint32_t>(want))
            << "row " << r << " element " << e;
      }
    }
  }
}

TEST(Relu, SixteenBitRowsMatchTheStagedDefinition) {
  const std::vector<uint16_t> patterns = every_pattern();
  const int64_t n = static_cast<int64_t>(patterns.size()) / 13 * 13;
  std::mt19937 gen(3);
  std::vector<uint16_t> gbits(patterns.size());
  for (uint16_t& b : gbits) b = static_cast<uint16_t>(gen());
  const DType types[] = {DType::f32, DType::f16, DType::bf16};
  int checked = 0;
  for (DType tx : {DType::f16, DType::bf16})
    for (DType ty : types) {
      const Tensor x = tensor_of(patterns.data(), tx, n);
      const std::vector<float> xf = as_f32(x);
      std::vector<float> yf(xf.size());
      for (size_t i = 0; i < xf.size(); ++i) yf[i] = xf[i] > 0.0f || xf[i] != xf[i] ? xf[i] : 0.0f;
      const Tensor y = unary(UnaryOp::kRelu, x, ty, MemoryCategory::activations);
      EXPECT_EQ(bytes_of(y), stored_as(yf, ty)) << dtype_name(tx) << " -> " << dtype_name(ty);
      // Backward: gradients of every type (random bits, NaNs among them) masked by y.
      for (DType tg : {DType::f16, DType::bf16})
        for (DType td : types) {
          const Tensor g = tensor_of(gbits.data(), tg, n);
          const std::vector<float> gf = as_f32(g);
          const std::vector<float> ys = as_f32(y);
          std::vector<float> df(gf.size());
          for (size_t i = 0; i < gf.size(); ++i)
            df[i] =
                std::bit_cast<float>(std::bit_cast<uint32_t>(gf[i]) & (ys[i] <= 0.0f ? 0u : ~0u));
          const Tensor dx =
              unary_backward(UnaryOp::kRelu, g, Tensor(), y, td, MemoryCategory::gradients);
          EXPECT_EQ(bytes_of(dx), stored_as(df, td))
              << "y " << dtype_name(ty) << ", g " << dtype_name(tg) << " -> " << dtype_name(td);
          ++checked;
        }
    }
  EXPECT_EQ(checked, 36);
  // An FP32 input with a 16-bit output rounds once.
  std::vector<float> big(130);
  for (size_t i = 0; i < big.size(); ++i) big[i] = (static_cast<float>(i) - 60.0f) * 1.0001f;
  big[7] = 70000.0f;
  big[8] = std::bit_cast<float>(0x7fc00001u);
  const Tensor xf = Tensor::from_floats(big, {10, 13}, DType::f32);
  std::vector<float> want(big.size());
  for (size_t i = 0; i < big.size(); ++i) want[i] = big[i] > 0.0f || big[i] != big[i] ? big[i] : 0;
  EXPECT_EQ(bytes_of(unary(UnaryOp::kRelu, xf, DType::f16, MemoryCategory::activations)),
            stored_as(want, DType::f16));
}

// FP32 through FP32 (the vector rows too): random bit patterns, every sign, NaN payloads,
// subnormals and -0 among them, forward and backward against the definitions.
TEST(Relu, Fp32RowsMatchTheDefinition) {
  std::mt19937 gen(9);
  const int64_t n = 13 * 777;
  std::vector<float> x(static_cast<size_t>(n)), g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = std::bit_cast<float>(static_cast<uint32_t>(gen()));
    g[i] = std::bit_cast<float>(static_cast<uint32_t>(gen()));
  }
  x[3] = -0.0f, x[4] = 0.0f, x[5] = std::bit_cast<float>(0x7fc00123u), x[6] = 1e-42f;
  const Tensor xt = Tensor::from_floats(x, {n / 13, 13}, DType::f32);
  const Tensor y = unary(UnaryOp::kRelu, xt, DType::f32, MemoryCategory::activations);
  std::vector<float> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = x[i] > 0.0f || x[i] != x[i] ? x[i] : 0.0f;
  EXPECT_EQ(bytes_of(y), stored_as(want, DType::f32)) << "forward";
  const std::vector<float> ys = as_f32(y);
  for (size_t i = 0; i < x.size(); ++i)
    want[i] = std::bit_cast<float>(std::bit_cast<uint32_t>(g[i]) & (ys[i] <= 0.0f ? 0u : ~0u));
  const Tensor dx = unary_backward(UnaryOp::kRelu, Tensor::from_floats(g, {n / 13, 13}), Tensor(),
                                   y, DType::f32, MemoryCategory::gradients);
  EXPECT_EQ(bytes_of(dx), stored_as(want, DType::f32)) << "backward";
}

}  // namespace
}  // namespace mantissa::kernels
