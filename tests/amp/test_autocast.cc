// Automatic casting: the policy and its lists, the dtype each category gives, op-list files
// reaching every op, the cast cache, the scope that disables casting, the decision log, gradients
// reaching FP32 weights, per-module precision, stochastic op outputs and the default partials.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>

#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/files.h"

namespace mantissa::ops {
namespace {

using testing::error_of;

Tensor param(const Shape& s, float scale = 0.1f) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>((i * 7919) % 23) - 1.0f;
  Tensor t = Tensor::from_floats(v, s, DType::f32);
  t.set_requires_grad(true);
  return t;
}

TEST(AutocastPolicy, StartsFromTheOpTable) {
  AutocastPolicy p;
  EXPECT_EQ(p.category(OpId::conv2d), AutocastCategory::kLowerPrecision);
  EXPECT_EQ(p.category(OpId::linear), AutocastCategory::kLowerPrecision);
  EXPECT_EQ(p.category(OpId::group_norm), AutocastCategory::kFp32);
  EXPECT_EQ(p.category(OpId::log_softmax), AutocastCategory::kFp32);
  EXPECT_EQ(p.category(OpId::add), AutocastCategory::kPromote);
  EXPECT_EQ(p.category(OpId::max_pool2d), AutocastCategory::kFollowInput);
  p.set(OpId::group_norm, AutocastCategory::kLowerPrecision);
  EXPECT_EQ(p.category(OpId::group_norm), AutocastCategory::kLowerPrecision);
  EXPECT_NE(error_of([&] { p.set(OpId::cast, AutocastCategory::kFp32); }), "");
}

TEST(AutocastPolicy, ListsAreReplacedAndChecked) {
  AutocastPolicy p;
  p.replace_lists(std::vector<std::string>{"linear", "group_norm"}, std::nullopt);
  EXPECT_EQ(p.category(OpId::linear), AutocastCategory::kLowerPrecision);
  EXPECT_EQ(p.category(OpId::group_norm), AutocastCategory::kLowerPrecision);
  EXPECT_EQ(p.category(OpId::conv2d), AutocastCategory::kFollowInput);  // left the list
  EXPECT_EQ(p.category(OpId::softmax), AutocastCategory::kFp32);        // untouched list
  p.replace_lists(std::nullopt, std::vector<std::string>{"conv2d"});
  EXPECT_EQ(p.category(OpId::conv2d), AutocastCategory::kFp32);
  EXPECT_EQ(p.category(OpId::softmax), AutocastCategory::kFollowInput);

  AutocastPolicy q;
  std::string e = error_of([&] {
    q.replace_lists(std::vector<std::string>{"conv2d"}, std::vector<std::string>{"conv2d"});
  });
  EXPECT_NE(e.find("'conv2d' is in both"), std::string::npos) << e;
  e = error_of([&] { q.replace_lists(std::vector<std::string>{"conv3d"}, std::nullopt); });
  EXPECT_NE(e.find("unknown op 'conv3d'"), std::string::npos) << e;
  EXPECT_NE(e.find("group_norm"), std::string::npos) << e;  // lists the names
  e = error_of([&] { q.replace_lists(std::vector<std::string>{"relu", "relu"}, std::nullopt); });
  EXPECT_NE(e.find("twice"), std::string::npos) << e;
  e = error_of([&] { q.replace_lists(std::vector<std::string>{"cast"}, std::nullopt); });
  EXPECT_NE(e.find("never cast"), std::string::npos) << e;
  // A failed replacement changes nothing.
  EXPECT_EQ(q.category(OpId::conv2d), AutocastCategory::kLowerPrecision);
}

TEST(AutocastPolicy, ReadsOpListFiles) {
  testing::TempDir dir;
  const std::string path = dir.file("lower.txt");
  std::ofstream(path) << "# ops in 16 bits\nconv2d\n  linear  # matrix ops\n\nrelu\n";
  EXPECT_EQ(read_op_list(path), (std::vector<std::string>{"conv2d", "linear", "relu"}));
  std::ofstream(path) << "conv2d, linear\n";
  EXPECT_NE(error_of([&] { read_op_list(path); }).find("line 1"), std::string::npos);
  EXPECT_NE(error_of([&] { read_op_list(dir.file("missing.txt")); }).find("missing.txt"),
            std::string::npos);
}

TEST(Autocast, EachCategoryGivesItsType) {
  AutocastPolicy policy;
  const Tensor x = Tensor::from_floats({1, 2, 3, 4, 5, 6}, {2, 3}, DType::f32);
  const Tensor w = param({4, 3});
  const Tensor h = Tensor::from_floats({1, 2, 3, 4, 5, 6}, {2, 3}, DType::f16);
  {
    AutocastScope scope(DType::f16, policy);
    EXPECT_TRUE(autocast_enabled());
    const Tensor y = linear(x, w);
    EXPECT_EQ(y.dtype(), DType::f16);              // lower precision
    EXPECT_EQ(softmax(y, 1).dtype(), DType::f32);  // FP32
    EXPECT_EQ(add(h, x).dtype(), DType::f32);      // promote: widest
    EXPECT_EQ(add(h, h).dtype(), DType::f16);
    EXPECT_EQ(relu(h).dtype(), DType::f16);                               // lower precision
    EXPECT_EQ(mul_scalar(h, 2.0).dtype(), DType::f16);                    // follows its input
    EXPECT_EQ(linear(x, w, Tensor(), {DType::f32}).dtype(), DType::f32);  // explicit type wins
    {
      AutocastDisabled off;
      EXPECT_FALSE(autocast_enabled());
      EXPECT_EQ(linear(x, w).dtype(), DType::f32);
    }
    EXPECT_TRUE(autocast_enabled());
  }
  EXPECT_FALSE(autocast_enabled());
  EXPECT_EQ(linear(x, w).dtype(), DType::f32);
  AutocastScope bf(DType::bf16, policy);
  EXPECT_EQ(linear(x, w).dtype(), DType::bf16);
  EXPECT_NE(error_of([&] { AutocastScope s(DType::f32, policy); }), "");
}

// The op lists reach every op, through files as the command line reads them: cat on the FP32
// list writes FP32; reshape, flatten and transpose follow their input as views by default and copy
// into FP32 on the FP32 list; the losses run in FP32 by default, write the 16-bit type on the
// lower-precision list and follow their input when a replaced FP32 list leaves them out.
// A weight whose values may still be arriving (AutogradMeta::before_read, ZeRO's gather): linear
// calls the hook before anything reads the weight, also before autocast casts it (the cast of a
// weight is cached for the scope: a cast made first would keep the old values).
TEST(Autocast, LinearWaitsForItsWeightBeforeCastingIt) {
  const Tensor x = Tensor::from_floats({1, 2, 3}, {1, 3}, DType::f32);
  const AutocastPolicy policy;  // the scope keeps its address
  for (const bool autocast : {false, true}) {
    Tensor w = param({2, 3});
    w.copy_from(Tensor::zeros({2, 3}, DType::f32));
    int calls = 0;
    w.autograd_meta()->before_read = [&] {
      ++calls;
      w.copy_from(Tensor::from_floats({1, 0, 0, 0, 0, 1}, {2, 3}));  // the values arrive
    };
    std::optional<AutocastScope> scope;
    if (autocast) scope.emplace(DType::f16, policy);
    EXPECT_EQ(linear(x, w).to_float_vector(), (std::vector<float>{1, 3})) << autocast;
    EXPECT_GE(calls, 1);  // the cast copy stands in for the weight and calls it again
  }
}

// conv2d reads an FP32 activation as its 16-bit copy (OpOptions::input_as) instead of casting it:
// the output, the input's gradient (computed in 16 bits and widened, as the cast's backward
// widens it) and the weight's gradient are those of an explicit cast, bit for bit (a Winograd
// layer and a direct one), and no 16-bit copy of the input is held from the forward pass.
TEST(Autocast, Conv2dReadsAnFp32InputAsItsSixteenBitCopy) {
  const AutocastPolicy policy;
  for (const DType lower : {DType::f16, DType::bf16})
    for (const Shape& ws : {Shape{16, 16, 3, 3}, Shape{5, 1, 3, 3}}) {
      const Shape xs{2, ws[1], 8, 8};
      std::vector<std::vector<float>> y, dx, dw;
      std::vector<size_t> held;
      for (const bool explicit_cast : {false, true}) {
        Tensor x0 = param(xs, 0.37f), w = param(ws, 0.05f), b = param({ws[0]});
        Tensor y_out;
        {
          AutocastScope scope(lower, policy);
          const Tensor x = mul_scalar(x0, 1.0);  // an activation: FP32, computed
          const size_t before =
              default_memory_tracker().stats().current_of(MemoryCategory::activations);
          y_out =
              conv2d(explicit_cast ? cast(x, lower) : x, w, b, kernels::Conv2dParams{1, 1, 1, 1});
          held.push_back(default_memory_tracker().stats().current_of(MemoryCategory::activations) -
                         before);
          autograd::backward(sum(y_out));
        }
        y.push_back(y_out.to_float_vector());
        dx.push_back(x0.grad().to_float_vector());
        dw.push_back(w.grad().to_float_vector());
        EXPECT_EQ(y_out.dtype(), lower);
        EXPECT_EQ(x0.grad().dtype(), DType::f32);
      }
      EXPECT_EQ(y[0], y[1]) << dtype_name(lower);
      EXPECT_EQ(dx[0], dx[1]) << dtype_name(lower);
      EXPECT_EQ(dw[0], dw[1]) << dtype_name(lower);
      // The explicit cast holds its 16-bit copy (2 bytes an input value) until the backward pass:
      // the activations held after the forward differ by that.
      EXPECT_EQ(held[1] - held[0], static_cast<size_t>(2 * 8 * 8 * ws[1] * 2)) << dtype_name(lower);
    }
}

// linear reads an FP32 activation as its 16-bit copy (input_as) at a batch of at most 16 rows: it
// makes the copy itself, which its weight gradient keeps as it would keep the cast's, and computes
// the input's gradient in FP32, rounded as the GEMM stores it: output, input gradient (FP32,
// holding the 16-bit gradient's values) and weight gradient are an explicit cast's, bit for bit,
// through the small-batch and the GEMM paths, with input gradients that overflow FP16 (scaled
// outputs), and the forward holds the same memory; a batch of 40 rows (past the small-batch path)
// too.
TEST(Autocast, LinearReadsAnFp32InputAsItsSixteenBitCopy) {
  const AutocastPolicy policy;
  for (const DType lower : {DType::f16, DType::bf16})
    for (const Shape& xs : {Shape{3, 1100}, Shape{40, 24}, Shape{2, 5, 24}})
      for (const double scale : {1.0, 6e4}) {  // 6e4: gradients past FP16's largest value
        const int64_t in = xs.back();
        std::vector<std::vector<float>> y, dx, dw;
        std::vector<size_t> held;
        for (const bool explicit_cast : {false, true}) {
          Tensor x0 = param(xs, 0.37f), w = param({7, in}, scale > 1 ? 1.0f : 0.05f),
                 b = param({7});
          Tensor y_out;
          {
            AutocastScope scope(lower, policy);
            const Tensor x = mul_scalar(x0, 1.0);  // an activation: FP32, computed
            const size_t before =
                default_memory_tracker().stats().current_of(MemoryCategory::activations);
            y_out = linear(explicit_cast ? cast(x, lower) : x, w, b);
            // What linear's input edge leads to: the cast, or the activation itself.
            EXPECT_STREQ(y_out.grad_fn()->inputs()[0].fn->name(),
                         explicit_cast ? "cast" : "mul_scalar");
            held.push_back(
                default_memory_tracker().stats().current_of(MemoryCategory::activations) - before);
            autograd::backward(sum(mul_scalar(y_out, scale)));
          }
          y.push_back(y_out.to_float_vector());
          dx.push_back(x0.grad().to_float_vector());
          dw.push_back(w.grad().to_float_vector());
          EXPECT_EQ(y_out.dtype(), lower);
          EXPECT_EQ(x0.grad().dtype(), DType::f32);
        }
        const std::string at =
            std::string(dtype_name(lower)) + " " + shape_str(xs) + " x" + std::to_string(scale);
        auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
          return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
        };
        EXPECT_TRUE(same_bits(y[0], y[1])) << at;
        EXPECT_TRUE(same_bits(dx[0], dx[1])) << at;
        EXPECT_TRUE(same_bits(dw[0], dw[1])) << at;
        EXPECT_EQ(held[0], held[1]) << at;
        if (scale > 1 && lower == DType::f16) {  // the input gradient overflowed somewhere
          EXPECT_TRUE(std::any_of(dx[0].begin(), dx[0].end(), [](float v) {
            return std::isinf(v);
          })) << at;
        }
      }
}

