// The gradient reducer and the agreement helpers in one process (a world of one rank): the bucket
// layout, the order buckets start in, no_sync, the values a world of one leaves, and the errors.
// tests/dist/test_reducer_mpi.cc runs them across ranks.
#include <gtest/gtest.h>
#include <chrono>

#include <cmath>
#include <string>
#include <vector>

#include "dist/small_model.h"
#include "mantissa/autograd/autograd.h"
#include "mantissa/dist/agreement.h"
#include "mantissa/dist/reducer.h"
#include "mantissa/dist/replicas.h"
#include "support/errors.h"

namespace mantissa {
namespace {

using dist::Reducer;
using dist::ReducerOptions;
using testing::error_of;

constexpr double kByte = 1.0 / (1024 * 1024);  // one byte in MiB

std::vector<std::vector<size_t>> bucket_params(const Reducer& r) {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : r.buckets()) out.push_back(b.params);
  return out;
}

// The small model's parameters hold 128, 16, 256, 16, 64 and 4 elements (0.weight ... 4.bias).
TEST(Reducer, BucketsTakeParametersInReverseOrderUpToTheCap) {
  auto comm = comm::make_single_process();
  auto model = testing::small_model(1);
  ReducerOptions o;
  o.bucket_cap_mib = 1000 * kByte;
  o.first_bucket_mib = 300 * kByte;
  {
    // FP32: {4.bias, 4.weight} (272 bytes; 2.bias would pass 300), {2.bias} (2.weight would pass
    // 1000), {2.weight} (1024 bytes: alone), {0.bias, 0.weight} (576 bytes).
    Reducer r(*comm, model->named_parameters(), o);
    EXPECT_EQ(bucket_params(r), (std::vector<std::vector<size_t>>{{5, 4}, {3}, {2}, {1, 0}}));
    EXPECT_EQ(r.buckets()[0].offsets, (std::vector<int64_t>{0, 4}));
    EXPECT_EQ(r.buckets()[3].offsets, (std::vector<int64_t>{0, 16}));
    EXPECT_EQ(r.buckets()[3].numel, 144);
  }
  {
    // FP16 halves the bytes: {4.bias, 4.weight, 2.bias} (168 bytes), then 800 bytes for the rest.
    o.wire = DType::f16;
    Reducer r(*comm, model->named_parameters(), o);
    EXPECT_EQ(bucket_params(r), (std::vector<std::vector<size_t>>{{5, 4, 3}, {2, 1, 0}}));
  }
  {
    // DDP's defaults hold this model in one bucket; a frozen parameter is left out.
    model->named_parameters()[1].tensor->set_requires_grad(false);
    Reducer r(*comm, model->named_parameters());
    EXPECT_EQ(bucket_params(r), (std::vector<std::vector<size_t>>{{4, 3, 2, 1, 0}}));
  }
}

// Leaves a, b, c in one bucket each (buckets c, b, a in reverse order); the chain
// y = sum(a * (b * (c * x))) finishes a first and c last, so bucket 2 is ready first, yet the
// buckets start in order 0, 1, 2, all of them once bucket 0 is ready.
TEST(Reducer, BucketsStartInBucketOrderWhateverOrderTheyAreReady) {
  auto comm = comm::make_single_process();
  Tensor a = Tensor::from_floats({1, 2}, {2}), b = Tensor::from_floats({3, 4}, {2}),
         c = Tensor::from_floats({5, 6}, {2});
  for (Tensor* t : {&a, &b, &c}) t->set_requires_grad();
  ReducerOptions o;
  o.bucket_cap_mib = o.first_bucket_mib = 8 * kByte;
  Reducer r(*comm, {{"a", &a}, {"b", &b}, {"c", &c}}, o);
  ASSERT_EQ(bucket_params(r), (std::vector<std::vector<size_t>>{{2}, {1}, {0}}));
  const Tensor x = Tensor::from_floats({1, 1}, {2});
  autograd::backward(ops::sum(ops::mul(a, ops::mul(b, ops::mul(c, x)))));
  EXPECT_EQ(r.ready_order(), (std::vector<size_t>{2, 1, 0}));
  EXPECT_EQ(r.launch_order(), (std::vector<size_t>{0, 1, 2}));
  r.finish();
  EXPECT_EQ(a.grad().to_float_vector(), (std::vector<float>{15, 24}));
  EXPECT_EQ(c.grad().to_float_vector(), (std::vector<float>{3, 8}));
}

// A world of one: FP32 leaves the gradients as they were, bit for bit (sum or mean); a 16-bit
// wire leaves them rounded to it once.
TEST(Reducer, OneRankLeavesGradientsAsTheyWereOrRoundedToTheWire) {
  auto comm = comm::make_single_process();
  for (const DType wire : {DType::f32, DType::f16, DType::bf16})
    for (const auto result : {ReducerOptions::Result::kSum, ReducerOptions::Result::kMean}) {
      auto model = testing::small_model(2);
      autograd::backward(testing::slice_loss(*model, 0, 6));
      const std::vector<std::vector<float>> local = testing::gradients(*model);
      model->zero_grad();
      ReducerOptions o;
      o.wire = wire;
      o.result = result;
      Reducer r(*comm, model->named_parameters(), o);
      autograd::backward(testing::slice_loss(*model, 0, 6));
      const auto finish_start = std::chrono::steady_clock::now();
      r.finish();
      const double finish_wall =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - finish_start).count();
      const std::vector<std::vector<float>> got = testing::gradients(*model);
      for (size_t p = 0; p < local.size(); ++p) {
        std::vector<float> want = local[p];
        if (wire != DType::f32) {
          std::vector<uint16_t> h(want.size());
          convert(want.data(), DType::f32, h.data(), wire, want.size());
          convert(h.data(), wire, want.data(), DType::f32, want.size());
        }
        EXPECT_EQ(got[p], want) << dtype_name(wire) << " parameter " << p;
      }
      EXPECT_EQ(r.last_step().steps, 1);
      EXPECT_EQ(r.last_step().bytes, 484 * static_cast<int64_t>(dtype_size(wire)));
      // The time finish() waited: within the call, and counted once.
      EXPECT_GE(r.last_step().exposed_seconds, 0);
      EXPECT_LE(r.last_step().exposed_seconds, finish_wall);
    }
}

