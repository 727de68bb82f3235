// Every op against the FP64 scalar reference, for every combination of input and output storage
// dtype (f32, f16, bf16), forward and backward. Reference gradients are central differences of the
// FP64 reference forward, so this is also the finite-difference gradient check of every op.
#include <gtest/gtest.h>

#include <limits>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "mantissa/autograd/autograd.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/reference.h"
#include "mantissa/mantissa.h"
#include "mantissa/ops/ops.h"
#include "support/compare.h"
#include "support/tensors.h"
#include "support/tolerances.h"

namespace mantissa {
namespace {

using reference::Array;

enum class Values { kNormal, kPositive, kAwayFromZero, kDistinct, kTarget, kBytes };

struct Input {
  Shape shape;
  Values values = Values::kNormal;
  bool differentiable = true;
  int64_t classes =
      0;  // kTarget: labels in [0, classes); -100 appears as an ignored label if ignore
  bool with_ignored = false;
};

struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  std::function<Tensor(const std::vector<Tensor>&, const ops::OpOptions&)> fast;
  std::function<Array(const std::vector<Array>&)> ref;
  double reduce_len = 1;      // the longest sum behind one output (tolerance)
  bool choose_output = true;  // false: the op's output dtype is fixed (losses: f32)
};

std::vector<float> make_values(const Input& in, uint32_t seed) {
  std::mt19937 gen(seed);
  int64_t n = 1;
  for (int64_t d : in.shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  switch (in.values) {
    case Values::kNormal:
      for (float& x : v) x = normal(gen);
      break;
    case Values::kPositive:
      for (float& x : v) x = 0.5f + std::fabs(normal(gen));
      break;
    case Values::kAwayFromZero:  // no kinks within reach of a finite difference
      for (float& x : v) {
        x = normal(gen);
        x += x < 0 ? -0.1f : 0.1f;
      }
      break;
    case Values::kDistinct: {  // distinct multiples of 1/64, exact in every 16-bit format
      for (size_t i = 0; i < v.size(); ++i)
        v[i] = (static_cast<float>(i) - static_cast<float>(v.size()) / 2) / 16.0f;
      std::shuffle(v.begin(), v.end(), gen);
      break;
    }
    case Values::kBytes: {  // u8 images
      std::uniform_int_distribution<int> byte(0, 255);
      for (float& x : v) x = static_cast<float>(byte(gen));
      break;
    }
    case Values::kTarget: {
      std::uniform_int_distribution<int64_t> cls(0, in.classes - 1);
      for (float& x : v) x = static_cast<float>(cls(gen));
      if (in.with_ignored && v.size() > 1) v[1] = -100.0f;
      break;
    }
  }
  return v;
}

std::string dname(DType t) { return std::string(dtype_name(t)); }

// The worst element of |got - want| relative to tol(i); fails naming it.
// The fast kernels against the FP64 reference (tolerance floor: 5% of the tensor's scale).
void expect_close(const std::string& what, const std::vector<double>& got,
                  const std::vector<double>& want, double rtol, double abs_floor) {
  testing::expect_close(what, got, want, rtol, 0.05, abs_floor, "got", "reference");
}

std::vector<double> values_of(const Tensor& t) { return reference::from_tensor(t).v; }

void run_case(const OpCase& c) {
  const DType types[] = {DType::f32, DType::f16, DType::bf16};
  for (DType in_t : types) {
    for (DType out_t : types) {
      if (!c.choose_output && out_t != DType::f32) continue;
      SCOPED_TRACE(c.name + " in " + dname(in_t) + " out " + dname(out_t));
      // Inputs stored in in_t (labels in i64, images in u8); the reference sees exactly the
      // stored values.
      std::vector<Tensor> xs;
      std::vector<Array> rx;
      for (size_t i = 0; i < c.inputs.size(); ++i) {
        const Input& in = c.inputs[i];
        const std::vector<float> v = make_values(in, static_cast<uint32_t>(17 + 31 * i));
        Tensor t = in.values == Values::kTarget  ? Tensor::from_floats(v, in.shape).to(DType::i64)
                   : in.values == Values::kBytes ? Tensor::from_floats(v, in.shape).to(DType::u8)
                                                 : Tensor::from_floats(v, in.shape, in_t);
        if (in.differentiable) t.set_requires_grad(true);
        rx.push_back(reference::from_tensor(t));
        xs.push_back(t);
      }
      ops::OpOptions opt;
      if (c.choose_output) opt.out = out_t;
      const Tensor y = c.fast(xs, opt);
      ASSERT_EQ(y.dtype(), c.choose_output ? out_t : DType::f32);
      const Array yr = c.ref(rx);
      ASSERT_EQ(y.shape(), yr.shape);
      const double fwd_rtol = testing::storage_rtol(out_t) + 4e-7 * std::sqrt(c.reduce_len) +
                              (in_t == DType::f32 ? 0.0 : 1e-6);
      expect_close(c.name + " forward (in " + dname(in_t) + ", out " + dname(out_t) + ")",
                   values_of(y), yr.v, fwd_rtol, 1e-6 * std::sqrt(c.reduce_len));
      // Gradients: of L = sum(y * R), once per input dtype (output in the same dtype).
      if (out_t != (c.choose_output ? in_t : DType::f32)) continue;
      bool differentiable = false;
      for (const Input& in : c.inputs) differentiable = differentiable || in.differentiable;
      if (!differentiable) continue;
      std::vector<float> r(static_cast<size_t>(y.numel()));
      std::mt19937 gen(99);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (float& v : r) v = normal(gen);
      autograd::backward(y, Tensor::from_floats(r, y.shape()));
      auto loss = [&](const std::vector<Array>& in) {
        const Array out = c.ref(in);
        double l = 0;
        for (size_t i = 0; i < out.v.size(); ++i) l += out.v[i] * r[i];
        return l;
      };
      for (size_t i = 0; i < c.inputs.size(); ++i) {
        if (!c.inputs[i].differentiable) continue;
        const Tensor g = xs[i].grad();
        ASSERT_TRUE(g.defined()) << c.name << ": no gradient for input " << i;
        ASSERT_EQ(g.dtype(), in_t) << c.name << ": gradients are stored in their tensor's dtype";
        ASSERT_EQ(g.shape(), xs[i].shape());
        std::vector<double> want(rx[i].v.size());
        std::vector<Array> probe = rx;
        for (size_t e = 0; e < want.size(); ++e) {
          const double x0 = rx[i].v[e], h = 1e-6 * std::max(1.0, std::fabs(x0));
          probe[i].v[e] = x0 + h;
          const double up = loss(probe);
          probe[i].v[e] = x0 - h;
          const double down = loss(probe);
          probe[i].v[e] = x0;
          want[e] = (up - down) / (2 * h);
        }
        expect_close(c.name + " gradient of input " + std::to_string(i) + " (" + dname(in_t) + ")",
                     values_of(g), want,
                     testing::gradient_rtol(in_t) * (1 + 0.02 * std::sqrt(c.reduce_len)), 1e-5);
      }
    }
  }
}

std::vector<OpCase> all_cases() {
  using kernels::Conv2dParams;
  using kernels::Pool2dParams;
  using reference::Binary;
  using reference::Unary;
  std::vector<OpCase> cs;
  auto T = [](const std::vector<Tensor>& x, size_t i) { return i < x.size() ? x[i] : Tensor(); };

  // ---- matrix ops ----
  cs.push_back({"linear",
                {{{3, 5}}, {{4, 5}}, {{4}}},
                [](auto& x, auto& o) { return ops::linear(x[0], x[1], x[2], o); },
                [](auto& r) { return reference::linear(r[0], r[1], &r[2]); },
                5});
  cs.push_back({"linear_3d_no_bias",
                {{{2, 3, 5}}, {{4, 5}}},
                [](auto& x, auto& o) { return ops::linear(x[0], x[1], Tensor(), o); },
                [](auto& r) { return reference::linear(r[0], r[1], nullptr); },
                5});
  cs.push_back({"matmul_batched",
                {{{2, 3, 4}}, {{2, 4, 5}}},
                [](auto& x, auto& o) { return ops::matmul(x[0], x[1], o); },
                [](auto& r) { return reference::matmul(r[0], r[1]); },
                4});
  cs.push_back({"matmul_batch_by_2d",
                {{{2, 3, 4}}, {{4, 5}}},
                [](auto& x, auto& o) { return ops::matmul(x[0], x[1], o); },
                [](auto& r) { return reference::matmul(r[0], r[1]); },
                4});
  auto conv_case = [&](std::string name, Shape xs, Shape ws, bool bias, Conv2dParams p) {
    std::vector<Input> in{{xs}, {ws}};
    if (bias) in.push_back({{ws[0]}});
    cs.push_back(
        {name, in, [p, T](auto& x, auto& o) { return ops::conv2d(x[0], x[1], T(x, 2), p, o); },
         [p, bias](auto& r) { return reference::conv2d(r[0], r[1], bias ? &r[2] : nullptr, p); },
         static_cast<double>(ws[1] * ws[2] * ws[3])});
  };
  conv_case("conv2d_pad1", {2, 3, 7, 6}, {4, 3, 3, 3}, true, {1, 1, 1, 1, 1, 1, 1});
  conv_case("conv2d_stride2", {2, 3, 7, 7}, {5, 3, 3, 2}, true, {2, 2, 0, 0, 1, 1, 1});
  conv_case("conv2d_dilation2_no_bias", {1, 2, 8, 8}, {3, 2, 3, 3}, false, {1, 1, 2, 1, 2, 2, 1});
  // Small filter banks take the direct path, larger ones im2col + GEMM: both with stride and
  // padding.
  conv_case("conv2d_direct_stride2x1_pad1x0", {2, 2, 8, 9}, {3, 2, 2, 3}, true,
            {2, 1, 1, 0, 1, 1, 1});
  conv_case("conv2d_gemm_stride2_pad1", {2, 6, 9, 9}, {4, 6, 3, 3}, true, {2, 2, 1, 1, 1, 1, 1});
  conv_case("conv2d_groups2", {2, 4, 6, 5}, {6, 2, 3, 3}, true, {1, 2, 1, 1, 1, 1, 2});
  conv_case("conv2d_5x5", {2, 5, 9, 9}, {12, 5, 5, 5}, true, {});
  // Stride 1, one group, 64+ outputs a plane and at most 1.15x the multiply-adds: implicit GEMM
  // (forward; backward-input as the convolution of the padded gradient with the flipped weights;
  // weight gradient by lane-split dot products). 3x1 and 1x3 kernels keep these cases small.
  conv_case("conv2d_implicit_3x1_pad1x0", {1, 12, 14, 8}, {2, 12, 3, 1}, true,
            {1, 1, 1, 0, 1, 1, 1});
  conv_case("conv2d_implicit_1x3_pad0x1", {1, 12, 8, 14}, {2, 12, 1, 3}, true,
            {1, 1, 0, 1, 1, 1, 1});
  conv_case("conv2d_implicit_3x1_dilation2", {1, 12, 27, 4}, {2, 12, 3, 1}, false,
            {1, 1, 2, 0, 2, 1, 1});

  // ---- pooling ----
  auto pool = [](int64_t k, int64_t s, int64_t p, bool ceil, bool include_pad) {
    Pool2dParams q;
    q.kernel_h = q.kernel_w = k;
    q.stride_h = q.stride_w = s;
    q.pad_h = q.pad_w = p;
    q.ceil_mode = ceil;
    q.count_include_pad = include_pad;
    return q;
  };
  for (auto [name, q] : {std::pair{"k2s2", pool(2, 2, 0, false, true)},
                         std::pair{"k2s2_ceil", pool(2, 2, 0, true, true)},
                         std::pair{"k3s2p1", pool(3, 2, 1, false, true)},
                         std::pair{"k3s2_ceil", pool(3, 2, 0, true, true)}}) {
    cs.push_back({std::string("max_pool2d_") + name,
                  {{{2, 3, 7, 8}, Values::kDistinct}},
                  [q](auto& x, auto& o) { return ops::max_pool2d(x[0], q, o); },
                  [q](auto& r) { return reference::max_pool2d(r[0], q); }});
  }
  for (auto [name, q] : {std::pair{"k2s2", pool(2, 2, 0, false, true)},
                         std::pair{"k3s2p1", pool(3, 2, 1, false, true)},
                         std::pair{"k3s2p1_exclude_pad", pool(3, 2, 1, false, false)},
                         std::pair{"k3s2_ceil", pool(3, 2, 0, true, true)}}) {
    cs.push_back({std::string("avg_pool2d_") + name,
                  {{{2, 3, 7, 8}}},
                  [q](auto& x, auto& o) { return ops::avg_pool2d(x[0], q, o); },
                  [q](auto& r) { return reference::avg_pool2d(r[0], q); },
                  9});
  }
  cs.push_back({"adaptive_avg_pool2d_3x2",
                {{{2, 3, 7, 5}}},
                [](auto& x, auto& o) { return ops::adaptive_avg_pool2d(x[0], 3, 2, o); },
                [](auto& r) { return reference::adaptive_avg_pool2d(r[0], 3, 2); },
                12});
  cs.push_back({"adaptive_avg_pool2d_1x1",
                {{{2, 4, 3, 5}}},
                [](auto& x, auto& o) { return ops::adaptive_avg_pool2d(x[0], 1, 1, o); },
                [](auto& r) { return reference::adaptive_avg_pool2d(r[0], 1, 1); },
                15});

  // ---- elementwise ----
  cs.push_back({"relu",
                {{{3, 4, 5}, Values::kAwayFromZero}},
                [](auto& x, auto& o) { return ops::relu(x[0], o); },
                [](auto& r) { return reference::unary(Unary::kRelu, r[0]); }});
  cs.push_back({"gelu",
                {{{3, 4, 5}}},
                [](auto& x, auto& o) { return ops::gelu(x[0], o); },
                [](auto& r) { return reference::unary(Unary::kGelu, r[0]); }});
  cs.push_back({"sigmoid",
                {{{3, 4, 5}}},
                [](auto& x, auto& o) { return ops::sigmoid(x[0], o); },
                [](auto& r) { return reference::unary(Unary::kSigmoid, r[0]); }});
  cs.push_back({"tanh",
                {{{3, 4, 5}}},
                [](auto& x, auto& o) { return ops::tanh(x[0], o); },
                [](auto& r) { return reference::unary(Unary::kTanh, r[0]); }});
  cs.push_back({"add_broadcast",
                {{{2, 3, 4}}, {{3, 1}}},
                [](auto& x, auto& o) { return ops::add(x[0], x[1], o); },
                [](auto& r) { return reference::binary(Binary::kAdd, r[0], r[1]); },
                4});
  cs.push_back({"sub_broadcast",
                {{{2, 1, 4}}, {{1, 3, 1}}},
                [](auto& x, auto& o) { return ops::sub(x[0], x[1], o); },
                [](auto& r) { return reference::binary(Binary::kSub, r[0], r[1]); },
                3});
  cs.push_back({"mul_broadcast_channels",
                {{{2, 3, 4, 5}}, {{1, 3, 1, 1}}},
                [](auto& x, auto& o) { return ops::mul(x[0], x[1], o); },
                [](auto& r) { return reference::binary(Binary::kMul, r[0], r[1]); },
                40});
  cs.push_back({"div_broadcast",
                {{{3, 4}}, {{4}, Values::kPositive}},
                [](auto& x, auto& o) { return ops::div(x[0], x[1], o); },
                [](auto& r) { return reference::binary(Binary::kDiv, r[0], r[1]); },
                3});
  cs.push_back({"add_scalar",
                {{{3, 5}}},
                [](auto& x, auto& o) { return ops::add_scalar(x[0], 0.75, o); },
                [](auto& r) { return reference::scalar(Binary::kAdd, r[0], 0.75); }});
  cs.push_back({"mul_scalar",
                {{{3, 5}}},
                [](auto& x, auto& o) { return ops::mul_scalar(x[0], -1.5, o); },
                [](auto& r) { return reference::scalar(Binary::kMul, r[0], -1.5); }});

  // ---- normalization ----
  cs.push_back({"batch_norm_train",
                {{{4, 3, 2, 5}}, {{3}}, {{3}}},
                [](auto& x, auto& o) {
                  Tensor rm = Tensor::zeros({3}, DType::f32),
                         rv = Tensor::full({3}, 1.0, DType::f32);
                  return ops::batch_norm(x[0], x[1], x[2], rm, rv, true, 0.1, 1e-5, o);
                },
                [](auto& r) {
                  return reference::batch_norm(r[0], &r[1], &r[2], nullptr, nullptr, true, 1e-5);
                },
                40});
  cs.push_back({"batch_norm_eval",
                {{{4, 3, 2, 5}},
                 {{3}},
                 {{3}},
                 {{3}, Values::kNormal, false},
                 {{3}, Values::kPositive, false}},
                [](auto& x, auto& o) {
                  return ops::batch_norm(x[0], x[1], x[2], x[3].to(DType::f32), x[4].to(DType::f32),
                                         false, 0.1, 1e-5, o);
                },
                [](auto& r) {
                  return reference::batch_norm(r[0], &r[1], &r[2], &r[3], &r[4], false, 1e-5);
                }});
  cs.push_back({"group_norm_3_groups",
                {{{2, 6, 3, 4}}, {{6}}, {{6}}},
                [](auto& x, auto& o) { return ops::group_norm(x[0], 3, x[1], x[2], 1e-5, o); },
                [](auto& r) { return reference::group_norm(r[0], 3, &r[1], &r[2], 1e-5); },
                24});
  cs.push_back(
      {"group_norm_no_affine",
       {{{2, 4, 5}}},
       [](auto& x, auto& o) { return ops::group_norm(x[0], 2, Tensor(), Tensor(), 1e-5, o); },
       [](auto& r) { return reference::group_norm(r[0], 2, nullptr, nullptr, 1e-5); },
       10});
  cs.push_back({"layer_norm_last",
                {{{3, 4, 6}}, {{6}}, {{6}}},
                [](auto& x, auto& o) { return ops::layer_norm(x[0], 1, x[1], x[2], 1e-5, o); },
                [](auto& r) { return reference::layer_norm(r[0], 1, &r[1], &r[2], 1e-5); },
                6});
  cs.push_back({"layer_norm_last2",
                {{{3, 4, 5}}, {{4, 5}}, {{4, 5}}},
                [](auto& x, auto& o) { return ops::layer_norm(x[0], 2, x[1], x[2], 1e-5, o); },
                [](auto& r) { return reference::layer_norm(r[0], 2, &r[1], &r[2], 1e-5); },
                20});
  cs.push_back({"dropout",
                {{{4, 50}}},
                [](auto& x, auto& o) { return ops::dropout(x[0], 0.3, true, 7, 2, o); },
                [](auto& r) { return reference::dropout(r[0], 0.3, 7, 2); }});

  // ---- layout ----
  cs.push_back({"reshape",
                {{{2, 3, 4}}},
                [](auto& x, auto& o) {
                  return ops::reshape(x[0], {4, 6}, o);
                },
                [](auto& r) {
                  Array a = r[0];
                  a.shape = {4, 6};
                  return a;
                }});
  cs.push_back({"flatten",
                {{{2, 3, 4, 5}}},
                [](auto& x, auto& o) { return ops::flatten(x[0], 1, -1, o); },
                [](auto& r) {
                  Array a = r[0];
                  a.shape = {2, 60};
                  return a;
                }});
  cs.push_back({"transpose",
                {{{2, 3, 4}}},
                [](auto& x, auto& o) { return ops::transpose(x[0], 0, 2, o); },
                [](auto& r) { return reference::transpose(r[0], 0, 2); }});
  cs.push_back({"cat",
                {{{2, 3}}, {{2, 4}}, {{2, 1}}},
                [](auto& x, auto& o) {
                  return ops::cat({x[0], x[1], x[2]}, 1, o);
                },
                [](auto& r) {
                  return reference::cat({r[0], r[1], r[2]}, 1);
                }});

  // ---- reductions and probabilities ----
  cs.push_back({"sum_all",
                {{{3, 4, 5}}},
                [](auto& x, auto& o) { return ops::sum(x[0], {}, false, o); },
                [](auto& r) { return reference::sum(r[0], {}, false); },
                60});
  cs.push_back({"sum_dims_keepdim",
                {{{3, 4, 5}}},
                [](auto& x, auto& o) {
                  return ops::sum(x[0], {0, 2}, true, o);
                },
                [](auto& r) {
                  return reference::sum(r[0], {0, 2}, true);
                },
                15});
  cs.push_back({"mean_dim",
                {{{3, 4, 5}}},
                [](auto& x, auto& o) { return ops::mean(x[0], {1}, false, o); },
                [](auto& r) {
                  Array s = reference::sum(r[0], {1}, false);
                  for (double& v : s.v) v /= 4;
                  return s;
                },
                4});
  cs.push_back({"softmax",
                {{{3, 7}}},
                [](auto& x, auto& o) { return ops::softmax(x[0], 1, o); },
                [](auto& r) { return reference::softmax(r[0], 1, false); },
                7});
  cs.push_back({"log_softmax_dim0",
                {{{5, 3, 2}}},
                [](auto& x, auto& o) { return ops::log_softmax(x[0], 0, o); },
                [](auto& r) { return reference::softmax(r[0], 0, true); },
                5});

  // ---- losses ----
  cs.push_back({"nll_loss",
                {{{5, 4}}, {{5}, Values::kTarget, false, 4, true}},
                [](auto& x, auto&) { return ops::nll_loss(x[0], x[1]); },
                [](auto& r) { return reference::nll_loss(r[0], r[1], -100); },
                5,
                false});
  cs.push_back({"cross_entropy",
                {{{6, 5}}, {{6}, Values::kTarget, false, 5}},
                [](auto& x, auto&) { return ops::cross_entropy(x[0], x[1]); },
                [](auto& r) { return reference::cross_entropy(r[0], r[1], 0.0, -100); },
                30,
                false});
  cs.push_back({"cross_entropy_label_smoothing",
                {{{6, 5}}, {{6}, Values::kTarget, false, 5, true}},
                [](auto& x, auto&) { return ops::cross_entropy(x[0], x[1], 0.1); },
                [](auto& r) { return reference::cross_entropy(r[0], r[1], 0.1, -100); },
                30,
                false});

  // ---- cast ----
  cs.push_back({"cast",
                {{{4, 5}}},
                [](auto& x, auto& o) { return ops::cast(x[0], o.out.value_or(DType::f32)); },
                [](auto& r) { return r[0]; }});

  // ---- input ----
  cs.push_back({"normalize_input",
                {{{2, 3, 2, 3}, Values::kBytes, false}},
                [](auto& x, auto& o) {
                  return ops::normalize_input(x[0], {0.5f, 0.25f, 0.75f}, {0.5f, 2.0f, 0.25f},
                                              o.out.value_or(DType::f32));
                },
                [](auto& r) {
                  const double mean[] = {0.5, 0.25, 0.75}, std[] = {0.5, 2.0, 0.25};
                  Array a = r[0];
                  for (size_t i = 0; i < a.v.size(); ++i) {
                    const size_t c = i / 6 % 3;  // 6 pixels a plane
                    a.v[i] = (a.v[i] / 255 - mean[c]) / std[c];
                  }
                  return a;
                }});
  return cs;
}

void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name; }

class OpTest : public ::testing::TestWithParam<OpCase> {};

TEST_P(OpTest, MatchesReferenceForwardAndBackwardInEveryDtype) { run_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(AllOps, OpTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) {
                           return info.param.name;
                         });

// Every op of the table has at least one case above.
TEST(OpTable, EveryOpIsTested) {
  const std::vector<OpCase> cases = all_cases();
  for (int i = 0; i < ops::kNumOps; ++i) {
    const std::string name(ops::kOpInfo[i].name);
    bool found = false;
    for (const OpCase& c : cases) found = found || c.name.rfind(name, 0) == 0;
    EXPECT_TRUE(found) << "op '" << name << "' has no test case";
  }
}

}  // namespace
}  // namespace mantissa