// weight_as and input_as read an f32 operand as f16 or bf16; any other pairing is refused, naming
// the op, the option and the operand.
TEST(Autocast, ReadAsOptionsRefuseOperandsThatAreNotFp32) {
  const Tensor x16 = Tensor::zeros({2, 8}, DType::f16), w16 = Tensor::zeros({3, 8}, DType::f16);
  const Tensor x32 = Tensor::zeros({2, 8}, DType::f32), w32 = Tensor::zeros({3, 8}, DType::f32);
  OpOptions in_bf16;
  in_bf16.input_as = DType::bf16;
  OpOptions w_bf16;
  w_bf16.weight_as = DType::bf16;
  OpOptions in_f64;
  in_f64.input_as = DType::f64;
  const std::string e1 = error_of([&] { linear(x16, w32, Tensor(), in_bf16); });
  EXPECT_NE(e1.find("linear: input_as bf16 for an f16 input"), std::string::npos) << e1;
  EXPECT_NE(e1.find("input_as reads an f32 input as f16 or bf16"), std::string::npos) << e1;
  const std::string e2 = error_of([&] { linear(x32, w16, Tensor(), w_bf16); });
  EXPECT_NE(e2.find("linear: weight_as bf16 for an f16 weight"), std::string::npos) << e2;
  const std::string e3 = error_of([&] { linear(x32, w32, Tensor(), in_f64); });
  EXPECT_NE(e3.find("linear: input_as f64 for an f32 input"), std::string::npos) << e3;
  const Tensor img16 = Tensor::zeros({1, 2, 5, 5}, DType::f16),
               k32 = Tensor::zeros({3, 2, 3, 3}, DType::f32);
  const std::string e4 =
      error_of([&] { conv2d(img16, k32, Tensor(), kernels::Conv2dParams{}, in_bf16); });
  EXPECT_NE(e4.find("conv2d: input_as bf16 for an f16 input"), std::string::npos) << e4;
  EXPECT_EQ(error_of([&] { linear(x32, w32, Tensor(), in_bf16); }), "");
}