// Passes inside no_sync() accumulate locally: no copies, no all-reduce, finish() does nothing;
// the next synchronised pass reduces the accumulated gradients.
TEST(Reducer, NoSyncLeavesAccumulationLocalUntilTheLastMicroBatch) {
  auto comm = comm::make_single_process();
  auto model = testing::small_model(3);
  auto reference = testing::small_model(3);
  Reducer r(*comm, model->named_parameters());
  {
    auto local = r.no_sync();
    EXPECT_FALSE(r.synchronising());
    autograd::backward(testing::slice_loss(*model, 0, 4));
    autograd::backward(testing::slice_loss(*model, 4, 4));
    r.finish();
  }
  EXPECT_TRUE(r.synchronising());
  EXPECT_EQ(r.total().steps, 0);
  EXPECT_EQ(r.total().bytes, 0);
  autograd::backward(testing::slice_loss(*model, 8, 4));
  r.finish();
  EXPECT_EQ(r.total().steps, 1);
  for (int64_t first : {0, 4, 8}) autograd::backward(testing::slice_loss(*reference, first, 4));
  EXPECT_EQ(testing::gradients(*model), testing::gradients(*reference));
}

// A parameter the pass does not reach ends with a zero gradient, the same on every rank.
TEST(Reducer, AParameterNotReachedGetsAZeroGradient) {
  auto comm = comm::make_single_process();
  auto model = testing::small_model(4);
  Tensor unused = Tensor::from_floats({7, 7, 7}, {3});
  unused.set_requires_grad();
  auto params = model->named_parameters();
  params.push_back({"unused", &unused});
  Reducer r(*comm, params);
  autograd::backward(testing::slice_loss(*model, 0, 4));
  r.finish();
  ASSERT_TRUE(unused.grad().defined());
  EXPECT_EQ(unused.grad().to_float_vector(), (std::vector<float>{0, 0, 0}));
}