namespace mantissa {
namespace {

// The 2x2/stride-2 fast path and the general loop agree on NaN: the first NaN of a window wins,
// with its index (PyTorch propagates NaN through max pooling).
TEST(MaxPool, NanPropagatesFromTheFirstNanOfTheWindow) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (bool general : {false, true}) {
    kernels::Pool2dParams p;  // 2x2, stride 2: the fast path
    if (general) p.pad_h = p.pad_w = 1, p.kernel_h = p.kernel_w = 3;  // 3x3/2, padded: the loop
    Tensor x = Tensor::from_floats({1, nan, 3, 4, nan, 2, 8, 1}, {1, 1, 2, 4});
    auto [y, idx] = kernels::max_pool2d(x, p, DType::f32);
    const std::vector<float> v = y.to_float_vector();
    EXPECT_TRUE(std::isnan(v[0])) << general;
    // the NaN at (0, 1), not the one at (1, 0)
    EXPECT_EQ(kernels::max_pool2d_argmax(idx, x.shape(), p, 0), 1) << general;
    if (!general) {
      EXPECT_EQ(v[1], 8.0f);
      EXPECT_EQ(kernels::max_pool2d_argmax(idx, x.shape(), p, 1), 6);
    }
  }
}

// Group and layer norm read a 16-bit input (and output gradient) as the FP32 values it holds,
// converting each row once for its statistics, its normalization and its gradient: the outputs and
// gradients equal those of FP32 copies of the same values, bit for bit, in every output type, on
// one and two threads (rows long enough to be split into chunks and across threads).
TEST(Norm, SixteenBitRowsGiveTheBitsOfTheirFp32Values) {
  std::mt19937 gen(11);
  std::normal_distribution<float> dist(0.3f, 2.0f);
  auto random = [&](const Shape& s) { return testing::tensor_of(s, [&] { return dist(gen); }); };
  const Shape shape{3, 6, 37, 41};
  const Tensor w = random({6}), b = random({6});
  for (const DType t : {DType::f16, DType::bf16}) {
    const Tensor x = ops::cast(random(shape), t), dy = ops::cast(random(shape), t);
    const Tensor x32 = x.to(DType::f32), dy32 = dy.to(DType::f32);
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      for (const DType out : {t, DType::f32}) {
        const std::string at = std::string(dtype_name(t)) + " -> " + std::string(dtype_name(out)) +
                               ", " + std::to_string(threads) + " threads";
        auto [y, mean, rstd] = kernels::group_norm(x, 3, w, b, 1e-5, out);
        auto [y32, mean32, rstd32] = kernels::group_norm(x32, 3, w, b, 1e-5, out);
        EXPECT_EQ(y.to_float_vector(), y32.to_float_vector()) << at;
        EXPECT_EQ(mean.to_float_vector(), mean32.to_float_vector()) << at;
        EXPECT_EQ(rstd.to_float_vector(), rstd32.to_float_vector()) << at;
        auto [dx, dw, db] = kernels::group_norm_backward(dy, x, 3, w, mean, rstd, out);
        auto [dx32, dw32, db32] = kernels::group_norm_backward(dy32, x32, 3, w, mean, rstd, out);
        EXPECT_EQ(dx.to_float_vector(), dx32.to_float_vector()) << at;
        EXPECT_EQ(dw.to_float_vector(), dw32.to_float_vector()) << at;
        EXPECT_EQ(db.to_float_vector(), db32.to_float_vector()) << at;
        auto [ly, lmean, lrstd] = kernels::layer_norm(x, 2, Tensor(), Tensor(), 1e-5, out);
        auto [ly32, lmean32, lrstd32] = kernels::layer_norm(x32, 2, Tensor(), Tensor(), 1e-5, out);
        EXPECT_EQ(ly.to_float_vector(), ly32.to_float_vector()) << at;
        auto [ldx, ldw, ldb] = kernels::layer_norm_backward(dy, x, 2, Tensor(), lmean, lrstd, out);
        auto [ldx32, ldw32, ldb32] =
            kernels::layer_norm_backward(dy32, x32, 2, Tensor(), lmean, lrstd, out);
        EXPECT_EQ(ldx.to_float_vector(), ldx32.to_float_vector()) << at;
      }
    }
    set_num_threads(0);
  }
}