// relu of an FP32 activation under autocast is computed from the FP32 values and rounded once into
// the 16-bit output, without casting the input first: relu commutes with rounding to nearest, so
// the output and the input's gradient (masked by the output, computed in FP32) are an explicit
// cast's, bit for bit, over values of every sign and magnitude, FP16's underflow and overflow
// included. Under stochastic outputs the input is still cast (the FP32 result would otherwise be
// rounded stochastically): the output then holds only FP16-rounded values.
TEST(Autocast, ReluOfAnFp32InputRoundsOnceAsItsCopyWould) {
  const AutocastPolicy policy;
  std::vector<float> v;
  for (int e = -30; e <= 20; ++e)
    for (const float m : {1.0f, 1.2345678f, -1.0009765625f, 1.99951171875f, -0.75f})
      v.push_back(std::ldexp(m, e));
  v.insert(v.end(), {0.0f, -0.0f, 65519.0f, 65520.0f, -70000.0f, 3e-8f, -3e-8f});
  const Shape shape{static_cast<int64_t>(v.size())};
  for (const DType lower : {DType::f16, DType::bf16}) {
    std::vector<std::vector<float>> y, dx;
    for (const bool explicit_cast : {false, true}) {
      Tensor x0 = Tensor::from_floats(v, shape);
      x0.set_requires_grad(true);
      Tensor out;
      {
        AutocastScope scope(lower, policy);
        const Tensor x = mul_scalar(x0, 1.0);
        out = relu(explicit_cast ? cast(x, lower) : x);
      }
      EXPECT_EQ(out.dtype(), lower);
      // Without the explicit cast, relu's input is the FP32 activation itself (no cast node).
      ASSERT_TRUE(out.grad_fn());
      EXPECT_EQ(std::string(out.grad_fn()->inputs()[0].fn->name()),
                explicit_cast ? "cast" : "mul_scalar");
      EXPECT_EQ(out.grad_fn()->inputs()[0].dtype, explicit_cast ? lower : DType::f32);
      // A gradient of 0.5 everywhere, 16-bit as the autocast graph's.
      autograd::backward(out,
                         Tensor::from_floats(std::vector<float>(v.size(), 0.5f), shape, lower));
      y.push_back(out.to_float_vector());
      dx.push_back(x0.grad().to_float_vector());
    }
    EXPECT_EQ(y[0], y[1]) << dtype_name(lower);
    EXPECT_EQ(dx[0], dx[1]) << dtype_name(lower);
  }
  // Stochastic outputs: every value is one of its FP16 neighbours' as the cast makes them, since
  // the cast (round to nearest) comes first and relu of FP16 values is exact.
  const Tensor x = Tensor::from_floats(v, shape);
  const std::vector<float> nearest = relu(x.to(DType::f16)).to_float_vector();
  AutocastScope scope(DType::f16, policy);
  StochasticOutputsScope sr(7, 0);
  EXPECT_EQ(relu(mul_scalar(x, 1.0)).to_float_vector(), nearest);
}

