// The gradient reducer and the agreement helpers across ranks, run by CTest under mpirun on 2 and
// 3 ranks. Rank r trains on rows [r * B, (r + 1) * B) of one global batch; every rank also
// computes, in one process, what the ranks' gradients add up to, and checks the reducer against
// it:
//   - FP32 wire, sum: bit for bit what one process accumulating the ranks' gradients in rank
//     order holds (g0 + g1) on 2 ranks; on 3 ranks within two FP32 roundings of the sum,
//     |error| <= 2^-23 * sum_r |g_r| (the all-reduce may add in another order);
//   - FP32 wire, mean: the gradient of one process on the concatenated batch, within a relative
//     1e-5 of the largest gradient (the batch's sums run in another order);
//   - 16-bit wires: within N * u * sum_r |g_r| (u = 2^-11 for f16, 2^-8 for bf16: one rounding of
//     each g_r / N and N - 1 of partial sums), plus one FP32 rounding and f16's subnormal spacing;
// and on every rank the same bits.
#include <gtest/gtest.h>
#include <chrono>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "dist/small_model.h"
#include "mantissa/autograd/autograd.h"
#include "mantissa/comm/communicator.h"
#include "mantissa/dist/agreement.h"
#include "mantissa/dist/factors.h"
#include "mantissa/dist/reducer.h"
#include "mantissa/dist/replicas.h"
#include "mantissa/dist/zero.h"
#include "mantissa/optim/optim.h"
#include "support/compare.h"
#include "support/errors.h"