// Sums at a bias gradient's size: the merged-plane path ({0, 2, 3} of a contiguous tensor), the
// serial path (outputs along the row), a non-contiguous input and a 16-bit one, against FP64, with
// the same bits on one and two threads.
TEST(Sum, ReductionsMatchFp64OnAnyThreadCount) {
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.5f, 1.0f);
  const Shape shape{6, 5, 40, 70};
  std::vector<float> v(6 * 5 * 40 * 70);
  for (float& e : v) e = dist(gen);
  const Tensor x = Tensor::from_floats(v, shape);
  struct Case {
    Tensor in;
    std::vector<int64_t> dims;
  };
  const std::vector<Case> cases = {{x, {0, 2, 3}},
                                   {x, {2, 3}},
                                   {x, {}},
                                   {x, {0}},
                                   {x, {1, 3}},
                                   {x.transpose(1, 3), {0, 2, 3}},
                                   {ops::cast(x, DType::bf16), {0, 2, 3}}};
  for (const Case& c : cases) {
    const Tensor in = c.in;
    const std::vector<float> xv = in.to_float_vector();  // logical order, rounded as stored
    // FP64 reference: output index of each element from its coordinates.
    const Shape& s = in.shape();
    std::vector<bool> red(4, c.dims.empty());
    for (int64_t d : c.dims) red[static_cast<size_t>(d)] = true;
    Shape kept = s;
    for (size_t d = 0; d < 4; ++d)
      if (red[d]) kept[d] = 1;
    std::vector<double> want(static_cast<size_t>(kept[0] * kept[1] * kept[2] * kept[3]), 0.0);
    std::vector<double> mag(want.size(), 0.0);
    size_t e = 0;
    for (int64_t a = 0; a < s[0]; ++a)
      for (int64_t b = 0; b < s[1]; ++b)
        for (int64_t h = 0; h < s[2]; ++h)
          for (int64_t w = 0; w < s[3]; ++w, ++e) {
            const int64_t i[4] = {a, b, h, w};
            int64_t o = 0;
            for (size_t d = 0; d < 4; ++d) o = o * kept[d] + (red[d] ? 0 : i[d]);
            want[static_cast<size_t>(o)] += xv[e];
            mag[static_cast<size_t>(o)] += std::fabs(xv[e]);
          }
    std::vector<std::vector<float>> got;
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      got.push_back(
          kernels::sum(in, c.dims, false, DType::f32, MemoryCategory::gradients).to_float_vector());
    }
    set_num_threads(0);
    ASSERT_EQ(got[0].size(), want.size());
    EXPECT_EQ(got[0], got[1]) << "thread counts disagree, dims of case " << c.dims.size();
    for (size_t k = 0; k < want.size(); ++k)
      EXPECT_NEAR(got[0][k], want[k], 1e-6 * mag[k] + 1e-6) << k;
  }
}