TEST(Autocast, OpListFilesReachEveryOp) {
  const Tensor h = Tensor::from_floats({1, 2, 3, 4, 5, 6}, {2, 3}, DType::f16);
  const Tensor labels = Tensor::from_floats({0, 2}, {2}).to(DType::i64);
  auto layout = [&] {
    return std::vector<Tensor>{reshape(h, {3, 2}), flatten(h, 0), transpose(h, 0, 1)};
  };
  {
    AutocastPolicy defaults;
    AutocastScope scope(DType::bf16, defaults);
    EXPECT_EQ(cat({h, h}, 0).dtype(), DType::f16);
    for (const Tensor& y : layout()) {
      EXPECT_EQ(y.dtype(), DType::f16);
      EXPECT_EQ(y.data_ptr(), h.data_ptr());  // a view
    }
    EXPECT_EQ(nll_loss(h, labels).dtype(), DType::f32);
    EXPECT_EQ(cross_entropy(h, labels).dtype(), DType::f32);
  }
  testing::TempDir dir;
  const std::string fp32 = dir.file("fp32.txt"), lower = dir.file("lower.txt");
  std::ofstream(fp32) << "cat\nreshape\nflatten\ntranspose\nnll_loss\n";
  std::ofstream(lower) << "linear\ncross_entropy\n";
  AutocastPolicy policy;
  policy.replace_lists(read_op_list(lower), read_op_list(fp32));
  const float ce_bf16 = static_cast<float>(cast(cross_entropy(h, labels), DType::bf16).item());
  {
    AutocastScope scope(DType::bf16, policy);
    const Tensor c = cat({h, h}, 0);
    EXPECT_EQ(c.dtype(), DType::f32);
    EXPECT_EQ(c.to_float_vector(), cat({h, h}, 0, {DType::f32}).to_float_vector());
    for (const Tensor& y : layout()) {
      EXPECT_EQ(y.dtype(), DType::f32);
      EXPECT_NE(y.data_ptr(), h.data_ptr());  // a copy
    }
    EXPECT_EQ(nll_loss(h, labels).dtype(), DType::f32);
    const Tensor ce = cross_entropy(h, labels);  // h is exact in bf16
    EXPECT_EQ(ce.dtype(), DType::bf16);
    EXPECT_EQ(static_cast<float>(ce.item()), ce_bf16);
  }
  AutocastPolicy softmax_only;
  softmax_only.replace_lists(std::nullopt, std::vector<std::string>{"softmax"});
  AutocastScope scope(DType::bf16, softmax_only);
  EXPECT_EQ(nll_loss(h, labels).dtype(), DType::f16);
  EXPECT_EQ(cross_entropy(h, labels).dtype(), DType::f16);
}