namespace mantissa {
namespace {

using dist::Reducer;
using dist::ReducerOptions;
using Grads = std::vector<std::vector<float>>;

constexpr int64_t kRows = 5;  // per rank

comm::Communicator& world() { return comm::world(); }

// The gradients as tensors, named like their parameters (for replica_mismatch).
std::vector<dist::NamedTensor> gradient_tensors(nn::Module& m, std::vector<Tensor>& keep) {
  std::vector<dist::NamedTensor> out;
  keep.clear();
  keep.reserve(m.named_parameters().size());
  for (const auto& p : m.named_parameters()) {
    keep.push_back(p.tensor->grad());
    out.push_back({p.name + ".grad", &keep.back()});
  }
  return out;
}

// Rank q's own gradient of its slice, computed here, for every q.
std::vector<Grads> every_ranks_gradient(uint64_t seed, DType dtype = DType::f32) {
  std::vector<Grads> out;
  for (int q = 0; q < world().size(); ++q) {
    auto m = testing::small_model(seed);
    m->to(dtype);
    autograd::backward(testing::slice_loss(*m, q * kRows, kRows, dtype));
    out.push_back(testing::gradients(*m));
  }
  return out;
}

// FP32 wire: sums over ranks. In FP32 and FP16 parameters (whose gradients are FP16: the sum is
// rounded into them once, as accumulation rounds g0 + g1).
TEST(Reducer, Fp32SumsEqualOneProcessAccumulatingTheRanksGradients) {
  comm::Communicator& w = world();
  for (const DType dtype : {DType::f32, DType::f16}) {
    auto model = testing::small_model(10);
    model->to(dtype);
    Reducer reducer(w, model->named_parameters());
    autograd::backward(testing::slice_loss(*model, w.rank() * kRows, kRows, dtype));
    reducer.finish();
    const Grads got = testing::gradients(*model);

    auto accumulated = testing::small_model(10);
    accumulated->to(dtype);
    for (int q = 0; q < w.size(); ++q)
      autograd::backward(testing::slice_loss(*accumulated, q * kRows, kRows, dtype));
    const Grads want = testing::gradients(*accumulated);
    const std::vector<Grads> each = every_ranks_gradient(10, dtype);
    const std::string at(dtype_name(dtype));
    if (w.size() == 2) {
      EXPECT_EQ(got, want) << at << ": 2 ranks, bit for bit";
    } else {
      const double u = dtype == DType::f32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -11);
      for (size_t p = 0; p < got.size(); ++p)
        for (size_t i = 0; i < got[p].size(); ++i) {
          double magnitude = 0;
          for (const Grads& g : each) magnitude += std::fabs(g[p][i]);
          ASSERT_LE(std::fabs(got[p][i] - want[p][i]), 2 * u * magnitude + 1e-30)
              << at << ": parameter " << p << ", element " << i;
        }
    }
    std::vector<Tensor> keep;
    EXPECT_EQ(dist::replica_mismatch(w, gradient_tensors(*model, keep)), "") << at;
  }
}

TEST(Reducer, Fp32MeansEqualOneProcessOnTheConcatenatedBatch) {
  comm::Communicator& w = world();
  auto model = testing::small_model(11);
  ReducerOptions o;
  o.result = ReducerOptions::Result::kMean;
  Reducer reducer(w, model->named_parameters(), o);
  autograd::backward(testing::slice_loss(*model, w.rank() * kRows, kRows));
  reducer.finish();
  auto whole = testing::small_model(11);
  autograd::backward(testing::slice_loss(*whole, 0, w.size() * kRows));
  const Grads got = testing::gradients(*model), want = testing::gradients(*whole);
  for (size_t p = 0; p < got.size(); ++p)
    testing::expect_close("parameter " + std::to_string(p),
                          std::vector<double>(got[p].begin(), got[p].end()),
                          std::vector<double>(want[p].begin(), want[p].end()), 1e-5, 1.0, 0.0);
  std::vector<Tensor> keep;
  EXPECT_EQ(dist::replica_mismatch(w, gradient_tensors(*model, keep)), "");
}

TEST(Reducer, SixteenBitWiresStayWithinTheirRoundingOfTheSum) {
  comm::Communicator& w = world();
  const std::vector<Grads> each = every_ranks_gradient(12);
  const double N = w.size();
  for (const DType wire : {DType::f16, DType::bf16}) {
    auto model = testing::small_model(12);
    ReducerOptions o;
    o.wire = wire;
    o.bucket_cap_mib = 512.0 / (1024 * 1024);  // several buckets
    Reducer reducer(w, model->named_parameters(), o);
    ASSERT_GT(reducer.buckets().size(), 2u);
    autograd::backward(testing::slice_loss(*model, w.rank() * kRows, kRows));
    reducer.finish();
    const Grads got = testing::gradients(*model);
    const double u = wire == DType::f16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    size_t wrong = 0;
    for (size_t p = 0; p < got.size(); ++p)
      for (size_t i = 0; i < got[p].size(); ++i) {
        double exact = 0, magnitude = 0;
        for (const Grads& g : each) exact += g[p][i], magnitude += std::fabs(g[p][i]);
        const double bound =
            (N * u + std::ldexp(1.0, -23)) * magnitude + N * N * std::ldexp(1.0, -24);
        wrong += !(std::fabs(got[p][i] - exact) <= bound);
      }
    EXPECT_EQ(wrong, 0u) << dtype_name(wire);
    std::vector<Tensor> keep;
    EXPECT_EQ(dist::replica_mismatch(w, gradient_tensors(*model, keep)), "") << dtype_name(wire);
    EXPECT_EQ(reducer.last_step().bytes, 484 * 2);
  }
}

// Four leaves in a bucket each; even ranks use them in the order a, b, c, d, odd ranks in the
// reverse order, so their backward passes finish the buckets in opposite orders. All ranks still
// start the all-reduces in bucket order, and each bucket gets the sum of the same leaf's
// gradients (the values are integers: every order of the sum is exact).
TEST(Reducer, EveryRankStartsTheBucketsInTheSameOrder) {
  comm::Communicator& w = world();
  auto leaf = [](float v) {
    Tensor t = Tensor::full({8}, v, DType::f32);
    t.set_requires_grad();
    return t;
  };
  Tensor a = leaf(1), b = leaf(2), c = leaf(3), d = leaf(4);
  ReducerOptions o;
  o.bucket_cap_mib = o.first_bucket_mib = 32.0 / (1024 * 1024);
  Reducer reducer(w, {{"a", &a}, {"b", &b}, {"c", &c}, {"d", &d}}, o);
  ASSERT_EQ(reducer.buckets().size(), 4u);
  // y = sum(outer * (second * (third * (inner * x)))): outer finishes first.
  auto loss = [&](int q) {
    const Tensor x = Tensor::full({8}, static_cast<double>(q + 1), DType::f32);
    Tensor* order[4] = {&a, &b, &c, &d};
    if (q % 2 == 1) std::swap(order[0], order[3]), std::swap(order[1], order[2]);
    return ops::sum(
        ops::mul(*order[0], ops::mul(*order[1], ops::mul(*order[2], ops::mul(*order[3], x)))));
  };
  autograd::backward(loss(w.rank()));
  const std::vector<size_t> ready = reducer.ready_order();
  reducer.finish();
  EXPECT_EQ(ready, w.rank() % 2 == 0 ? (std::vector<size_t>{3, 2, 1, 0})
                                     : (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(reducer.launch_order(), (std::vector<size_t>{0, 1, 2, 3}));
  // d/d(leaf) = (product of the other three) * x, summed over ranks: x sums to N (N + 1) / 2.
  const float xs = static_cast<float>(w.size() * (w.size() + 1) / 2);
  EXPECT_EQ(a.grad().to_float_vector(), std::vector<float>(8, 24 * xs / 1));
  EXPECT_EQ(b.grad().to_float_vector(), std::vector<float>(8, 24 * xs / 2));
  EXPECT_EQ(c.grad().to_float_vector(), std::vector<float>(8, 24 * xs / 3));
  EXPECT_EQ(d.grad().to_float_vector(), std::vector<float>(8, 24 * xs / 4));
}

// Gradient accumulation over 2 micro-batches per rank: the first inside no_sync (gradients stay
// local and differ between ranks; nothing is sent), the second reduces the accumulated sums.
TEST(Reducer, NoSyncCommunicatesOnlyOnTheLastMicroBatch) {
  comm::Communicator& w = world();
  auto model = testing::small_model(13);
  Reducer reducer(w, model->named_parameters());
  const int64_t r = w.rank();
  {
    auto local = reducer.no_sync();
    autograd::backward(testing::slice_loss(*model, (2 * r) * kRows, kRows));
    reducer.finish();
  }
  std::vector<Tensor> keep;
  EXPECT_NE(dist::replica_mismatch(w, gradient_tensors(*model, keep)), "");
  EXPECT_EQ(reducer.total().bytes, 0);
  autograd::backward(testing::slice_loss(*model, (2 * r + 1) * kRows, kRows));
  reducer.finish();
  EXPECT_EQ(reducer.total().steps, 1);
  EXPECT_EQ(reducer.total().bytes, 484 * 4);
  EXPECT_EQ(dist::replica_mismatch(w, gradient_tensors(*model, keep)), "");

  // Each rank's accumulated gradient, then their sum in rank order.
  Grads want;
  for (int q = 0; q < w.size(); ++q) {
    auto m = testing::small_model(13);
    autograd::backward(testing::slice_loss(*m, (2 * q) * kRows, kRows));
    autograd::backward(testing::slice_loss(*m, (2 * q + 1) * kRows, kRows));
    const Grads g = testing::gradients(*m);
    if (want.empty()) {
      want = g;
    } else {
      for (size_t p = 0; p < g.size(); ++p)
        for (size_t i = 0; i < g[p].size(); ++i) want[p][i] += g[p][i];
    }
  }
  const Grads got = testing::gradients(*model);
  if (w.size() == 2) {
    EXPECT_EQ(got, want) << "2 ranks, bit for bit";
  }
  for (size_t p = 0; p < got.size(); ++p)
    testing::expect_close("parameter " + std::to_string(p),
                          std::vector<double>(got[p].begin(), got[p].end()),
                          std::vector<double>(want[p].begin(), want[p].end()), 1e-6, 1.0, 0.0);
}

// A parameter only rank 0's pass reaches: every rank ends with rank 0's gradient.
TEST(Reducer, AParameterOneRankDoesNotReachGetsTheOthersGradient) {
  comm::Communicator& w = world();
  auto model = testing::small_model(14);
  Tensor extra = Tensor::from_floats({1, 2, 3}, {3});
  extra.set_requires_grad();
  auto params = model->named_parameters();
  params.push_back({"extra", &extra});
  Reducer reducer(w, params);
  Tensor loss = testing::slice_loss(*model, w.rank() * kRows, kRows);
  if (w.rank() == 0)
    loss = ops::add(loss, ops::sum(ops::mul(extra, Tensor::from_floats({4, 5, 6}, {3}))));
  autograd::backward(loss);
  const auto finish_start = std::chrono::steady_clock::now();
  reducer.finish();
  const double finish_wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - finish_start).count();
  EXPECT_EQ(extra.grad().to_float_vector(), (std::vector<float>{4, 5, 6}));
  EXPECT_GT(reducer.last_step().busy_seconds, 0);
  // The time finish() waited: within the call, and counted once.
  EXPECT_GE(reducer.last_step().exposed_seconds, 0);
  EXPECT_LE(reducer.last_step().exposed_seconds, finish_wall);
}

TEST(Reducer, RanksWithOtherParametersAreRefused) {
  comm::Communicator& w = world();
  auto model = testing::small_model(15);
  Tensor extra = Tensor::from_floats({1}, {1});
  extra.set_requires_grad();
  auto params = model->named_parameters();
  if (w.rank() == w.size() - 1) params.push_back({"extra", &extra});
  const std::string error = testing::error_of([&] { Reducer r(w, params); });
  EXPECT_NE(error.find("ranks disagree on the parameters of the data-parallel model: rank " +
                       std::to_string(w.size() - 1) + " has 'extra', which rank 0 does not"),
            std::string::npos)
      << error;
  EXPECT_FALSE(extra.autograd_meta()->on_grad_ready) << "no hook left behind";
}

TEST(Agreement, ConfigurationsAreComparedFieldByField) {
  comm::Communicator& w = world();
  const int last = w.size() - 1;
  EXPECT_NO_THROW(dist::check_config_agreement(w, {{"model", "lenet5"}, {"lr", "0.1"}}));
  const std::string lr = w.rank() == last ? "0.2" : "0.1";
  EXPECT_NE(testing::error_of([&] {
              dist::check_config_agreement(w, {{"model", "lenet5"}, {"lr", lr}});
            })
                .find("ranks disagree on the configuration: 'lr' is '0.1' on rank 0 but '0.2' "
                      "on rank " +
                      std::to_string(last)),
            std::string::npos);
  dist::ConfigFields fewer{{"model", "lenet5"}};
  if (w.rank() != last) fewer.push_back({"lr", "0.1"});
  EXPECT_NE(testing::error_of([&] {
              dist::check_config_agreement(w, fewer, "flags");
            }).find("ranks disagree on the flags: rank 0 has 'lr', which rank"),
            std::string::npos);
}

TEST(Agreement, OverflowFlagsAndNormsCombineOverRanks) {
  comm::Communicator& w = world();
  EXPECT_TRUE(dist::found_inf_on_any_rank(w, w.rank() == 1));
  EXPECT_FALSE(dist::found_inf_on_any_rank(w, false));
  double squares = 0;
  for (int q = 0; q < w.size(); ++q) squares += (q + 1.0) * (q + 1.0);
  EXPECT_DOUBLE_EQ(dist::global_norm(w, (w.rank() + 1.0) * (w.rank() + 1.0)), std::sqrt(squares));
  EXPECT_TRUE(std::isinf(dist::global_norm(w, w.rank() == 1 ? INFINITY : 1.0)));
}

TEST(Replicas, BroadcastMakesEveryRankHoldRankZerosModel) {
  comm::Communicator& w = world();
  auto model = testing::small_model(100 + static_cast<uint64_t>(w.rank()));  // differ by rank
  const std::string before = dist::replica_mismatch(w, model->named_parameters());
  EXPECT_EQ(before.substr(0, before.find(" on")), "0.weight differs from rank 0's") << before;
  dist::broadcast_tensors(w, model->named_parameters());
  EXPECT_EQ(dist::replica_mismatch(w, model->named_parameters()), "");
  auto rank0 = testing::small_model(100);
  for (size_t p = 0; p < model->named_parameters().size(); ++p)
    EXPECT_EQ(model->named_parameters()[p].tensor->to_float_vector(),
              rank0->named_parameters()[p].tensor->to_float_vector());
}

// The small model's parameters with only the middle layer's weight ("2.weight", params[2])
// trainable.
std::vector<dist::NamedTensor> only_middle_weight_trains(nn::Module& model) {
  std::vector<dist::NamedTensor> params = model.named_parameters();
  for (const dist::NamedTensor& p : params) p.tensor->set_requires_grad(p.name == "2.weight");
  EXPECT_EQ(params[2].name, "2.weight");
  return params;
}

// ops::linear hands its input factor over in the forward pass (AutogradMeta::gather_input_factor),
// where it starts travelling; the backward pass gathers the output gradients alone and takes it.
// The gradient is the one gathered wholly in the backward pass, bit for bit; a forward pass without
// gradients gathers nothing (evaluation), and an input the backward pass does not read (a forward
// pass before it whose graph was dropped) is not used for it.
TEST(FactorGradients, TheInputFactorTravelsFromTheForwardPass) {
  comm::Communicator& w = world();
  auto model = testing::small_model(7);
  const std::vector<dist::NamedTensor> params = only_middle_weight_trains(*model);
  Tensor& weight = *params[2].tensor;
  dist::FactorGradients factors(w, {params[2]});
  auto pass = [&] {
    weight.zero_grad();
    autograd::backward(testing::slice_loss(*model, w.rank() * kRows, kRows));
    factors.finish();
    return weight.grad().to_float_vector();
  };
  {
    autograd::NoGradScope no_grad;
    testing::slice_loss(*model, w.rank() * kRows, kRows);
  }
  EXPECT_EQ(factors.total().bytes, 0);
  (void)testing::slice_loss(*model, 0, kRows);  // gathered, then replaced by the next forward
  const std::vector<float> early = pass();
  EXPECT_EQ(factors.inputs_gathered_in_forward(), 1);
  AutogradMeta& meta = *weight.autograd_meta();
  const auto hook = meta.gather_input_factor;
  meta.gather_input_factor = nullptr;  // every factor gathered in the backward pass
  const std::vector<float> late = pass();
  meta.gather_input_factor = hook;
  EXPECT_EQ(factors.inputs_gathered_in_forward(), 1);
  EXPECT_EQ(early, late);
  EXPECT_EQ(pass(), late);
  EXPECT_EQ(factors.inputs_gathered_in_forward(), 2);
}

// ZeRO-1's gather of a factored weight's rows runs past gather_parameters(): the weight's first
// read by ops::linear waits for it. Rank 1 starts its part 300 ms late; every other rank reads the
// weight at once, and must see rank 1's updated rows (with the wait skipped it would read rank 1's
// block as it was before the step: the outputs would differ).
TEST(Zero1, AFactoredWeightsFirstReadWaitsForItsRows) {
  comm::Communicator& w = world();
  auto model = testing::small_model(7);
  // Only the middle layer's weight trains: no bucket to gather, so gather_parameters() returns
  // as soon as the rows' gather has started.
  const std::vector<dist::NamedTensor> params = only_middle_weight_trains(*model);
  Tensor& weight = *params[2].tensor;
  dist::FactorGradients factors(w, {params[2]});
  Reducer reducer(w, {}, ReducerOptions{.scatter = true});
  optim::SgdOptions o;
  o.lr = 0.5;
  optim::Sgd sgd({{"2.weight", &weight}}, o);
  dist::Zero1 zero(w, reducer, sgd, &factors);
  // Blocks of ceil(16 / N) rows of 16 values (on 3 ranks 6, 6 and 4 rows: gathered through a
  // padded buffer).
  const int64_t block = (16 + w.size() - 1) / w.size();
  const int64_t r0 = std::min<int64_t>(w.rank() * block, 16),
                r1 = std::min<int64_t>(r0 + block, 16);
  EXPECT_EQ(sgd.shard(0).begin, r0 * 16);
  EXPECT_EQ(sgd.shard(0).end, r1 * 16);
  const Tensor x = Tensor::from_floats(std::vector<float>(3 * 16, 0.25f), {3, 16});
  const std::vector<float> before = ops::linear(x, weight, Tensor()).to_float_vector();
  autograd::backward(testing::slice_loss(*model, w.rank() * kRows, kRows));
  reducer.finish();
  factors.finish();
  sgd.step();
  if (w.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  zero.gather_parameters();
  const std::vector<float> early = ops::linear(x, weight, Tensor()).to_float_vector();
  zero.finish_gather();
  const std::vector<float> after = ops::linear(x, weight, Tensor()).to_float_vector();
  EXPECT_NE(after, before) << "the step changed the weight";
  EXPECT_EQ(early, after);
  EXPECT_EQ(dist::replica_mismatch(w, {params[2]}), "");
}

}  // namespace
}  // namespace mantissa