// Linear over an empty batch, or with no input features, as PyTorch computes it: outputs of the
// batch's rows (zeros where nothing is summed) and zero or empty gradients, in the backward pass
// too (which viewed an empty gradient as non-contiguous, and took the rows as numel / 0).
TEST(Linear, EmptyBatchesAndNoFeaturesDifferentiate) {
  for (const auto& [x_shape, w_shape] :
       {std::pair{Shape{0, 3}, Shape{4, 3}}, std::pair{Shape{2, 0}, Shape{4, 0}},
        std::pair{Shape{2, 0, 3}, Shape{4, 3}}}) {
    SCOPED_TRACE(shape_str(x_shape) + " x " + shape_str(w_shape));
    Tensor x = Tensor::full(x_shape, 1.0, DType::f32).set_requires_grad(true);
    Tensor w = Tensor::full(w_shape, 1.0, DType::f32).set_requires_grad(true);
    const Tensor y = ops::linear(x, w);
    Shape want = x_shape;
    want.back() = w_shape[0];
    EXPECT_EQ(y.shape(), want);
    for (const float v : y.to_float_vector()) EXPECT_EQ(v, 0.0f);
    autograd::backward(ops::sum(y));
    ASSERT_TRUE(x.grad().defined());
    ASSERT_TRUE(w.grad().defined());
    EXPECT_EQ(x.grad().shape(), x_shape);
    EXPECT_EQ(w.grad().shape(), w_shape);
    for (const float v : w.grad().to_float_vector()) EXPECT_EQ(v, 0.0f);
  }
  // No input features with a bias: every row is the bias.
  const Tensor y = ops::linear(Tensor::zeros({2, 0}, DType::f32), Tensor::zeros({3, 0}, DType::f32),
                               Tensor::from_floats({1, 2, 3}, {3}));
  EXPECT_EQ(y.to_float_vector(), (std::vector<float>{1, 2, 3, 1, 2, 3}));
}