TEST(Autocast, LowerPrecisionOpsRoundTheirInputsLikeACast) {
  AutocastPolicy policy;
  const Tensor x = Tensor::from_floats({0.1f, 0.2f, 0.3f, 1.0f / 3}, {1, 4}, DType::f32);
  const Tensor w = param({2, 4});
  const Tensor expected = linear(cast(x, DType::f16), cast(w, DType::f16));
  AutocastScope scope(DType::f16, policy);
  EXPECT_EQ(linear(x, w).to_float_vector(), expected.to_float_vector());
}

TEST(Autocast, WeightsAreCastOncePerScope) {
  AutocastPolicy policy;
  Tensor w = param({3, 3});
  Tensor x = Tensor::from_floats({1, 2, 3}, {1, 3}, DType::f32);
  {
    AutocastScope scope(DType::f16, policy);
    // The same weight used three times: one copy.
    matmul(matmul(matmul(x, w), w), w);
    EXPECT_EQ(scope.cache_misses(), 1u);
    EXPECT_EQ(scope.cache_hits(), 2u);
  }
  // A new scope makes a new copy (the weight may have changed).
  AutocastScope again(DType::f16, policy);
  matmul(x, w);
  EXPECT_EQ(again.cache_misses(), 1u);
}

TEST(Autocast, LinearReadsItsFp32WeightRoundedAndGradientsReachItInFp32) {
  AutocastPolicy policy;
  Tensor w = param({3, 3});
  Tensor x = Tensor::from_floats({1, 2, 3}, {1, 3}, DType::f32);
  Tensor loss;
  {
    AutocastScope scope(DType::f16, policy);
    // linear makes no 16-bit copy of its weight: the kernels round it as they read it.
    Tensor y = linear(linear(linear(x, w), w), w);
    EXPECT_EQ(scope.cache_misses(), 0u);
    EXPECT_EQ(scope.cache_hits(), 0u);
    EXPECT_EQ(y.dtype(), DType::f16);
    loss = sum(y);
  }
  autograd::backward(loss);
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  // The weight's gradient is computed in FP32 from the 16-bit activations and activation
  // gradients (no FP16 rounding of the weight gradient), one use at a time, last use first.
  {
    autograd::NoGradScope no_grad;
    const Tensor wh = cast(w, DType::f16), xh = cast(x, DType::f16);
    const Tensor y1 = linear(xh, wh), y2 = linear(y1, wh);
    const Tensor g3 = Tensor::full({1, 3}, 1.0, DType::f16);
    const Tensor g2 = matmul(g3, wh), g1 = matmul(g2, wh);  // f16, as the activations
    const OpOptions f32{DType::f32};
    const Tensor dw =
        add(add(matmul(transpose(g3, 0, 1), y2, f32), matmul(transpose(g2, 0, 1), y1, f32)),
            matmul(transpose(g1, 0, 1), xh, f32));
    EXPECT_EQ(w.grad().to_float_vector(), dw.to_float_vector());
  }
}