// FP32 wire, FP32 gradients, sum: finish() leaves each gradient as a view of its place in the
// bucket (no copy), with the values a copy would hold; a pass that adds to such a gradient (not
// zeroed in between) accumulates as without the reducer, and a gradient the pass does not reach
// keeps its value. Other wires and the mean leave gradients of their own.
TEST(Reducer, Fp32SumsLeaveGradientsAsViewsOfTheBucket) {
  auto comm = comm::make_single_process();
  auto model = testing::small_model(5);
  auto reference = testing::small_model(5);
  Tensor unused = Tensor::from_floats({7, 7, 7}, {3});
  unused.set_requires_grad();
  auto params = model->named_parameters();
  params.push_back({"unused", &unused});
  Reducer r(*comm, params);
  ASSERT_EQ(r.buckets().size(), 1u);
  autograd::backward(testing::slice_loss(*model, 0, 4));
  r.finish();
  autograd::backward(testing::slice_loss(*reference, 0, 4));
  EXPECT_EQ(testing::gradients(*model), testing::gradients(*reference));
  for (const auto& p : params)
    EXPECT_EQ(p.tensor->grad().storage().get(), r.storage(0).storage().get()) << p.name;
  unused.grad().fill(5.0);  // writes its place in the bucket
  autograd::backward(testing::slice_loss(*model, 4, 4));
  r.finish();
  autograd::backward(testing::slice_loss(*reference, 4, 4));
  EXPECT_EQ(testing::gradients(*model), testing::gradients(*reference));
  EXPECT_EQ(unused.grad().to_float_vector(), (std::vector<float>{5, 5, 5}));
  for (const DType wire : {DType::f32, DType::bf16})
    for (const auto result : {ReducerOptions::Result::kSum, ReducerOptions::Result::kMean}) {
      if (wire == DType::f32 && result == ReducerOptions::Result::kSum) continue;
      auto other = testing::small_model(5);
      ReducerOptions o;
      o.wire = wire;
      o.result = result;
      Reducer ro(*comm, other->named_parameters(), o);
      autograd::backward(testing::slice_loss(*other, 0, 4));
      ro.finish();
      for (const auto& p : other->named_parameters())
        EXPECT_NE(p.tensor->grad().storage().get(), ro.storage(0).storage().get())
            << dtype_name(wire) << " " << p.name;
    }
}

TEST(Reducer, MisuseIsAnErrorNamingTheFix) {
  auto comm = comm::make_single_process();
  auto model = testing::small_model(5);
  ReducerOptions fp8;
  fp8.wire = DType::e4m3;
  EXPECT_NE(error_of([&] {
              Reducer r(*comm, model->named_parameters(), fp8);
            }).find("cannot travel as e4m3"),
            std::string::npos);
  {
    Reducer r(*comm, model->named_parameters());
    EXPECT_NE(error_of([&] {
                Reducer again(*comm, model->named_parameters());
              }).find("already has a gradient-ready hook"),
              std::string::npos);
    autograd::backward(testing::slice_loss(*model, 0, 4));
    EXPECT_NE(error_of([&] { auto local = r.no_sync(); }).find("call finish() first"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                autograd::backward(testing::slice_loss(*model, 0, 4));
              }).find("without finish() in between"),
              std::string::npos);
  }
  {
    // The hooks went with the first reducer.
    Reducer r(*comm, model->named_parameters());
    model->to(DType::f16);
    EXPECT_NE(error_of([&] { r.finish(); }).find("make the reducer after the model's dtypes"),
              std::string::npos);
  }
  Tensor w = Tensor::from_floats({1}, {1});
  w.set_requires_grad();
  EXPECT_NE(error_of([&] {
              Reducer r(*comm, {{"w", &w}, {"again", &w}});
            }).find("twice"),
            std::string::npos);
}

TEST(Agreement, OneRankAgreesWithItself) {
  auto comm = comm::make_single_process();
  EXPECT_NO_THROW(dist::check_config_agreement(*comm, {{"model", "resnet18"}, {"lr", "0.1"}}));
  EXPECT_TRUE(dist::found_inf_on_any_rank(*comm, true));
  EXPECT_FALSE(dist::found_inf_on_any_rank(*comm, false));
  EXPECT_EQ(dist::global_norm(*comm, 25.0), 5.0);
  auto model = testing::small_model(6);
  const std::vector<float> before = model->named_parameters()[0].tensor->to_float_vector();
  dist::broadcast_tensors(*comm, model->named_parameters());
  EXPECT_EQ(model->named_parameters()[0].tensor->to_float_vector(), before);
  EXPECT_EQ(dist::replica_mismatch(*comm, model->named_parameters()), "");
}

}  // namespace
}  // namespace mantissa