TEST(MacCounter, CountsEachMatrixOpsForwardOnceInTheInnermostScope) {
  Tensor x = Tensor::full({3, 5}, 1.0, DType::f32).set_requires_grad(true);
  Tensor w = Tensor::full({4, 5}, 1.0, DType::f32).set_requires_grad(true);
  Tensor a = Tensor::full({2, 3, 5}, 1.0, DType::f32), b = Tensor::full({5, 7}, 1.0, DType::f32);
  // Two groups, stride 2, padding 1: 9x9 -> 5x5 outputs, each 2 channels x 3x3 taps.
  Tensor img = Tensor::full({2, 4, 9, 9}, 1.0, DType::f32),
         k = Tensor::full({6, 2, 3, 3}, 1.0, DType::f32);
  ops::Conv2dParams p;
  p.stride_h = p.stride_w = 2;
  p.pad_h = p.pad_w = 1;
  p.groups = 2;
  count_macs(1000);  // no counter: nothing to add to
  MacCounter outer;
  Tensor y = ops::linear(x, w);
  EXPECT_EQ(outer.macs(), 3 * 4 * 5);
  {
    MacCounter inner;
    ops::matmul(a, b);
    EXPECT_EQ(inner.macs(), 2 * 3 * 7 * 5);
    ops::conv2d(img, k, Tensor(), p);
    EXPECT_EQ(inner.macs(), 2 * 3 * 7 * 5 + 2 * 6 * 5 * 5 * (2 * 3 * 3));
  }
  EXPECT_EQ(outer.macs(), 3 * 4 * 5);  // the inner scope's ops are its own
  autograd::backward(ops::sum(y));     // backward kernels are not counted: 3x forward is a rule
  EXPECT_EQ(outer.macs(), 3 * 4 * 5);
  {
    // Autocast re-dispatches the op with cast inputs: still counted once.
    const ops::AutocastPolicy policy;  // the scope keeps a reference to it
    ops::AutocastScope autocast(DType::bf16, policy);
    ops::linear(x, w);
  }
  EXPECT_EQ(outer.macs(), 2 * 3 * 4 * 5);
}

}  // namespace
}  // namespace mantissa