// ReadAsScope (O2): FP32 parameters marked with AutogradMeta::read_as are read as their 16-bit
// copy, which is never made for linear's and conv2d's weights; their gradients are computed in
// the 16-bit type (no FP32 gradient first); unmarked parameters and code under AutocastDisabled
// read FP32 as stored.
TEST(ReadAs, MarkedParametersAreReadAsTheirSixteenBitCopy) {
  for (const DType h : {DType::f16, DType::bf16}) {
    auto marked = [h](Tensor t) {
      t.autograd_meta()->read_as = h;
      t.autograd_meta()->grad_dtype = h;
      return t;
    };
    Tensor w = marked(param({256, 512}, 0.013f)), b = marked(param({256}, 0.07f));
    Tensor cw = marked(param({4, 2, 3, 3}, 0.09f));
    Tensor scale = param({256}, 0.05f);  // unmarked: read in FP32 (a normalization's weight)
    std::vector<float> xv(64 * 512);
    for (size_t i = 0; i < xv.size(); ++i) xv[i] = static_cast<float>((i * 37) % 101) / 50 - 1;
    const Tensor x = Tensor::from_floats(xv, {64, 512}).to(h);
    const Tensor img = Tensor::from_floats(
                           std::vector<float>(xv.begin(), xv.begin() + 2 * 2 * 8 * 8), {2, 2, 8, 8})
                           .to(h);
    Tensor y, yc, ys, y_off;
    {
      ReadAsScope scope;
      y = linear(x, w, b);
      yc = conv2d(img, cw, Tensor(), Conv2dParams{});
      ys = mul(y, scale);  // promote: f32, the unmarked weight's type
      AutocastDisabled off;
      y_off = linear(x, w, b);
    }
    EXPECT_EQ(y.dtype(), h);
    EXPECT_EQ(yc.dtype(), h);
    EXPECT_EQ(ys.dtype(), DType::f32);
    EXPECT_EQ(y_off.dtype(), DType::f32) << "AutocastDisabled reads parameters as stored";
    EXPECT_EQ(linear(x, w, b).dtype(), DType::f32) << "outside the scope: as stored";
    const Tensor wh = w.detach().to(h), bh = b.detach().to(h), cwh = cw.detach().to(h);
    {
      autograd::NoGradScope no_grad;
      EXPECT_EQ(y.to_float_vector(), linear(x, wh, bh).to_float_vector());
      EXPECT_EQ(yc.to_float_vector(), conv2d(img, cwh, Tensor(), Conv2dParams{}).to_float_vector());
    }
    // The weight gradient straight in h: the backward holds no FP32 gradient of w's size.
    default_memory_tracker().reset_peaks();
    const size_t before = default_memory_tracker().stats().current_of(MemoryCategory::gradients);
    autograd::backward(sum(ys));
    const size_t peak = default_memory_tracker().stats().peak_of(MemoryCategory::gradients);
    EXPECT_LT(peak - before, static_cast<size_t>(w.numel()) * 4) << dtype_name(h);
    ASSERT_TRUE(w.grad().defined() && b.grad().defined() && scale.grad().defined());
    EXPECT_EQ(w.grad().dtype(), h);
    EXPECT_EQ(b.grad().dtype(), h);
    EXPECT_EQ(scale.grad().dtype(), DType::f32);
    {
      autograd::NoGradScope no_grad;
      // dy = scale (broadcast over rows), rounded to y's type as the mul's backward gives it.
      const Tensor dy = mul(Tensor::full({64, 256}, 1.0, DType::f32), scale.detach(), OpOptions{h});
      const Tensor dw = matmul(transpose(dy, 0, 1), x, OpOptions{h});
      EXPECT_EQ(w.grad().to_float_vector(), dw.to_float_vector());
      EXPECT_EQ(b.grad().to_float_vector(), sum(dy, {0}, false, OpOptions{h}).to_float_vector());
    }
  }
}

TEST(Autocast, StandInsOnlyStandInForLeavesOfTheirShape) {
  Tensor w = param({2, 2});
  const Tensor h = Tensor::zeros({2, 2}, DType::f16);
  EXPECT_TRUE(h.stand_in_for(w).requires_grad());
  EXPECT_NE(error_of([&] { h.stand_in_for(Tensor::zeros({2, 2}, DType::f32)); }), "");
  EXPECT_NE(error_of([&] { h.stand_in_for(mul_scalar(w, 2.0)); }), "");
  EXPECT_NE(error_of([&] { Tensor::zeros({4}, DType::f16).stand_in_for(w); }).find("shape"),
            std::string::npos);
}

TEST(Autocast, LogsEachDecisionOnceWithTheModulePath) {
  AutocastPolicy policy;
  std::vector<std::string> lines;
  AutocastLog log([&](const std::string& l) { lines.push_back(l); });
  auto model = nn::make_model("tutorial-cnn", [] {
    nn::ModelConfig c;
    c.image_size = 24;
    return c;
  }());
  const Tensor x = Tensor::zeros({2, 1, 24, 24}, DType::f32);
  for (int i = 0; i < 3; ++i) {
    AutocastScope scope(DType::f16, policy, &log);
    (*model)(x);
  }
  ASSERT_EQ(log.decisions().size(), lines.size());
  auto has = [&](const std::string& s) {
    for (auto& l : lines)
      if (l == s) return true;
    return false;
  };
  EXPECT_TRUE(has("autocast: conv2d in conv1: f32 -> f16 (lower_precision)"));
  EXPECT_TRUE(has("autocast: conv2d in conv2: f32 -> f16 (lower_precision)"));  // its weight
  EXPECT_TRUE(has("autocast: group_norm in norm: f16 -> f32 (fp32)"));
  EXPECT_TRUE(has("autocast: linear in fc1: f32 -> f16 (lower_precision)"));
  EXPECT_TRUE(has("autocast: log_softmax in log_softmax: f16 -> f32 (fp32)"));
  EXPECT_EQ(lines.size(), 6u);  // fc2's weight too; three passes, each decision once
  EXPECT_TRUE(has("autocast: linear in fc2: f32 -> f16 (lower_precision)"));
}

TEST(Autocast, AModuleWithItsOwnPrecisionOverridesThePolicy) {
  AutocastPolicy policy;
  nn::ModelConfig c;
  c.image_size = 24;
  auto model = nn::make_model("tutorial-cnn", c);
  model->submodule("fc2").float_();  // keep in FP32
  EXPECT_EQ(model->submodule("fc2").precision(), DType::f32);
  EXPECT_FALSE(model->submodule("fc1").precision());
  AutocastLog log;
  AutocastScope scope(DType::f16, policy, &log);
  const Tensor y = (*model)(Tensor::zeros({2, 1, 24, 24}, DType::f32));
  bool fc1_cast = false;
  for (auto& d : log.decisions()) {
    EXPECT_NE(d.module, "fc2") << to_string(d);
    fc1_cast = fc1_cast || (d.module == "fc1" && d.op == "linear");
  }
  EXPECT_TRUE(fc1_cast) << "the policy still casts the other layers";
  EXPECT_EQ(y.dtype(), DType::f32);
  // And a half() module in an FP32 model runs in 16 bits, its input cast at its entry.
  auto m2 = nn::make_model("tutorial-cnn", c);
  m2->submodule("conv1").half();
  EXPECT_EQ(m2->named_parameters()[0].tensor->dtype(), DType::f16);
  EXPECT_EQ(m2->submodule("conv1")(Tensor::zeros({1, 1, 24, 24}, DType::f32)).dtype(), DType::f16);
}

TEST(OpContext, PartialsScopeSetsTheDefaultAccumulation) {
  const Tensor a = Tensor::from_floats(std::vector<float>(64, 1.001f), {1, 64}, DType::f16);
  const Tensor b = Tensor::from_floats(std::vector<float>(64 * 2, 0.999f), {2, 64}, DType::f16);
  OpOptions f16p;
  f16p.partials = kernels::Partials::kF16;
  f16p.out = DType::f32;
  const auto explicit_f16 = linear(a, b, Tensor(), f16p).to_float_vector();
  const auto f32 = linear(a, b, Tensor(), {DType::f32}).to_float_vector();
  ASSERT_NE(explicit_f16, f32);
  PartialsScope scope(kernels::Partials::kF16);
  EXPECT_EQ(default_partials(), kernels::Partials::kF16);
  EXPECT_EQ(linear(a, b, Tensor(), {DType::f32}).to_float_vector(), explicit_f16);
}

TEST(OpContext, StochasticOutputsAreReproducibleAndUnbiased) {
  // f16(0.1) * 1.3 lies 70% of the way between two FP16 values: round to nearest gives one of
  // them everywhere, stochastic rounding a mix whose mean is the FP32 product.
  const Tensor x = Tensor::full({4096}, 0.1, DType::f16);
  auto run = [&](uint64_t seed) {
    StochasticOutputsScope sr(seed, 0);
    return mul_scalar(x, 1.3).to_float_vector();
  };
  const auto a = run(1), b = run(1), c = run(2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  double mean = 0;
  for (float v : a) mean += v;
  mean /= static_cast<double>(a.size());
  const double exact = static_cast<double>(static_cast<float>(f16(0.1f)) * 1.3f);
  EXPECT_NEAR(mean, exact, 6e-6);  // 5 standard errors: 1.2e-4 * 0.46 / sqrt(4096) * 5
  const auto rne = mul_scalar(x, 1.3).to_float_vector();
  EXPECT_EQ(std::set<float>(rne.begin(), rne.end()).size(), 1u);
  EXPECT_EQ(std::set<float>(a.begin(), a.end()).size(), 2u);
}

TEST(ModulePath, ModulesKnowTheirPathFromTheRoot) {
  nn::ModelConfig c;
  auto m = nn::make_model("resnet18", c);
  EXPECT_EQ(m->path(), "");
  EXPECT_EQ(m->submodule("layer1.0.conv1").path(), "layer1.0.conv1");
  EXPECT_EQ(m->submodule("layer2.0.downsample.0").path(), "layer2.0.downsample.0");
  EXPECT_EQ(current_module_path(), "");
}

}  // namespace
}  // namespace mantissa::ops
